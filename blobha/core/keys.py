"""Blob keys: Storm's key rules, a safe on-disk name for each key, and whose a code key is.

A key is made of letters, digits, ``_``, ``.``, ``-`` and space (it matches
``[\\w ._-]+``; ``\\w`` is Unicode-aware, so ``données_2024`` is valid), is not ``.`` or
``..``, and is at most :data:`MAX_KEY_BYTES` bytes of UTF-8. Unlike Storm, a key may not hold
characters ZooKeeper refuses in node names, which Storm accepted only to fail later in
ZooKeeper: control characters (Storm's rule allows tab), and characters beyond U+FFFF such as
emoji, which Java stores as surrogate pairs. The rules exclude ``/`` (which would nest znodes
or escape the blob directory) and ``:`` (which would collide with the ``host:port-seq``
replica node names).

Keys under ``code.<segment>.`` hold job code (``blobha spark-submit``) and belong to the one
user whose name :func:`code_segment` spells as ``<segment>``; the masters let only that user
create, write or administer them (:func:`code_key_refusal`).
"""

from __future__ import annotations

import re
import urllib.parse

from blobha.core.errors import InvalidArgument

MAX_KEY_BYTES = 512
#: Storm's rule without the tab it allows, which ZooKeeper refuses (see _zookeeper_refuses).
_KEY_RE = re.compile(r"[\w ._-]+")
# Longest directory name we produce; most file systems cap a name at 255 bytes.
_MAX_DIRNAME = 200


def validate_key(key: str) -> str:
    """Return ``key`` unchanged if valid, else raise :class:`InvalidArgument` saying why."""
    if not key:
        raise InvalidArgument("the key is empty; give a key such as 'geo-table_v2'")
    try:
        encoded = key.encode("utf-8")
    except UnicodeEncodeError:
        # Bytes that are not UTF-8, passed through by the shell as lone surrogates.
        raise InvalidArgument(f"invalid key {key!r}: it is not valid UTF-8; keys are text such"
                              " as 'geo-table_v2'") from None
    if len(encoded) > MAX_KEY_BYTES:
        raise InvalidArgument(f"the key is longer than {MAX_KEY_BYTES} bytes of UTF-8; shorten it")
    if key in (".", ".."):
        raise InvalidArgument(f"{key!r} is not a valid key; choose a name with letters or digits")
    # The usual key passes in one match; \w takes no control, surrogate, private-use or
    # Specials character, so of what ZooKeeper refuses only those beyond U+FFFF remain.
    if _KEY_RE.fullmatch(key) and max(key) <= "\uffff":
        return key
    # Some character fails one rule or the other: the first one is named.
    bad = next(c for c in key if _zookeeper_refuses(c) or not _KEY_RE.fullmatch(c))
    why = _zookeeper_refuses(bad)
    if why:
        raise InvalidArgument(
            f"invalid key {key!r}: character {bad!r} (U+{ord(bad):04X}, {why}) cannot be stored"
            " in a ZooKeeper node name; remove it"
        )
    raise InvalidArgument(
        f"invalid key {key!r}: character {bad!r} is not allowed; keys may contain only letters,"
        " digits, '_', '.', '-' and space (no '/', ':' or other punctuation)"
    )


def _zookeeper_refuses(c: str) -> str:
    """Why ZooKeeper refuses ``c`` in a node name, or "" if it does not.

    Its PathUtils rejects these UTF-16 code units in any path component. A code point above
    U+FFFF is a surrogate pair in Java's UTF-16, so it is refused as well."""
    o = ord(c)
    if o < 0x20 or 0x7F <= o <= 0x9F:
        return "a control character"
    if 0xD800 <= o <= 0xDFFF:
        return "a surrogate"
    if 0xE000 <= o <= 0xF8FF:
        return "a private-use character"
    if 0xFFF0 <= o <= 0xFFFF:
        return "in the Specials block"
    if o > 0xFFFF:
        return "beyond U+FFFF: Java stores it as a surrogate pair"
    return ""


def key_dirname(key: str) -> str:
    """A file-system-safe, collision-free directory name for a valid key.

    Readable when short: percent-encoding of everything but ``[A-Za-z0-9_.-]``; a leading dot is
    encoded too so a key never becomes a hidden or special entry, and so is the ``h`` of a leading
    ``h-`` so a short key never takes the name of a hashed long one. Long encodings fall back to a
    hash, and the key itself is always recorded inside the directory.
    """
    name = urllib.parse.quote(key, safe="_-.")
    if name.startswith("."):
        name = "%2E" + name[1:]
    elif name.startswith("h-"):
        name = "%68" + name[1:]
    if len(name) > _MAX_DIRNAME:
        import xxhash  # here: most keys are short, and the node cache's users need no hash

        name = "h-" + xxhash.xxh3_128_hexdigest(key.encode("utf-8"))
    return name


