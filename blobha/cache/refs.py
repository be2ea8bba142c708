"""References: which jobs and processes hold which cached versions, and whether they still run."""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
from pathlib import Path
from typing import NamedTuple

from blobha.cache.layout import Layout, rmtree, unlink
from blobha.core.errors import InvalidArgument
from blobha.core.keys import key_dirname
from blobha.core.lazy import LazyLogger
from blobha.core.locks import boot_id

__all__ = ["Process", "Ref", "RefSpec", "References", "sweep_temps", "tag_alive"]

log = LazyLogger("blobha.cache")

# Pids and start times restart at every boot; the boot id tells a reference written before a
# reboot (always stale) from one written since.
_BOOT_ID = boot_id()
_HAVE_PROC = Path("/proc/self/stat").exists()


def _start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot); None if it is gone or a zombie, 0 where
    the system does not say."""
    if not _HAVE_PROC:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return 0
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = data[data.rfind(b")") + 2 :].split()
    if len(fields) < 20 or fields[0] in (b"Z", b"X") or not fields[19].isdigit():
        return None
    return int(fields[19])


class Process(NamedTuple):
    """A process, told apart from a later one given the same pid (by boot and start time)."""

    boot: str
    pid: int
    start: int

    @staticmethod
    def me() -> Process:
        pid = os.getpid()
        return Process(_BOOT_ID, pid, _start_ticks(pid) or 0)

    @property
    def tag(self) -> str:
        return f"{self.boot[:8] or 'noboot'}-{self.pid}-{self.start}"

    def alive(self) -> bool:
        if self.boot and _BOOT_ID and self.boot != _BOOT_ID:
            return False
        ticks = _start_ticks(self.pid)
        return ticks is not None and (ticks == self.start or not _HAVE_PROC)


_TAG = re.compile(r"([0-9a-f]{8}|noboot)-([0-9]+)-([0-9]+)")


def tag_alive(tag: str) -> bool:
    """Whether the process named by a ``Process.tag`` prefix still runs."""
    m = _TAG.match(tag)
    if m is None:
        return False
    boot, pid, start = m.group(1), int(m.group(2)), int(m.group(3))
    if boot != "noboot" and _BOOT_ID and not _BOOT_ID.startswith(boot):
        return False
    ticks = _start_ticks(pid)
    return ticks is not None and (ticks == start or not _HAVE_PROC)


def sweep_temps(tmp_root: Path) -> None:
    """Remove the scratch directories of processes that died (half downloads, half
    extractions, half-written files)."""
    try:
        names = os.listdir(tmp_root)
    except FileNotFoundError:
        return
    for name in names:
        if not tag_alive(name):
            log.info("removing %s, left by a process that ended", tmp_root / name)
            path = tmp_root / name
            if path.is_dir() and not path.is_symlink():
                rmtree(path)
            else:
                unlink(path)


class Ref(NamedTuple):
    """A reference file as read back."""

    path: Path
    owner: str
    instance: str
    version: int
    process: Process

    @property
    def holder(self) -> str:
        return self.owner if self.owner else f"instance:{self.instance}"


class RefSpec(NamedTuple):
    """The reference a ``get`` records: an explicit owner, or this instance."""

    filename: str
    owner: str
    instance: str


class References:
    """The reference files of one cache instance's process (``blobs/<key dir>/refs/``): the
    ones it writes, and everyone's as read back."""

    def __init__(self, layout: Layout, me: Process, instance: str) -> None:
        self._layout = layout
        self._me = me
        self._instance = instance
        self._lock = threading.Lock()
        self._touched: set[str] = set()  # key dirs holding this instance's references

    @staticmethod
    def owner_prefix(owner: str) -> str:
        if not isinstance(owner, str) or not owner or "\x00" in owner:
            raise InvalidArgument(f"owner must be a non-empty string, not {owner!r}")
        # key_dirname percent-encodes '@' and '=', so the prefix cannot match another owner.
        return f"o={key_dirname(owner)}@"

    def spec(self, owner: str | None) -> RefSpec:
        if owner is None:
            return self.instance_spec()
        return RefSpec(self.owner_prefix(owner) + self._me.tag, owner, "")

    def instance_spec(self) -> RefSpec:
        return RefSpec(f"i={self._instance}", "", self._instance)

    def write(self, kd: str, spec: RefSpec, version: int, now: float) -> None:
        path = self._layout.blobs / kd / "refs" / spec.filename
        since = now
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            old = json.loads(path.read_bytes())
            if old.get("version") == version and old.get("pid") == self._me.pid:
                return
            since = float(old.get("since", now))
        record = {
            "owner": spec.owner,
            "instance": spec.instance,
            "version": version,
            "boot": self._me.boot,
            "pid": self._me.pid,
            "start": self._me.start,
            "since": since,
        }
        self._layout.write_atomic(path, json.dumps(record).encode())
        if spec.instance:
            with self._lock:
                self._touched.add(kd)

    def drop_instance(self) -> None:
        """Remove the references this instance took without an owner."""
        with self._lock:
            touched = list(self._touched)
        name = self.instance_spec().filename
        for kd in touched:
            unlink(self._layout.blobs / kd / "refs" / name)

    def release(self, owner: str) -> int:
        """Remove every reference ``owner`` holds (from any process); how many there were."""
        prefix = self.owner_prefix(owner)
        dropped = 0
        for kd in self._layout.key_dirs():
            refs = self._layout.blobs / kd / "refs"
            try:
                names = os.listdir(refs)
            except OSError:
                continue
            for name in names:
                if name.startswith(prefix) and unlink(refs / name):
                    dropped += 1
        return dropped

    def read(self, kd: str) -> tuple[dict[int, list[Ref]], list[Path]]:
        """Live references by version, and the files of stale ones."""
        live: dict[int, list[Ref]] = {}
        stale: list[Path] = []
        refs = self._layout.blobs / kd / "refs"
        try:
            names = os.listdir(refs)
        except OSError:
            return live, stale
        for name in names:
            path = refs / name
            try:
                data = json.loads(path.read_bytes())
                ref = Ref(
                    path=path,
                    owner=str(data["owner"]),
                    instance=str(data["instance"]),
                    version=int(data["version"]),
                    process=Process(str(data["boot"]), int(data["pid"]), int(data["start"])),
                )
            except FileNotFoundError:
                continue  # released meanwhile
            except (OSError, ValueError, TypeError, KeyError):
                stale.append(path)  # unreadable: written by no version of this code
                continue
            if ref.process == self._me or ref.process.alive():  # ours: alive, no /proc read
                live.setdefault(ref.version, []).append(ref)
            else:
                stale.append(path)
        return live, stale
