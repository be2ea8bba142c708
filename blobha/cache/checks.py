"""Per-user checks: the cluster's answers about a key's current version, recorded for the node."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from blobha.cache.layout import Layout, unlink
from blobha.cache.stats import Counters
from blobha.core.errors import NO_ANSWER, KeyNotFound, NotAuthorized, Stale
from blobha.core.keys import key_dirname
from blobha.core.lazy import LazyLogger
from blobha.core.locks import lock_file

if TYPE_CHECKING:
    # Imported when a cache first talks to the cluster: a process served from a warm cache
    # never does, and grpc and the client's other dependencies would cost it more than the
    # lookup itself (see BlobCache._cluster).
    from blobha.client import BlobMeta, Client

__all__ = ["Checks", "Known", "Order", "Remote", "newest", "readable_meta", "seed"]

log = LazyLogger("blobha.cache")

#: In a key's directory: ``<this>/<user>`` is held by the process asking the cluster about the
#: key for that user (a directory of its own: no user's lock name can be another's record).
_CHECK_LOCKS = "asking"
# What _check_flock found.
_ASKER, _WAITED, _NO_LOCK = "asker", "waited", "no lock"


#: A version of a key as (creation time of the key, version): versions count again from 1
#: after a delete and create, so the creation time orders incarnations first.
Order = tuple[float, int]


def newest(*orders: Order | None) -> Order | None:
    """The newest of ``orders`` that says when its key was created (records of older releases
    do not: they set no minimum)."""
    known = [o for o in orders if o is not None and o[0] > 0 and o[1] > 0]
    return max(known) if known else None


def seed(client: Client, key: str, order: Order | None) -> None:
    """Make ``client`` read ``key`` at ``order`` or newer: a master whose view is older
    refuses, and the client asks another (read-your-writes across processes)."""
    if order is not None and order[0] > 0 and order[1] > 0:
        client.remember_version(key, order[1], order[0])


def readable_meta(client: Client, key: str) -> BlobMeta:
    """The metadata of ``key``, which must grant the client's user READ (NotAuthorized
    otherwise): masters show it to writers and administrators too, and the cache serves the
    blob on the strength of this answer."""
    from blobha.client import require_read  # loaded already: the client exists

    return require_read(client.get_meta(key), client.user)


class Remote(NamedTuple):
    """What the cluster said of a key's current version: all a cache needs of its metadata,
    and what a check record keeps."""

    version: int
    digest: str
    size: int
    created_at: float

    @staticmethod
    def of(meta: BlobMeta) -> Remote:
        return Remote(meta.version, meta.digest, meta.size, meta.created_at)

    @property
    def order(self) -> Order:
        return (self.created_at, self.version)


class Known(NamedTuple):
    meta: Remote
    #: When the cluster gave this answer (this cache's clock), whichever process asked.
    checked_at: float


# Check records: ``blobs/<key dir>/checks/<user>`` holds the cluster's last answer to that
# user about the key (its current version, hence also "this user may read it") and when it
# was given. Every process on the node reuses it for the rest of its update interval, so a
# new Spark application within the interval of an earlier one needs no round trip (and no
# client) at all. This keeps the spec's bounds: a new version, and a revoked READ, are
# noticed within the interval of the cluster's answer, as a long-running process already
# noticed them. Authorisation stays per user: a record only ever serves the user the
# cluster answered, and a user without a fresh record of their own asks the cluster (a
# refusal removes the user's record). The records add no trust in the directory: whoever
# can write them can also replace the blob files, which the cache serves to every user.


class Checks:
    """What one user was told about keys: in this process, and through the node's records."""

    def __init__(
        self,
        layout: Layout,
        user: str,
        update_interval: float,
        clock: Callable[[], float],
        cluster: Callable[[], Client],
        counters: Counters,
    ) -> None:
        self._layout = layout
        self._user = user
        self._update_interval = update_interval
        self._clock = clock
        self._cluster = cluster
        self._counters = counters
        self._lock = threading.Lock()
        self._check_locks: dict[str, threading.Lock] = {}
        self._remote: dict[str, Known] = {}

    def remote_meta(self, key: str, kd: str, need: Order | None = None,
                    floor: Order | None = None) -> tuple[Known, bool, contextlib.ExitStack]:
        """The key's current version as this user sees it; whether the cluster was asked just
        now and the answer is still to be recorded for the node; and the node-wide lock on
        asking, when this process asked and recorded the answer: the caller closes it once it
        has obtained that version.

        The cluster is asked once the last answer to this user about this key, given to this
        process or (through a check record) to another on the node, is
        ``update_interval_secs`` old, or older than ``need`` (a version the caller must read
        at least, newer than any it served). Asking is also the authorisation check: the
        server answers only users who may read the key. The question carries the newest of
        ``floor``, the version the node holds and the last answer as its minimum, so a master
        behind them refuses it and the client asks another: an answer never goes back."""
        with self._lock:
            check_lock = self._check_locks.setdefault(key, threading.Lock())
        # One question per key at a time: threads asking together share the answer.
        with check_lock:
            now = self._clock()
            with self._lock:
                known = self._remote.get(key)
            if (known is not None and now - known.checked_at < self._update_interval
                    and _reaches(known, need)):
                return known, False, contextlib.ExitStack()
            recorded = self._fresh_check(key, kd, now, need)
            if recorded is not None:
                return recorded, False, contextlib.ExitStack()
            # And one per key and user on the node: the executors of a new application all ask
            # at once when the record has aged, and each would load the client (grpc) and ask.
            # The first asks; the others wait for its record.
            with contextlib.ExitStack() as asking:
                role = asking.enter_context(self._check_flock(kd))
                if role != _NO_LOCK:
                    # Also as the asker: another may have recorded since our read.
                    recorded = self._fresh_check(key, kd, self._clock(), need)
                    if recorded is not None:
                        return recorded, False, contextlib.ExitStack()
                answer, answered = self._ask(key, kd, known, floor)
                if role == _ASKER and answered and self.write(kd, answer):
                    # Recorded now, before the others waiting here read it (else, the key's
                    # directory went meanwhile: the caller records it with the key's lock).
                    return answer, False, asking.pop_all()
                return answer, answered, contextlib.ExitStack()

    def _fresh_check(self, key: str, kd: str, now: float, need: Order | None = None
                     ) -> Known | None:
        """This user's check record of ``key`` on the node, if it is within the interval and
        reaches ``need``."""
        recorded = self._read(kd)
        if (recorded is None or not 0 <= now - recorded.checked_at < self._update_interval
                or not _reaches(recorded, need)):
            return None
        # Keeps the time of the cluster's answer, so the interval still bounds how long a new
        # version or a revoked READ takes to be noticed.
        with self._lock:
            self._remote[key] = recorded
        return recorded

    @contextlib.contextmanager
    def _check_flock(self, kd: str) -> Iterator[str]:
        """The node-wide lock on asking the cluster about a key for this user
        (``blobs/<key dir>/asking/<user>``; not the key's lock, so that no question waits for
        another user's download).

        Yields _ASKER while this process holds it; the asker keeps it while it obtains the
        version it was told of (see BlobCache.get), so the others find that version
        installed. Yields _WAITED once another process that held it let go: it recorded its
        answer, or got none, and then the processes that waited ask in parallel (with a
        cluster that cannot be reached, each waits for the rest of the first one's question
        and then for its own, not for one question per process ahead of it). Yields _NO_LOCK
        when the key has no directory: nothing is cached, and the download's lock keeps the
        node to one download."""
        path = self._layout.blobs / kd / _CHECK_LOCKS / key_dirname(self._user)
        fd: int | None = None
        role = _NO_LOCK
        try:
            path.parent.mkdir(exist_ok=True)
            fd = lock_file(path, blocking=False)
            if fd is None:
                waited = lock_file(path, blocking=True)
                if waited is not None:
                    os.close(waited)
                role = _WAITED
            else:
                role = _ASKER
        except OSError:  # no directory: never cached here, or evicted meanwhile
            pass
        try:
            yield role
        finally:
            if fd is not None:
                os.close(fd)

    def _ask(self, key: str, kd: str, known: Known | None, floor: Order | None
             ) -> tuple[Known, bool]:
        """Ask the cluster about ``key`` as this user: its answer and True, or, when the
        cluster cannot be reached and this user was allowed to read the key before, what was
        known and False."""
        now = self._clock()
        self._counters.bump(checks=1)
        try:
            # Scanned only now, to ask: a hit served from a fresh answer never reads the disk.
            held = self._layout.scan_key(kd, key).current()
            recorded = known or self._read(kd)
            floor = newest(floor, held.order if held else None,
                           recorded.meta.order if recorded else None)
            client = self._cluster()
            seed(client, key, floor)
            meta = Remote.of(readable_meta(client, key))
            if floor is not None and meta.order < floor:
                # A master of a release before read minimums ignored it: as if none answered.
                raise Stale(f"the cluster answered {key!r} v{meta.version}, older than"
                            f" v{floor[1]} this node holds or has seen; asking again later")
        except NotAuthorized:
            with self._lock:
                self._remote.pop(key, None)
            unlink(self.path(kd))
            raise
        except KeyNotFound:
            with self._lock:
                self._remote.pop(key, None)
            self.mark_deleted(kd)
            raise
        except NO_ANSWER as exc:
            if known is None:
                # A new process (a Spark worker started during the outage): the cluster's last
                # answer to this user about this key on the node, however old, as a process
                # that had asked itself would use its own.
                known = self._read(kd)
                if known is None:
                    raise
            # This user was allowed to read this key and nothing newer was known; an
            # unreachable cluster must not stop jobs that run on cached blobs. Asked again
            # after the next interval. (Not recorded for the node: other processes ask for
            # themselves.)
            log.warning("serving cached %r: cannot reach the cluster (%s)", key, exc)
            known = Known(known.meta, now)
            with self._lock:
                self._remote[key] = known
            return known, False
        fresh = Known(meta, now)
        with self._lock:
            self._remote[key] = fresh
        return fresh, True

    # -- the records -----------------------------------------------------------------------

    def path(self, kd: str) -> Path:
        """This user's check record of the key in ``kd``."""
        return self._layout.blobs / kd / "checks" / key_dirname(self._user)

    def _read(self, kd: str) -> Known | None:
        try:
            data = json.loads(self.path(kd).read_bytes())
            if data["user"] != self._user:
                return None
            meta = Remote(
                int(data["version"]), str(data["digest"]), int(data["size"]),
                float(data.get("created_at") or 0.0),
            )
            return Known(meta, float(data["checked_at"]))
        except (OSError, ValueError, TypeError, KeyError):
            return None  # none yet, or unreadable: ask the cluster

    def write(self, kd: str, known: Known) -> bool:
        """Record the cluster's answer for the node; whether it was. Called with the key's lock
        held, so the key's directory exists and stays, or with the check lock, when that
        directory may have gone meanwhile (evicted)."""
        record = {
            "user": self._user,
            "checked_at": known.checked_at,
            "version": known.meta.version,
            "digest": known.meta.digest,
            "size": known.meta.size,
            "created_at": known.meta.created_at,
        }
        path = self.path(kd)
        try:
            path.parent.mkdir(exist_ok=True)
            self._layout.write_atomic(path, json.dumps(record).encode())
        except FileNotFoundError:
            return False  # no key directory: evicted meanwhile
        except OSError as exc:  # only costs other processes a round trip
            log.warning("cannot record the version check in %s: %s", path, exc)
            return False
        return True

    def mark_deleted(self, kd: str) -> None:
        """The cluster said the key no longer exists: mark it so (evicted first)."""
        kdir = self._layout.blobs / kd
        if kdir.is_dir():
            with contextlib.suppress(OSError):
                self._layout.write_atomic(kdir / "deleted", str(self._clock()).encode())
            # No user's version check may vouch for a key the cluster no longer has.
            with contextlib.suppress(OSError):
                for name in os.listdir(kdir / "checks"):
                    unlink(kdir / "checks" / name)


def _reaches(known: Known, need: Order | None) -> bool:
    return need is None or known.meta.order >= need
