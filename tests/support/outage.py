"""A kazoo client that loses its ZooKeeper server at a chosen call: the race between a
connection check and the call that follows it, made real. Once ``armed``, the subclass's hook
calls :meth:`Outage.outage_first` just before the call it picks: the server is killed, and the
call is made once kazoo knows the connection is gone. kazoo then holds it until a connection is
back: with the server gone, for ever."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from kazoo.client import KazooClient, KazooState

from blobha.ops.zkserver import EmbeddedZooKeeper
from support.waiting import wait_until


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


def into_outage(zk: Outage, call: Callable[[], object], limit: float, what: str
                ) -> tuple[object, float]:
    """Arm ``zk`` and run ``call`` on a thread: its result (or error) once the held ZooKeeper
    call is given up, and how long that took. Fails the test if ``call`` still waits after
    ``limit`` + 8 s, or if the outage never came."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(call())
        except Exception as e:  # the outcome is what is checked
            outcome.append(e)

    zk.armed = True
    started = time.monotonic()
    thread = threading.Thread(target=run, name="into-outage", daemon=True)
    thread.start()
    thread.join(timeout=limit + 8)
    assert not thread.is_alive(), f"{what} still waits for ZooKeeper"
    assert zk.held.is_set()  # the call was made as the connection was gone
    return outcome[0], time.monotonic() - started
