"""The leader's side of a forwarded write: with a write quorum W above 1, a small write's bytes go
to W-1 of the other masters the placement chooses for its key while the leader installs them,
one StageVersions call per holder carrying the whole group commit.

Each holder syncs its copy and checks its digest before it confirms (blobha.master.staging);
the commit records the confirmed holders (``BlobState.confirmed``) and is acknowledged in its
own transaction when the leader and they make the write quorum, with no round trip through a
follower's watch. Copies beyond W come through the ordinary sync: forwarding them too would
cost every write a call and a sync more on the holders, for nothing the writer waits for.

A holder that fails is replaced by a spare (the key's next placement holder) at once, and one
that has not answered after :data:`HEDGE_SECS` gets a spare beside it, so a stalled holder
costs a write that much, not the wait's bound. With no spare left, the write waits for replica
nodes as without forwarding. A holder that failed or stayed silent is passed over for a while.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from blobha.core import placement
from blobha.wire.peers import Peers

log = logging.getLogger("blobha.master")

#: How long a holder that failed or was too slow is passed over.
SUSPECT_SECS = 30.0
#: How long a forward may go unanswered before its key is also sent to a spare holder: far
#: above a healthy holder's answer (a sync of a few small files), far below the bound.
HEDGE_SECS = 0.2
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
                 bound: float, suspect: Callable[[str], None],
                 spares: dict[str, list[str]] | None = None,
                 send: Callable[[str, list[Item]], list[Call]] | None = None,
                 items: dict[str, Item] | None = None) -> None:
        self._needs = needs
        self._calls = calls
        self._started = started
        self._bound = bound
        self._suspect = suspect
        #: Per key, the holders to forward to in order when one of its holders fails.
        self._spares = spares or {}
        self._send = send
        self._items = items or {}

    def wait(self) -> dict[str, tuple[str, ...]]:
        """Each forwarded key's holders that confirmed a staged copy: waits until every key has
        its quorum of confirmations, or all holders answered, or the bound. A holder that
        fails is replaced by the key's next spare, one silent past the hedge gets one beside
        it. A holder still busy at the end is not waited for: the staged copy it makes is
        still what its sync installs, once it sees the commit."""
        confirmed: dict[str, list[str]] = {key: [] for key in self._needs}
        pending = {future: (holder, keys) for holder, keys, future in self._calls}
        deadline = self._started + self._bound
        hedge_at: float | None = self._started + min(HEDGE_SECS, self._bound / 4)
        enough = False
        while pending:
            now = time.monotonic()
            short = {k: n - len(confirmed[k]) for k, n in self._needs.items()
                     if len(confirmed[k]) < n}
            enough = not short
            if enough or now >= deadline:
                break
            if hedge_at is not None and now >= hedge_at:
                hedge_at = None
                for holder, keys, future in self._replace(
                        [k for k, missing in short.items() for _ in range(missing)]):
                    pending[future] = (holder, keys)
            until = deadline if hedge_at is None else hedge_at
            done, _ = wait(list(pending), timeout=until - now, return_when=FIRST_COMPLETED)
            failed: list[str] = []
            for future in done:
                holder, keys = pending.pop(future)
                try:
                    staged = future.result()
                except Exception as e:
                    log.info("forward to %s failed (%s); it syncs after the commit", holder, e)
                    self._suspect(holder)
                    failed.extend(keys)
                    continue
                for key, ok in zip(keys, staged, strict=True):
                    if ok:
                        confirmed[key].append(holder)
                    else:
                        failed.append(key)
            for holder, keys, future in self._replace(failed):
                pending[future] = (holder, keys)
        if not enough:
            # Past the bound: passed over for a while, so the next writes do not wait for it.
            for holder in sorted({holder for holder, _ in pending.values()}):
                log.info("forward to %s had no answer within %g s; it syncs after the commit",
                         holder, self._bound)
                self._suspect(holder)
        return {key: tuple(sorted(hs)) for key, hs in confirmed.items()}

    def _replace(self, failed: list[str]) -> list[Call]:
        """Forwards of the ``failed`` keys to their next spares (a key listed twice takes two),
        grouped per holder."""
        if self._send is None:
            return []
        per_holder: dict[str, list[Item]] = {}
        for key in failed:
            spares = self._spares.get(key)
            if spares:
                per_holder.setdefault(spares.pop(0), []).append(self._items[key])
        return [call for holder, its in per_holder.items() for call in self._send(holder, its)]


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
        """Forward the writes whose quorum is above 1 to W-1 holders each (None when there
        are none, or forwarding is off)."""
        items = [item for item in items if item[2] >= 2]
        if not self.enabled or not items:
            return None
        now = time.monotonic()
        known = self.known() | {self.identity}
        live = self.live()
        per_holder: dict[str, list[Item]] = {}
        needs: dict[str, int] = {}
        spares: dict[str, list[str]] = {}
        by_key: dict[str, Item] = {}
        for item in items:
            key, rf, w = item[0], item[1], item[2]
            needs[key] = w - 1
            by_key[key] = item
            targets = self.targets(key, rf, known, live, now)
            spares[key] = targets[w - 1:]
            for holder in targets[:w - 1]:
                per_holder.setdefault(holder, []).append(item)
        epoch = self.epoch()
        calls = [call for holder, its in per_holder.items()
                 for call in self._send(holder, its, epoch)]
        return Forward(needs, calls, now, self.bound_secs, self.suspect, spares,
                       lambda holder, its: self._send(holder, its, epoch), by_key)

    def _send(self, holder: str, items: list[Item], epoch: int) -> list[Call]:
        """StageVersions calls carrying ``items`` to ``holder``, under the batch's epoch."""
        calls: list[Call] = []
        for part in _parts(items):
            versions = [(key, size, digest, data) for key, _, _, size, digest, data in part]
            with self._lock:
                self._in_flight[holder] = self._in_flight.get(holder, 0) + 1
            future = self._pool.submit(self.peers.stage, holder, epoch, versions,
                                       self.bound_secs)
            future.add_done_callback(functools.partial(self._done, holder))
            calls.append((holder, [item[0] for item in part], future))
        self.forwarded += len(items)
        return calls

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
