"""A kazoo client that loses its ZooKeeper server at a chosen call: the race between a
connection check and the call that follows it, made real. Once ``armed``, the subclass's hook
calls :meth:`Outage.outage_first` just before the call it picks: the server is killed, and the
call is made once kazoo knows the connection is gone. kazoo then holds it until a connection is
back: with the server gone, for ever."""

from __future__ import annotations

import threading
from typing import Any

from kazoo.client import KazooClient, KazooState
from waiting import wait_until

from blobha.zkserver import EmbeddedZooKeeper


class Outage(KazooClient):
    def __init__(self, *args: Any, server: EmbeddedZooKeeper, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.server = server
        self.armed = False
        self.held = threading.Event()

    def outage_first(self) -> None:
        self.armed = False
        self.server.kill()
        wait_until(lambda: self.state != KazooState.CONNECTED, 15, "kazoo to see the outage")
        self.held.set()
