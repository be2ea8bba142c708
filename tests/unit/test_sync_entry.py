"""The synchroniser's in-memory form of a key's metadata record."""

from __future__ import annotations

import os

from blobha.sync.view import Entry, pack, unpack

from blobha.core.acl import parse_acl
from blobha.zk.layout import BlobState, PastVersion


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
