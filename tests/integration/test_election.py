"""The election against a real ZooKeeper server, where kazoo's calls can fail after the server
applied them (the connection dropped before the reply)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionLoss
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.protocol.serialization import Transaction
from support.outage import Outage, into_outage
from support.waiting import wait_until

from blobha.leader.election import LeaderElection
from blobha.ops.zkserver import EmbeddedZooKeeper
from blobha.zk.layout import ELECTION, JOURNAL

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SESSION_SECS = 4.0


class _LosesReplies(KazooClient):
    """A client whose first ``lose`` candidacy creates and deletes are applied by the server
    but answered with ConnectionLoss, as when the connection drops before the reply."""

    def __init__(self, *args: Any, lose: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lose = lose

    def _lost(self, path: str) -> bool:
        if path.startswith(f"{ELECTION}/") and self.lose > 0:
            self.lose -= 1
            return True
        return False

    # The async calls: the election makes those (and kazoo's plain calls wrap them).
    def create_async(self, path: str, *args: Any, **kwargs: Any) -> Any:
        made = super().create_async(path, *args, **kwargs)
        if not self._lost(path):
            return made
        lost = self.handler.async_result()
        made.rawlink(lambda _: lost.set_exception(ConnectionLoss()))  # applied, answer lost
        return lost

    def delete_async(self, path: str, *args: Any, **kwargs: Any) -> Any:
        if not self._lost(path):
            return super().delete_async(path, *args, **kwargs)
        lost = self.handler.async_result()
        lost.set_exception(ConnectionLoss())  # this one not applied: the node stays
        return lost


@pytest.fixture
def zookeeper(tmp_path: Path) -> Iterator[str]:
    with EmbeddedZooKeeper(tmp_path / "zk", tick_ms=500) as zk:
        root = KazooClient(hosts=zk.connect_string, timeout=SESSION_SECS)
        root.start(timeout=15)
        try:
            root.ensure_path("/t")
        finally:
            root.stop()
            root.close()
        yield zk.connect_string + "/t"


def _elections(connect: str, first: KazooClient) -> tuple[list[KazooClient], list[LeaderElection]]:
    clients = [first, KazooClient(hosts=connect, timeout=SESSION_SECS)]
    elections: list[LeaderElection] = []
    for i, zk in enumerate(clients):
        zk.start(timeout=15)
        e = LeaderElection(zk, f"m{i + 1}:6627", SESSION_SECS, on_elected=lambda epoch: None,
                           on_deposed=lambda: None)
        e.start()
        elections.append(e)
        # m1 joins first, so its candidacies are the lowest.
        wait_until(lambda e=e: e._node is not None, 15, f"m{i + 1} in the election")
    return clients, elections


def _stop(clients: list[KazooClient], elections: list[LeaderElection]) -> None:
    for e in elections:
        e.stop()
    for zk in clients:
        zk.stop()
        zk.close()


def _candidacies(zk: KazooClient, owner: int) -> list[str]:
    out = []
    for child in zk.get_children(ELECTION):
        stat = zk.exists(f"{ELECTION}/{child}")
        if stat is not None and stat.ephemeralOwner == owner:
            out.append(child)
    return out


def test_a_candidacy_made_but_unanswered_does_not_block_the_election(zookeeper: str) -> None:
    # Before: m1's first candidacy was made, its reply lost; m1 joined again with a second one
    # and never tracked the first. The first was the lowest, so m1 followed it (itself, as far
    # as the others knew) and m2 followed m1: no leader until m1's session ended.
    lossy = _LosesReplies(hosts=zookeeper, timeout=SESSION_SECS)
    clients, elections = _elections(zookeeper, lossy)
    try:
        wait_until(lambda: any(e.is_leader for e in elections), 15, "a leader")
        m1, m2 = elections
        assert m1.is_leader
        # m2 learns of the leader from its own watch, a moment after m1 takes office.
        wait_until(lambda: m2.leader_address == "m1:6627", 15, "m2 to follow m1")
        assert _candidacies(lossy, lossy.client_id[0]) == [m1._node.rsplit("/", 1)[1]]
        assert lossy.lose == 0  # the answer was lost
    finally:
        _stop(clients, elections)


def test_a_resignation_whose_delete_failed_is_finished_by_the_next_step(zookeeper: str) -> None:
    # A leader deposed by a refused commit deletes its candidacy so that the next one leads.
    # Before, a failed delete was ignored: the candidacy stayed lowest, the master followed it
    # (itself) and the others followed that master, with no leader until its session ended.
    lossy = _LosesReplies(hosts=zookeeper, timeout=SESSION_SECS, lose=0)
    clients, elections = _elections(zookeeper, lossy)
    try:
        m1, m2 = elections
        wait_until(lambda: m1.is_leader, 15, "m1 leading")
        lossy.lose = 1
        m1.depose("a test")
        wait_until(lambda: m2.is_leader, 15, "m2 leading")
        assert m1.leader_address == "m2:6627" and not m1.is_leader
        assert len(_candidacies(lossy, lossy.client_id[0])) == 1
        assert lossy.lose == 0  # the delete failed
    finally:
        _stop(clients, elections)


class _OutageBeforeNextRead(Outage):
    """The election's next read of the candidacies is the call held."""

    def get_children_async(self, path: str, *args: Any, **kwargs: Any) -> Any:
        if self.armed and path == ELECTION:
            self.outage_first()
        return super().get_children_async(path, *args, **kwargs)


