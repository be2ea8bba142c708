"""Archive names the node cache knows, and their kind: shared by the cache and its unpacker."""

from __future__ import annotations

__all__ = ["ARCHIVE_SUFFIXES"]

#: Archive names :mod:`blobha.cache.unpack` knows, and their kind. Apart from the unpacker: a
#: cached file keeps its extension (see :func:`blobha.cache.layout.file_name`), and naming a
#: file must not load the unpacking code (tarfile, zipfile).
ARCHIVE_SUFFIXES: dict[str, str] = {
    ".tar.gz": "tar",
    ".tgz": "tar",
    ".tar": "tar",
    ".zip": "zip",
    ".jar": "zip",
}
