"""Code keys belong to one user: ``code.<segment>.…`` is the key space of the one user whose
name :func:`code_segment` spells as ``<segment>`` (the rule, its one-to-one spelling, the ACLs
such a key may have, and the masters' :class:`Authority` applying it)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from blobha.core import acl as acls
from blobha.core.acl import AccessControl, code_acl_refusal, parse_acl
from blobha.core.errors import NotAuthorized
from blobha.core.keys import (
    code_key_refusal,
    code_owner,
    code_segment,
    code_segment_user,
    owns_code_key,
    validate_key,
)
from blobha.master.rules import Authority
from blobha.spark.jobcode import code_key

DIGEST = "0123456789abcdef0123456789abcdef"
AUTHORITY = Authority(frozenset({"admin"}), "blobha-master")


@pytest.mark.parametrize(("user", "segment"), [
    ("alice", "alice"),
    ("Bob-2", "Bob-2"),
    ("svc_etl", "svc__etl"),
    ("alice.x", "alice_2e_x"),
    ("alice@EXAMPLE.COM", "alice_40_EXAMPLE_2e_COM"),
    ("a b", "a_20_b"),
    ("données", "donn_e9_es"),
])
def test_a_user_s_segment_is_spelled_out(user: str, segment: str) -> None:
    assert code_segment(user) == segment
    assert code_segment_user(segment) == user


def test_a_long_name_s_segment_is_its_sha256() -> None:
    long = "x" * 97
    assert code_segment(long) == "_h" + __import__("hashlib").sha256(long.encode()).hexdigest()
    assert code_segment("x" * 96) == "x" * 96
    assert code_segment_user(code_segment(long)) is None  # one-way; still one user's
    assert owns_code_key(long, f"code.{code_segment(long)}.{DIGEST}.lib.zip")


# Names that differ only in what a lossy spelling would drop or merge.
_CLASHES = ["a_b", "a@b", "a.b", "a b", "a__b", "a_40_b", "a-b", "a_2e_b", "a", "a.", "_", "__",
            "a-40-b", "a_40_", "a_b-1a2b3c4d", "_h" + "0" * 64]


def test_segments_are_one_to_one_and_make_valid_keys() -> None:
    segments = [code_segment(u) for u in _CLASHES]
    assert len(set(segments)) == len(_CLASHES)
    for user, segment in zip(_CLASHES, segments, strict=True):
        assert "." not in segment and segment
        key = code_key(user, DIGEST, "lib.zip")
        assert validate_key(key) == key and code_owner(key) == segment
        assert [u for u in _CLASHES if owns_code_key(u, key)] == [user]


@given(st.text(min_size=1, max_size=40).filter(lambda u: "\x00" not in u))
def test_any_name_round_trips_and_never_holds_a_dot(user: str) -> None:
    segment = code_segment(user)
    assert "." not in segment
    # Spelled out (then read back), or past 96 characters hashed (then one-way).
    assert code_segment_user(segment) == (None if segment.startswith("_h") else user)


@given(st.text(min_size=1, max_size=12), st.text(min_size=1, max_size=12))
def test_two_names_never_share_a_segment(a: str, b: str) -> None:
    assert (code_segment(a) == code_segment(b)) == (a == b)


@pytest.mark.parametrize(("key", "owner"), [
    (f"code.alice.{DIGEST}.lib.zip", "alice"),
    ("code.alice", "alice"),
    ("code.", ""),
    ("code..x", ""),
    ("codex.alice.x", None),
    ("Code.alice.x", None),
    ("alice.code.x", None),
    ("geo-table", None),
])
def test_the_owner_is_the_segment_after_code(key: str, owner: str | None) -> None:
    assert code_owner(key) == owner


def test_who_owns_what() -> None:
    key = f"code.alice.{DIGEST}.lib.zip"
    assert owns_code_key("alice", key) and not owns_code_key("bob", key)
    # A dot in a name does not make its prefix somebody else's: "alice.x" is not under
    # "code.alice.", and "alice" has nothing under "code.alice_2e_x.".
    assert not owns_code_key("alice.x", key)
    assert not owns_code_key("alice", code_key("alice.x", DIGEST, "lib.zip"))
    assert not owns_code_key("", "code..x") and not owns_code_key("alice", "code.")
    assert not owns_code_key("alice", "geo-table")
    assert code_key_refusal("alice", key) is None and code_key_refusal("bob", "geo") is None
    message = code_key_refusal("bob", key)
    assert message is not None and "\n" not in message
    assert message.startswith("keys under 'code.alice.' belong to user 'alice'")
    assert "'code.bob.'" in message
    assert "belong to one user" in (code_key_refusal("bob", "code._zz_.x") or "")


def _no_one_else_writes(key: str, text: str) -> str | None:
    return code_acl_refusal(key, parse_acl(text), AUTHORITY.privileged)


def test_a_code_key_s_acl_grants_others_read_at_most() -> None:
    key = f"code.alice.{DIGEST}.lib.zip"
    for fine in ("u:alice:rwa", "u:alice:rwa,o::r,u:bob:r", "u:alice:rwa,u:admin:rwa",
                 "u:blobha-master:rwa", ""):
        assert _no_one_else_writes(key, fine) is None, fine
    for bad, who in (("u:alice:rwa,u:bob:rw", "user 'bob'"), ("o::rw", "everyone"),
                     ("u:alice:rwa,u:bob:a", "user 'bob'"),
                     ("u:alice.x:rwa", "user 'alice.x'")):
        message = _no_one_else_writes(key, bad)
        assert message is not None and who in message and "READ at most" in message, bad
    # Other keys' ACLs are none of this rule's business.
    assert _no_one_else_writes("geo-table", "o::rwa") is None


def test_the_masters_keep_code_keys_to_their_owner_whatever_the_acl() -> None:
    key = f"code.alice.{DIGEST}.lib.zip"
    # An ACL stored before the rule, granting bob and everyone writes.
    legacy = [AccessControl("u", "bob", acls.ALL), AccessControl("o", "", acls.ALL)]
    for access in (acls.WRITE, acls.ADMIN, acls.WRITE | acls.READ):
        with pytest.raises(NotAuthorized, match="belong to user 'alice'"):
            AUTHORITY.require("bob", legacy, access, key)
    AUTHORITY.require("bob", legacy, acls.READ, key)  # reading is what the ACL may grant
    assert AUTHORITY.access("bob", legacy, key) == acls.READ
    # The owner, the admins and the masters may do anything, with or without an entry.
    for user in ("alice", "admin", "blobha-master"):
        AUTHORITY.require(user, [], acls.ALL, key)
        assert AUTHORITY.access(user, [], key) == acls.ALL
    # Creating: only the owner (or the privileged), and with an ACL sharing no writes.
    AUTHORITY.require_create("alice", key, parse_acl("u:alice:rwa,o::r"))
    AUTHORITY.require_create("admin", key, parse_acl("u:admin:rwa"))
    with pytest.raises(NotAuthorized, match="belong to user 'alice'"):
        AUTHORITY.require_create("bob", key, parse_acl("u:alice:rwa"))
    with pytest.raises(NotAuthorized, match="READ at most"):
        AUTHORITY.require_create("alice", key, parse_acl("u:alice:rwa,u:bob:w"))
    # Any other key: as its ACL says.
    AUTHORITY.require_create("bob", "geo-table", parse_acl("o::rwa"))
    AUTHORITY.require("bob", legacy, acls.ALL, "geo-table")
    assert AUTHORITY.access("bob", legacy, "geo-table") == acls.ALL
