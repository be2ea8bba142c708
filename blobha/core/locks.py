"""Exclusive file locks between processes (``flock``): a master's data directory
(:mod:`blobha.store.local`) and the node-local cache's keys, counters and clean-up
(:mod:`blobha.cache`). Kept apart from both so the cache, imported by every Spark task, does not
load the master's store to take a lock."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

__all__ = ["boot_id", "lock_file"]


def boot_id() -> str:
    """The running kernel's id ('' where Linux does not say): new at every boot, shared by
    the containers on a host. A lock proves its holder dead only within one boot; pids and
    start times restart at every boot too."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return ""


def lock_file(path: Path, blocking: bool) -> int | None:
    """An exclusive ``flock`` on ``path``: the open descriptor, or None if busy (non-blocking).

    The lock lasts while the descriptor is open, and goes with its process. A lock file may be
    deleted by its holder (the node cache's, of evicted keys), so after locking, check that the
    name still leads to the locked inode; otherwise another process may hold a newer file.
    """
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        try:
            named = os.stat(path)
        except FileNotFoundError:
            os.close(fd)
            continue
        held = os.fstat(fd)
        if (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino):
            return fd
        os.close(fd)
