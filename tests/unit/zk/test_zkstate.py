"""ZooKeeper layout helpers: replica names (scenarios 12, 13) and the committed blob state."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blobha.core.acl import ALL, READ, AccessControl
from blobha.core.blobstate import BlobState, PastVersion, write_tag
from blobha.zk.layout import (
    EpochRecord,
    holders,
    key_path,
    latest_seq,
    parse_replica,
    replica_name,
    replica_path,
)


def test_latest_seq_among_storm_style_names() -> None:
    assert latest_seq(["nimbus1:8000-2", "nimbus-1:8000-4"]) == 4


def test_latest_seq_compares_numbers_not_strings() -> None:
    assert latest_seq(["m:1-9", "m:2-10", "m:3-2"]) == 10


def test_latest_seq_of_nothing_is_zero() -> None:
    assert latest_seq([]) == 0
    assert latest_seq(["garbage", "m:1-x"]) == 0


@pytest.mark.parametrize(
    ("name", "parsed"),
    [
        ("nimbus-1:7800-1", ("nimbus-1:7800", 1)),
        ("nimbus1:8000-2", ("nimbus1:8000", 2)),
        ("a-b-c:1-2-3", ("a-b-c:1-2", 3)),
        ("10.0.0.1:6627-42", ("10.0.0.1:6627", 42)),
        ("[::1]:6627-7", ("[::1]:6627", 7)),
    ],
)
def test_parse_replica(name: str, parsed: tuple[str, int]) -> None:
    assert parse_replica(name) == parsed


@pytest.mark.parametrize(
    "name",
    ["", "garbage", "nimbus-1", "host:80", "host:80-", "host:80-x", "host-1", "-5",
     "host:80-1.5", "host:80- 1", "host:80-+1", "host:80-\u00b2", "host:80-\u0661"],
)
def test_garbage_names_give_none(name: str) -> None:
    # Superscript and non-ASCII digits pass str.isdigit(); they must not crash or parse.
    assert parse_replica(name) is None


def test_garbage_never_breaks_latest_seq_or_holders() -> None:
    names = ["m1:1-3", "m2:1-\u00b2", "x"]
    assert latest_seq(names) == 3
    assert holders(names, 3) == ["m1:1"]


def test_replica_name_round_trips() -> None:
    name = replica_name("nimbus-1:7800", 12)
    assert name == "nimbus-1:7800-12"
    assert parse_replica(name) == ("nimbus-1:7800", 12)


def test_paths() -> None:
    assert key_path("k") == "/blobstore/k"
    assert replica_path("k", "m-1:1", 3) == "/blobstore/k/m-1:1-3"


def test_only_replicas_at_the_given_seq_are_holders() -> None:
    names = ["m1:1-3", "m2:1-2", "m-3:1-3", "m4:1-1", "junk", "m1:1-2"]
    assert holders(names, 3) == ["m-3:1", "m1:1"]
    assert holders(names, 2) == ["m1:1", "m2:1"]
    assert holders(names, 4) == []
    assert holders(names, latest_seq(names)) == ["m-3:1", "m1:1"]


def test_a_master_is_counted_once() -> None:
    assert holders(["m1:1-3", "m1:1-3"], 3) == ["m1:1"]


def _state(**changes: object) -> BlobState:
    base = BlobState(
        seq=3,
        size=11,
        digest="0" * 32,
        acl=(AccessControl("u", "alice", ALL), AccessControl("o", "", READ)),
        replication_factor=3,
        creator="alice",
        created_at=100.0,
        updated_at=200.5,
        epoch=2,
        acked=True,
        write_quorum=2,
        history=(PastVersion(2, 10, "1" * 32), PastVersion(1, 9, "2" * 32)),
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def test_blob_state_round_trip() -> None:
    state = _state()
    back = BlobState.decode(state.encode(), meta_version=17)
    assert back == _state(meta_version=17)
    assert back.acl == state.acl
    assert back.history == state.history


def test_meta_version_is_not_stored() -> None:
    raw = json.loads(_state(meta_version=5).encode())
    assert "meta_version" not in raw
    assert raw["acl"] == "u:alice:rwa,o::r--"
    assert BlobState.decode(_state(meta_version=5).encode()).meta_version == 0


def test_every_field_but_the_znode_version_is_stored() -> None:
    # encode() names each field itself: a field added to BlobState or PastVersion and not to
    # encode() would be lost at the first write.
    tagged = _state(write_tag="t1", history=(PastVersion(2, 10, "1" * 32, "t0"),),
                    confirmed=("m2:7800",))
    raw = json.loads(tagged.encode())
    assert set(raw) == {f.name for f in dataclasses.fields(BlobState)} - {"meta_version"}
    assert set(raw["history"][0]) == {f.name for f in dataclasses.fields(PastVersion)}
    assert BlobState.decode(tagged.encode()) == tagged


def test_decode_without_history_or_quorum() -> None:
    raw = json.loads(_state().encode())
    del raw["history"]
    del raw["write_quorum"]
    back = BlobState.decode(json.dumps(raw).encode())
    assert back.history == ()
    assert back.write_quorum == 1


def test_with_new_version_moves_the_old_one_into_history() -> None:
    state = _state()
    new = state.with_new_version(
        seq=4, size=12, digest="3" * 32, now=300.0, epoch=5, write_quorum=1, keep_history=2
    )
    assert (new.seq, new.size, new.digest) == (4, 12, "3" * 32)
    assert new.updated_at == 300.0 and new.created_at == state.created_at
    assert new.epoch == 5 and new.write_quorum == 1
    assert new.acked is False
    assert new.history == (PastVersion(3, 11, "0" * 32), PastVersion(2, 10, "1" * 32))
    assert new.acl == state.acl and new.creator == state.creator
    # The original is untouched (states are values).
    assert state.seq == 3 and state.acked is True


def test_with_new_version_history_limits() -> None:
    state = _state()
    none = state.with_new_version(4, 1, "3" * 32, 1.0, 1, 1, keep_history=0)
    assert none.history == ()
    many = state.with_new_version(4, 1, "3" * 32, 1.0, 1, 1, keep_history=10)
    assert [p.seq for p in many.history] == [3, 2, 1]


def test_history_survives_encoding_after_an_update() -> None:
    new = _state().with_new_version(4, 1, "3" * 32, 1.0, 1, 1, keep_history=2)
    assert BlobState.decode(new.encode()) == new


def test_a_write_is_found_by_its_tag_until_it_leaves_the_history() -> None:
    tag = write_tag("alice", b"w1")
    assert tag and tag != write_tag("bob", b"w1") and write_tag("alice", b"") == ""
    mine = _state().with_new_version(4, 5, "4" * 32, 1.0, 2, 1, keep_history=2, write_tag=tag)
    assert mine.written_by(tag) == mine
    assert mine.written_by(write_tag("bob", b"w1")) is None and mine.written_by("") is None
    later = mine.with_new_version(5, 6, "5" * 32, 2.0, 2, 1, keep_history=2)
    found = later.written_by(tag)
    # Superseded by a later commit: reported as that version, acknowledged no sooner than the
    # later one (until then a roll-back could skip past both).
    assert found is not None and (found.seq, found.size, found.digest, found.acked) == (
        4, 5, "4" * 32, False)
    later = replace(later, acked=True)
    found = later.written_by(tag)
    assert found is not None and (found.seq, found.acked) == (4, True)
    assert BlobState.decode(later.encode()).written_by(tag) == found
    gone = later.with_new_version(6, 1, "6" * 32, 3.0, 2, 1, keep_history=1)
    assert gone.written_by(tag) is None


def test_a_rolled_back_write_is_no_longer_found() -> None:
    tag = write_tag("alice", b"w1")
    unacked = replace(_state().with_new_version(4, 5, "4" * 32, 1.0, 2, 2, keep_history=2,
                                                write_tag=tag), acked=False)
    restored = unacked.with_new_version(5, 11, "0" * 32, 2.0, 3, 2, keep_history=2, undone=True)
    # A retry of the undone write must write it again, not be told it was made.
    assert restored.written_by(tag) is None


def test_untagged_states_store_no_tag() -> None:
    state = _state().with_new_version(4, 1, "3" * 32, 1.0, 1, 1, keep_history=2)
    assert b"write_tag" not in state.encode()
    tagged = replace(state, write_tag="ab" * 8)
    assert tagged.encode().count(b"write_tag") == 1
    assert BlobState.decode(tagged.encode()) == tagged


def test_epoch_record() -> None:
    rec = EpochRecord(7, "m1:6627")
    assert EpochRecord.decode(rec.encode()) == rec
    assert EpochRecord.decode(b"") == EpochRecord(0, "")


_texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=256)


@settings(max_examples=300, deadline=None)
@given(names=st.lists(_texts, max_size=20), creator=_texts, tag=_texts,
       past=st.lists(st.tuples(st.integers(0, 2**63), _texts, _texts), max_size=4),
       numbers=st.tuples(st.integers(0, 2**63), st.integers(0, 2**63),
                         st.floats(allow_nan=False), st.integers(0, 2**63)))
def test_the_size_bound_is_never_below_the_encoded_record(
        names: list[str], creator: str, tag: str, past: list[tuple[int, str, str]],
        numbers: tuple[int, int, float, int]) -> None:
    # The commit trusts the bound to keep a record, and a group commit's transaction, under
    # ZooKeeper's request limit without encoding it: it must never under-estimate.
    seq, size, when, epoch = numbers
    state = BlobState(
        seq=seq, size=size, digest=tag[:32], acl=tuple(AccessControl("u", n, ALL) for n in names),
        replication_factor=3, creator=creator, created_at=when, updated_at=when, epoch=epoch,
        acked=True, write_quorum=2, write_tag=tag,
        history=tuple(PastVersion(s, s, d, t) for s, d, t in past))
    assert len(state.encode()) <= state.size_bound()


@pytest.mark.parametrize("char", ["\x01", '"', "\\", "é", "日", "😀", "a"])
def test_the_size_bound_holds_for_the_costliest_characters(char: str) -> None:
    # Escaped control characters take 6 bytes, quotes 2, and UTF-8 up to 4, for one character.
    text = char * 256
    state = BlobState(
        seq=2**63, size=2**63, digest=text, acl=tuple(AccessControl("u", text, ALL)
                                                    for _ in range(1000)),
        replication_factor=3, creator=text, created_at=-1.2345678901234567e-300,
        updated_at=1.7976931348623157e308, epoch=2**63, acked=False, write_quorum=2,
        write_tag=text, history=tuple(PastVersion(2**63, 2**63, text, text) for _ in range(8)))
    assert len(state.encode()) <= state.size_bound()
