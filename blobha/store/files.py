"""Durable file primitives of the store: whole writes, atomic JSON records, directory fsync."""

from __future__ import annotations

import ctypes
import json
import os
from collections.abc import Callable
from itertools import count
from pathlib import Path
from typing import Any

# Temp-file names of records (see write_json_atomic).
_temp_names = count()


def libc_function(name: str) -> Any:
    """A function of the C library this process runs on (ctypes), or None where it has none
    (not Linux, not glibc)."""
    try:
        return getattr(_LIBC, name) if _LIBC is not None else None
    except AttributeError:
        return None


def _load_libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)  # the one already loaded in this process
    except OSError:
        return None


_LIBC = _load_libc()


def _load_sync_file_range() -> Callable[[int, int, int], None] | None:
    """``sync_file_range(fd, offset, n, SYNC_FILE_RANGE_WRITE)`` (Linux), or None elsewhere."""
    fn = libc_function("sync_file_range")
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    write = 2  # SYNC_FILE_RANGE_WRITE: start write-back of dirty pages, do not wait for it

    def start(fd: int, offset: int, nbytes: int) -> None:
        fn(fd, offset, nbytes, write)  # advisory: a failure only means the fsync does it all

    return start


#: ``start_writeback(fd, offset, nbytes)``: start writing a file's dirty pages in that range
#: to disk without waiting for it; None where the system has no ``sync_file_range``.
start_writeback = _load_sync_file_range()


def write_all(fd: int, data: bytes | memoryview) -> None:
    """``os.write`` until all of ``data`` is written (a write may take only part of it)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """``os.pwrite`` of all of ``data`` at ``offset``. At an explicit offset, not the file's
    position: a write that stored part of its bytes and then failed (a full disk) moves the
    position, and the resumed upload's bytes would land that far off, shifted."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def pwritev_all(fd: int, pieces: list[bytes], offset: int) -> None:
    """``os.pwritev`` of all of ``pieces``, one after the other, at ``offset``."""
    views = [memoryview(p) for p in pieces if p]
    while views:
        n = os.pwritev(fd, views[:1024], offset)  # IOV_MAX
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def write_json_atomic(path: Path, obj: object, sync: bool = True, mode: int = 0o644) -> None:
    """Write ``obj`` to a temp file and rename it to ``path``; ``sync=False`` leaves the fsync
    to the caller's file-system sync (a batch), or to nobody where a lost record costs little.

    One ``write`` of the encoded record on a raw descriptor, and a temp name from a counter:
    a buffered text file and a random name cost as much again, for a record written per
    version installed (100,000s when a master catches up)."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{next(_temp_names)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        write_all(fd, json.dumps(obj).encode("utf-8"))
        if sync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    """Make the names in directory ``path`` (a new file, a rename) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
