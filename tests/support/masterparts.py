"""A leader's write and read parts built through their constructors, for unit tests: a real
LocalStore in a temp dir, with ZooKeeper, the election, the synchroniser and the membership
faked by the test."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from blobha.master.acks import Acknowledger
from blobha.master.channel import Channel
from blobha.master.committer import Committer
from blobha.master.config import Config
from blobha.master.metadata import Metadata
from blobha.master.quotas import QuotaLimits, Quotas
from blobha.master.reads import Reads
from blobha.master.repairs import Repairs
from blobha.master.rules import Authority
from blobha.master.settings import MasterSettings
from blobha.master.waits import ReplicationWaits
from blobha.master.writes import Writes
from blobha.store.local import LocalStore
from blobha.sync import Usage


class Node:
    """The parts of a leader's write path, built through their constructors over a real
    LocalStore and a fake ZooKeeper, election, synchroniser and membership."""

    def __init__(self, tmp_path: Path, zk: Any, *, sync: Any = None, membership: Any = None,
                 peers: Any = None, uploads: Any = None, write_timeout_secs: float = 60.0,
                 **settings: Any) -> None:
        self.identity = "m1:6627"
        self.settings = dataclasses.replace(
            MasterSettings.from_config(Config.of({"blobstore.dir": str(tmp_path / "data")})),
            identity=self.identity, versions_retained=2, write_timeout_secs=write_timeout_secs,
            **settings)
        self.store = LocalStore(tmp_path / "store")
        self.election: Any = SimpleNamespace(is_leader=True, epoch=3,
                                             fenced_results=zk.fenced_results)
        self.zk = zk
        self.membership = membership or SimpleNamespace(known=lambda: {self.identity},
                                                        live=lambda: {self.identity},
                                                        holding=lambda: frozenset(
                                                            {self.identity}))
        self.sync = sync or SimpleNamespace(
            view=lambda key: None, session_id=lambda: 7, registered=lambda *args: None,
            creating=lambda keys: None, created=lambda keys: None, follow=lambda *args: None,
            schedule=lambda key: None)
        self.peers = peers
        self.authority = Authority(frozenset(), "blobha-master")
        self.meta = Metadata(zk, self.election, self.identity, 0.3, threading.Event())
        self.waits = ReplicationWaits(zk, self.election, self.meta, self.authority,
                                      threading.Event())
        self.acks = Acknowledger(self.settings, self.store, self.meta, self.waits, self.sync)
        self.quotas = Quotas(QuotaLimits(), self.authority, lambda user: Usage(),
                             lambda key: None, lambda: 0)
        self.committer = Committer(self.settings, self.identity, self.store, self.election,
                                   self.meta, self.authority, self.sync, self.membership,
                                   uploads, self.quotas)
        self.uploads = uploads
        self.writes = Writes(self.settings, self.store, uploads, SimpleNamespace(), self.meta,
                             self.authority, self.committer, self.acks, Channel(), self.quotas)
        # In touch with ZooKeeper as far as the read rules go; fake sessions have no states.
        self.reads = Reads(self.settings, self.identity, "blobha-master", self.store, zk,
                           self.meta, self.authority, self.sync, Channel(),
                           cut_off=SimpleNamespace(seconds=lambda: 0.0))
        self.repairs = Repairs(self.settings, self.identity, self.store, self.election,
                               self.meta, self.acks, self.membership, peers, self.sync)
