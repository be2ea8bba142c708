"""CPU affinity for a whole process: Linux keeps one mask per thread."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Set
from pathlib import Path


def pin_threads(pid: int, cpus: Set[int]) -> None:
    """Run every thread of process ``pid`` on ``cpus``. ``sched_setaffinity`` moves one thread,
    and a thread started later takes its starter's mask; so each existing thread is set, in a
    second pass too, for one started during the first by a thread not yet set."""
    tasks = Path(f"/proc/{pid}/task")
    for _ in range(2):
        tids = [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [pid]
        for tid in tids:
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setaffinity(tid, cpus)
