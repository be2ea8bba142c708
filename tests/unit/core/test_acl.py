"""ACL grammar and semantics (Storm's; scenarios 4, 8 and 14)."""

from __future__ import annotations

import pytest

from blobha.core.acl import (
    ADMIN,
    ALL,
    MAX_STORED_BYTES,
    READ,
    WRITE,
    AccessControl,
    allowed,
    check_entries,
    check_entry,
    describe,
    format_acl,
    normalize_for_create,
    normalize_for_set,
    parse_acl,
    parse_entry,
    stored_size,
)
from blobha.core.blobstate import BlobState
from blobha.core.errors import InvalidArgument
from blobha.zk.layout import MAX_STATE_BYTES


def test_parse_user_and_other_entries() -> None:
    assert parse_acl("u:alice:rwa,o::r") == [
        AccessControl("u", "alice", ALL),
        AccessControl("o", "", READ),
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("u:bob:r--", AccessControl("u", "bob", READ)),
        ("u:bob:-w-", AccessControl("u", "bob", WRITE)),
        ("u:bob:--a", AccessControl("u", "bob", ADMIN)),
        ("u:bob:wa", AccessControl("u", "bob", WRITE | ADMIN)),
        ("o::---", AccessControl("o", "", 0)),
        ("o::rwa", AccessControl("o", "", ALL)),
        ("  u:carol:r  ", AccessControl("u", "carol", READ)),
        # Storm's other spellings (BlobStoreAclHandler.parseAccessControl).
        ("user:alice:rwa", AccessControl("u", "alice", ALL)),
        ("other::r", AccessControl("o", "", READ)),
        ("alice:rw", AccessControl("u", "alice", READ | WRITE)),
        ("r", AccessControl("o", "", READ)),
        ("-", AccessControl("o", "", 0)),
        (" user:bob:-w- ", AccessControl("u", "bob", WRITE)),
    ],
)
def test_parse_entry(text: str, expected: AccessControl) -> None:
    assert parse_entry(text) == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("x:alice:r", "type must be"),
        ("U:alice:r", "type must be"),
        ("User:alice:r", "type must be"),
        ("user::r", "needs a user name"),
        ("other:alice:r", "takes no name"),
        ("user:alice", "expected"),
        ("bob:", "expected"),
        ("rx", "expected"),
        ("alice:rx", "expected"),
        (":r", "needs a user name"),
        ("al ice :r", "must not start or end with spaces"),
        ("u::r", "needs a user name"),
        ("o:alice:r", "takes no name"),
        ("u:alice:rx", "unknown permission 'x'"),
        ("u:alice:R", "unknown permission 'R'"),
        ("u:alice:rwar", "up to three"),
        ("u:alice:", "up to three"),
        ("u:alice", "expected"),
        ("alice", "expected"),
        ("u:alice:r:extra", "expected"),
        ("", "expected"),
        ("u: alice:r", "must not start or end with spaces"),
        ("u:alice :r", "must not start or end with spaces"),
        ("u:al\x01ice:r", "control characters"),
        ("u:" + "a" * 257 + ":r", "1-256 characters"),
    ],
)
def test_malformed_entries_are_rejected_with_a_reason(text: str, fragment: str) -> None:
    with pytest.raises(InvalidArgument, match=fragment):
        parse_entry(text)


@pytest.mark.parametrize("text", ["o:r", "u:rwa", "user:r", "other:r"])
def test_a_two_part_entry_named_like_a_type_is_refused_as_ambiguous(text: str) -> None:
    # Storm reads "o:r" as a user named "o"; the person typing it almost surely meant o::r.
    name, bits = text.split(":")
    with pytest.raises(InvalidArgument, match="ambiguous") as caught:
        parse_entry(text)
    assert f"o::{bits}" in str(caught.value) and f"u:{name}:{bits}" in str(caught.value)


def test_long_and_short_forms_mix_in_one_acl_and_format_in_the_short_form() -> None:
    acl = parse_acl("user:alice:rwa,bob:r,other::-,")
    assert format_acl(acl) == "u:alice:rwa,u:bob:r--,o::---"
    with pytest.raises(InvalidArgument, match="more than once"):
        parse_acl("alice:r,user:alice:w")
    with pytest.raises(InvalidArgument, match="more than once"):
        parse_acl("r,o::w")


