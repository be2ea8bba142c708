"""Eviction: staged cleanup, LRU above the soft limit, and room made when the disk is full."""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from blobha.cache.checks import Checks, readable_meta
from blobha.cache.layout import KeyScan, Layout, Version, unlink
from blobha.cache.refs import Ref, References, sweep_temps
from blobha.cache.stats import CleanupReport, Counters
from blobha.core.errors import NO_ANSWER, KeyNotFound, NotAuthorized
from blobha.core.lazy import LazyLogger
from blobha.core.locks import lock_file

if TYPE_CHECKING:
    from blobha.client import Client

__all__ = ["DISK_FULL", "Janitor", "Tidied"]

log = LazyLogger("blobha.cache")

#: ``flock`` held by the process making a cleanup pass; its mtime is when the last one began.
_CLEANUP_LOCK = "cleanup.lock"
#: What a write fails with when the disk (or the user's quota) is full.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class Tidied(NamedTuple):
    scan: KeyScan
    live: dict[int, list[Ref]]
    stale_refs: int
    gone: list[tuple[str, int, int]]  # (key, version, bytes) removed


class Janitor:
    """The cleanup passes of one cache instance: when to make one, and what each removes."""

    def __init__(
        self,
        layout: Layout,
        refs: References,
        checks: Checks,
        counters: Counters,
        cluster: Callable[[], Client],
        clock: Callable[[], float],
        *,
        soft_limit: int,
        retention: float,
        interval: float,
        update_interval: float,
    ) -> None:
        self._layout = layout
        self._refs = refs
        self._checks = checks
        self._counters = counters
        self._cluster = cluster
        self._clock = clock
        self._soft_limit = soft_limit
        self._retention = retention
        self._interval = interval
        self._update_interval = update_interval
        self._lock = threading.Lock()
        self._cleanup_lock = threading.Lock()
        self._probed: dict[str, float] = {}
        self._last_cleanup: float | None = None

    def tidy(self, kd: str, keep: int | None, scan: KeyScan | None = None) -> Tidied:
        """With the key's lock held: remove stale references, damaged version directories and
        every version but ``keep`` (None: the current one) that no live process references.
        ``scan``: the key's directory as read under this hold of its lock, if the caller has
        it (versions installed or removed since would be missing from it)."""
        layout = self._layout
        if scan is None:
            scan = layout.scan_key(kd)
        live, stale = self._refs.read(kd)
        stale_count = sum(unlink(path) for path in stale)
        for junk in scan.junk:
            layout.discard(junk)
        if keep is None:
            current = scan.current()
            keep = current.version if current else None
        gone: list[tuple[str, int, int]] = []
        for number, version in list(scan.versions.items()):
            if number != keep and not live.get(number):
                layout.discard(version.dir)
                del scan.versions[number]
                gone.append((scan.key, number, version.disk_bytes))
        if gone:
            self._counters.bump(removed_versions=len(gone))
        return Tidied(scan, live, stale_count, gone)

    def maybe_cleanup(self) -> None:
        """A pass, unless this process or another on the node made one within the interval."""
        now = self._clock()
        with self._lock:
            due = self._last_cleanup is None or now - self._last_cleanup >= self._interval
            if due:
                self._last_cleanup = now
        if not due:
            return
        # Every Spark Python worker is a new process with no pass of its own yet: a node
        # starting many makes one pass per interval (each one reads every key), not one each.
        last = self._node_last_cleanup()
        if last is not None and 0 <= now - last < self._interval:
            with self._lock:
                self._last_cleanup = last
            return
        try:
            self.cleanup(blocking=False)
        except Exception:  # the get itself succeeded; the next pass will try again
            log.exception("cache cleanup failed under %s", self._layout.root)

    def _node_last_cleanup(self) -> float | None:
        try:
            return os.stat(self._layout.root / _CLEANUP_LOCK).st_mtime
        except OSError:
            return None

    def cleanup(self, blocking: bool, urgent: bool = False) -> CleanupReport:
        if not self._cleanup_lock.acquire(blocking):
            return CleanupReport(ran=False)
        try:
            fd = lock_file(self._layout.root / _CLEANUP_LOCK, blocking)
            if fd is None:
                return CleanupReport(ran=False)
            try:
                # When the node's last pass began, for the processes that come after; a pass
                # that fails leaves the time of the last one, so the next process tries again.
                before = os.fstat(fd)
                now = self._clock()
                with contextlib.suppress(OSError):
                    os.utime(fd, (now, now))
                try:
                    return self._cleanup_pass(urgent)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.utime(fd, ns=(before.st_atime_ns, before.st_mtime_ns))
                    raise
            finally:
                os.close(fd)
        finally:
            self._cleanup_lock.release()

    def _cleanup_pass(self, urgent: bool = False) -> CleanupReport:
        """Flink's staged cleanup with Storm's LRU eviction (``urgent``, the disk being full:
        every version that may go goes, whatever the soft limit).

        Per key, under its lock (busy keys are skipped): stale references go; older versions
        nobody references go; a current version nobody references is staged on the first
        pass that finds it so, and becomes deletable on a later pass once ``retention_secs``
        have passed without use. Deletable versions of keys deleted remotely go; the others
        go least recently used first while the cache is above the soft limit.
        """
        layout = self._layout
        sweep_temps(layout.tmp_root)
        with self._lock:
            self._last_cleanup = self._clock()
        staged: list[tuple[str, int]] = []
        removed: list[tuple[str, int]] = []
        busy: list[str] = []
        stale_refs = 0
        freed = 0
        total = 0
        candidates: list[tuple[KeyScan, Version]] = []
        for kd in layout.key_dirs():
            with layout.key_lock(kd, blocking=False) as held:
                if held is None:
                    scan = layout.scan_key(kd)
                    busy.append(scan.key or kd)
                    total += sum(v.disk_bytes for v in scan.versions.values())
                    continue
                tidied = self.tidy(kd, keep=None)
                scan, live = tidied.scan, tidied.live
                stale_refs += tidied.stale_refs
                for key, number, size in tidied.gone:
                    removed.append((key, number))
                    freed += size
                total += sum(v.disk_bytes for v in scan.versions.values())
                current = scan.current()
                if current is None:
                    if not live:
                        layout.remove_key_dir(kd, held)
                    continue
                if live.get(current.version):
                    unlink(current.dir / "staged")
                    continue
                now = self._clock()
                if urgent and now - current.last_used >= self._retention:
                    # The disk is full: what a staged marker would prove, no use for a whole
                    # retention interval, the last use proves as well.
                    candidates.append((scan, current))
                    continue
                if current.staged is None or current.last_used > current.staged:
                    # First pass to find it unreferenced (or used since it was staged).
                    try:
                        layout.write_atomic(current.dir / "staged", repr(now).encode())
                    except OSError as e:
                        if e.errno not in DISK_FULL:
                            raise
                        continue  # staged by a later pass, once there is room for the marker
                    staged.append((scan.key, current.version))
                elif now - current.staged >= self._retention:
                    candidates.append((scan, current))

        limit = 0 if urgent else self._soft_limit
        if total > limit:
            self._probe_deleted([s for s, _ in candidates if not s.deleted])
        # Keys deleted remotely first, then least recently used.
        candidates.sort(key=lambda c: (not c[0].deleted, c[1].last_used))
        evicted: list[tuple[str, int]] = []
        for scan, version in candidates:
            if not scan.deleted and total <= limit:
                break
            if self._evict(scan, version):
                evicted.append((scan.key, version.version))
                total -= version.disk_bytes
                freed += version.disk_bytes
        if evicted:
            self._counters.bump(evictions=len(evicted))
        return CleanupReport(
            staged=tuple(staged),
            evicted=tuple(evicted),
            removed_versions=tuple(removed),
            stale_refs=stale_refs,
            freed_bytes=freed,
            total_bytes=total,
            busy=tuple(busy),
        )

    def _evict(self, scan: KeyScan, chosen: Version) -> bool:
        """Delete a staged version unless, since it was chosen, it was used or referenced."""
        layout = self._layout
        with layout.key_lock(scan.kd, blocking=False) as held:
            if held is None:
                return False
            again = layout.scan_key(scan.kd, scan.key)
            version = again.versions.get(chosen.version)
            live, _stale = self._refs.read(scan.kd)
            if (
                version is None
                or live.get(chosen.version)
                or version.last_used != chosen.last_used
                or version.staged != chosen.staged
            ):
                return False
            layout.discard(version.dir)
            if not live and not again.versions.keys() - {chosen.version}:
                layout.remove_key_dir(scan.kd, held)
        log.info("evicted %r version %d from %s", scan.key, chosen.version, layout.root)
        return True

    def _probe_deleted(self, scans: list[KeyScan]) -> None:
        """Ask the cluster whether the keys of eviction candidates still exist, so that those
        deleted remotely go first; at most once per update interval per key."""
        for scan in scans:
            now = self._clock()
            with self._lock:
                last = self._probed.get(scan.key)
            if last is not None and now - last < self._update_interval:
                continue
            try:
                readable_meta(self._cluster(), scan.key)
            except KeyNotFound:
                self._checks.mark_deleted(scan.kd)
                scan.deleted = True
            except NotAuthorized:
                # It exists; this user may no longer read it, and the node's record of an
                # earlier answer must not serve the user's next process in an outage.
                unlink(self._checks.path(scan.kd))
            except NO_ANSWER:
                return  # no answers now; plain LRU this time
            with self._lock:
                self._probed[scan.key] = now