class _OutageBeforeNextTransaction(Outage):
    """The next transaction is the call held: the connection dropped between the leader's
    check and its fenced commit."""

    def _call(self, request: Any, async_object: Any) -> Any:
        if self.armed and isinstance(request, Transaction):
            self.outage_first()
        return super()._call(request, async_object)


class _OutageBeforeJournalRead(Outage):
    """The read of the change journal that a term's first commit of a new key makes is the
    call held: the journal's lock, and the commit, waited on it."""

    def get_async(self, path: str, *args: Any, **kwargs: Any) -> Any:
        if self.armed and path == JOURNAL:
            self.outage_first()
        return super().get_async(path, *args, **kwargs)


@contextlib.contextmanager
def _sole_candidate(tmp_path: Path, client: type[Outage]
                    ) -> Iterator[tuple[Outage, LeaderElection]]:
    """A real ZooKeeper server and one master's election, leading, through ``client``."""
    with EmbeddedZooKeeper(tmp_path / "zk", tick_ms=500) as server:
        zk = client(hosts=server.connect_string, timeout=SESSION_SECS, server=server)
        zk.start(timeout=15)
        election = LeaderElection(zk, "m1:6627", SESSION_SECS, on_elected=lambda epoch: None,
                                  on_deposed=lambda: None)
        try:
            election.start()
            wait_until(lambda: election.is_leader, 15, "m1 leading")
            yield zk, election
        finally:
            zk.stop()
            zk.close()


def test_a_master_stops_promptly_when_zookeeper_vanished_under_an_election_step(
        tmp_path: Path) -> None:
    # Before: the election's calls waited for ZooKeeper's answer without a limit, under the
    # election's lock. kazoo holds a call made while it reconnects until a connection is back,
    # so with ZooKeeper gone stop() waited for that lock for ever: the master never exited.
    with _sole_candidate(tmp_path, _OutageBeforeNextRead) as (zk, election):
        stopper = threading.Thread(target=election.stop, name="stopper", daemon=True)
        zk.armed = True
        # The election thread is now inside a step, holding its lock, its read held.
        wait_until(zk.held.is_set, 15, "the election's read made during the outage")
        started = time.monotonic()
        stopper.start()
        # The read is given up after two thirds of the session timeout; the resignation's
        # delete after its own 3 s; then the thread is joined.
        stopper.join(timeout=SESSION_SECS + 3 + 8)
        assert not stopper.is_alive(), "stop() still waits for the election's lock"
        assert time.monotonic() - started >= SESSION_SECS * 2 / 3 - 0.5  # read waited for
        assert not election.is_leader


@pytest.mark.parametrize(("client", "changed", "error"), [
    # The transaction held: it may yet apply, so the caller is told ConnectionLoss (re-read).
    (_OutageBeforeNextTransaction, (), ConnectionLoss),
    # The journal's read held: nothing was sent, ZooKeeper is unreachable.
    (_OutageBeforeJournalRead, ("written",), KazooTimeoutError),
])
def test_a_fenced_commit_that_meets_an_outage_is_given_up(
        tmp_path: Path, client: type[Outage], changed: tuple[str, ...],
        error: type[Exception]) -> None:
    # Before: the fenced transaction's answer, and a term's first read of the change journal,
    # were waited for without a limit. Made while kazoo reconnected, they waited for as long as
    # ZooKeeper stayed away, and with them the group commit and every write behind it, long
    # after the watchdog had deposed the leader.
    with _sole_candidate(tmp_path, client) as (zk, election):
        try:
            outcome, took = into_outage(
                zk, lambda: election.fenced(lambda txn: txn.create("/written", b""), changed),
                election.suspension_limit, "the fenced commit")
            assert took >= election.suspension_limit - 0.5
            assert isinstance(outcome, error), outcome
        finally:
            election.stop()
