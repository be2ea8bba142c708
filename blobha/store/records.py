"""Version records on disk: VersionInfo, its JSON form, and the files of a key's directory."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class VersionInfo:
    key: str
    seq: int
    size: int
    digest: str
    chunk_size: int
    chunks: tuple[str, ...]
    #: Stored with its record: a record of a segment (``segment`` >= 0), or a ``.ver`` file
    #: of an earlier release (else ``.blob`` and ``.json``).
    packed: bool = False
    #: The segment holding it and the offset of its bytes there; -1: a file of its own.
    segment: int = -1
    offset: int = 0


#: The last bytes of a ``.ver`` file: its record's length (4 bytes, little-endian), then this.
_PACKED_MAGIC = b"BLOBHAv1"
_PACKED_FOOTER = 4 + len(_PACKED_MAGIC)
#: A packed file's tail read at once: the record of a small version comes with its footer.
_PACKED_TAIL_READ = 4096


def info_from(raw: dict[str, Any], key: str, packed: bool = False) -> VersionInfo:
    """The VersionInfo of record ``raw`` (as :func:`info_json` wrote it) of a version of
    ``key``."""
    return VersionInfo(
        key, int(raw["seq"]), int(raw["size"]), str(raw["digest"]),
        int(raw["chunk_size"]), tuple(raw["chunks"]), packed,
    )


def info_json(info: VersionInfo) -> dict[str, object]:
    """The record stored with a version: in its ``.json`` file, or ahead of its bytes in a
    segment."""
    return {
        "key": info.key,
        "seq": info.seq,
        "size": info.size,
        "digest": info.digest,
        "chunk_size": info.chunk_size,
        "chunks": list(info.chunks),
        "installed_at": time.time(),
    }


def read_packed(path: Path, key: str | None) -> VersionInfo:
    """The record at the end of packed version file ``path`` (for ``key``; None: the key it
    names). ValueError if the file does not end in a whole record that accounts for its every
    byte (a truncated or overwritten file)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        end = os.fstat(fd).st_size
        take = min(end, _PACKED_TAIL_READ)
        tail = os.pread(fd, take, end - take)
        if len(tail) < _PACKED_FOOTER or not tail.endswith(_PACKED_MAGIC):
            raise ValueError(f"{path.name} has no record at its end")
        n = int.from_bytes(tail[-_PACKED_FOOTER:-len(_PACKED_MAGIC)], "little")
        if n + _PACKED_FOOTER > end:
            raise ValueError(f"{path.name}'s record is longer than the file")
        if n + _PACKED_FOOTER <= take:
            record = tail[take - _PACKED_FOOTER - n:take - _PACKED_FOOTER]
        else:
            record = os.pread(fd, n, end - _PACKED_FOOTER - n)
    finally:
        os.close(fd)
    raw = json.loads(record)
    info = info_from(raw, str(raw["key"]) if key is None else key, packed=True)
    if info.size + n + _PACKED_FOOTER != end:
        raise ValueError(f"{path.name} holds {end} bytes, not its {info.size} and its record")
    return info


def remove_version_files(d: Path, seq: int) -> None:
    """Remove version ``seq``'s files from key directory ``d``, if it has any: its record
    first, so it is gone even if the rest is not."""
    try:
        names = os.listdir(d)
    except (FileNotFoundError, NotADirectoryError):
        return
    for suffix in (".json", ".ver", ".blob"):
        if f"v{seq}{suffix}" in names:
            (d / f"v{seq}{suffix}").unlink(missing_ok=True)


def footprint(d: str | Path) -> tuple[bool, int]:
    """(whether it holds a version file, their bytes) of key directory ``d``: a packed
    version's bytes include its record's few hundred."""
    found = False
    total = 0
    try:
        with os.scandir(d) as files:
            for f in files:
                if f.name.startswith("v") and f.name.endswith((".blob", ".ver")):
                    try:
                        total += f.stat().st_size
                        found = True
                    except FileNotFoundError:
                        pass
    except (FileNotFoundError, NotADirectoryError):
        pass
    return found, total


def versions_in(d: str | Path) -> list[int]:
    """The installed versions in key directory ``d``, oldest first."""
    try:
        names = os.listdir(d)
    except (FileNotFoundError, NotADirectoryError):
        return []
    seqs = set()
    for n in names:
        if n.startswith("v") and n.endswith(".json") and n[1:-5].isdigit():
            seqs.add(int(n[1:-5]))
        elif n.startswith("v") and n.endswith(".ver") and n[1:-4].isdigit():
            seqs.add(int(n[1:-4]))
    return sorted(seqs)


def key_of_dir(d: Path) -> str | None:
    """The key a directory under keys/ holds: named in each version record (the directory name
    is an encoding that long keys make one-way); stores written before that have a ``key``
    file."""
    try:
        names = sorted(n for n in os.listdir(d)
                       if n.startswith("v") and n.endswith((".json", ".ver")))
    except OSError:
        return None
    for name in [*names, "key"]:
        try:
            if name.endswith(".ver"):
                return read_packed(d / name, None).key
            with open(d / name, encoding="utf-8") as f:
                return str(json.load(f)["key"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None