def test_parse_acl_skips_empty_items_and_accepts_a_list() -> None:
    assert parse_acl("") == []
    assert parse_acl(" , u:bob:r ,") == [AccessControl("u", "bob", READ)]
    assert parse_acl(["u:bob:r", "o::r"]) == [
        AccessControl("u", "bob", READ),
        AccessControl("o", "", READ),
    ]


@pytest.mark.parametrize(
    "text", ["u:alice:r,u:alice:w", "u:alice:rwa,o::r,u:alice:r", "o::r,o::w"]
)
def test_duplicate_entries_are_rejected(text: str) -> None:
    with pytest.raises(InvalidArgument, match="more than once"):
        parse_acl(text)


def test_distinct_users_are_not_duplicates() -> None:
    assert len(parse_acl("u:alice:r,u:bob:r,o::r")) == 3


def test_duplicates_are_rejected_on_set_as_well_as_create() -> None:
    dup = [AccessControl("u", "alice", READ), AccessControl("u", "alice", WRITE)]
    with pytest.raises(InvalidArgument, match="more than once"):
        normalize_for_create(dup, "bob")
    with pytest.raises(InvalidArgument, match="more than once"):
        normalize_for_set(dup, "bob")


def test_empty_acl_on_create_gives_the_creator_full_access() -> None:
    acl = normalize_for_create([], "alice")
    assert acl == [AccessControl("u", "alice", ALL)]
    assert allowed(acl, "alice", ALL)
    assert not allowed(acl, "bob", READ)


def test_create_ors_full_access_into_the_creators_existing_entry() -> None:
    acl = normalize_for_create(parse_acl("u:alice:r,o::r"), "alice")
    assert acl == [AccessControl("u", "alice", ALL), AccessControl("o", "", READ)]


def test_set_keeps_admin_for_the_setter_and_nothing_more() -> None:
    acl = normalize_for_set(parse_acl("u:bob:r"), "alice")
    assert acl == [AccessControl("u", "bob", READ), AccessControl("u", "alice", ADMIN)]
    assert allowed(acl, "alice", ADMIN)
    assert not allowed(acl, "alice", READ)
    kept = normalize_for_set(parse_acl("u:alice:r"), "alice")
    assert kept == [AccessControl("u", "alice", READ | ADMIN)]


def test_other_entries_apply_to_everyone() -> None:
    acl = parse_acl("o::r")
    assert allowed(acl, "anyone", READ)
    assert not allowed(acl, "anyone", WRITE)


def test_user_entries_apply_only_to_that_user() -> None:
    acl = parse_acl("u:alice:rwa")
    assert allowed(acl, "alice", READ | WRITE | ADMIN)
    assert not allowed(acl, "bob", READ)
    assert not allowed(acl, "alice2", READ)
    assert not allowed(acl, "", READ)


def test_bits_from_user_and_other_entries_add_up() -> None:
    acl = parse_acl("u:alice:w,o::r")
    assert allowed(acl, "alice", READ | WRITE)
    assert not allowed(acl, "alice", ADMIN)
    assert not allowed(acl, "bob", WRITE)


def test_every_requested_bit_is_needed() -> None:
    acl = parse_acl("u:alice:r")
    assert not allowed(acl, "alice", READ | WRITE)
    assert allowed(acl, "alice", 0)
    assert not allowed([], "alice", READ)


@pytest.mark.parametrize(
    "text", ["u:alice:rwa", "o::r--", "u:bob:-w-", "o::---", "u:alice:r-a,o::r--"]
)
def test_str_round_trip(text: str) -> None:
    acl = parse_acl(text)
    assert format_acl(acl) == text
    assert parse_acl(format_acl(acl)) == acl


def test_str_uses_the_canonical_three_letter_form() -> None:
    assert str(parse_entry("u:bob:wa")) == "u:bob:-wa"
    assert format_acl(parse_acl("u:alice:a,o::r")) == "u:alice:--a,o::r--"


def test_describe_names_the_bits() -> None:
    assert describe(READ) == "READ"
    assert describe(WRITE | ADMIN) == "WRITE+ADMIN"


