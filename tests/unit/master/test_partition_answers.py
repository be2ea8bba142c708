"""A leader whose ZooKeeper connection is suspended answers its writers within the watchdog's
bound (issue 44): a wait on ZooKeeper ends at the suspension limit after the suspension
began, not a session timeout after the call; a commit given up there is answered as of
unknown outcome, with its copy kept; a write refused for it says why."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kazoo.client import KazooState
from kazoo.exceptions import ConnectionLoss
from kazoo.handlers.threading import AsyncResult, KazooTimeoutError, SequentialThreadingHandler
from support.masterparts import Node

from blobha.core.digest import digest_bytes
from blobha.core.errors import Refused, Unavailable
from blobha.leader import Deposed
from blobha.leader.election import LeaderElection, answer_within
from blobha.master.metadata import Metadata
from blobha.master.rules import CommitOutcomeUnknown, PutRequest

_HANDLER = SequentialThreadingHandler()
#: Far beyond any bound below: a wait that lasts anywhere near it was not cut short.
_LONG = 30.0
#: Scheduling on a loaded machine.
_SLACK = 0.5


def _unanswered() -> AsyncResult:
    """A kazoo call held by kazoo (sent while it reconnects): no answer comes."""
    return AsyncResult(_HANDLER)


def _timed(fn: Any) -> tuple[BaseException | None, float]:
    started = time.monotonic()
    try:
        fn()
    except BaseException as e:
        return e, time.monotonic() - started
    return None, time.monotonic() - started


def test_a_wait_while_connected_is_bounded_by_its_timeout_alone() -> None:
    error, took = _timed(lambda: answer_within(_unanswered(), 0.2, lambda: None))
    assert isinstance(error, KazooTimeoutError) and "within 0.2s" in str(error)
    assert 0.2 <= took < 0.2 + _SLACK


def test_a_wait_ends_at_the_watchdogs_bound_not_its_timeout() -> None:
    give_up = time.monotonic() + 0.3
    error, took = _timed(lambda: answer_within(_unanswered(), _LONG, lambda: give_up))
    assert isinstance(error, KazooTimeoutError) and "watchdog" in str(error)
    assert 0.3 - 0.05 <= took < 0.3 + _SLACK


def test_a_suspension_that_begins_during_the_wait_moves_its_end() -> None:
    suspended = threading.Event()  # set once the wait is under way
    give_up: list[float] = []

    def watchdog() -> float | None:
        if not suspended.is_set():
            suspended.set()
            return None
        if not give_up:
            give_up.append(time.monotonic() + 0.2)
        return give_up[0]

    error, took = _timed(lambda: answer_within(_unanswered(), _LONG, watchdog))
    assert isinstance(error, KazooTimeoutError)
    assert took < 0.2 + _SLACK


def test_a_session_already_lost_ends_the_wait_at_once() -> None:
    error, took = _timed(lambda: answer_within(_unanswered(), _LONG,
                                               lambda: time.monotonic() - 1.0))
    assert isinstance(error, KazooTimeoutError)
    assert took < _SLACK


def test_an_answer_within_the_bound_is_returned() -> None:
    pending = _unanswered()
    threading.Thread(target=pending.set, args=("answer",), daemon=True).start()
    assert answer_within(pending, _LONG, lambda: time.monotonic() + _LONG) == "answer"
    failed = _unanswered()
    failed.set_exception(ConnectionLoss())
    with pytest.raises(ConnectionLoss):
        answer_within(failed, _LONG, lambda: None)


def _election(session_timeout: float = 6.0) -> Any:
    zk = SimpleNamespace(add_listener=lambda fn: None, state=KazooState.CONNECTED,
                         client_id=(1, b""))
    e: Any = LeaderElection(zk, "m1:6627", session_timeout,  # type: ignore[arg-type]
                            on_elected=lambda epoch: None, on_deposed=lambda: None)
    e._leading = e._ready = True
    e._node = "/election/n_0000000001"
    return e


def test_the_watchdogs_bound_is_the_suspension_limit_after_the_suspension() -> None:
    e = _election(6.0)
    assert e.give_up_at() is None and e._next_look() == 0.5
    before = time.monotonic()
    e._on_state(KazooState.SUSPENDED)
    give_up = e.give_up_at()
    assert give_up is not None and before + 4.0 <= give_up <= time.monotonic() + 4.0
    # The election thread looks again no later than the bound, to step down on time.
    e._suspended_since = time.monotonic() - 3.9
    assert e._next_look() <= 0.1 + 0.01
    e._on_state(KazooState.CONNECTED)
    assert e.give_up_at() is None
    e._on_state(KazooState.LOST)
    lost = e.give_up_at()
    assert lost is not None and lost <= time.monotonic()


def test_a_fenced_commit_while_suspended_is_refused_before_it_is_sent() -> None:
    e = _election()
    e._on_state(KazooState.SUSPENDED)
    with pytest.raises(Deposed, match="its ZooKeeper connection is suspended"):
        e.fenced_results(lambda txn: None)


def test_a_fenced_commit_unanswered_is_given_up_at_the_watchdogs_bound() -> None:
    e = _election(_LONG)
    pending = _unanswered()

    def sent() -> AsyncResult:
        # The connection drops with the transaction in flight: the watchdog gives up on it
        # 0.2 s from now, far sooner than the suspension limit (20 s) after the call.
        e._on_state(KazooState.SUSPENDED)
        e._suspended_since = time.monotonic() - e.suspension_limit + 0.2
        return pending

    e.zk.transaction = lambda: SimpleNamespace(check=lambda *a: None, commit_async=sent)
    started = time.monotonic()
    with pytest.raises(ConnectionLoss, match="it may yet apply"):
        e.fenced_results(lambda txn: None)
    assert time.monotonic() - started < 0.2 + _SLACK


# ---- the master's side: metadata reads and commits ------------------------------------------


class _Cut:
    """ZooKeeper as a cut-off leader sees it: suspended, every call held by kazoo; its fenced
    transaction given up as of unknown outcome."""

    state = KazooState.SUSPENDED

    def fenced_results(self, build: Any, changed: Any = ()) -> list[object]:
        raise ConnectionLoss("no answer before the watchdog gave up; it may yet apply")

    def sync_async(self, path: str) -> AsyncResult:
        return _unanswered()

    def get_async(self, path: str, watch: Any = None) -> AsyncResult:
        return _unanswered()


def _suspended_node(tmp_path: Path, since: float, session_timeout: float = _LONG) -> Node:
    m = Node(tmp_path, _Cut())
    m.election.give_up_at = lambda: since + session_timeout * 2 / 3
    m.meta = Metadata(m.zk, m.election, m.identity, session_timeout, threading.Event())
    m.committer.meta = m.meta
    return m


def _put(key: str, data: bytes) -> PutRequest:
    return PutRequest("alice", key, True, (), 1, 1, 0, data, digest_bytes(data))


def test_a_commit_given_up_is_answered_by_the_watchdogs_bound_and_keeps_its_copy(
        tmp_path: Path) -> None:
    # Suspended for most of the limit already: the commit's outcome is unknown at the bound,
    # 0.3 s from now, not after a session timeout (30 s) of trying to read it back.
    m = _suspended_node(tmp_path, since=time.monotonic() - _LONG * 2 / 3 + 0.3)
    started = time.monotonic()
    [result] = m.committer.commit_puts([_put("k", b"maybe")])
    took = time.monotonic() - started
    assert isinstance(result, CommitOutcomeUnknown), result
    assert not isinstance(result, Refused)  # may have run: the client settles it
    assert f"ZooKeeper is unreachable from master {m.identity}" in str(result)
    assert "outcome is unknown" in str(result) and "\n" not in str(result)
    assert took < 0.3 + _SLACK
    # With W=1 ZooKeeper may already hold it as acknowledged: the copy may be its only one.
    assert m.store.versions("k") == [1]


def test_a_read_for_a_write_waits_no_longer_than_the_watchdogs_bound(tmp_path: Path) -> None:
    m = _suspended_node(tmp_path, since=time.monotonic() - _LONG * 2 / 3 + 0.3)
    error, took = _timed(lambda: m.meta.answer_write(m.zk.get_async("/blobstore/k")))
    assert isinstance(error, KazooTimeoutError)
    assert took < 0.3 + _SLACK


def test_a_read_for_a_write_on_a_connection_kazoo_thinks_alive_ends_at_the_limit() -> None:
    # kazoo pings only an idle connection: a leader busy sending requests may not see its
    # connection dead, and no suspension comes. The wait ends by itself at the suspension
    # limit, as kazoo ends an unanswered ping, not at the session timeout.
    election = SimpleNamespace(suspension_limit=0.3, give_up_at=lambda: None)
    meta = Metadata(_Cut(), election, "m1:6627", _LONG, threading.Event())  # type: ignore[arg-type]
    error, took = _timed(lambda: meta.answer_write(_unanswered()))
    assert isinstance(error, KazooTimeoutError)
    assert 0.3 <= took < 0.3 + _SLACK


def test_a_write_to_a_suspended_leader_is_refused_saying_why(tmp_path: Path) -> None:
    m = _suspended_node(tmp_path, since=time.monotonic())
    m.election.is_leader = False
    with pytest.raises(Refused) as refused:
        m.meta.require_leader()
    message = str(refused.value)
    assert message.startswith(f"ZooKeeper is unreachable from master {m.identity}")
    assert "retry" in message and "\n" not in message


def test_a_commit_deposed_before_it_was_sent_says_not_the_leader_any_more(
        tmp_path: Path) -> None:
    m = _suspended_node(tmp_path, since=time.monotonic())

    def deposed(build: Any, changed: Any = ()) -> list[object]:
        raise Deposed("its ZooKeeper connection is suspended")

    m.election.fenced_results = deposed
    m.zk.state = KazooState.CONNECTED  # the suspension began after the leadership check
    [result] = m.committer.commit_puts([_put("k", b"never")])
    assert isinstance(result, Unavailable)
    assert str(result).startswith("not the leader any more (its ZooKeeper connection is"
                                  " suspended); nothing was committed")
    assert m.store.versions("k") == []  # known not committed: its copy goes

