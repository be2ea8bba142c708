"""The fetcher: brings committed versions from other masters and installs them, verified."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from typing import TYPE_CHECKING

from blobha.core.blobstate import BlobState
from blobha.core.errors import BlobError
from blobha.store.local import BlobBuffer, LocalStore, TempBlob
from blobha.sync.registry import SyncDeferred
from blobha.sync.view import ReplicaView
from blobha.wire.peers import Peers

if TYPE_CHECKING:
    from blobha.sync.protocols import ClusterGuard
    from blobha.sync.settings import SyncSettings

log = logging.getLogger("blobha.sync.synchronizer")

#: A version to fetch: (key, committed state, its holders).
Wanted = tuple[str, BlobState, list[str]]


def stale_fetch(key: str) -> SyncDeferred:
    # What was fetched may be of the key's earlier incarnation (deleted and created again
    # here since the read), under the new one's version number: installing it would replace
    # the new, acknowledged version. The key is looked at again.
    return SyncDeferred(f"{key!r} was committed here while it was fetched; looking again")


class Fetcher:
    """Downloads a batch's versions in parallel and installs them, never over a commit this
    master made since the batch read the key (see ReplicaView.read_is_current)."""

    def __init__(self, store: LocalStore, peers: Peers, identity: str, view: ReplicaView,
                 guard: ClusterGuard, settings: SyncSettings,
                 holding: Callable[[], AbstractSet[str]]) -> None:
        self.store = store
        self.peers = peers
        self.identity = identity
        #: The masters whose replica nodes count now (under /holders, with a session; see
        #: :meth:`sources`).
        self.holding = holding
        self.view = view
        self.guard = guard
        self.settings = settings
        # Downloads of one batch run in parallel: a small blob's fetch is a few round trips
        # and fsyncs, not CPU, so one at a time would leave the machine idle.
        self._pool = ThreadPoolExecutor(max_workers=settings.threads,
                                        thread_name_prefix="sync-fetch")

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def fetch_all(self, to_fetch: list[Wanted], failures: dict[str, Exception],
                  read_mark: int = -1
                  ) -> tuple[list[tuple[str, BlobState, bytes]], list[tuple[str, int]], set[str]]:
        """Fetch a batch's versions: (small blobs fetched, for the caller to install together;
        versions installed here already, to register; the keys that had no version here).
        Failures go into ``failures``.

        Small blobs of keys with nothing local come in one FetchVersions call per source (a
        catching-up master has 100,000s of them; a call each would cost more than the bytes);
        the rest, and whatever a batch call did not bring, one Download each, in parallel."""
        small, step = self.settings.small_blob, self.settings.fetch_batch
        groups: dict[str, list[Wanted]] = {}
        singles: list[Wanted] = []
        fresh: set[str] = set()
        holding = self.holding()
        staged: list[tuple[str, BlobState, bytes]] = []
        for item in to_fetch:
            key, state, holders = item
            # The leader forwarded these bytes before its commit (blobha.master.forward): the
            # commit names them now, so they are installed as if fetched, without a fetch.
            copy = self.store.staged.read(key, state.digest, state.size)
            if copy is not None:
                if not self.store.versions(key):
                    fresh.add(key)
                staged.append((key, state, copy))
                continue
            if self.store.staged.is_whole(key, state.digest):
                singles.append(item)  # a streamed upload's copy: fetch() moves it in
                continue
            sources = self.sources(holders, holding)
            # A key with a local version goes alone: fetch may find the bytes locally.
            if state.size <= small and sources and not self.store.versions(key):
                fresh.add(key)
                groups.setdefault(sources[0], []).append(item)
            else:
                singles.append(item)
        batches = [
            (source, part, self._pool.submit(self.fetch_batch, source, part))
            for source, items in groups.items()
            for part in (items[i:i + step] for i in range(0, len(items), step))
        ]
        futures: list[tuple[str, BlobState, Future[bytes | None]]] = [
            (key, state, self._pool.submit(self.fetch, key, state, holders, read_mark))
            for key, state, holders in singles
        ]
        fetched: list[tuple[str, BlobState, bytes]] = staged
        for source, items, batch in batches:
            try:
                got = batch.result()
            except Exception as e:
                log.info("fetching %d small blobs from %s in one call failed (%s); fetching"
                         " them one by one", len(items), source, e)
                got = {}
            for key, state, holders in items:
                data = got.get(key)
                if data is not None:
                    fetched.append((key, state, data))
                else:
                    futures.append((key, state, self._pool.submit(
                        self.fetch, key, state, holders, read_mark)))
        done: list[tuple[str, int]] = []
        for key, state, future in futures:
            try:
                result = future.result()
            except Exception as e:
                failures[key] = e
                continue
            if result is None:
                done.append((key, state.seq))
            else:
                fetched.append((key, state, result))
        return fetched, done, fresh

    def fetch(self, key: str, state: BlobState, holders: list[str], read_mark: int = -1
              ) -> bytes | None:
        """Obtain the committed version of ``key``: a small blob's bytes, for the caller to
        install with the rest of its batch, or None once a big one (or a local copy) is
        installed here."""
        if self.store.staged.is_whole(key, state.digest):
            with self.guard.key_lock(key):
                if not self.view.read_is_current(key, read_mark):
                    raise stale_fetch(key)
                if self.store.install_staged(key, state.seq, state.digest, state.size):
                    log.info("installed the forwarded copy of %r v%d", key, state.seq)
                    return None
        copy = self.store.find_by_digest(key, state.digest, state.size)
        if copy is not None:
            with self.guard.key_lock(key):
                if not self.view.read_is_current(key, read_mark):
                    raise stale_fetch(key)
                self.store.install_copy(key, state.seq, copy)
            return None
        sources = self.sources(holders, self.holding())
        if not sources:
            raise SyncDeferred(f"no live replica holds v{state.seq} yet")
        self.store.reserve(state.size)
        small = state.size <= self.settings.small_blob
        dest: TempBlob | BlobBuffer = BlobBuffer() if small else self.store.new_temp("sync")
        started = time.monotonic()
        try:
            timeout = 60.0 + state.size / (20 * 1024 * 1024)
            last: Exception | None = None
            for source in sources:
                try:
                    self.peers.fetch(source, key, state.seq, state.digest, dest, timeout)
                    last = None
                    break
                except BlobError as e:
                    # Resume from the next replica at the offset already received.
                    last = e
                    log.info("fetch of %r v%d from %s failed (%s); trying another",
                             key, state.seq, source, e)
            if last is not None:
                raise last
            if isinstance(dest, BlobBuffer):
                return dest.value()
            with self.guard.key_lock(key):
                if not self.view.read_is_current(key, read_mark):
                    raise stale_fetch(key)
                self.store.install(key, state.seq, dest, state.size, state.digest)
        except BaseException:
            if isinstance(dest, TempBlob):
                dest.discard()
            raise
        log.info("synced %r v%d (%d bytes) in %.3fs", key, state.seq, state.size,
                 time.monotonic() - started)
        return None

    def sources(self, holders: list[str], holding: AbstractSet[str]) -> list[str]:
        """The other holders to fetch from, in the order to try them: only masters whose
        replica nodes count (with a session). A batch's holders were read before its fetches
        start, and a holder whose session ended since (paused, cut off) keeps a fetch waiting
        for the stall limit, and the whole batch's registrations with it (a writer's W=2
        waits on those); its replica nodes no longer count, so the key is deferred and read
        again instead."""
        return self.peers.rank(h for h in holders if h != self.identity and h in holding)

    def fetch_batch(self, source: str, items: list[Wanted]) -> dict[str, bytes]:
        """The bytes of the small versions ``source`` sent whose digest it gives as ZooKeeper
        does (install_many verifies the bytes themselves)."""
        wanted = {key: state for key, state, _ in items}
        total = sum(state.size for state in wanted.values())
        self.store.reserve(total)
        timeout = 60.0 + total / (20 * 1024 * 1024)
        got: dict[str, bytes] = {}
        refs = [(key, state.seq) for key, state in wanted.items()]
        for key, seq, digest, data in self.peers.fetch_many(source, refs, timeout):
            state = wanted.get(key)
            if state is None or state.seq != seq:
                continue
            if digest != state.digest:
                log.warning("%s offers %r v%d with digest %s, ZooKeeper says %s; fetching it"
                            " elsewhere", source, key, seq, digest, state.digest)
                continue
            got[key] = data
        return got

    def install_fetched(self, fetched: list[tuple[str, BlobState, bytes]], read_mark: int = -1
                        ) -> dict[str, Exception]:
        """Install the small blobs a batch fetched, together (see LocalStore.install_many),
        except those of keys this master committed to since the batch read them."""
        if not fetched:
            return {}
        failures: dict[str, Exception] = {}
        with ExitStack() as locks:
            # In key order, as the group commit takes them: no two take each other's.
            for key in sorted({key for key, _, _ in fetched}):
                locks.enter_context(self.guard.key_lock(key))
            stale = {key for key, _, _ in fetched
                     if not self.view.read_is_current(key, read_mark)}
            for key in stale:
                failures[key] = stale_fetch(key)
            fetched = [item for item in fetched if item[0] not in stale]
            try:
                outcomes = self.store.install_many(
                    [(key, state.seq, data, state.size, state.digest)
                     for key, state, data in fetched])
            except Exception as e:
                return {**failures, **{key: e for key, _, _ in fetched}}
        synced = 0
        for (key, state, _), outcome in zip(fetched, outcomes, strict=True):
            if isinstance(outcome, Exception):
                failures[key] = outcome
            else:
                synced += 1
                self.store.staged.take(key, state.digest)
        log.info("synced %d small blobs", synced)
        return failures


__all__ = ["Fetcher", "Wanted", "stale_fetch"]
