"""Fakes for the synchroniser's unit tests: a ZooKeeper client whose answers have already arrived,
the cluster guard and the leader's duties as a test sets them, and settings."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from kazoo.exceptions import NoNodeError

from blobha.sync.settings import SyncSettings
from blobha.sync.view import KeyView

ME, A, B = "m1:6627", "m2:6627", "m3:6627"
SESSION = 77
PATH = "/blobstore/k"


class Answer:
    """A kazoo async result that has already arrived (a value, or an error to raise)."""

    def __init__(self, names: Any) -> None:
        self.names = names

    def get_nowait(self) -> Any:
        if isinstance(self.names, Exception):
            raise self.names
        return self.names

    def get(self, timeout: float | None = None) -> Any:
        return self.get_nowait()

    def rawlink(self, callback: Any) -> None:
        callback(self)

    def wait(self, timeout: float | None = None) -> bool:
        return True


class FakeZk:
    client_id = (SESSION, b"")

    def __init__(self) -> None:
        self.watched_reads: list[tuple[str, Any]] = []
        self.next_names: list[str] = []
        self.listed: dict[str, list[str]] = {}  # per path, where given
        self.deleted: list[str] = []
        self.data_reads: list[tuple[str, Any]] = []
        self.data: dict[str, Any] = {}  # get_async's answer per path (default: no node)

    def add_listener(self, fn: Any) -> None:
        pass

    def delete(self, path: str) -> None:
        self.deleted.append(path)

    def get_children_async(self, path: str, watch: Any = None) -> Answer:
        self.watched_reads.append((path, watch))
        return Answer(self.listed.get(path, self.next_names))

    def get_async(self, path: str, watch: Any = None) -> Answer:
        self.data_reads.append((path, watch))
        return Answer(self.data.get(path, NoNodeError()))

    # What blobha.zk.connection.read_many_async asks of kazoo: a multiRead request's reads, each
    # answered as the reads above are (and recorded the same way).
    chroot = ""

    @property
    def handler(self) -> Any:
        return SimpleNamespace(async_result=lambda: SimpleNamespace())

    def _call(self, request: Any, result: Any) -> None:
        answers = []
        for op, path in request.ops:
            answer = self.get_children_async(path) if op == 8 else self.get_async(path)
            try:
                answers.append(answer.get())
            except Exception as e:
                answers.append(e)
        result.get = Answer(answers).get


class Guard:
    """The cluster guard (blobha.sync.protocols.ClusterGuard) as a test sets it."""

    def __init__(self, leading: list[bool], ours: Any = True, lock: Any = None) -> None:
        self.leading = leading
        self.ours = ours
        self.lock = lock

    def is_leader(self) -> bool:
        return self.leading[0]

    def deletions_allowed(self) -> bool:
        return bool(self.ours() if callable(self.ours) else self.ours)

    def key_lock(self, key: str) -> Any:
        return self.lock(key) if self.lock is not None else threading.RLock()


class NoDuties:
    """The leader's duties (blobha.sync.protocols.LeaderDuties), never changing a key."""

    def leader_duty(self, key: str, view: KeyView) -> bool:
        return False


def settings(recursive: bool = False, **changes: Any) -> SyncSettings:
    return SyncSettings(**{**dict(  # type: ignore[arg-type]
        replica_grace_secs=1, delete_grace_secs=1, period_secs=60, versions_retained=2,
        threads=1, periodic_keys_per_sec=200, recursive_watch=recursive), **changes})
