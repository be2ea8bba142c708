"""Access control lists with Storm's grammar and semantics.

An entry is ``[u|o]:[username]:[r-][w-][a-]``: ``u:alice:rwa`` gives alice everything,
``o::r`` lets everyone read. Storm's longer and shorter spellings (``user:alice:rwa``,
``other::r``, ``alice:rwa``, ``r``) parse to the same entries. Bits: READ=1, WRITE=2, ADMIN=4.
The creator of a blob always keeps full access, and whoever sets an ACL keeps ADMIN, so nobody
locks themselves out by mistake.

>>> parse_acl("u:alice:rwa,o::r")
[AccessControl(type='u', name='alice', access=7), AccessControl(type='o', name='', access=1)]
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from blobha.core import keys
from blobha.core.errors import InvalidArgument

READ = 1
WRITE = 2
ADMIN = 4
ALL = READ | WRITE | ADMIN

_BITS = {"r": READ, "w": WRITE, "a": ADMIN}
_NAMES = {READ: "READ", WRITE: "WRITE", ADMIN: "ADMIN"}


@dataclass(frozen=True)
class AccessControl:
    type: str  # "u" (a named user) or "o" (everyone)
    name: str
    access: int

    def __str__(self) -> str:
        return f"{self.type}:{self.name}:{format_access(self.access)}"


def format_access(access: int) -> str:
    """Permission bits as the ACL grammar writes them: 'rw-', say."""
    return "".join(c if access & b else "-" for c, b in _BITS.items())


#: The longest user name an ACL (and authentication) accepts.
MAX_NAME_LENGTH = 256
#: Most entries one ACL may hold. The ACL lives in the key's ZooKeeper node, which ZooKeeper
#: caps at about 1 MB (jute.maxbuffer): a larger one was refused there by dropping the
#: leader's connection, again at each retry. At the longest names this is about 260 KB.
MAX_ENTRIES = 1000
#: Most bytes an ACL may take as stored (its text form, in the key's JSON record). The entry
#: and name limits do not bound it: 1,000 names of 256 four-byte characters take 1 MB. It
#: leaves the rest of the record (history, creator) and its transaction room below
#: ZooKeeper's 1 MB (blobha.zk.layout.MAX_STATE_BYTES).
MAX_STORED_BYTES = 900_000


def name_problem(name: str) -> str | None:
    """What is wrong with ``name`` as a user name, or None. Names live inside the ACL's text
    form (``u:name:rwa`` entries joined by ``,``), which is how ZooKeeper stores it, so ``:``
    and ``,`` would make a stored ACL unreadable, and with it the key (and listings)."""
    if not name or len(name) > MAX_NAME_LENGTH:
        return f"must be 1-{MAX_NAME_LENGTH} characters"
    if ":" in name or "," in name:
        return "must not contain ':' or ','"
    if name != name.strip():
        return "must not start or end with spaces"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "must not contain control characters"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        # Bytes that are not UTF-8, passed through by the shell as lone surrogates.
        return "must be valid UTF-8"
    return None


def check_entry(entry: AccessControl) -> AccessControl:
    """``entry`` if it is well-formed, else :class:`InvalidArgument` saying why (for entries
    built in code or received over the wire, which skip :func:`parse_entry`)."""
    if entry.type not in ("u", "o"):
        raise InvalidArgument(
            f"bad ACL entry type {entry.type!r}: use 'u' (a user) or 'o' (everyone else)"
        )
    if not isinstance(entry.access, int) or not 0 <= entry.access <= ALL:
        raise InvalidArgument(
            f"bad ACL access {entry.access!r}: use a sum of READ=1, WRITE=2 and ADMIN=4"
        )
    if entry.type == "o":
        if entry.name:
            raise InvalidArgument(f"an 'o' ACL entry takes no name, not {entry.name!r}; e.g. o::r")
        return entry
    if not isinstance(entry.name, str):
        raise InvalidArgument(f"an ACL user name must be a string, not {entry.name!r}")
    problem = name_problem(entry.name)
    if problem:
        raise InvalidArgument(f"bad user name {entry.name!r} in the ACL: it {problem}")
    return entry


def check_entries(acl: Iterable[AccessControl]) -> list[AccessControl]:
    """Every entry checked (:func:`check_entry`), no user named twice, and at most
    :data:`MAX_ENTRIES` entries."""
    out = [check_entry(e) for e in acl]
    if len(out) > MAX_ENTRIES:
        raise InvalidArgument(
            f"the ACL has {len(out):,} entries, more than the {MAX_ENTRIES:,} a key may hold;"
            " give access to fewer users (o::r grants everyone else)"
        )
    check_duplicates(out)
    stored = stored_size(out)
    if stored > MAX_STORED_BYTES:
        raise InvalidArgument(
            f"the ACL takes {stored:,} bytes as stored, more than the {MAX_STORED_BYTES:,} a"
            " key's metadata has room for (ZooKeeper caps it at 1 MB): give access to fewer"
            " users or use shorter names (o::r grants everyone else)"
        )
    return out


def stored_size(acl: Iterable[AccessControl]) -> int:
    """The bytes ``acl`` takes in the key's record: its text form as a JSON string (UTF-8,
    quotes and escapes included), as :meth:`blobha.core.blobstate.BlobState.encode` writes it."""
    return len(json.dumps(format_acl(acl), ensure_ascii=False).encode())


#: Type words, short and long (Storm accepts both), to the type stored.
_TYPES = {"u": "u", "user": "u", "o": "o", "other": "o"}

_FORM = "expected [u|o]:[username]:[r-][w-][a-], e.g. u:alice:rwa or o::r"


def parse_entry(text: str, strict: bool = True) -> AccessControl:
    """Parse one ACL entry, raising :class:`InvalidArgument` with the expected form.

    Storm's other spellings are accepted too: ``user:`` and ``other:`` for ``u:`` and ``o:``,
    ``alice:rwa`` (two parts) for ``u:alice:rwa`` and ``r`` (one part) for ``o::r``. A
    two-part entry whose name is a type word (``o:r``) is refused as ambiguous: Storm reads it
    as a user named "o", which is rarely what was meant.

    ``strict=False`` skips the user-name rules (:func:`name_problem`), for ACLs read back from
    ZooKeeper: a name an older version stored must not make its key unreadable."""
    stripped = text.strip()
    parts = stripped.split(":")
    if not stripped or len(parts) > 3:
        raise InvalidArgument(f"bad ACL entry {text!r}: {_FORM}")
    if len(parts) == 3:
        kind_text, name, bits = parts
        kind = _TYPES.get(kind_text)
        if kind is None:
            raise InvalidArgument(
                f"bad ACL entry {text!r}: the type must be 'u' or 'user' (a user), 'o' or"
                " 'other' (everyone else)"
            )
    elif len(parts) == 2:
        kind, (name, bits) = "u", parts
        if not _is_permissions(bits):
            raise InvalidArgument(f"bad ACL entry {text!r}: {_FORM}")
        if name in _TYPES:
            raise InvalidArgument(
                f"bad ACL entry {text!r} is ambiguous: write o::{bits} for everyone, or"
                f" u:{name}:{bits} for a user named {name!r}"
            )
    else:
        kind, name, bits = "o", "", parts[0]
        if not _is_permissions(bits):
            raise InvalidArgument(f"bad ACL entry {text!r}: {_FORM}")
    if kind == "u" and not name:
        raise InvalidArgument(f"bad ACL entry {text!r}: a 'u' entry needs a user name")
    if kind == "o" and name:
        raise InvalidArgument(f"bad ACL entry {text!r}: an 'o' entry takes no name, e.g. o::r")
    if not bits or len(bits) > 3:
        raise InvalidArgument(f"bad ACL entry {text!r}: permissions are up to three of r, w, a, -")
    access = 0
    for c in bits:
        if c == "-":
            continue
        if c not in _BITS:
            raise InvalidArgument(
                f"bad ACL entry {text!r}: unknown permission {c!r}; use r, w, a or -"
            )
        access |= _BITS[c]
    if kind == "u" and strict:
        problem = name_problem(name)
        if problem:
            raise InvalidArgument(f"bad ACL entry {text!r}: the user name {problem}")
    return AccessControl(kind, name, access)


def _is_permissions(bits: str) -> bool:
    """Whether ``bits`` reads as permissions (the short forms have no type word to tell a
    mistyped entry from one with a bad permission: such text gets the expected form)."""
    return 0 < len(bits) <= 3 and all(c in "rwa-" for c in bits)


def parse_acl(text: str | Iterable[str], strict: bool = True) -> list[AccessControl]:
    """Parse a comma-separated ACL string (or entries) and reject duplicate entries
    (``strict``: see :func:`parse_entry`)."""
    items = text.split(",") if isinstance(text, str) else list(text)
    acl = [parse_entry(t, strict) for t in items if t.strip()]
    check_duplicates(acl)
    return acl


def check_duplicates(acl: Iterable[AccessControl]) -> None:
    seen: set[tuple[str, str]] = set()
    for e in acl:
        if (e.type, e.name) in seen:
            who = f"user {e.name!r}" if e.type == "u" else "'other'"
            raise InvalidArgument(f"the ACL names {who} more than once; merge those entries")
        seen.add((e.type, e.name))


def format_acl(acl: Iterable[AccessControl]) -> str:
    return ",".join(str(e) for e in acl)


def ensure_user_access(acl: list[AccessControl], user: str, access: int) -> list[AccessControl]:
    """``acl`` with ``user``'s entry OR-ed with ``access`` (added if missing)."""
    check_duplicates(acl)
    out: list[AccessControl] = []
    found = False
    for e in acl:
        if e.type == "u" and e.name == user:
            out.append(AccessControl("u", user, e.access | access))
            found = True
        else:
            out.append(e)
    if not found:
        out.append(AccessControl("u", user, access))
    return out


