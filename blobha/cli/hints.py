"""What the command line adds to an error: the library's message states what happened, and
this table says which command helps, by error class and the situation the message names."""

from __future__ import annotations

from blobha.core.errors import (
    BlobError,
    DeadlineExceeded,
    InvalidArgument,
    KeyAlreadyExists,
    KeyNotFound,
    NotAuthorized,
    Unauthenticated,
    Unavailable,
)

_ADDRESSES = "the addresses come from --cluster, BLOBHA_CLUSTER or the client profile"

# (class, words the message holds or "" for any, commands or () for any, hint); the first match
# wins, so narrower rows come first.
_HINTS: tuple[tuple[type[BlobError], str, tuple[str, ...], str], ...] = (
    (KeyAlreadyExists, "", (), "use 'blobha update'"),
    (KeyNotFound, "", ("update",), "use 'blobha create' first"),
    (KeyNotFound, "no blob with key", (), "'blobha list' shows the keys"),
    (Unauthenticated, "", (), ""),
    (NotAuthorized, "grant access", (), "'blobha set-acl' grants it"),
    (InvalidArgument, "raise the key's factor", (),
     "'blobha replication --update -r N KEY' raises it"),
    (DeadlineExceeded, "acknowledged", (),
     "'blobha cluster' shows the masters; 'blobha meta KEY' shows whether it was acknowledged"),
    (Unavailable, "may have been made", (), "'blobha meta KEY' shows whether it was"),
    (Unavailable, "no reachable master holds", (),
     "'blobha replication --read KEY' shows how many masters hold it"),
    (Unavailable, "no master answered", (), _ADDRESSES),
    (Unavailable, "masters answered (", (), f"{_ADDRESSES}; is the cluster running?"),
)


def hint(error: BlobError, command: str = "") -> str:
    """The command that helps with ``error`` met by ``command``, or ""."""
    message = str(error)
    for cls, words, commands, text in _HINTS:
        if (isinstance(error, cls) and words in message
                and (not commands or command in commands)):
            return text
    return ""


def describe(error: BlobError, command: str = "") -> str:
    """The line the command line prints for ``error``: its message, then any hint."""
    message = str(error) or type(error).__name__
    extra = hint(error, command)
    return f"{message}; {extra}" if extra else message
