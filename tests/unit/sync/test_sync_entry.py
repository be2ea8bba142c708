"""The synchroniser's in-memory form of a key's metadata record."""

from __future__ import annotations

import os

from blobha.core.acl import format_acl, parse_acl
from blobha.core.blobstate import BlobState, PastVersion
from blobha.sync.view import Entry, ReplicaView, Usage, acl_bytes, pack, unpack


def _state(**changes: object) -> BlobState:
    fields: dict[str, object] = dict(
        seq=3, size=4096, digest=os.urandom(16).hex(), acl=(), replication_factor=3,
        creator="alice", created_at=1763700000.123456, updated_at=1763700100.654321, epoch=4,
        acked=True, write_quorum=1,
        history=(PastVersion(2, 4000, os.urandom(16).hex()),),
    )
    fields.update(changes)
    return BlobState(**fields)  # type: ignore[arg-type]


def test_a_typical_record_packs_to_well_under_half_and_back() -> None:
    raw = _state().encode()
    packed = pack(raw)
    assert unpack(packed) == raw
    assert len(packed) < len(raw) * 0.45, (len(packed), len(raw))


def test_records_unlike_the_dictionary_round_trip_exactly() -> None:
    acl = tuple(parse_acl(",".join(f"u:user-{i}-ünïcode:rwa" for i in range(60))))
    history = tuple(PastVersion(i, i * 1000, os.urandom(16).hex()) for i in range(1, 40))
    for raw in (
        _state(acl=acl, history=history, creator="ünïcode-créateur").encode(),  # > the window
        os.urandom(3000),
        b"",
    ):
        assert unpack(pack(raw)) == raw


def test_an_entry_gives_back_the_state_it_was_made_from() -> None:
    state = _state(acked=False)
    raw = state.encode()
    entry = Entry(pack(raw), 7, state.seq, state.replication_factor, state.acked,
                   ("a:1", "b:2"), 0)
    view = entry.view()
    assert view.state == BlobState.decode(raw, 7)
    assert view.holders == ("a:1", "b:2")


def _view() -> ReplicaView:
    return ReplicaView("me:1", None)  # type: ignore[arg-type]  # membership unused here


def _put(view: ReplicaView, key: str, state: BlobState) -> None:
    with view.lock:
        view.put(key, Entry.of(pack(state.encode()), 0, state, ("me:1",), 0))


def test_the_view_counts_each_creator_s_keys_bytes_and_acl_bytes_through_every_change() -> None:
    view = _view()
    acl = tuple(parse_acl("u:carol:r,u:dave:rw"))
    _put(view, "a", _state(size=100, acl=acl))
    _put(view, "b", _state(size=50))
    _put(view, "c", _state(size=7, creator="bob"))
    assert view.usage("alice") == Usage(2, 150, len(b"u:carol:r--,u:dave:rw-"))
    assert view.usage("bob") == Usage(1, 7, 0)
    # A new version replaces the old one's figures; the ACL's go with it.
    _put(view, "a", _state(seq=4, size=1000))
    assert view.usage("alice") == Usage(2, 1050, 0)
    view.forget("a")
    view.forget("a")  # twice: counted once
    assert view.usage("alice") == Usage(1, 50, 0)
    view.forget("b")
    assert view.usage("alice") == Usage()
    assert view.usage("nobody") == Usage()
    assert view.usage("bob") == Usage(1, 7, 0)


def test_an_entry_s_acl_bytes_are_those_of_its_stored_acl() -> None:
    acl = tuple(parse_acl(",".join(f"u:user-{i}:r" for i in range(30))))
    state = _state(acl=acl)
    assert acl_bytes(state) == len(format_acl(acl).encode())
    assert f'"acl":"{format_acl(acl)}"'.encode() in state.encode()
