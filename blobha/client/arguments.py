"""The caller's arguments: their defaults and the checks made before any call.

Some defaults come from the environment; a bad argument fails here, with its reason, rather than
as a refusal from every master."""

from __future__ import annotations

import getpass
import os
from collections.abc import Sequence

from blobha.core.acl import AccessControl, check_entries, name_problem, parse_acl
from blobha.core.addresses import parse_cluster
from blobha.core.errors import InvalidArgument

KiB = 1024
MiB = 1024 * KiB

DEFAULT_CHUNK_SIZE = MiB
MIN_CHUNK_SIZE = 256 * KiB
MAX_CHUNK_SIZE = MiB
#: Seconds a master may go silent before the client moves on: a replica that sends nothing
#: during a download (the download resumes from another where it stopped), or a master that
#: neither answers a call nor, after half of this, a status check. A paused, overloaded or
#: cut-off master keeps its connections open, its place in the replica list and its leadership
#: until its ZooKeeper session expires; the client's whole timeout is far too long to wait for
#: it. Data arrives in pieces of at most 1 MiB, so only a link slower than 100 KiB/s looks
#: stalled, and the download still goes on.
STALL_TIMEOUT = 10.0
# Below this, a master merely busy for a moment would count as gone.
MIN_STALL_TIMEOUT = 0.5

UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1


def parse_address_map(text: str) -> dict[str, str]:
    """``"ADVERTISED=DIAL,..."``, e.g. ``"m1:6627=127.0.0.1:16627,m2:6627=127.0.0.1:16628"``.

    Masters identify themselves by their advertised address (``master.advertise``), which is
    what the cluster summary and replica lists return. A client outside the masters' network
    (containers reached through published ports, NAT) cannot dial those, so it maps them."""
    out: dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        advertised, sep, dial = item.partition("=")
        if not sep:
            raise InvalidArgument(
                f"bad address map entry {item!r}: expected ADVERTISED_HOST:PORT=DIAL_HOST:PORT"
            )
        out[parse_cluster(advertised)[0]] = parse_cluster(dial)[0]
    return out


def default_address_map() -> dict[str, str]:
    """``$BLOBHA_ADDRESS_MAP`` parsed (empty when unset)."""
    return parse_address_map(os.environ.get("BLOBHA_ADDRESS_MAP", ""))


def default_user() -> str:
    """The caller's identity: ``$BLOBHA_USER``, else the operating-system user."""
    user = os.environ.get("BLOBHA_USER", "").strip()
    if user:
        return user
    try:
        return getpass.getuser()
    except (OSError, KeyError):
        raise InvalidArgument(
            "cannot tell who you are; set BLOBHA_USER or pass a user name"
        ) from None


def check_user(user: str) -> str:
    # The masters' rule (a name appears in ACLs), checked here so a bad name fails before any
    # call with the reason, not as a refusal from every master.
    problem = name_problem(user)
    if problem:
        raise InvalidArgument(f"invalid user name {user!r}: it {problem}")
    # Call metadata values must be printable ASCII; a bad name would otherwise fail deep
    # inside gRPC with an obscure message on the first call.
    if not all(" " <= c <= "~" for c in user):
        raise InvalidArgument(
            f"invalid user name {user!r}: use printable ASCII (letters, digits, punctuation)"
        )
    return user


def check_chunk_size(chunk_size: int) -> int:
    if not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:
        raise InvalidArgument(
            f"chunk_size {chunk_size} is out of range: use {MIN_CHUNK_SIZE} to {MAX_CHUNK_SIZE}"
            " bytes"
        )
    return chunk_size


def normalize_acl(acl: str | Sequence[AccessControl] | None) -> list[AccessControl]:
    if acl is None:
        return []
    if isinstance(acl, str):
        return parse_acl(acl)
    entries = list(acl)
    for e in entries:
        if not isinstance(e, AccessControl):
            raise InvalidArgument(
                f"ACL entries must be AccessControl values or a string like 'u:alice:rwa', not"
                f" {type(e).__name__}"
            )
    # Values built in code skip the parser: the same rules (type, access bits, user names,
    # duplicates) are checked here so a bad entry fails before any call, as a string would.
    return check_entries(entries)


def check_count(name: str, value: int, maximum: int = UINT64_MAX, minimum: int = 0) -> None:
    # Checked here so a bad number is an InvalidArgument, not a ValueError from protobuf.
    if not isinstance(value, int) or not minimum <= value <= maximum:
        raise InvalidArgument(
            f"{name} must be a whole number from {minimum} to {maximum}, not {value!r}")
