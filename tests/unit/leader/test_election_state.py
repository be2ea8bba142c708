"""The election's view of leadership across kazoo's connection states (no ZooKeeper needed:
the flags are set from kazoo's event thread, the election thread acts on them)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kazoo.client import KazooState

from blobha.leader.election import LeaderElection


def _leading_election() -> Any:
    zk = SimpleNamespace(add_listener=lambda fn: None, state=KazooState.CONNECTED,
                         client_id=(1, b""))
    e: Any = LeaderElection(zk, "m1:6627", 10.0, on_elected=lambda epoch: None,  # type: ignore[arg-type]
                      on_deposed=lambda: None)
    e._leading = e._ready = True
    e._session = 1
    e._leader_address = "m1:6627"  # as the election thread sets it on winning
    return e


def test_a_suspension_hides_leadership_until_the_same_session_reconnects() -> None:
    e = _leading_election()
    assert e.is_leader
    e._on_state(KazooState.SUSPENDED)
    assert not e.is_leader
    e._on_state(KazooState.CONNECTED)
    assert e.is_leader


def test_a_lost_session_never_shows_the_old_term_as_leading_on_the_next_session() -> None:
    # LOST, then the new session's CONNECTED: before the election thread has stepped down,
    # the cluster summary showed this master leading a term its lost session no longer held.
    e = _leading_election()
    e._on_state(KazooState.SUSPENDED)
    e._on_state(KazooState.LOST)
    e._on_state(KazooState.CONNECTED)
    assert not e.is_leader
    assert e.leader_address == ""
