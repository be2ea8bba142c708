"""The piece scheduler: peers first once they hold pieces, replicas striped, bad peers dropped."""

from __future__ import annotations

import random

from blobha.cache.peers.schedule import MASTER_RUN, Scheduler
from blobha.cache.peers.wire import decode_have, encode_have

MASTERS = ["m1:1", "m2:1", "m3:1"]


def test_without_peers_the_replicas_are_striped_in_runs() -> None:
    s = Scheduler(40, MASTERS, random.Random(1))
    got = [s.next(0.0, master_cap=3) for _ in range(4)]
    assert got[3] is None  # the cap: three requests at once
    assigned = [a for a in got if a is not None]
    assert sorted(a.source for a in assigned) == MASTERS  # one each: striped
    assert all(a.from_master and len(a.pieces) == MASTER_RUN for a in assigned)
    pieces = [p for a in assigned for p in a.pieces]
    assert len(set(pieces)) == len(pieces)
    for a in assigned:
        for p in a.pieces:
            s.done(a, p)
        s.finished(a)
    assert len(s.missing) == 40 - 3 * MASTER_RUN


def test_a_peer_holding_pieces_is_preferred_and_masters_skip_what_peers_hold() -> None:
    s = Scheduler(8, MASTERS, random.Random(2))
    s.add_peers(["p:1"])
    probe = s.next(0.0, 4)
    assert probe is not None and probe.source == "p:1"  # asked what it holds
    s.learned("p:1", {0, 1, 2, 3}, 0.0)
    s.finished(probe)
    a = s.next(0.1, 4)
    assert a is not None and a.source == "p:1" and a.pieces[0] in {0, 1, 2, 3}
    m = s.next(0.1, 4)
    b = s.next(0.1, 4)  # the peer is at its limit of requests: the replicas take the rest
    assert m is not None and m.source == "p:1"
    assert b is not None and b.from_master and set(b.pieces) <= {4, 5, 6, 7}


def test_a_bad_piece_drops_the_peer_and_the_piece_is_fetched_again() -> None:
    s = Scheduler(2, MASTERS, random.Random(3))
    s.add_peers(["evil:1"])
    s.learned("evil:1", {0, 1}, 0.0)
    a = s.next(0.0, 4)
    assert a is not None and a.source == "evil:1"
    s.failed("evil:1", bad_piece=True)
    s.finished(a)
    assert "evil:1" in s.bad and s.usable_peers(0.0) == []
    s.add_peers(["evil:1"])  # named again by a later plan: still avoided
    b = s.next(0.0, 4)
    assert b is not None and b.from_master and a.pieces[0] in b.pieces


def test_a_dead_peer_costs_retries_then_is_dropped() -> None:
    s = Scheduler(4, MASTERS, random.Random(4))
    s.add_peers(["gone:1"])
    s.failed("gone:1", bad_piece=False)
    assert "gone:1" not in s.bad
    s.failed("gone:1", bad_piece=False)
    assert "gone:1" in s.bad


def test_have_bitmaps_round_trip() -> None:
    assert decode_have(encode_have({0, 5, 9}, 10), 10) == {0, 5, 9}
    assert decode_have(encode_have(None, 10), 10) == set(range(10))
    assert decode_have("!!not base64", 10) == set()


def test_with_peers_a_cache_takes_only_its_own_stripe_from_the_masters() -> None:
    # Three caches (this one and two peers): blocks of MASTER_RUN pieces, every third ours.
    s = Scheduler(24, MASTERS, random.Random(5), ordinal=1)
    s.add_peers(["p:1", "q:1"])
    s.learned("p:1", set(), 0.0)
    s.learned("q:1", set(), 0.0)
    taken = []
    while (a := s.next(0.0, master_cap=1)) is not None:
        assert a.from_master
        taken.extend(a.pieces)
        for p in a.pieces:
            s.done(a, p)
        s.finished(a)
        if len(taken) > 24:
            break
    # Idle with its stripe done and nothing in flight, it would take the rest itself; here
    # every block it took is its own.
    own = [p for p in range(24) if (p // MASTER_RUN) % 3 == 1]
    assert sorted(taken[:len(own)]) == own
