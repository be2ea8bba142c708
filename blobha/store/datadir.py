"""The store directory's lock: one process, and one store object, uses a data directory."""

from __future__ import annotations

import os
from pathlib import Path

from blobha.core.locks import lock_file


class DataDirInUse(OSError):
    """Another process (or another store object in this one) holds the store's directory."""


#: The store's lock file, under its root.
LOCK_NAME = "LOCK"


def lock_data_dir(root: Path) -> int:
    """Take ``root``'s lock (:func:`lock_file`) for as long as the returned descriptor stays
    open, and write our pid in it. A second master started with the same data directory (a
    copied configuration, a unit started twice) would otherwise empty tmp/ under the first
    one's uploads at its start-up and serve the same files as a second replica; it stops here
    instead, before it touches anything."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_NAME
    fd = lock_file(path, blocking=False)
    if fd is None:
        try:
            holder = path.read_text("ascii", "replace").strip() or "unknown"
        except OSError:
            holder = "unknown"
        raise DataDirInUse(
            f"the data directory {root} is in use by another blobha master (pid {holder});"
            " stop that one first, or give this master a blobstore.dir of its own")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
    return fd