def key_of_dirname(name: str) -> str | None:
    """The key :func:`key_dirname` gave ``name``, or None for a hashed name (one-way: the key is
    recorded inside the directory) and for a name it never gives."""
    if name.startswith("h-"):
        return None
    try:
        key = urllib.parse.unquote(name, errors="strict")
    except UnicodeDecodeError:
        return None
    # The round trip rejects what quoting never makes (lower-case escapes, a bare '%').
    return key if key and key_dirname(key) == name else None


# --------------------------------------------------------------------------------------------
# Code keys: ``code.<segment>.…`` belongs to the one user whose name encodes to <segment>
# --------------------------------------------------------------------------------------------

#: Keys under this prefix hold users' job code (``blobha spark-submit``), one user's each.
CODE_PREFIX = "code."
#: Longest segment spelled out; a longer one is replaced by a SHA-256 of the name.
_MAX_SEGMENT = 96
_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-")
_HEX = frozenset("0123456789abcdef")


def code_segment(user: str) -> str:
    """The segment naming ``user`` in its code keys, ``code.<segment>.<digest>.<name>``.

    One-to-one, so that no two users share a prefix: ASCII letters, digits and ``-`` stay,
    ``_`` becomes ``__`` and any other character ``_<hex code point>_`` (never a ``.``, which
    ends the segment). A segment longer than 96 characters becomes ``_h`` and the SHA-256 of
    the name, which no spelled-out segment starts with (``_`` is followed by ``_`` or a hex
    digit there).

    >>> code_segment("alice"), code_segment("svc_etl"), code_segment("alice@EXAMPLE.COM")
    ('alice', 'svc__etl', 'alice_40_EXAMPLE_2e_COM')
    """
    parts = []
    for c in user:
        if c in _PLAIN:
            parts.append(c)
        elif c == "_":
            parts.append("__")
        else:
            parts.append(f"_{ord(c):x}_")
    segment = "".join(parts)
    if len(segment) > _MAX_SEGMENT:
        import hashlib  # here: the Spark worker hook loads this module, and needs no hash

        segment = "_h" + hashlib.sha256(user.encode("utf-8", "surrogatepass")).hexdigest()
    return segment


def code_segment_user(segment: str) -> str | None:
    """The user name :func:`code_segment` spells as ``segment``; None for a hashed segment
    and for one it never makes."""
    out: list[str] = []
    i = 0
    while i < len(segment):
        c = segment[i]
        if c in _PLAIN:
            out.append(c)
            i += 1
            continue
        if c != "_" or i + 1 >= len(segment):
            return None
        if segment[i + 1] == "_":
            out.append("_")
            i += 2
            continue
        end = segment.find("_", i + 1)
        digits = segment[i + 1:end] if end > 0 else ""
        if not digits or not set(digits) <= _HEX or len(digits) > 6:
            return None
        point = int(digits, 16)
        if point > 0x10FFFF:
            return None
        out.append(chr(point))
        i = end + 1
    user = "".join(out)
    # Only a segment code_segment gives: a non-canonical spelling belongs to nobody.
    return user if user and code_segment(user) == segment else None


def code_owner(key: str) -> str | None:
    """The segment owning ``key`` when it is a code key (under ``code.``), else None. The
    segment runs to the next ``.`` or the key's end (``code.`` alone has ``""``: nobody's)."""
    if not key.startswith(CODE_PREFIX):
        return None
    return key[len(CODE_PREFIX):].split(".", 1)[0]


def owns_code_key(user: str, key: str) -> bool:
    """Whether ``key`` is a code key of ``user``'s (``code.<code_segment(user)>.…``)."""
    owner = code_owner(key)
    return owner is not None and owner != "" and owner == code_segment(user)


def code_key_refusal(user: str, key: str) -> str | None:
    """Why ``user`` may not create, write or administer ``key``, a code key of another user;
    None when it may (the key is not a code key, or it is ``user``'s own)."""
    owner = code_owner(key)
    if owner is None or owns_code_key(user, key):
        return None
    name = code_segment_user(owner)
    whose = f"user {name!r}" if name is not None else "one user (not you)"
    return (f"keys under {CODE_PREFIX + owner + '.'!r} belong to {whose}: only they (or an"
            f" admin) may create, write or administer {key!r}, which user {user!r} may at most"
            f" read; store your own code under {CODE_PREFIX + code_segment(user) + '.'!r}")
