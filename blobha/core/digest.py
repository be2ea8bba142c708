"""Checksums: xxh3-128 over a whole blob, xxh3-64 over each stored chunk.

The whole-blob digest is what clients check end to end. The per-chunk digests let a master
verify every chunk before it leaves the disk, so a corrupt byte is never sent, and let ranged
reads be verified without reading the whole file.
"""

from __future__ import annotations

from typing import BinaryIO

import xxhash

#: Granularity of the stored chunk digests, and the size of chunks the master streams.
CHUNK_SIZE = 1024 * 1024

#: The largest blob a single Put call carries whole (one chunk); larger ones use the
#: resumable upload.
PUT_MAX_BYTES = CHUNK_SIZE

EMPTY_DIGEST = xxhash.xxh3_128_hexdigest(b"")


class Digester:
    """Incremental xxh3-128."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_128()
        self.size = 0

    def update(self, data: bytes | memoryview) -> None:
        self._h.update(data)
        self.size += len(data)

    def hexdigest(self) -> str:
        return str(self._h.hexdigest())


class ChunkDigests:
    """xxh3-64 of every ``CHUNK_SIZE`` piece of a stream that arrives in pieces of any size."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()
        self._fill = 0
        self.done: list[str] = []

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            take = min(CHUNK_SIZE - self._fill, len(view))
            self._h.update(view[:take])
            self._fill += take
            view = view[take:]
            if self._fill == CHUNK_SIZE:
                self.done.append(str(self._h.hexdigest()))
                self._h.reset()
                self._fill = 0

    def digests(self) -> list[str]:
        """Every chunk's digest, the last partial chunk's included."""
        return self.done + ([str(self._h.hexdigest())] if self._fill else [])


def chunk_digest(data: bytes | bytearray | memoryview) -> str:
    return str(xxhash.xxh3_64_hexdigest(data))


def digest_bytes(data: bytes) -> str:
    return str(xxhash.xxh3_128_hexdigest(data))


def digest_file(f: BinaryIO, chunk_size: int = CHUNK_SIZE) -> tuple[str, list[str], int]:
    """Read ``f`` from its current position: (whole digest, chunk digests, size)."""
    whole = Digester()
    chunks: list[str] = []
    while True:
        data = f.read(chunk_size)
        if not data:
            break
        whole.update(data)
        chunks.append(chunk_digest(data))
    return whole.hexdigest(), chunks, whole.size


def digest_stream(f: BinaryIO, chunk_size: int = CHUNK_SIZE) -> tuple[str, int]:
    """Read ``f`` from its current position: (whole digest, size)."""
    whole = Digester()
    while data := f.read(chunk_size):
        whole.update(data)
    return whole.hexdigest(), whole.size


def is_digest(text: str) -> bool:
    return len(text) == 32 and all(c in "0123456789abcdef" for c in text)
