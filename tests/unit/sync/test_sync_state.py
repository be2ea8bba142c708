"""The replica view's in-flight state on its own: every transition (ReplicaView's methods named
for their events) and the invariants they keep. No threads, no ZooKeeper, no clock."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from blobha.core.blobstate import BlobState
from blobha.sync.view import Change, Entry, ReplicaView, holders_of, pack

ME, A, B = "m1:6627", "m2:6627", "m3:6627"
SESSION = 77


def view() -> ReplicaView:
    return ReplicaView(ME, SimpleNamespace(known=lambda: {ME, A, B},
                                         holding=lambda: frozenset({ME, A, B})))  # type: ignore[arg-type]


def state(seq: int = 5, rf: int = 3, creator: str = "alice", size: int = 10) -> BlobState:
    return BlobState(seq=seq, size=size, digest="d" * 32, acl=(), replication_factor=rf,
                     creator=creator, created_at=1.0, updated_at=1.0, epoch=1, acked=True)


def held(v: ReplicaView, key: str, holders: tuple[str, ...] = (ME,), seq: int = 5,
         registered: int = SESSION, rf: int = 3) -> Entry:
    """An entry of ``key`` as a read stored it (through the view's only way in, put)."""
    s = state(seq, rf)
    with v.lock:
        return v.put(key, Entry.of(pack(s.encode()), 0, s, holders, registered))


def names(*holders: str, seq: int = 5) -> list[str]:
    return [f"{h}-{seq}" for h in holders]


def now(e: Entry) -> tuple[str, ...]:
    """``e``'s holders as they are now (for the type checker, which narrows the attribute)."""
    return e.holders


def check_invariants(v: ReplicaView) -> None:
    """What every transition keeps, whatever the order of the events."""
    flight = v.flight
    # A batch's bookkeeping comes and goes with the batch (batch_started, batch_ended).
    assert set(flight.reading) <= set(flight.batch_moved)
    assert flight.deleted_in_batch <= set(flight.batch_moved)
    # The usage counts follow the entries; holders stay sorted, each once.
    assert sum(u.keys for u in v._usage.values()) == len(v.entries)
    for e in v.entries.values():
        assert list(e.holders) == sorted(e.holders) and len(set(e.holders)) == len(e.holders)


# ---- the connection and the recursive watch's key events ---------------------------------

def test_a_change_of_the_connection_drops_every_creation_held() -> None:
    v = view()
    v.key_created("k", born_max=10)
    v.commit_creating(["j"])
    v.connection_changed()
    assert v.flight.born == {}


def test_a_created_key_holds_its_events_up_to_the_bound() -> None:
    v = view()
    v.key_created("a", born_max=2)
    v.key_created("b", born_max=2)
    v.key_created("c", born_max=2)
    assert v.flight.born == {"a": [], "b": []}


def test_a_deleted_key_drops_its_creation_and_marks_its_batch() -> None:
    v = view()
    v.key_created("k", born_max=10)
    v.key_deleted("k")
    assert v.flight.born == {} and v.flight.deleted_in_batch == set()
    v.batch_started(["k"])
    v.key_deleted("k")
    assert v.flight.deleted_in_batch == {"k"}
    check_invariants(v)
    assert v.deleted_meanwhile(["k", "j"]) == {"k"}
    v.batch_ended(["k"])
    assert v.deleted_meanwhile(["k"]) == set()


# ---- replica events ------------------------------------------------------------------------

def test_a_replica_event_moves_the_holders_and_hands_back_the_entry() -> None:
    v = view()
    e = held(v, "k", (ME,))
    generation = v.generation
    assert v.replica_event("k", (A, 5, True)) is e
    assert e.holders == (ME, A) and v.generation == generation + 1
    assert v.replica_event("k", (A, 5, True)) is None  # already there: nothing moved
    assert v.replica_event("k", (B, 4, True)) is None  # another version: not counted
    assert v.replica_event("k", (ME, 5, False)) is e and now(e) == (A,)
    assert v.replica_event("unknown", (A, 5, True)) is None


def test_a_replica_event_is_held_for_the_creation_and_the_batch_reading_the_key() -> None:
    v = view()
    v.key_created("new", born_max=10)
    v.replica_event("new", (A, 1, True))
    assert v.flight.born == {"new": [(A, 1, True)]}
    assert v.batch_started(["new"]) == {"new"}  # the events are its replica list
    assert v.flight.reading == {"new": [(A, 1, True)]} and v.flight.born == {}
    assert v.replica_event("new", (B, 1, True)) is None  # the batch has it
    assert v.flight.reading == {"new": [(A, 1, True), (B, 1, True)]}
    check_invariants(v)


def test_an_event_during_a_batch_is_left_to_the_batch_end() -> None:
    v = view()
    e = held(v, "k", (ME,))
    v.batch_started(["k"])
    assert v.replica_event("k", (A, 5, True)) is None and e.holders == (ME, A)
    assert v.flight.batch_moved == {"k": True}
    v.replica_event("k", (B, 4, True))  # moves nothing: the mark stays
    assert v.flight.batch_moved == {"k": True}
    assert v.batch_ended(["k"]) == ["k"]
    assert v.flight.batch_moved == {} and v.flight.reading == {}


# ---- the one-shot watches' replica lists -----------------------------------------------------

def test_a_replica_list_announced_asks_to_rearm_while_still_short() -> None:
    v = view()
    held(v, "short", (ME,))
    held(v, "almost", (ME, A))
    assert v.replicas_announced("short") and not v.replicas_announced("almost")
    assert not v.replicas_announced("unknown")
    assert v.flight.arming == {}  # only a key being armed is marked


def test_a_replica_list_announced_while_arming_marks_it_moved() -> None:
    v = view()
    held(v, "k", (ME,))
    v.flight.arm_on_read["k"] = 100.0
    assert v.batch_taken(["k"], now=100.5, arm_within=1.0) == {"k"}
    assert v.armed_unmoved({"k"}) == {"k"}
    v.replicas_announced("k")
    assert v.flight.arming == {"k": True} and v.armed_unmoved({"k"}) == set()
    v.arming_ended({"k"})
    assert v.flight.arming == {} and v.flight.arm_on_read == {}


def test_a_commit_too_old_arms_nothing_but_is_spent() -> None:
    v = view()
    v.flight.arm_on_read["k"] = 100.0
    assert v.batch_taken(["k", "j"], now=102.0, arm_within=1.0) == set()
    assert v.flight.arm_on_read == {} and v.flight.arming == {}


def test_a_replica_list_read_sets_the_holders() -> None:
    v = view()
    e = held(v, "k", (ME,))
    assert v.replicas_listed("k", names(A, ME, B)) is e and e.holders == (ME, A, B)
    assert v.replicas_listed("unknown", names(A)) is None
    assert not v.holders_read(e, names(ME, A, B))
    assert v.holders_read(e, names(B)) and now(e) == (B,)
    assert not v.list_differs("k", names(B)) and v.list_differs("k", names(A))
    assert v.list_differs("unknown", [])


def test_entries_where_picks_the_entries_that_pass() -> None:
    v = view()
    e = held(v, "k", (ME,))
    held(v, "j", (ME, A, B))
    assert v.entries_where(["k", "j", "x"], lambda key, entry: len(entry.holders) < 3) == [
        ("k", e)]


# ---- a batch's reads ----------------------------------------------------------------------------

def test_a_batch_without_creations_reads_every_list() -> None:
    v = view()
    v.flight.reading["k"] = [(A, 5, True)]  # left by nothing: kept as it is
    assert v.batch_started(["k", "j"]) == set()
    assert v.flight.reading == {"k": [(A, 5, True)], "j": []}
    assert v.flight.batch_moved == {"k": False, "j": False}
    assert v.batch_ended(["k", "j"]) == []
    assert v.flight.reading == {} and v.flight.batch_moved == {}


def test_a_read_stored_makes_the_entry_and_catches_up() -> None:
    v = view()
    v.heard("k")
    mark = v.heard_mark()
    s = state()
    holders, registered, unchanged = v.read_stored("k", s, s.encode(), 0, (ME, A), SESSION,
                                                   from_events=False, heard=mark)
    assert (holders, registered, unchanged) == ((ME, A), 0, False)
    assert v.entries["k"].holders == (ME, A) and v.unread == {}
    assert v.usage("alice").keys == 1 and v.usage("alice").bytes == 10
    check_invariants(v)


def test_a_read_stored_again_is_unchanged_and_keeps_the_registration() -> None:
    v = view()
    s = state()
    v.read_stored("k", s, s.encode(), 0, (ME, A), SESSION, from_events=False)
    v.registered("k", 5, SESSION)
    generation = v.generation
    assert v.read_stored("k", s, s.encode(), 0, (ME, A), SESSION, from_events=False) == (
        (ME, A), SESSION, True)
    assert v.generation == generation  # nothing moved: the figures stay
    # Without our node in the list read, the registration is not kept.
    assert v.read_stored("k", s, s.encode(), 0, (A,), SESSION, from_events=False)[1] == 0


def test_an_announcement_after_the_read_was_sent_stays_unread() -> None:
    v = view()
    mark = v.heard_mark()
    v.heard("k")
    s = state()
    v.read_stored("k", s, s.encode(), 0, (A,), SESSION, from_events=False, heard=mark)
    assert "k" in v.unread and v.view("k").behind  # type: ignore[union-attr]


def test_a_read_stored_takes_the_commits_registration() -> None:
    v = view()
    v.commit_registered("k", 5, SESSION)
    assert v.committed_here == {"k": (5, SESSION)}
    s = state()
    assert v.read_stored("k", s, s.encode(), 0, (ME,), SESSION, from_events=False)[1] == SESSION
    assert v.committed_here == {}


def test_a_read_of_an_older_version_leaves_the_commits_registration() -> None:
    v = view()
    v.commit_registered("k", 6, SESSION)
    s = state(seq=5)
    assert v.read_stored("k", s, s.encode(), 0, (ME,), SESSION, from_events=False)[1] == 0
    assert v.committed_here == {"k": (6, SESSION)}


def test_a_read_stored_replays_the_events_since_it_was_sent() -> None:
    v = view()
    v.batch_started(["k"])
    v.replica_event("k", (B, 5, True))  # no entry yet: held for the read
    s = state()
    holders, _, _ = v.read_stored("k", s, s.encode(), 0, (ME,), SESSION, from_events=False)
    assert holders == (ME,)  # the decision goes by the read
    assert v.entries["k"].holders == (ME, B) and v.flight.batch_moved == {"k": True}
    assert "k" not in v.flight.reading
    assert v.batch_ended(["k"]) == ["k"]
    check_invariants(v)


def test_a_read_stored_from_events_decides_by_them() -> None:
    v = view()
    v.key_created("k", born_max=10)
    v.replica_event("k", (A, 5, True))
    v.replica_event("k", (B, 5, True))
    assert v.batch_started(["k"]) == {"k"}
    s = state()
    holders, _, _ = v.read_stored("k", s, s.encode(), 0, (), SESSION, from_events=True)
    assert holders == (A, B) and v.flight.batch_moved == {"k": False}
    assert v.batch_ended(["k"]) == []


# ---- registration ----------------------------------------------------------------------------

def test_registered_and_unregistered() -> None:
    v = view()
    e = held(v, "k", (A,), registered=0)
    assert not v.is_registered("k", 5, SESSION)
    v.registered("k", 5, SESSION)
    assert v.is_registered("k", 5, SESSION) and e.holders == (ME, A)
    assert not v.is_registered("k", 5, SESSION + 1) and not v.is_registered("k", 4, SESSION)
    assert not v.is_registered("k", 5, 0)
    v.unregistered("k")
    assert e.registered == 0 and now(e) == (A,)
    v.registered("k", 4, SESSION)  # another version: nothing
    assert not v.is_registered("k", 4, SESSION) and now(e) == (A,)


# ---- the leader's commits ---------------------------------------------------------------------

def test_a_commit_counts_and_marks_the_key() -> None:
    v = view()
    v.commit_registered("k", 5, SESSION)
    v.commit_registered("j", 1, SESSION)
    assert v.commits == 2 and v.commit_marks == {"k": 1, "j": 2}
    assert not v.read_is_current("k", 0) and v.read_is_current("k", 1, spend=True)
    assert v.commit_marks == {"j": 2}


def test_a_commit_of_the_version_held_registers_it() -> None:
    v = view()
    e = held(v, "k", (A,), registered=0)
    v.commit_registered("k", 5, SESSION, arm_at=12.5)
    assert v.committed_here == {} and e.registered == SESSION and e.holders == (ME, A)
    assert v.flight.arm_on_read == {"k": 12.5}
    v.forget("k")
    assert v.flight.arm_on_read == {} and "k" not in v.entries


def test_a_creating_commit_makes_the_entry_with_the_events_since() -> None:
    v = view()
    v.commit_creating(["new"])
    v.replica_event("new", (A, 1, True))
    s = state(seq=1)
    v.commit_registered("new", 1, SESSION, s, s.encode(), arm_at=3.0)
    e = v.entries["new"]
    assert e.holders == (ME, A) and e.registered == SESSION and e.seq == 1
    assert v.made_here == {"new": 1} and v.flight.born == {}
    assert v.flight.arm_on_read == {} and v.committed_here == {}
    assert v.commit_followed("new", 1)  # nothing to read back
    assert v.made_here == {} and v.commit_marks == {}
    v.commit_ended(["new"])
    check_invariants(v)


def test_a_creating_commit_read_by_a_batch_keeps_its_mark() -> None:
    v = view()
    v.commit_creating(["new"])
    s = state(seq=1)
    v.commit_registered("new", 1, SESSION, s, s.encode())
    v.batch_started(["new"])
    assert v.commit_followed("new", 1) and v.commit_marks == {"new": 1}


def test_a_commit_without_its_creation_held_is_read_back() -> None:
    v = view()
    s = state(seq=1)
    v.commit_registered("new", 1, SESSION, s, s.encode())  # creating() was not called
    assert "new" not in v.entries and v.committed_here == {"new": (1, SESSION)}
    assert not v.commit_followed("new", 1)
    v.commit_creating(["gone"])
    v.commit_ended(["gone"])
    assert v.flight.born == {}


def test_a_creating_commit_in_no_session_makes_no_entry() -> None:
    v = view()
    v.commit_creating(["new"])
    s = state(seq=1)
    v.commit_registered("new", 1, 0, s, s.encode())
    assert "new" not in v.entries and v.made_here == {} and v.committed_here == {"new": (1, 0)}


# ---- the invariants, over many orders of events ------------------------------------------------

@pytest.mark.parametrize("seed", range(20))
def test_any_order_of_events_keeps_the_invariants(seed: int) -> None:
    rng = random.Random(seed)
    v = view()
    keys = ["a", "b", "c", "d"]
    batch: list[str] = []
    armed: set[str] = set()
    now = 0.0
    for _ in range(300):
        now += rng.random()
        key = rng.choice(keys)
        change: Change = (rng.choice([ME, A, B]), rng.choice([4, 5]), rng.random() < 0.6)
        step = rng.randrange(14)
        if step == 0:
            v.connection_changed()
        elif step == 1:
            v.key_created(key, born_max=3)
        elif step == 2:
            v.key_deleted(key)
        elif step == 3:
            v.replica_event(key, change)
        elif step == 4:
            v.replicas_announced(key)
        elif step == 5:
            v.replicas_listed(key, names(*rng.sample([ME, A, B], rng.randrange(4))))
        elif step == 6 and not batch:
            batch = rng.sample(keys, rng.randrange(1, 4))
            armed = v.batch_taken(batch, now, 1.0)
            v.batch_started(batch)
        elif step == 7 and batch:
            k = rng.choice(batch)
            s = state(seq=rng.choice([4, 5]))
            v.read_stored(k, s, s.encode(), 0, holders_of(names(*rng.sample([ME, A, B], 2),
                                                                seq=s.seq), s.seq),
                          SESSION, from_events=False, heard=v.heard_mark())
        elif step == 8 and batch:
            v.armed_unmoved(armed)
            v.arming_ended(armed)
            moved = v.batch_ended(batch)
            assert set(moved) <= set(batch)
            assert not set(batch) & (set(v.flight.reading) | set(v.flight.batch_moved)
                                     | v.flight.deleted_in_batch)
            batch = []
        elif step == 9:
            v.commit_creating([key])
            s = state(seq=1)
            v.commit_registered(key, 1, SESSION, s, s.encode(), arm_at=now)
            v.commit_followed(key, 1)
            v.commit_ended([key])
        elif step == 10:
            v.forget(key)
        elif step == 11:
            v.heard(key)
        elif step == 12:
            v.unregistered(key)
        elif step == 13:
            v.registered(key, rng.choice([1, 4, 5]), SESSION)
        check_invariants(v)
    if batch:
        v.arming_ended(armed)
        v.batch_ended(batch)
    assert v.flight.reading == {} and v.flight.batch_moved == {}
    assert v.flight.deleted_in_batch == set() and v.flight.arming == {}


def test_the_marks_are_the_counts_of_commits_and_announcements() -> None:
    v = view()
    assert v.marks() == (0, 0)
    v.commit_registered("k", 5, SESSION)
    v.heard("k")
    v.heard("j")
    assert v.marks() == (v.read_mark(), v.heard_mark()) == (1, 2)
