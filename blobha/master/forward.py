"""The leader's side of a forwarded write: with a write quorum above 1, a small write's bytes go
to the other masters the placement chooses for its key while the leader installs them, one
StageVersions call per holder carrying the whole group commit.

Each holder syncs its copy and checks its digest before it confirms (blobha.master.staging);
the commit records the confirmed holders (``BlobState.confirmed``) and is acknowledged in its
own transaction when the leader and they make the write quorum, with no round trip through a
follower's watch. A holder that fails, or is slow past the wait's bound, is left out: it
fetches the version after the commit through the ordinary sync, and the write then waits for
replica nodes as without forwarding. It is passed over for a while, so one stalled holder does
not cost every write the bound.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from blobha.core import placement
from blobha.sync.peers import Peers

log = logging.getLogger("blobha.master")

#: How long a holder that failed or was too slow is passed over.
SUSPECT_SECS = 30.0
#: Forwards to one holder in flight at most: one that stalled unnoticed (its calls not failed
#: yet) must not take every sending thread, and the healthy holders' forwards with them.
MAX_IN_FLIGHT = 4

#: A write to forward: (key, replication factor, write quorum, size, digest, data).
Item = tuple[str, int, int, int, str, bytes]
#: One call: its holder, the keys it carries, and its answer to come.
Call = tuple[str, list[str], Future[list[bool]]]
#: Bytes one StageVersions call carries at most: well under the masters' message limit
#: (MAX_MESSAGE), which a group commit's batch (8 MiB) would exceed with its framing.
CALL_BYTES = 4 * 1024 * 1024


class Forward:
    """One batch's forwards in flight."""

    def __init__(self, needs: dict[str, int], calls: list[Call], started: float,
                 bound: float, suspect: Callable[[str], None]) -> None:
        self._needs = needs
        self._calls = calls
        self._started = started
        self._bound = bound
        self._suspect = suspect

    def wait(self) -> dict[str, tuple[str, ...]]:
        """Each forwarded key's holders that confirmed a staged copy: waits until every key has
        its quorum of confirmations, or all holders answered, or the bound. A holder still
        busy then is not waited for: the staged copy it makes is still what its sync
        installs, once it sees the commit."""
        confirmed: dict[str, list[str]] = {key: [] for key in self._needs}
        pending = {future: (holder, keys) for holder, keys, future in self._calls}
        deadline = self._started + self._bound
        enough = False
        while pending:
            now = time.monotonic()
            enough = all(len(confirmed[k]) >= n for k, n in self._needs.items())
            if enough or now >= deadline:
                break
            done, _ = wait(list(pending), timeout=deadline - now, return_when=FIRST_COMPLETED)
            for future in done:
                holder, keys = pending.pop(future)
                try:
                    staged = future.result()
                except Exception as e:
                    log.info("forward to %s failed (%s); it syncs after the commit", holder, e)
                    self._suspect(holder)
                    continue
                for key, ok in zip(keys, staged, strict=True):
                    if ok:
                        confirmed[key].append(holder)
        if not enough:
            # Past the bound: passed over for a while, so the next writes do not wait for it.
            for holder in sorted({holder for holder, _ in pending.values()}):
                log.info("forward to %s had no answer within %g s; it syncs after the commit",
                         holder, self._bound)
                self._suspect(holder)
        return {key: tuple(sorted(hs)) for key, hs in confirmed.items()}


class Forwarder:
    """Sends a batch's bytes to their other holders (see the module's doc)."""

    def __init__(self, identity: str, peers: Peers, live: Callable[[], set[str]],
                 known: Callable[[], set[str]], epoch: Callable[[], int], bound_secs: float,
                 enabled: bool) -> None:
        self.identity = identity
        self.peers = peers
        self.live = live
        self.known = known
        self.epoch = epoch
        self.bound_secs = bound_secs
        self.enabled = enabled
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="forward")
        self._suspects: dict[str, float] = {}
        self._in_flight: dict[str, int] = {}
        self._lock = threading.Lock()
        #: Versions forwarded since start (each once per holder).
        self.forwarded = 0

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def suspect(self, holder: str) -> None:
        """Pass ``holder`` over for a while: it failed a forward, or was too slow."""
        with self._lock:
            self._suspects[holder] = time.monotonic()

    def _trusted(self, holder: str, now: float) -> bool:
        with self._lock:
            if self._in_flight.get(holder, 0) >= MAX_IN_FLIGHT:
                return False
            since = self._suspects.get(holder)
            if since is None:
                return True
            if now - since >= SUSPECT_SECS:
                del self._suspects[holder]
                return True
            return False

    def targets(self, key: str, replication_factor: int, known: set[str], live: set[str],
                now: float) -> list[str]:
        """The other masters the synchroniser will place ``key`` on, that have a session and
        did not fail a forward lately."""
        rf = min(replication_factor, max(len(known), 1))
        chosen = known if rf >= len(known) else placement.choose(key, known, rf)
        return sorted(h for h in chosen
                      if h != self.identity and h in live and self._trusted(h, now))

    def start(self, items: Sequence[Item]) -> Forward | None:
        """Forward the writes whose quorum is above 1 (None when there are none, or
        forwarding is off)."""
        items = [item for item in items if item[2] >= 2]
        if not self.enabled or not items:
            return None
        now = time.monotonic()
        known = self.known() | {self.identity}
        live = self.live()
        per_holder: dict[str, list[Item]] = {}
        needs: dict[str, int] = {}
        for item in items:
            key, rf, w = item[0], item[1], item[2]
            needs[key] = w - 1
            for holder in self.targets(key, rf, known, live, now):
                per_holder.setdefault(holder, []).append(item)
        epoch = self.epoch()
        calls: list[Call] = []
        for holder, its in per_holder.items():
            for part in _parts(its):
                versions = [(key, size, digest, data) for key, _, _, size, digest, data in part]
                with self._lock:
                    self._in_flight[holder] = self._in_flight.get(holder, 0) + 1
                future = self._pool.submit(self.peers.stage, holder, epoch, versions,
                                           self.bound_secs)
                future.add_done_callback(functools.partial(self._done, holder))
                calls.append((holder, [item[0] for item in part], future))
            self.forwarded += len(its)
        return Forward(needs, calls, now, self.bound_secs, self.suspect)


    def _done(self, holder: str, future: Future[list[bool]]) -> None:
        # A call no write waited for any more (its quorum came from others) fails here too:
        # a holder that stalled is then passed over.
        with self._lock:
            self._in_flight[holder] -= 1
        if future.cancelled() or future.exception() is not None:
            self.suspect(holder)


def _parts(items: list[Item]) -> list[list[Item]]:
    """``items`` in runs of at most :data:`CALL_BYTES` (one item over it goes alone)."""
    out: list[list[Item]] = [[]]
    size = 0
    for item in items:
        if out[-1] and size + item[3] > CALL_BYTES:
            out.append([])
            size = 0
        out[-1].append(item)
        size += item[3]
    return out