def normalize_for_create(acl: list[AccessControl], creator: str) -> list[AccessControl]:
    """The creator always keeps full access (an empty ACL becomes ``u:creator:rwa``)."""
    return ensure_user_access(acl, creator, ALL)


def normalize_for_set(acl: list[AccessControl], setter: str) -> list[AccessControl]:
    """Whoever sets an ACL keeps ADMIN, so they can always fix it again."""
    return ensure_user_access(acl, setter, ADMIN)


def access_of(acl: Iterable[AccessControl], user: str) -> int:
    """The bits ``user`` holds through its user entries and the 'other' entries."""
    have = 0
    for e in acl:
        if e.type == "o" or (e.type == "u" and e.name == user):
            have |= e.access
    return have


def allowed(acl: Iterable[AccessControl], user: str, access: int) -> bool:
    """Whether ``user`` holds every bit of ``access`` through a user or 'other' entry."""
    return access_of(acl, user) & access == access


def describe(access: int) -> str:
    return "+".join(name for bit, name in _NAMES.items() if access & bit)


def code_acl_refusal(key: str, acl: Iterable[AccessControl],
                     exempt: Callable[[str], bool]) -> str | None:
    """Why ``acl`` may not be given to ``key``, a code key (see
    :func:`blobha.core.keys.code_owner`); None if it may. Only the key's owner and ``exempt``
    users (the cluster's admins and the masters, who may do anything anyway) may hold WRITE
    or ADMIN there: an entry granting them to anyone else would never be honoured, and is
    refused rather than stored as a promise the masters do not keep."""
    owner = keys.code_owner(key)
    if owner is None:
        return None
    for e in acl:
        if not e.access & (WRITE | ADMIN):
            continue
        if e.type == "u" and (keys.owns_code_key(e.name, key) or exempt(e.name)):
            continue
        who = f"user {e.name!r}" if e.type == "u" else "everyone ('o')"
        return (f"keys under {keys.CODE_PREFIX + owner + '.'!r} are written and administered"
                f" by their owner only: the ACL of {key!r} may grant others READ at most, not"
                f" {describe(e.access & (WRITE | ADMIN))} to {who}; drop the w and a of"
                f" {str(e)!r} (e.g. {e.type}:{e.name}:r)")
    return None
