"""Blob key rules (Storm's, scenario 15) and the on-disk directory name of a key."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from blobha.core import keys
from blobha.core.errors import InvalidArgument
from blobha.core.keys import MAX_KEY_BYTES, key_dirname, key_of_dirname, validate_key

VALID = [
    "test",
    "geo-table_v2",
    "a.b.c",
    "données_2024",
    "日本語キー",
    "with space",
    "...x",
    ".hidden",
    "-leading-dash",
    "x" * MAX_KEY_BYTES,
    "é" * (MAX_KEY_BYTES // 2),
]

INVALID = [
    "",
    ".",
    "..",
    "a/b",
    "/abs",
    "a:b",
    "host:1-2",
    "new\nline",
    "trailing\n",
    "back\\slash",
    "star*",
    "nul\x00byte",
    "tab\tkey",  # Storm's regex allows tab, but ZooKeeper refuses it in node names
    "del\x7fchar",
    "private\ue000use",
    "x" * (MAX_KEY_BYTES + 1),
    "é" * (MAX_KEY_BYTES // 2 + 1),
]


@pytest.mark.parametrize("key", VALID)
def test_valid_keys_are_returned_unchanged(key: str) -> None:
    assert validate_key(key) == key


@pytest.mark.parametrize("key", INVALID)
def test_invalid_keys_are_rejected(key: str) -> None:
    with pytest.raises(InvalidArgument):
        validate_key(key)


def test_characters_zookeeper_refuses_are_named() -> None:
    with pytest.raises(InvalidArgument, match=r"U\+0009.*ZooKeeper"):
        validate_key("tab\tkey")


@pytest.mark.parametrize(
    ("key", "named"),
    [
        ("tab\tkey", r"character '\t' (U+0009, a control character)"),
        ("emoji-\U0001F600", "character '\U0001F600' (U+1F600, beyond U+FFFF"),
        ("private\ue000use", r"character '\ue000' (U+E000, a private-use character)"),
        ("repl\ufffd", "character '\ufffd' (U+FFFD, in the Specials block)"),
        ("a/b", "character '/' is not allowed"),
        ("ok:\t", "character ':' is not allowed"),  # the first offending character
        ("star*\U0001F600", "character '*' is not allowed"),
    ],
)
def test_the_message_names_the_offending_character(key: str, named: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        validate_key(key)
    message = str(info.value)
    assert named in message
    # Only the rule that was broken: no "such as tab" for an emoji, and tab is never offered
    # as allowed (ZooKeeper refuses it).
    assert "tab" not in message.replace(repr(key), "")


def test_the_documented_rule_is_the_enforced_one() -> None:
    # Tab: neither in the pattern, nor in the module's rule, nor accepted.
    assert not keys._KEY_RE.fullmatch("\t")
    assert "\\t" not in (keys.__doc__ or "")
    assert validate_key("letters digits_._-") == "letters digits_._-"


def test_characters_beyond_the_bmp_are_refused_like_zookeeper_does() -> None:
    # Found by the request fuzzer: ZooKeeper refused U+10000 at commit time (BadArguments, an
    # INTERNAL error) because Java stores it as a surrogate pair, which its path check rejects.
    for key in ("\U00010000", "emoji-\U0001F600", "cjk-ext-b-\U00020000"):
        with pytest.raises(InvalidArgument, match=r"U\+[0-9A-F]{5}.*ZooKeeper"):
            validate_key(key)
    assert validate_key("données-日本語-\uac00") == "données-日本語-\uac00"  # BMP: still valid


def test_rejection_messages_say_why() -> None:
    with pytest.raises(InvalidArgument, match="empty"):
        validate_key("")
    with pytest.raises(InvalidArgument, match="longer than"):
        validate_key("x" * (MAX_KEY_BYTES + 1))
    with pytest.raises(InvalidArgument, match="'/'"):
        validate_key("a/b")


@pytest.mark.parametrize("key", VALID)
def test_dirname_is_a_safe_single_path_component(key: str, tmp_path: Path) -> None:
    name = key_dirname(key)
    assert name not in ("", ".", "..")
    assert not name.startswith(".")
    assert "/" not in name and "\\" not in name and "\x00" not in name
    assert all(c.isascii() and c.isprintable() and not c.isspace() for c in name)
    assert len(name.encode()) <= 255
    # The file system agrees: the name creates exactly one entry directly under tmp_path.
    (tmp_path / name).mkdir()
    assert os.listdir(tmp_path) == [name]


def test_dirnames_are_unique_for_distinct_keys() -> None:
    keys = [
        *VALID,
        "A", "a", "a b", "a_b", "a-b", "a.b", "a\tb", ".Hidden", "_hidden", " x", "x ",
        "x" * 300, "x" * 301, "y" * 300,
    ]
    names = [key_dirname(k) for k in keys]
    assert len(set(names)) == len(keys)


def test_a_short_key_never_takes_the_directory_of_a_hashed_long_key() -> None:
    long_key = "z" * 300
    hashed = key_dirname(long_key)
    # A valid key spelled exactly like the hash name must get a directory of its own, or the
    # two keys would share one directory (and one set of versions) in the store.
    impostor = validate_key(hashed)
    assert key_dirname(impostor) != hashed


def test_short_keys_stay_readable() -> None:
    assert key_dirname("geo-table_v2") == "geo-table_v2"
    assert key_dirname("a.b") == "a.b"


def test_long_keys_fall_back_to_a_stable_hash() -> None:
    # 170 three-byte characters: a valid key whose percent-encoding is far too long.
    long_key = validate_key("日本語" * 56 + "キー"[:2])
    name = key_dirname(long_key)
    assert name.startswith("h-")
    assert name == key_dirname(long_key)
    assert name != key_dirname(long_key[:-1])
    assert key_dirname("x" * 300).startswith("h-")


@pytest.mark.parametrize("key", [*VALID, "a%b", "h-y", "100%", "%41"])
def test_a_directory_name_gives_its_key_back_unless_hashed(key: str) -> None:
    name = key_dirname(key)
    if name.startswith("h-"):
        assert key_of_dirname(name) is None  # one-way: the key is read from the records
    else:
        assert key_of_dirname(name) == key


@pytest.mark.parametrize("name", ["%2e", "a%2fb", "%", "%zz", "%C3", "%68x", ""])
def test_names_the_encoding_never_gives_have_no_key(name: str) -> None:
    # Lower-case escapes, broken escapes and stray encodings are not directories of ours.
    assert key_of_dirname(name) is None


def test_a_key_that_is_not_utf8_is_invalid_not_a_crash() -> None:
    # A shell passes bytes that are not UTF-8 as lone surrogates ($'\xff'); encoding the key
    # raised UnicodeEncodeError, which the CLI reported as an internal error.
    with pytest.raises(InvalidArgument, match="not valid UTF-8"):
        validate_key(os.fsdecode(b"geo\xff"))