@pytest.mark.parametrize(
    ("entry", "fragment"),
    [
        # Names the text grammar cannot carry: stored, they made the key's ACL unreadable.
        (AccessControl("u", "carol,x", READ), "must not contain ':' or ','"),
        (AccessControl("u", "a:b", READ), "must not contain ':' or ','"),
        (AccessControl("u", "line\nbreak", READ), "control characters"),
        (AccessControl("u", " bob", READ), "spaces"),
        (AccessControl("u", "", READ), "1-256 characters"),
        (AccessControl("o", "bob", READ), "takes no name"),
        (AccessControl("x", "bob", READ), "entry type"),
        (AccessControl("u", "bob", 8), "access"),
        (AccessControl("u", "bob", -1), "access"),
    ],
)
def test_entries_built_in_code_are_checked_like_parsed_ones(
    entry: AccessControl, fragment: str
) -> None:
    with pytest.raises(InvalidArgument, match=fragment):
        check_entry(entry)


def test_check_entries_accepts_what_the_grammar_round_trips_and_rejects_duplicates() -> None:
    acl = [AccessControl("u", "Ærøskøbing user", ALL), AccessControl("o", "", READ)]
    assert check_entries(acl) == acl
    assert parse_acl(format_acl(acl)) == acl
    with pytest.raises(InvalidArgument, match="more than once"):
        check_entries([AccessControl("u", "bob", READ), AccessControl("u", "bob", WRITE)])


def test_acls_read_back_from_zookeeper_keep_names_stored_before_the_rules() -> None:
    # An older version stored 'u: bob:r' as the name ' bob': its key must stay readable.
    from blobha.core.blobstate import BlobState

    state = BlobState(seq=1, size=1, digest="0" * 32, acl=(AccessControl("u", " bob", READ),),
                      replication_factor=3, creator="alice", created_at=0.0, updated_at=0.0,
                      epoch=1, acked=True)
    assert BlobState.decode(state.encode()).acl == state.acl
    with pytest.raises(InvalidArgument, match="spaces"):
        parse_acl("u: bob:r")


def test_a_user_name_that_is_not_utf8_is_refused() -> None:
    import os

    from blobha.core.acl import parse_entry

    with pytest.raises(InvalidArgument, match="valid UTF-8"):
        parse_entry("u:" + os.fsdecode(b"al\xffice") + ":r")


def test_an_acl_has_at_most_max_entries() -> None:
    from blobha.core.acl import MAX_ENTRIES, AccessControl, check_entries

    many = [AccessControl("u", f"user-{i}", 1) for i in range(MAX_ENTRIES)]
    assert len(check_entries(many)) == MAX_ENTRIES
    with pytest.raises(InvalidArgument, match="1,001 entries"):
        check_entries([*many, AccessControl("o", "", 1)])


def _names(char: str) -> list[AccessControl]:
    # 1,000 entries of 256-character names: the entry and name limits at their largest.
    return [AccessControl("u", f"{i:04d}" + char * 252, READ) for i in range(1000)]


def test_an_acl_is_bounded_by_its_stored_size_as_well_as_its_entries() -> None:
    # Before: the record escaped non-ASCII as \uXXXX, so 1,000 names of 256 CJK characters
    # took 1.5 MB in ZooKeeper, which dropped the leader's connection at each retry.
    cjk = _names("日")
    assert check_entries(cjk) == cjk
    record = BlobState(seq=1, size=1, digest="0" * 32, acl=tuple(cjk), replication_factor=3,
                       creator="alice", created_at=1.0, updated_at=1.0, epoch=1,
                       acked=True).encode()
    assert stored_size(cjk) < MAX_STORED_BYTES
    assert len(record) < MAX_STATE_BYTES
    assert "日".encode() * 252 in record  # raw UTF-8
    # Four-byte characters: within the entry and name limits, past what ZooKeeper holds.
    with pytest.raises(InvalidArgument, match=r"bytes as stored, more than the 900,000"):
        check_entries(_names("😀"))
    # Quotes are stored escaped, and counted so.
    assert stored_size([AccessControl("u", '"', READ)]) == len('"u:\\":r--"')
