"""The synchroniser's decision per key (blobha.sync.decide), as a pure function over values: what
one master does about a key given the committed state, its holders, its local copy and the
placement. No ZooKeeper, no disk."""

from __future__ import annotations

from dataclasses import replace

import pytest

from blobha.core import placement
from blobha.sync.decide import Action, Facts, Local, Plan, decide, has_work, in_motion
from blobha.sync.view import Entry

ME, A, B = "m1:6627", "m2:6627", "m3:6627"
MASTERS = frozenset({ME, A, B})
SESSION = 77

#: Keys whose single copy the placement gives to this master, and to another.
ONE_HERE = next(k for k in (f"k{i}" for i in range(100))
                if placement.choose(k, MASTERS, 1) == [ME])
ONE_THERE = next(k for k in (f"k{i}" for i in range(100))
                 if placement.choose(k, MASTERS, 1) == [A])


def facts(**changes: object) -> Facts:
    """Key 'k' at v5 with three copies wanted of three masters, held by A and B; nothing here."""
    base = Facts(key="k", seq=5, rf=3, holders=(A, B), own_nodes=(), local=Local.ABSENT,
                 registered=0, session=SESSION, identity=ME, known=MASTERS, leader=False)
    return replace(base, **changes)  # type: ignore[arg-type]


CASES: list[tuple[str, Facts, Plan]] = [
    ("chosen and lacking: fetch",
     facts(), Plan(action=Action.FETCH)),
    ("not chosen and lacking: only prune",
     facts(key=ONE_THERE, rf=1, holders=(A,)), Plan(prune=True)),
    ("a factor above the masters known is capped: every one of them fetches",
     facts(rf=5), Plan(action=Action.FETCH)),
    ("held, verified, registered in this session: prune only",
     facts(holders=(ME, A, B), own_nodes=((f"{ME}-5", 5),), local=Local.PRESENT,
           registered=SESSION), Plan(prune=True)),
    ("held and trusted (verified this session, record unchanged): nothing",
     facts(holders=(ME, A, B), own_nodes=((f"{ME}-5", 5),), local=Local.TRUSTED,
           registered=SESSION), Plan()),
    ("held, not registered: register (and prune)",
     facts(local=Local.PRESENT), Plan(action=Action.REGISTER, prune=True)),
    ("held, registered in an earlier session: register again",
     facts(holders=(ME, A, B), own_nodes=((f"{ME}-5", 5),), local=Local.TRUSTED,
           registered=SESSION - 1), Plan(action=Action.REGISTER)),
    ("held, no session now: register (once there is one)",
     facts(local=Local.PRESENT, session=0), Plan(action=Action.REGISTER, prune=True)),
    ("our node of another version goes; the committed one's stays",
     facts(holders=(ME, A, B), own_nodes=((f"{ME}-4", 4), (f"{ME}-5", 5)), local=Local.PRESENT,
           registered=SESSION),
     Plan(drop_nodes=((f"{ME}-4", 4),), prune=True)),
    ("our node of a version not held here goes, and the version is fetched",
     facts(holders=(ME, A, B), own_nodes=((f"{ME}-5", 5),), registered=SESSION),
     Plan(drop_nodes=((f"{ME}-5", 5),), action=Action.FETCH)),
    ("a copy unlike the record is discarded, its node removed, the record's version fetched",
     facts(holders=(ME, A, B), own_nodes=((f"{ME}-5", 5),), local=Local.DIFFERS,
           registered=SESSION),
     Plan(discard_local=True, drop_nodes=((f"{ME}-5", 5),), action=Action.FETCH)),
    ("held beyond the placement, the chosen holder has it: drop",
     facts(key=ONE_THERE, rf=1, holders=(ME, A), local=Local.PRESENT, registered=SESSION),
     Plan(action=Action.DROP)),
    ("held beyond the placement, the chosen holder lacks it: keep (and register)",
     facts(key=ONE_THERE, rf=1, holders=(B,), local=Local.PRESENT),
     Plan(action=Action.REGISTER, prune=True)),
    ("held and chosen, with more holders than wanted: keep",
     facts(key=ONE_HERE, rf=1, holders=(ME, A), local=Local.TRUSTED, registered=SESSION),
     Plan()),
    ("the leader: its duty first",
     facts(leader=True), Plan(leader_duty=True, action=Action.FETCH)),
]


@pytest.mark.parametrize(("case", "given", "expected"), CASES, ids=[c[0] for c in CASES])
def test_decide(case: str, given: Facts, expected: Plan) -> None:
    rf = min(given.rf, len(given.known))
    targets = tuple(placement.choose(given.key, given.known, rf))
    assert decide(given) == replace(expected, targets=targets)


def test_decide_is_pure() -> None:
    given = facts(local=Local.PRESENT)
    assert decide(given) == decide(given)
    assert given == facts(local=Local.PRESENT)


def entry(holders: tuple[str, ...], rf: int = 3, acked: bool = True,
          registered: int = SESSION) -> Entry:
    return Entry(b"", 0, 5, rf, acked, holders, registered)


@pytest.mark.parametrize(("case", "held", "leader", "work"), [
    ("holder, registered in this session", entry((ME, A)), False, False),
    ("holder, registered in an earlier session", entry((ME, A), registered=1), False, True),
    ("leader, unacknowledged", entry((ME, A), acked=False), True, True),
    ("follower, unacknowledged", entry((ME, A), acked=False), False, False),
    ("chosen, lacking", entry((A,), registered=0), False, True),
    ("our registered copy left the list", entry((A, B)), False, True),
])
def test_has_work(case: str, held: Entry, leader: bool, work: bool) -> None:
    assert has_work(ME, "k", held, MASTERS, leader, SESSION) is work


@pytest.mark.parametrize(("case", "key", "held", "leader", "moving"), [
    ("complete", "k", entry((ME, A, B)), False, False),
    ("under-replicated", "k", entry((ME, A)), False, True),
    ("unacknowledged, leader", "k", entry((ME, A, B), acked=False), True, True),
    ("held here beyond the placement", ONE_THERE, entry((ME, A), rf=1), False, True),
    ("held elsewhere as placed", ONE_THERE, entry((A,), rf=1), False, False),
])
def test_in_motion(case: str, key: str, held: Entry, leader: bool, moving: bool) -> None:
    assert in_motion(ME, key, held, MASTERS, leader) is moving
