"""What a write waiting for its write quorum is told when the wait ends early (issue 44): a
stop or a lost leadership is a retryable UNAVAILABLE, never a timeout that did not happen."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from kazoo.exceptions import NoNodeError
from kazoo.protocol.states import KazooState
from support.sync_fakes import Answer
from support.waiting import wait_until

from blobha.core.blobstate import BlobState
from blobha.core.errors import DeadlineExceeded, Unavailable
from blobha.master.acks import Acknowledger
from blobha.master.metadata import Metadata
from blobha.master.rules import Authority
from blobha.master.waits import ReplicationWaits
from blobha.zk.layout import key_path, replica_name

KEY = "k"
ME = "m1:6627"


def _state(seq: int = 2) -> BlobState:
    return BlobState(seq=seq, size=1, digest="d", acl=(), replication_factor=3, creator="alice",
                     created_at=1.0, updated_at=1.0, epoch=3, acked=False, write_quorum=2)


class _Zk:
    """ZooKeeper as a wait reads it: the key's state (None: no node) and one holder, this
    master; never a second, so the quorum of 2 is not reached."""

    state = KazooState.CONNECTED

    def __init__(self, blob: BlobState | None) -> None:
        self.blob = blob

    def get_async(self, path: str, watch: Any = None) -> Answer:
        assert path == key_path(KEY)
        if self.blob is None:
            return Answer(NoNodeError())
        return Answer((self.blob.encode(), SimpleNamespace(version=0)))

    def get_children_async(self, path: str, watch: Any = None) -> Answer:
        return Answer([] if self.blob is None else [replica_name(ME, self.blob.seq)])


def _acks(blob: BlobState | None, stopped: threading.Event, leading: bool = True,
          timeout: float = 60.0) -> tuple[Acknowledger, ReplicationWaits]:
    zk: Any = _Zk(blob)
    election: Any = SimpleNamespace(is_leader=leading, epoch=3)
    meta = Metadata(zk, election, ME, 0.3, stopped)
    waits = ReplicationWaits(zk, election, meta, Authority(frozenset(), "blobha-master"),
                             stopped)
    settings: Any = SimpleNamespace(write_timeout_secs=timeout)
    sync: Any = SimpleNamespace(follow=lambda *args: None)
    return Acknowledger(settings, None, meta, waits, sync), waits  # type: ignore[arg-type]


def test_a_stop_during_the_wait_answers_stepping_down_not_a_timeout() -> None:
    stopped = threading.Event()
    acks, waits = _acks(_state(), stopped)
    answered: list[BaseException] = []

    def write() -> None:
        try:
            acks.acknowledge(KEY, _state())
        except BaseException as e:
            answered.append(e)

    t = threading.Thread(target=write)
    started = time.monotonic()
    t.start()
    wait_until(lambda: waits.replication_waits() > 0, 10, "the write to wait for its quorum")
    stopped.set()
    waits.stop_waits()  # Master.resign's wake-up
    t.join(10)
    assert not t.is_alive()
    [e] = answered
    assert isinstance(e, Unavailable) and not isinstance(e, DeadlineExceeded)
    assert "stepping down" in str(e)
    assert time.monotonic() - started < 10  # not the write timeout (60 s)


def test_a_lost_leadership_is_retryable_even_at_the_deadline() -> None:
    acks, _ = _acks(_state(), threading.Event(), leading=False, timeout=0.0)
    with pytest.raises(Unavailable, match="leadership was lost"):
        acks.acknowledge(KEY, _state())


def test_a_timeout_that_did_happen_is_still_reported() -> None:
    acks, _ = _acks(_state(), threading.Event(), timeout=0.0)
    with pytest.raises(DeadlineExceeded, match="NOT acknowledged"):
        acks.acknowledge(KEY, _state())


def test_a_create_rolled_back_under_the_wait_is_written_again() -> None:
    # The next leader's roll-back of an unacknowledged create removes the key: the write was
    # never acknowledged, so the client is told to retry (and writes it again), not "no such
    # key".
    acks, _ = _acks(None, threading.Event())
    with pytest.raises(Unavailable, match="retry to write it again"):
        acks.acknowledge(KEY, _state(seq=1))
