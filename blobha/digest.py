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


def chunk_digest(data: bytes | memoryview) -> str:
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


def is_digest(text: str) -> bool:
    return len(text) == 32 and all(c in "0123456789abcdef" for c in text)
