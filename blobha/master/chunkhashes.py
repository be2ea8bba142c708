"""SHA-256 of every chunk of a stored version, for the plans that let node caches take pieces
from each other: a piece that comes from a peer is checked against these, not the xxh3 chunk
digests, which guard against accidents but can be forged on purpose.

Computed on a version's first plan, from the bytes this master stores (each chunk checked
against its stored xxh3 digest as it is read, so rot is never hashed in), then kept in memory
up to a bound. Uploads pay nothing: a blob no cache fetches through peers is never hashed."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator

from blobha.core.errors import ResourceExhausted

__all__ = ["MAX_DIGESTS", "ChunkHashes"]

#: Chunk digests kept at most (32 bytes each, 32 MiB in all): 32 TiB of 1 MiB chunks. Each
#: version counts as one at least, so empty ones are bounded too.
MAX_DIGESTS = 1024 * 1024
#: Versions hashed at once: any reader may ask a plan of any version it may read, and each
#: first plan reads the whole version; more wait for none of it and are told "busy" (the cache
#: then downloads from the masters).
MAX_HASHING = 2


class _Entry:
    def __init__(self) -> None:
        self.ready = threading.Event()
        self.digests: tuple[bytes, ...] | None = None
        self.error: BaseException | None = None


class ChunkHashes:
    """Per-version SHA-256 chunk digests, computed once per version however many plans ask
    for it at the same time."""

    def __init__(self, read: Callable[[str, int], Iterator[bytes]],
                 max_digests: int = MAX_DIGESTS, max_hashing: int = MAX_HASHING) -> None:
        #: ``read(key, seq)`` yields a version's chunks, each verified against its stored
        #: digest (LocalStore.read).
        self._read = read
        self._max = max_digests
        self._lock = threading.Lock()
        # (key, seq, xxh3 digest) -> entry; the digest tells a version deleted and created
        # again under the same number from the one hashed before.
        self._entries: OrderedDict[tuple[str, int, str], _Entry] = OrderedDict()
        self._held = 0
        self._hashing = threading.BoundedSemaphore(max_hashing)
        #: Versions hashed since start (for tests and metrics).
        self.computed = 0

    def get(self, key: str, seq: int, digest: str) -> tuple[bytes, ...]:
        """The SHA-256 of each chunk of version ``seq`` of ``key`` (whose xxh3-128 digest is
        ``digest``), as this master stores it. Raises what reading it raises (a version not
        held, or found corrupt)."""
        ident = (key, seq, digest)
        with self._lock:
            entry = self._entries.get(ident)
            owner = entry is None
            if entry is None:
                if not self._hashing.acquire(blocking=False):
                    raise ResourceExhausted(
                        "this master is hashing other versions for peer plans; retry, or"
                        " download from the masters")
                entry = self._entries[ident] = _Entry()
            else:
                self._entries.move_to_end(ident)
        if not owner:
            entry.ready.wait()
            if entry.digests is not None:
                return entry.digests
            raise entry.error or RuntimeError("chunk hashes failed")
        try:
            digests = tuple(hashlib.sha256(chunk).digest() for chunk in self._read(key, seq))
        except BaseException as e:
            entry.error = e
            with self._lock:
                if self._entries.get(ident) is entry:
                    del self._entries[ident]
            entry.ready.set()
            raise
        finally:
            self._hashing.release()
        entry.digests = digests
        entry.ready.set()
        with self._lock:
            self.computed += 1
            if self._entries.get(ident) is entry:
                self._held += _weight(digests)
                self._evict()
        return digests

    def _evict(self) -> None:
        while self._held > self._max and len(self._entries) > 1:
            ident, old = next(iter(self._entries.items()))
            if old.digests is None:  # still being computed: its owner counts it when done
                self._entries.move_to_end(ident)
                if all(e.digests is None for e in self._entries.values()):
                    return
                continue
            del self._entries[ident]
            self._held -= _weight(old.digests)


def _weight(digests: tuple[bytes, ...]) -> int:
    return max(1, len(digests))
