"""BlobCache: the node cache's orchestration; its parts (layout, refs, checks...) do the work."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from blobha.cache import install
from blobha.cache.checks import Checks, Known, Order, Remote, newest, seed
from blobha.cache.evict import DISK_FULL, Janitor
from blobha.cache.layout import Layout, Version, random_hex, rmtree, touch, unlink
from blobha.cache.refs import Process, References, RefSpec, sweep_temps
from blobha.cache.stats import CacheStats, CleanupReport, Counters
from blobha.cache.values import CachedBlob, CacheEntry
from blobha.cache.verify import Verifier
from blobha.core.errors import (
    ChecksumMismatch,
    InvalidArgument,
    KeyNotFound,
    ResourceExhausted,
    Stale,
)
from blobha.core.keys import key_dirname, validate_key
from blobha.core.lazy import LazyLogger

if TYPE_CHECKING:
    # Imported when a cache first talks to the cluster: a process served from a warm cache
    # never does, and grpc and the client's other dependencies would cost it more than the
    # lookup itself (see _cluster).
    from blobha.client import Client, ProgressCallback

__all__ = ["DEFAULT_CLEANUP_INTERVAL_SECS", "BlobCache", "default_cache_dir"]

log = LazyLogger("blobha.cache")

GiB = 1024**3
#: The longest time between two cleanup passes started from :meth:`BlobCache.get`.
DEFAULT_CLEANUP_INTERVAL_SECS = 30.0

# A corrupt file is discarded and fetched again; more failures than this in one get mean
# something other than a bad disk block is wrong.
_ATTEMPTS = 3


def default_cache_dir() -> Path:
    """``$BLOBHA_CACHE_DIR``, else ``~/.cache/blobha``."""
    env = os.environ.get("BLOBHA_CACHE_DIR", "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "blobha"


class BlobCache:
    """A node-local cache of blobs, shared by every process and thread that opens the same
    directory.

    ``cluster`` names masters (default ``$BLOBHA_CLUSTER``), or pass a ready ``client``
    (``user`` then defaults to its user), or ``connect``, which makes the client when one is
    first needed (with ``user`` given: a process served by the node's records never needs
    one). ``soft_limit_bytes`` is the size above which
    unreferenced entries are evicted, least recently used first; ``retention_secs`` the least
    time an unreferenced entry is kept (Flink's staged cleanup: it is deleted only by the
    second cleanup pass that finds it unreferenced); ``update_interval_secs`` how often a key's
    version, and the caller's right to read it, are checked with the cluster: at most once per
    interval for each user on the node, as every process reuses the answers recorded there.
    ``clock`` (wall-clock seconds) exists for tests. ``peers`` (default
    ``$BLOBHA_CACHE_PEERS``, on) fetches from other nodes' caches and serves them what this
    one holds (docs/cache.md, "Peer serving"); False turns it off for this instance.

    :meth:`get` records a reference to what it returns: held by ``owner`` when given (say, a
    Spark application id; dropped by :meth:`release`), else by this instance (dropped by
    :meth:`close`). References die with the process that made them. Referenced versions are
    never removed; an older version is removed as soon as no live reference holds it.

    Processes sharing a directory must see each other's pids (one node, one pid namespace):
    liveness of references and scratch space is judged by pid and start time. Open one
    instance per process (not before a fork); an instance may be shared by threads.

    Example::

        with BlobCache("/var/cache/blobha", "m1:6627", user="alice") as cache:
            blob = cache.get("model.bin", owner="app-42")
            weights = blob.path.read_bytes()
            cache.release("app-42")
    """

    def __init__(
        self,
        cache_dir: str | os.PathLike[str],
        cluster: str | Sequence[str] | None = None,
        *,
        user: str | None = None,
        soft_limit_bytes: int = 10 * GiB,
        retention_secs: float = 600.0,
        update_interval_secs: float = 30.0,
        client: Client | None = None,
        connect: Callable[[], Client] | None = None,
        clock: Callable[[], float] = time.time,
        peers: bool | None = None,
    ) -> None:
        if not isinstance(soft_limit_bytes, int) or soft_limit_bytes < 0:
            raise InvalidArgument(f"soft_limit_bytes must be 0 or more, not {soft_limit_bytes!r}")
        for name, value in (
            ("retention_secs", retention_secs),
            ("update_interval_secs", update_interval_secs),
        ):
            if not value >= 0:
                raise InvalidArgument(f"{name} must be 0 or more seconds, not {value!r}")
        self._clock = clock
        from blobha.cache.peers.settings import PeerSettings

        self._peers = PeerSettings.from_env(enabled=peers)

        if client is not None and connect is not None:
            raise InvalidArgument("pass a client or a way to connect, not both")
        # A cache owns (and closes) the client it made or had ``connect`` make, not one it
        # was given.
        self._owns_client = client is None
        if connect is not None and user is None:
            client, connect = connect(), None  # only the client can tell who we are
        elif client is None and connect is None:
            addresses = cluster if cluster else os.environ.get("BLOBHA_CLUSTER", "").strip()
            if not addresses:
                raise InvalidArgument(
                    "no cluster given: pass cluster='HOST:PORT,...' or set BLOBHA_CLUSTER"
                )
            from blobha.client import Client

            client = Client(addresses, user=user)
        elif client is not None and user is not None and user != client.user:
            raise InvalidArgument(
                f"user {user!r} differs from the client's user {client.user!r}; pass one"
            )
        self._client: Client | None = client
        self._connect = connect
        self._user: str = client.user if client is not None else str(user)
        try:
            root = Path(cache_dir).expanduser().absolute()
            self._me = Process.me()
            instance = f"{self._me.tag}-{random_hex(4)}"
            self._layout = Layout(root, instance)
            self._layout.open()
            sweep_temps(self._layout.tmp_root)
            self._layout.tmp.mkdir(mode=0o700)
        except BaseException:
            if self._owns_client and client is not None:
                client.close()
            raise

        self._lock = threading.Lock()
        self._closed = False
        # Per key: the version callers said must be read at least (remember_version), and the
        # newest this instance served; no get returns older than either.
        self._required: dict[str, Order] = {}
        self._served: dict[str, Order] = {}
        layout = self._layout
        self._counters = Counters(layout)
        self._refs = References(layout, self._me, instance)
        self._checks = Checks(layout, self._user, float(update_interval_secs), clock,
                              self._cluster, self._counters)
        self._verifier = Verifier(layout, self._counters)
        self._janitor = Janitor(
            layout, self._refs, self._checks, self._counters, self._cluster, clock,
            soft_limit=soft_limit_bytes,
            retention=float(retention_secs),
            interval=min(float(retention_secs), DEFAULT_CLEANUP_INTERVAL_SECS),
            update_interval=float(update_interval_secs),
        )

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def directory(self) -> Path:
        return self._layout.root

    @property
    def user(self) -> str:
        return self._user

    def close(self) -> None:
        """Drop the references this instance took without an owner, remove its scratch space,
        and close the client if this instance made it. Cached blobs stay."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._refs.drop_instance()
        rmtree(self._layout.tmp)
        with self._lock:
            client, self._client = self._client, None
        if self._owns_client and client is not None:
            client.close()

    def __enter__(self) -> BlobCache:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"BlobCache({str(self._layout.root)!r}, user={self.user!r})"

    # -- the public operations -------------------------------------------------------------

    def remember_version(self, key: str, version: int, created_at: float) -> None:
        """Serve ``key`` from now on at ``version`` or newer (the key created at
        ``created_at``, :attr:`BlobMeta.created_at`), as :meth:`Client.remember_version`:
        for a process handed a version that another wrote or read (a job launched after its
        input was updated). A :meth:`get` then asks the cluster, whatever the update
        interval, unless this node already knows that version; when no master can confirm
        it, the get raises :class:`~blobha.core.errors.Stale` rather than serve older. A
        minimum already newer stays."""
        validate_key(key)
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise InvalidArgument(f"version must be a whole number, 1 or more, not {version!r}")
        if not created_at > 0:
            raise InvalidArgument(f"created_at must be the key's creation time (seconds since"
                                  f" the epoch, from its metadata), not {created_at!r}")
        order = (float(created_at), version)
        with self._lock:
            self._required[key] = max(order, self._required.get(key, order))

    def get(self, key: str, *, uncompress: bool = False, owner: str | None = None,
            progress: ProgressCallback | None = None) -> CachedBlob:
        """The node-local copy of ``key``'s current version, downloaded if needed.

        Checks with the cluster, at most every ``update_interval_secs`` per key, that this
        user may read the key (:class:`~blobha.core.errors.NotAuthorized` otherwise, even when the
        blob is cached) and whether a newer version exists (then fetched and returned).
        With ``uncompress`` the result is a directory holding the archive's contents.
        ``progress`` hears of a download's bytes (nothing on a hit).

        The reference taken holds one version per owner and process: when a later ``get`` for
        the same owner in the same process returns a newer version, the older one is released
        (and removed if nobody else holds it). Threads of one process that must keep reading
        an older version while others move on should use owners of their own.
        """
        validate_key(key)
        spec = self._refs.spec(owner)
        self._check_open()
        root = self._layout.root
        try:
            return self._get(key, uncompress, spec, progress)
        except (OSError, ResourceExhausted) as e:
            if isinstance(e, OSError) and e.errno not in DISK_FULL:
                raise
            # Room first (what staged cleanup may remove), then once more: a full disk must
            # not leave every job on the node failing, even on blobs already cached. (An
            # archive refused for want of room says so as ResourceExhausted.)
            log.warning("the node cache's disk under %s is full (%s); cleaning up and trying"
                        " %r again", root, e.strerror if isinstance(e, OSError) else e,
                        key)
            try:
                self._janitor.cleanup(blocking=True, urgent=True)
            except Exception:
                log.exception("cache cleanup failed under %s", root)
        try:
            return self._get(key, uncompress, spec, progress)
        except OSError as e:
            if e.errno not in DISK_FULL:
                raise
            raise ResourceExhausted(
                f"the node cache's disk under {root} is full ({e.strerror}) and nothing"
                f" cached could be removed to make room for {key!r}: free space there or lower"
                " the cache's soft limit"
            ) from None

    def _get(self, key: str, uncompress: bool, spec: RefSpec,
             progress: ProgressCallback | None) -> CachedBlob:
        kd = key_dirname(key)
        with self._lock:
            required = self._required.get(key)
            served = self._served.get(key)
        floor = newest(required, served)
        # A required version newer than any served makes the cache ask, whatever the update
        # interval (once: what it then serves reaches it).
        need = required if required is not None and (served is None or served < required) \
            else None
        known, asked, asking = self._checks.remote_meta(key, kd, need, floor)
        check = known if asked else None
        for _attempt in range(_ATTEMPTS):
            try:
                version, downloaded = self._obtain(key, kd, known.meta, spec, check, floor,
                                                   progress)
            finally:
                # Held until now by the process that asked, so the processes waiting for its
                # answer also find the version installed: they need no client, even to download.
                asking.close()
            check = None
            if not downloaded and not self._verifier.check(key, kd, version):
                continue
            path = version.file
            if uncompress:
                unpacked = install.unpack_version(self._layout, key, kd, version)
                if unpacked is None:
                    continue  # the version was replaced meanwhile: take the new one
                path = unpacked
            if not downloaded:
                self._counters.bump(hits=1)
                if self._peers.enabled and self._client is not None:
                    # A hit needs no client: only a process that has one serves its hits.
                    from blobha.cache.peers.node import serve_installed

                    serve_installed(self._peers, self._client, key, version.version,
                                    version.dir, version.file)
            if version.created_at > 0:
                with self._lock:
                    self._served[key] = max(version.order, self._served.get(key, version.order))
            self._janitor.maybe_cleanup()
            return CachedBlob(key, version.version, version.size, version.digest, path)
        raise ChecksumMismatch(
            f"the cached copy of {key!r} failed its digest check {_ATTEMPTS} times; check the"
            f" disk under {self._layout.root}"
        )

    def has_sha256(self, blob: CachedBlob, sha256: str) -> bool:
        """Whether ``blob``, as :meth:`get` returned it without ``uncompress``, holds bytes
        whose SHA-256 is ``sha256`` (64 lower-case hex digits): for content pinned by a
        cryptographic hash, which the store's own digest is not. Hashed once per node and
        boot; later calls trust a record beside the file while the file is unchanged."""
        self._check_open()
        return self._verifier.has_sha256(blob.path, blob.path.parent.parent, blob.size, sha256)

    def batched_counters(self) -> contextlib.AbstractContextManager[None]:
        """Gets made meanwhile update the node's counters (see :meth:`stats`) once, at the
        end, not once each: for a process that makes a few gets and ends, such as the Spark
        worker hook. Counts made meanwhile are lost if the process dies first (the counters
        are best effort anyway)."""
        return self._counters.batched()

    def release(self, owner: str) -> int:
        """Drop every reference ``owner`` holds (from any process); how many there were."""
        return self._refs.release(owner)

    def version(self, key: str) -> int | None:
        """The version of ``key`` this node holds, or None if it is not cached."""
        validate_key(key)
        current = self._layout.scan_key(key_dirname(key)).current()
        return current.version if current else None

    def entries(self) -> list[CacheEntry]:
        """Every cached version, by key and version."""
        out: list[CacheEntry] = []
        for scan in self._layout.scan_all():
            live, _stale = self._refs.read(scan.kd)
            current = scan.current()
            for v in sorted(scan.versions.values(), key=lambda v: v.version):
                holders = live.get(v.version, [])
                out.append(
                    CacheEntry(
                        key=scan.key,
                        version=v.version,
                        size=v.disk_bytes,
                        last_used=v.last_used,
                        refs=len(holders),
                        path=v.file,
                        digest=v.digest,
                        unpacked=v.dir / "unpacked" if v.unpacked_size is not None else None,
                        current=v is current,
                        deleted_remotely=scan.deleted,
                        owners=tuple(sorted(r.holder for r in holders)),
                    )
                )
        out.sort(key=lambda e: (e.key, e.version))
        return out

    def stats(self) -> CacheStats:
        """The counters of every process that used this directory, and what it holds now."""
        counters = self._counters.read()
        held = [v for scan in self._layout.scan_all() for v in scan.versions.values()]
        return CacheStats(
            downloads=counters["downloads"],
            hits=counters["hits"],
            evictions=counters["evictions"],
            bytes=sum(v.disk_bytes for v in held),
            bytes_downloaded=counters["bytes_downloaded"],
            entries=len(held),
            corrupt=counters["corrupt"],
            removed_versions=counters["removed_versions"],
            checks=counters["checks"],
            verifications=counters["verifications"],
            bytes_from_peers=counters["bytes_from_peers"],
        )

    def cleanup(self) -> CleanupReport:
        """Run one staged cleanup and eviction pass now (waits for a pass another process
        runs to end first)."""
        self._check_open()
        return self._janitor.cleanup(blocking=True)

    # -- the parts' shared needs -----------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument("this BlobCache is closed; create a new one")
        if os.getpid() != self._me.pid:
            # References would name the parent, and the gRPC client does not survive a fork.
            raise InvalidArgument(
                f"this BlobCache was opened in process {self._me.pid} and cannot be used in a"
                " forked child; open one in each process"
            )

    def _cluster(self) -> Client:
        """The client, made on first use when the cache was given ``connect``: a process whose
        every blob is served from the node's records never pays for it."""
        with self._lock:
            if self._client is None:
                if self._closed or self._connect is None:
                    raise InvalidArgument("this BlobCache is closed; create a new one")
                client = self._connect()
                if client.user != self._user:
                    client.close()
                    raise InvalidArgument(
                        f"connected as {client.user!r}, but this cache serves {self._user!r}"
                    )
                self._client = client
            return self._client

    # -- getting a blob --------------------------------------------------------------------

    def _obtain(
        self, key: str, kd: str, meta: Remote, spec: RefSpec, check: Known | None,
        floor: Order | None, progress: ProgressCallback | None,
    ) -> tuple[Version, bool]:
        """Under the key's lock: the version to serve (downloaded if missing) with a reference
        recorded, so no cleanup can remove it, and ``check`` recorded for the node if given.
        True if this call downloaded it. Never one older than ``floor``: Stale instead."""
        layout = self._layout
        with layout.key_lock(kd) as held:
            assert held is not None
            layout.ensure_key_dir(key, kd)
            if check is not None:
                self._checks.write(kd, check)
            scan = layout.scan_key(kd, key)
            version = install.choose(scan, meta)
            downloaded = version is None
            if version is None:
                version = self._download(key, kd, meta, progress)
            _check_floor(key, version, meta, floor)
            now = self._clock()
            self._refs.write(kd, spec, version.version, now)
            touch(version.dir / "used", now)
            unlink(version.dir / "staged")
            unlink(layout.blobs / kd / "deleted")
            # A hit passes the scan it chose from (nothing was installed or removed since); a
            # download changed the directory, which tidy reads again.
            self._janitor.tidy(kd, keep=version.version, scan=None if downloaded else scan)
        return version, downloaded

    def _download(self, key: str, kd: str, meta: Remote,
                  progress: ProgressCallback | None) -> Version:
        def client() -> Client:
            # What the cluster said, maybe to another process on the node: no master behind it
            # may deliver an older version.
            made = self._cluster()
            seed(made, key, meta.order)
            return made

        try:
            dest, name, info, from_peers = install.download(
                self._layout, client, key, kd, meta, self._clock, progress, self._peers)
        except KeyNotFound:
            self._checks.mark_deleted(kd)
            raise
        # The client checked the digest end to end: recorded so the node's other processes
        # need not hash it again.
        self._verifier.downloaded(kd, dest, name, info.version, info.digest)
        self._counters.bump(downloads=1, bytes_downloaded=info.size,
                            bytes_from_peers=from_peers)
        installed = self._layout.read_version(key, dest, info.version)
        if installed is None:  # pragma: no cover - we just wrote it
            raise ChecksumMismatch(f"the copy of {key!r} just installed cannot be read back")
        return installed


def _check_floor(key: str, version: Version, meta: Remote, floor: Order | None) -> None:
    """Stale if ``version`` is older than ``floor``: what the cache served, or was told to
    read at least, and no master could confirm a version as new (all behind, or none
    reachable and only an older copy on the node)."""
    if floor is None:
        return
    order = version.order
    if version.created_at <= 0 and (version.version, version.digest) == (meta.version,
                                                                           meta.digest):
        order = meta.order  # a record of an older release: the cluster's answer dates it
    if order < floor:
        raise Stale(
            f"the node cache has {key!r} v{version.version}, older than v{floor[1]} it must"
            " serve at least, and no master confirmed a newer one; retry once they can"
        )
