"""Blob keys: Storm's key rules, and a safe on-disk name for each key.

A key is made of letters, digits, ``_``, ``.``, ``-`` and space (it matches
``[\\w ._-]+``; ``\\w`` is Unicode-aware, so ``données_2024`` is valid), is not ``.`` or
``..``, and is at most :data:`MAX_KEY_BYTES` bytes of UTF-8. Unlike Storm, a key may not hold
characters ZooKeeper refuses in node names, which Storm accepted only to fail later in
ZooKeeper: control characters (Storm's rule allows tab), and characters beyond U+FFFF such as
emoji, which Java stores as surrogate pairs. The rules exclude ``/`` (which would nest znodes
or escape the blob directory) and ``:`` (which would collide with the ``host:port-seq``
replica node names).
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
