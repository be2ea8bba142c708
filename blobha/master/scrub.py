"""The background scrubber: re-verifies every stored version against its digests.

A read already verifies what it serves, but a replica that nobody reads can rot silently until
the day it is the last copy. The scrubber walks the local store at a bounded I/O rate (like
HDFS's block scanner) so that rot is found while healthy replicas still exist. A corrupt version
is removed by :meth:`LocalStore.read` itself, which calls the store's ``on_corrupt`` hook: the
replica is unregistered in ZooKeeper and the synchronizer fetches a healthy copy.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from blobha.core.digest import Digester
from blobha.core.errors import ChecksumMismatch, KeyNotFound
from blobha.store.local import LocalStore

log = logging.getLogger("blobha.scrub")


class Scrubber:
    """Re-verifies every stored version, one pass every ``interval_secs``, reading at most
    ``rate_bytes_per_sec``. The counters are read by status and metrics code."""

    def __init__(
        self,
        store: LocalStore,
        interval_secs: float,
        rate_bytes_per_sec: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.interval_secs = interval_secs
        self.rate = rate_bytes_per_sec
        self._clock = clock
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.passes = 0
        self.files_verified = 0
        self.bytes_verified = 0
        self.corrupt_found = 0

    @property
    def enabled(self) -> bool:
        return self.interval_secs > 0

    def start(self) -> None:
        if not self.enabled or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="scrubber", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def run_now(self) -> None:
        """Start the next pass without waiting for the interval (operators and tests)."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.scrub_pass()
            except Exception:  # a bug here must not kill the thread; the next pass retries
                log.exception("scrub pass failed")
            self._wake.wait(self.interval_secs)
            self._wake.clear()

    def scrub_pass(self) -> int:
        """Verify every stored version once; return how many were corrupt."""
        found = 0
        budget = _RateLimit(self.rate, self._clock, self._stop)
        for key in self.store.keys():  # noqa: SIM118 - a method of the store, not a dict
            for seq in self.store.versions(key):
                if self._stop.is_set():
                    return found
                if not self._verify(key, seq, budget):
                    found += 1
        self.passes += 1
        if found:
            log.warning("scrub pass %d found %d corrupt version(s); healthy copies are being"
                        " fetched", self.passes, found)
        return found

    def _verify(self, key: str, seq: int, budget: _RateLimit) -> bool:
        info = self.store.info(key, seq)
        if info is None:  # pruned or deleted since the listing
            return True
        whole = Digester()
        try:
            # LocalStore.read checks every chunk and, on a mismatch, discards the version
            # (discard_corrupt) before raising, so the repair starts from here.
            for data in self.store.read(key, seq):
                whole.update(data)
                self.bytes_verified += len(data)
                budget.spend(len(data))
                if self._stop.is_set():
                    return True
        except KeyNotFound:
            return True  # removed concurrently (pruned, deleted, replaced)
        except ChecksumMismatch:
            self.corrupt_found += 1
            return False
        self.files_verified += 1
        if whole.hexdigest() != info.digest or whole.size != info.size:
            # Every chunk matched its own digest but the whole does not: the version record
            # itself is inconsistent. Treat it as corrupt, the same way.
            self.corrupt_found += 1
            self.store.discard_corrupt(key, seq, "the whole content")
            return False
        return True


class _RateLimit:
    """Sleeps (interruptibly) so that bytes spent stay under ``rate`` per second."""

    def __init__(self, rate: int, clock: Callable[[], float], stop: threading.Event) -> None:
        self.rate = rate
        self.clock = clock
        self.stop = stop
        self.start = clock()
        self.spent = 0

    def spend(self, n: int) -> None:
        if self.rate <= 0:
            return
        self.spent += n
        ahead = self.spent / self.rate - (self.clock() - self.start)
        if ahead > 0:
            self.stop.wait(ahead)
