"""The node cache's answers about blobs: what a get returns and what the cache holds."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

__all__ = ["CacheEntry", "CachedBlob"]

# The records of the cache, public and private, are named tuples and slotted classes, not
# dataclasses: it loads in every Python worker of a Spark job that reads a blob, and a frozen
# dataclass costs several times a named tuple to create (it compiles six methods).


class CachedBlob(NamedTuple):
    """A blob as this node holds it. ``path`` is the file, or the directory it was unpacked
    into when asked with ``uncompress=True``; ``size`` and ``digest`` describe the blob."""

    key: str
    version: int
    size: int
    digest: str
    path: Path


class CacheEntry(NamedTuple):
    """One cached version of a key."""

    key: str
    version: int
    #: Bytes on disk: the blob plus its unpacked tree, if any.
    size: int
    #: Wall-clock time of the last :meth:`BlobCache.get` that returned it.
    last_used: float
    #: Live references (of processes that are still running).
    refs: int
    #: The blob file.
    path: Path
    digest: str = ""
    #: The unpacked tree, if someone asked for it.
    unpacked: Path | None = None
    #: False for an older version still kept for a process that references it.
    current: bool = True
    #: The cluster said the key no longer exists.
    deleted_remotely: bool = False
    #: Who holds the live references; instances that fetched without an owner appear as
    #: ``instance:<pid>-...``.
    owners: tuple[str, ...] = ()
