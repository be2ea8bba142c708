"""The node-local blob cache: every blob downloaded once per node and shared by its processes.

Storm calls this the localizer and Flink the ``BlobCache``. :class:`BlobCache` keeps the current
version of each requested key under one directory that any number of processes (and threads)
on the node share. Everything it knows lives in that directory, so a process that starts later,
or a restarted one, sees the same cache:

``blobs/<key dir>/key``
    the key itself (its directory name is :func:`~blobha.core.keys.key_dirname`, maybe a hash)
``blobs/<key dir>/v<N>/``
    version N, installed by one atomic rename of a complete directory: ``meta.json`` (size,
    digest...), ``file/<name>`` (the blob, read-only), ``used`` (its mtime is the last use),
    ``staged`` (set by the first cleanup pass that found it unreferenced), ``verified`` (the
    node checked the file's digest: which file, in which boot) and ``unpacked/`` once someone
    asked for the archive's contents
``blobs/<key dir>/checks/<user>``
    the cluster's last answer to that user about the key (its current version, and so the
    right to read it) and when it came: reused by every process for the update interval
``blobs/<key dir>/asking/<user>``
    ``flock`` held while a process asks the cluster about the key for that user: processes
    that find the user's record aged at the same moment ask once for the node, not once each
``blobs/<key dir>/refs/``
    one file per reference: who holds it (an owner such as a Spark application id, or a
    :class:`BlobCache` instance) from which process (boot id, pid and start time, so the
    references of dead processes are recognised as stale) and for which version
``blobs/<key dir>/deleted``
    the cluster said the key no longer exists: evicted first
``locks/<key dir>.lock``
    ``flock`` per key: one download per node, and no eviction while a process takes a reference
``tmp/<instance>/``
    each instance's scratch space (downloads, extractions, atomic writes); removed at start
    when its process is dead, so a crash never leaves a half file in view
``stats.json``
    download, hit and eviction counters shared by every process
``cleanup.lock``
    ``flock`` held by the process making a cleanup pass; its mtime is when the node's last
    pass began, so a process that starts within the cleanup interval does not make another

Example::

    from blobha.cache import BlobCache

    with BlobCache("/var/cache/blobha", "m1:6627,m2:6627", user="alice") as cache:
        model = cache.get("model.bin", owner="app-42")          # a file
        libs = cache.get("libs.tgz", uncompress=True, owner="app-42")  # a directory
        print(model.path, model.version, libs.path)
        ...
        cache.release("app-42")  # the job ended; its blobs may now be evicted
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import secrets
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, NamedTuple

from blobha.core.digest import CHUNK_SIZE, Digester
from blobha.core.errors import (
    NO_ANSWER,
    ChecksumMismatch,
    InvalidArgument,
    KeyNotFound,
    NotAuthorized,
    ResourceExhausted,
)
from blobha.core.keys import key_dirname, validate_key
from blobha.core.locks import boot_id, lock_file

if TYPE_CHECKING:
    # Imported when a cache first talks to the cluster: a process served from a warm cache
    # never does, and grpc and the client's other dependencies would cost it more than the
    # lookup itself (see _cluster).
    from blobha.client import BlobMeta, Client


def _readable_meta(client: Client, key: str) -> BlobMeta:
    """The metadata of ``key``, which must grant the client's user READ (NotAuthorized
    otherwise): masters show it to writers and administrators too, and the cache serves the
    blob on the strength of this answer."""
    from blobha.client import require_read  # loaded already: the client exists

    return require_read(client.get_meta(key), client.user)


__all__ = [
    "DEFAULT_CLEANUP_INTERVAL_SECS",
    "BlobCache",
    "CacheEntry",
    "CacheStats",
    "CachedBlob",
    "CleanupReport",
    "default_cache_dir",
]

log = logging.getLogger(__name__)

GiB = 1024**3
#: The longest time between two cleanup passes started from :meth:`BlobCache.get`.
DEFAULT_CLEANUP_INTERVAL_SECS = 30.0

_LAYOUT = "blobha-cache 1"
#: ``flock`` held by the process making a cleanup pass; its mtime is when the last one began.
_CLEANUP_LOCK = "cleanup.lock"
_VERSION_DIR = re.compile(r"v([1-9][0-9]{0,18})")
# A corrupt file is discarded and fetched again; more failures than this in one get mean
# something other than a bad disk block is wrong.
_ATTEMPTS = 3
#: In a key's directory: ``<this>/<user>`` is held by the process asking the cluster about the
#: key for that user (a directory of its own: no user's lock name can be another's record).
_CHECK_LOCKS = "asking"
# What _check_flock found.
_ASKER, _WAITED, _NO_LOCK = "asker", "waited", "no lock"
# Longest file name we give a blob; most file systems cap a name at 255 bytes.
_MAX_NAME_BYTES = 200
#: Archive names :mod:`blobha.cache.unpack` knows, and their kind. Here, not there: a file
#: name keeps its extension, and naming a file must not load the unpacking code.
ARCHIVE_SUFFIXES: dict[str, str] = {
    ".tar.gz": "tar",
    ".tgz": "tar",
    ".tar": "tar",
    ".zip": "zip",
    ".jar": "zip",
}
_STAT_FIELDS = (
    "downloads",
    "hits",
    "evictions",
    "bytes_downloaded",
    "corrupt",
    "removed_versions",
    "checks",
    "verifications",
)


def default_cache_dir() -> Path:
    """``$BLOBHA_CACHE_DIR``, else ``~/.cache/blobha``."""
    env = os.environ.get("BLOBHA_CACHE_DIR", "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "blobha"


# --------------------------------------------------------------------------------------------
# Plain results
# --------------------------------------------------------------------------------------------

# The records of this module, public and private, are named tuples and slotted classes, not
# dataclasses: it loads in every Python worker of a Spark job that reads a blob, and a frozen
# dataclass costs about 1.2 ms to create (it compiles six methods), a named tuple 0.2 ms.


class CachedBlob(NamedTuple):
    """A blob as this node holds it. ``path`` is the file, or the directory it was unpacked
    into when asked with ``uncompress=True``; ``size`` and ``digest`` describe the blob."""

    key: str
    version: int
    size: int
    digest: str
    path: Path


class CacheEntry(NamedTuple):
    """One cached version of a key."""

    key: str
    version: int
    #: Bytes on disk: the blob plus its unpacked tree, if any.
    size: int
    #: Wall-clock time of the last :meth:`BlobCache.get` that returned it.
    last_used: float
    #: Live references (of processes that are still running).
    refs: int
    #: The blob file.
    path: Path
    digest: str = ""
    #: The unpacked tree, if someone asked for it.
    unpacked: Path | None = None
    #: False for an older version still kept for a process that references it.
    current: bool = True
    #: The cluster said the key no longer exists.
    deleted_remotely: bool = False
    #: Who holds the live references; instances that fetched without an owner appear as
    #: ``instance:<pid>-...``.
    owners: tuple[str, ...] = ()


class CacheStats(NamedTuple):
    """Counters kept on disk, so they cover every process that used this cache directory,
    plus what the cache holds now."""

    downloads: int
    hits: int
    #: Current versions removed by cleanup (over the soft limit, or deleted remotely).
    evictions: int
    #: Bytes held now (blobs and unpacked trees).
    bytes: int
    bytes_downloaded: int
    #: Cached versions held now.
    entries: int
    #: Cached files that failed their digest check and were fetched again.
    corrupt: int
    #: Older versions removed once nobody referenced them.
    removed_versions: int
    #: Questions to the cluster about a key's current version (and the user's right to read
    #: it); answers recorded for the node spare the others.
    checks: int = 0
    #: Cached files hashed again to check their digest (a file the node's cache had not
    #: checked since the node started, or that changed since).
    verifications: int = 0


class CleanupReport(NamedTuple):
    """What one cleanup pass did. Keys are reported as ``(key, version)``."""

    #: Unreferenced and seen for the first time: deletable from the next pass on, once
    #: ``retention_secs`` have passed.
    staged: tuple[tuple[str, int], ...] = ()
    #: Current versions deleted (deleted remotely, or LRU while over the soft limit).
    evicted: tuple[tuple[str, int], ...] = ()
    #: Older versions deleted because no live process references them.
    removed_versions: tuple[tuple[str, int], ...] = ()
    #: References of dead processes removed.
    stale_refs: int = 0
    freed_bytes: int = 0
    #: Bytes held after the pass.
    total_bytes: int = 0
    #: Keys skipped because another thread or process held them (downloading, say).
    busy: tuple[str, ...] = ()
    #: False when another pass was running and this one (started by ``get``) stood aside.
    ran: bool = True


# --------------------------------------------------------------------------------------------
# Processes: who holds a reference, and whether it still runs
# --------------------------------------------------------------------------------------------


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


class _Process(NamedTuple):
    boot: str
    pid: int
    start: int

    @staticmethod
    def me() -> _Process:
        pid = os.getpid()
        return _Process(_BOOT_ID, pid, _start_ticks(pid) or 0)

    @property
    def tag(self) -> str:
        return f"{self.boot[:8] or 'noboot'}-{self.pid}-{self.start}"

    def alive(self) -> bool:
        if self.boot and _BOOT_ID and self.boot != _BOOT_ID:
            return False
        ticks = _start_ticks(self.pid)
        return ticks is not None and (ticks == self.start or not _HAVE_PROC)


_TAG = re.compile(r"([0-9a-f]{8}|noboot)-([0-9]+)-([0-9]+)")


def _tag_alive(tag: str) -> bool:
    """Whether the process named by a ``_Process.tag`` prefix still runs."""
    m = _TAG.match(tag)
    if m is None:
        return False
    boot, pid, start = m.group(1), int(m.group(2)), int(m.group(3))
    if boot != "noboot" and _BOOT_ID and not _BOOT_ID.startswith(boot):
        return False
    ticks = _start_ticks(pid)
    return ticks is not None and (ticks == start or not _HAVE_PROC)


class _Ref(NamedTuple):
    """A reference file as read back."""

    path: Path
    owner: str
    instance: str
    version: int
    process: _Process

    @property
    def holder(self) -> str:
        return self.owner if self.owner else f"instance:{self.instance}"


class _RefSpec(NamedTuple):
    """The reference a ``get`` records: an explicit owner, or this instance."""

    filename: str
    owner: str
    instance: str


# --------------------------------------------------------------------------------------------
# Locks and files
# --------------------------------------------------------------------------------------------


class _Held:
    """A held key lock; ``remove()`` deletes the lock file before it is released."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.remove_file = False

    def remove(self) -> None:
        self.remove_file = True


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def _rmtree(path: Path) -> None:
    """Remove a tree, read-only directories (unpacked archives) included."""
    for sub, _dirs, _files in os.walk(path):
        with contextlib.suppress(OSError):
            os.chmod(sub, 0o755)
    shutil.rmtree(path, ignore_errors=True)


#: An unpack leaves this much of the cache's disk free (or 5% of it, if that is less): an
#: archive that would expand past it (a zip or tar bomb) is refused while it unpacks, before
#: every other writer on the node runs out of space.
UNPACK_MARGIN_BYTES = 1024**3


def _room_to_unpack(path: Path) -> int:
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    return max(0, free - min(UNPACK_MARGIN_BYTES, st.f_blocks * st.f_frsize // 20))


def _fsync_dir(path: Path) -> None:
    # A rename is durable only once its directory is; without this a power cut could undo an
    # install whose data is already on disk (harmless: the blob is fetched again).
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _touch(path: Path, when: float) -> None:
    try:
        os.utime(path, (when, when))
    except FileNotFoundError:
        path.touch()
        os.utime(path, (when, when))


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def _tree_size(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, name))
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
    return total


def _hash_file(path: Path) -> tuple[str, int, os.stat_result]:
    """(xxh3-128 digest, size, status when opened) of a file."""
    digester = Digester()
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        while chunk := f.read(CHUNK_SIZE):
            digester.update(chunk)
    return digester.hexdigest(), digester.size, st


# Verification records: ``v<N>/verified`` says that this node's cache checked the digest of
# ``v<N>/file/<name>`` (a download checked by the client end to end, or a re-verification) and
# which file that was: its device, inode, size, modification and change times, and the boot.
# A later process trusts a record that still matches instead of hashing the whole blob again
# (hundreds of MiB for every new Spark application otherwise), because a file cannot change
# without changing what is recorded: it is read-only, a rewrite or chmod moves its change
# time (which no program can set back), a replacement is another inode. Records are trusted
# only within the boot that wrote them: the first use after the node restarts (when a crash
# may have left damage, or the disk was checked or restored meanwhile) verifies the file again,
# as Flink does on a cache's first use of a file. Change times have a coarse clock, so, as git
# does with its index, a record written in the same clock tick as the file's last change
# proves nothing (a change later in that tick would leave the same time) and is not trusted.
_VERIFIED = "verified"


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino, a.st_size, a.st_mtime_ns, a.st_ctime_ns) == (
        b.st_dev, b.st_ino, b.st_size, b.st_mtime_ns, b.st_ctime_ns
    )


def _verification_record(st: os.stat_result, digest: str) -> bytes:
    return json.dumps({
        "boot": _BOOT_ID, "dev": st.st_dev, "ino": st.st_ino, "size": st.st_size,
        "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "digest": digest,
    }).encode()


def _verified_on_node(file: Path, record: Path, digest: str, size: int) -> bool:
    """Whether ``record`` vouches for ``file`` holding ``size`` bytes with ``digest``."""
    if not _BOOT_ID:
        return False  # cannot tell a restart: verify every time
    try:
        with open(record, "rb") as f:
            written = os.fstat(f.fileno()).st_mtime_ns
            data = json.loads(f.read())
        st = os.stat(file)
        return bool(
            data["boot"] == _BOOT_ID
            and data["digest"] == digest
            and (data["dev"], data["ino"], data["size"], data["mtime_ns"], data["ctime_ns"])
            == (st.st_dev, st.st_ino, size, st.st_mtime_ns, st.st_ctime_ns)
            and st.st_size == size
            and written > st.st_ctime_ns
        )
    except (OSError, ValueError, TypeError, KeyError):
        return False


def _file_name(key: str) -> str:
    """The name the blob file gets: the key itself (so ``libs.zip`` stays a ``.zip`` for
    tools that look at the name), or a hash keeping the extension when the key is too long."""
    if len(key.encode("utf-8")) <= _MAX_NAME_BYTES:
        return key
    suffix = next((s for s in ARCHIVE_SUFFIXES if key.lower().endswith(s)), "")
    if not suffix:
        ext = os.path.splitext(key)[1]
        suffix = ext if 1 < len(ext) <= 16 and ext.isascii() else ""
    return key_dirname(key) + suffix


# --------------------------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------------------------


class _Version:
    """One installed version as read from disk."""

    __slots__ = ("created_at", "digest", "dir", "key", "last_used", "name", "size", "staged",
                 "unpacked_size", "version")

    def __init__(self, key: str, version: int, dir: Path, size: int, digest: str,
                 created_at: float, name: str, last_used: float, staged: float | None,
                 unpacked_size: int | None) -> None:
        self.key = key
        self.version = version
        self.dir = dir
        self.size = size
        self.digest = digest
        self.created_at = created_at
        self.name = name
        self.last_used = last_used
        self.staged = staged
        self.unpacked_size = unpacked_size  # None: not unpacked

    @property
    def file(self) -> Path:
        return self.dir / "file" / self.name

    @property
    def order(self) -> tuple[float, int]:
        # A key deleted and created again starts over at version 1; its creation time tells the
        # newer incarnation apart.
        return (self.created_at, self.version)

    @property
    def disk_bytes(self) -> int:
        return self.size + (self.unpacked_size or 0)


class _KeyScan:
    __slots__ = ("deleted", "junk", "kd", "key", "versions")

    def __init__(self, key: str, kd: str, deleted: bool = False) -> None:
        self.key = key
        self.kd = kd
        self.versions: dict[int, _Version] = {}
        self.junk: list[Path] = []
        self.deleted = deleted

    def current(self) -> _Version | None:
        return max(self.versions.values(), key=lambda v: v.order, default=None)


class _Tidied(NamedTuple):
    scan: _KeyScan
    live: dict[int, list[_Ref]]
    stale_refs: int
    gone: list[tuple[str, int, int]]  # (key, version, bytes) removed


class _Remote(NamedTuple):
    """What the cluster said of a key's current version: all a cache needs of its metadata,
    and what a check record keeps."""

    version: int
    digest: str
    size: int
    created_at: float

    @staticmethod
    def of(meta: BlobMeta) -> _Remote:
        return _Remote(meta.version, meta.digest, meta.size, meta.created_at)


class _Known(NamedTuple):
    meta: _Remote
    #: When the cluster gave this answer (this cache's clock), whichever process asked.
    checked_at: float


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
    ``clock`` (wall-clock seconds) exists for tests.

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
    ) -> None:
        if not isinstance(soft_limit_bytes, int) or soft_limit_bytes < 0:
            raise InvalidArgument(f"soft_limit_bytes must be 0 or more, not {soft_limit_bytes!r}")
        for name, value in (
            ("retention_secs", retention_secs),
            ("update_interval_secs", update_interval_secs),
        ):
            if not value >= 0:
                raise InvalidArgument(f"{name} must be 0 or more seconds, not {value!r}")
        self._soft_limit = soft_limit_bytes
        self._retention = float(retention_secs)
        self._update_interval = float(update_interval_secs)
        self._cleanup_interval = min(self._retention, DEFAULT_CLEANUP_INTERVAL_SECS)
        self._clock = clock

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
            self._root = Path(cache_dir).expanduser().absolute()
            self._blobs = self._root / "blobs"
            self._locks = self._root / "locks"
            self._tmp_root = self._root / "tmp"
            self._open_dir()
            self._me = _Process.me()
            self._instance = f"{self._me.tag}-{secrets.token_hex(4)}"
            self._tmp = self._tmp_root / self._instance
            self._sweep_temps()
            self._tmp.mkdir(mode=0o700)
        except BaseException:
            if self._owns_client and client is not None:
                client.close()
            raise

        self._lock = threading.Lock()
        self._key_locks: dict[str, threading.Lock] = {}
        self._check_locks: dict[str, threading.Lock] = {}
        self._stats_lock = threading.Lock()
        self._cleanup_lock = threading.Lock()
        self._remote: dict[str, _Known] = {}
        self._verified: set[tuple[str, int, str]] = set()
        self._touched: set[str] = set()  # key dirs holding this instance's references
        self._probed: dict[str, float] = {}
        self._last_cleanup: float | None = None
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def directory(self) -> Path:
        return self._root

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
            touched = list(self._touched)
        name = self._instance_spec().filename
        for kd in touched:
            _unlink(self._blobs / kd / "refs" / name)
        _rmtree(self._tmp)
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
        return f"BlobCache({str(self._root)!r}, user={self.user!r})"

    # -- the public operations -------------------------------------------------------------

    def get(self, key: str, *, uncompress: bool = False, owner: str | None = None) -> CachedBlob:
        """The node-local copy of ``key``'s current version, downloaded if needed.

        Checks with the cluster, at most every ``update_interval_secs`` per key, that this
        user may read the key (:class:`~blobha.core.errors.NotAuthorized` otherwise, even when the
        blob is cached) and whether a newer version exists (then fetched and returned).
        With ``uncompress`` the result is a directory holding the archive's contents.

        The reference taken holds one version per owner and process: when a later ``get`` for
        the same owner in the same process returns a newer version, the older one is released
        (and removed if nobody else holds it). Threads of one process that must keep reading
        an older version while others move on should use owners of their own.
        """
        validate_key(key)
        spec = self._ref_spec(owner)
        self._check_open()
        try:
            return self._get(key, uncompress, spec)
        except (OSError, ResourceExhausted) as e:
            if isinstance(e, OSError) and e.errno not in _DISK_FULL:
                raise
            # Room first (what staged cleanup may remove), then once more: a full disk must
            # not leave every job on the node failing, even on blobs already cached. (An
            # archive refused for want of room says so as ResourceExhausted.)
            log.warning("the node cache's disk under %s is full (%s); cleaning up and trying"
                        " %r again", self._root, e.strerror if isinstance(e, OSError) else e,
                        key)
            try:
                self._cleanup(blocking=True, urgent=True)
            except Exception:
                log.exception("cache cleanup failed under %s", self._root)
        try:
            return self._get(key, uncompress, spec)
        except OSError as e:
            if e.errno not in _DISK_FULL:
                raise
            raise ResourceExhausted(
                f"the node cache's disk under {self._root} is full ({e.strerror}) and nothing"
                f" cached could be removed to make room for {key!r}: free space there or lower"
                " the cache's soft limit"
            ) from None

    def _get(self, key: str, uncompress: bool, spec: _RefSpec) -> CachedBlob:
        kd = key_dirname(key)
        known, asked, asking = self._remote_meta(key, kd)
        check = known if asked else None
        for _attempt in range(_ATTEMPTS):
            try:
                version, downloaded = self._obtain(key, kd, known.meta, spec, check)
            finally:
                # Held until now by the process that asked, so the processes waiting for its
                # answer also find the version installed: they need no client, even to download.
                asking.close()
            check = None
            if not downloaded and not self._verify(key, kd, version):
                continue
            path = version.file
            if uncompress:
                unpacked = self._unpacked(key, kd, version)
                if unpacked is None:
                    continue  # the version was replaced meanwhile: take the new one
                path = unpacked
            if not downloaded:
                self._bump(hits=1)
            self._maybe_cleanup()
            return CachedBlob(key, version.version, version.size, version.digest, path)
        raise ChecksumMismatch(
            f"the cached copy of {key!r} failed its digest check {_ATTEMPTS} times; check the"
            f" disk under {self._root}"
        )

    def release(self, owner: str) -> int:
        """Drop every reference ``owner`` holds (from any process); how many there were."""
        prefix = self._owner_prefix(owner)
        dropped = 0
        for kd in self._key_dirs():
            refs = self._blobs / kd / "refs"
            try:
                names = os.listdir(refs)
            except OSError:
                continue
            for name in names:
                if name.startswith(prefix) and _unlink(refs / name):
                    dropped += 1
        return dropped

    def version(self, key: str) -> int | None:
        """The version of ``key`` this node holds, or None if it is not cached."""
        validate_key(key)
        current = self._scan_key(key_dirname(key)).current()
        return current.version if current else None

    def entries(self) -> list[CacheEntry]:
        """Every cached version, by key and version."""
        out: list[CacheEntry] = []
        for scan in self._scan_all():
            live, _stale = self._refs(scan.kd)
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
        counters = self._read_stats()
        held = [v for scan in self._scan_all() for v in scan.versions.values()]
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
        )

    def cleanup(self) -> CleanupReport:
        """Run one staged cleanup and eviction pass now (waits for a pass another process
        runs to end first)."""
        self._check_open()
        return self._cleanup(blocking=True)

    # -- references ------------------------------------------------------------------------

    def _owner_prefix(self, owner: str) -> str:
        if not isinstance(owner, str) or not owner or "\x00" in owner:
            raise InvalidArgument(f"owner must be a non-empty string, not {owner!r}")
        # key_dirname percent-encodes '@' and '=', so the prefix cannot match another owner.
        return f"o={key_dirname(owner)}@"

    def _ref_spec(self, owner: str | None) -> _RefSpec:
        if owner is None:
            return self._instance_spec()
        return _RefSpec(self._owner_prefix(owner) + self._me.tag, owner, "")

    def _instance_spec(self) -> _RefSpec:
        return _RefSpec(f"i={self._instance}", "", self._instance)

    def _write_ref(self, kd: str, spec: _RefSpec, version: int, now: float) -> None:
        path = self._blobs / kd / "refs" / spec.filename
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
        self._write_atomic(path, json.dumps(record).encode())
        if spec.instance:
            with self._lock:
                self._touched.add(kd)

    def _refs(self, kd: str) -> tuple[dict[int, list[_Ref]], list[Path]]:
        """Live references by version, and the files of stale ones."""
        live: dict[int, list[_Ref]] = {}
        stale: list[Path] = []
        refs = self._blobs / kd / "refs"
        try:
            names = os.listdir(refs)
        except OSError:
            return live, stale
        for name in names:
            path = refs / name
            try:
                data = json.loads(path.read_bytes())
                ref = _Ref(
                    path=path,
                    owner=str(data["owner"]),
                    instance=str(data["instance"]),
                    version=int(data["version"]),
                    process=_Process(str(data["boot"]), int(data["pid"]), int(data["start"])),
                )
            except FileNotFoundError:
                continue  # released meanwhile
            except (OSError, ValueError, TypeError, KeyError):
                stale.append(path)  # unreadable: written by no version of this code
                continue
            if ref.process.alive():
                live.setdefault(ref.version, []).append(ref)
            else:
                stale.append(path)
        return live, stale

    # -- the cluster -----------------------------------------------------------------------

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

    def _remote_meta(self, key: str, kd: str) -> tuple[_Known, bool, contextlib.ExitStack]:
        """The key's current version as this user sees it; whether the cluster was asked just
        now and the answer is still to be recorded for the node; and the node-wide lock on
        asking, when this process asked and recorded the answer: the caller closes it once it
        has obtained that version.

        The cluster is asked once the last answer to this user about this key, given to this
        process or (through a check record) to another on the node, is
        ``update_interval_secs`` old. Asking is also the authorisation check: the server
        answers only users who may read the key."""
        with self._lock:
            check_lock = self._check_locks.setdefault(key, threading.Lock())
        # One question per key at a time: threads asking together share the answer.
        with check_lock:
            now = self._clock()
            with self._lock:
                known = self._remote.get(key)
            if known is not None and now - known.checked_at < self._update_interval:
                return known, False, contextlib.ExitStack()
            recorded = self._fresh_check(key, kd, now)
            if recorded is not None:
                return recorded, False, contextlib.ExitStack()
            # And one per key and user on the node: the executors of a new application all ask
            # at once when the record has aged, and each would load the client (grpc) and ask.
            # The first asks; the others wait for its record.
            with contextlib.ExitStack() as asking:
                role = asking.enter_context(self._check_flock(kd))
                if role != _NO_LOCK:
                    # Also as the asker: another may have recorded since our read.
                    recorded = self._fresh_check(key, kd, self._clock())
                    if recorded is not None:
                        return recorded, False, contextlib.ExitStack()
                answer, answered = self._ask(key, kd, known)
                if role == _ASKER and answered and self._write_check(kd, answer):
                    # Recorded now, before the others waiting here read it (else, the key's
                    # directory went meanwhile: the caller records it with the key's lock).
                    return answer, False, asking.pop_all()
                return answer, answered, contextlib.ExitStack()

    def _fresh_check(self, key: str, kd: str, now: float) -> _Known | None:
        """This user's check record of ``key`` on the node, if it is within the interval."""
        recorded = self._read_check(kd)
        if recorded is None or not 0 <= now - recorded.checked_at < self._update_interval:
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
        version it was told of (see get), so the others find that version installed. Yields
        _WAITED once another process that held it let go: it recorded its answer, or got none,
        and then the processes that waited ask in parallel (with a cluster that cannot be
        reached, each waits for the rest of the first one's question and then for its own, not
        for one question per process ahead of it). Yields _NO_LOCK when the key has no
        directory: nothing is cached, and the download's lock keeps the node to one download."""
        path = self._blobs / kd / _CHECK_LOCKS / key_dirname(self._user)
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

    def _ask(self, key: str, kd: str, known: _Known | None) -> tuple[_Known, bool]:
        """Ask the cluster about ``key`` as this user: its answer and True, or, when the
        cluster cannot be reached and this user was allowed to read the key before, what was
        known and False."""
        now = self._clock()
        self._bump(checks=1)
        try:
            meta = _Remote.of(_readable_meta(self._cluster(), key))
        except NotAuthorized:
            with self._lock:
                self._remote.pop(key, None)
            _unlink(self._check_path(kd))
            raise
        except KeyNotFound:
            with self._lock:
                self._remote.pop(key, None)
            self._mark_deleted(kd)
            raise
        except NO_ANSWER as exc:
            if known is None:
                # A new process (a Spark worker started during the outage): the cluster's last
                # answer to this user about this key on the node, however old, as a process
                # that had asked itself would use its own.
                known = self._read_check(kd)
                if known is None:
                    raise
            # This user was allowed to read this key and nothing newer was known; an
            # unreachable cluster must not stop jobs that run on cached blobs. Asked again
            # after the next interval. (Not recorded for the node: other processes ask for
            # themselves.)
            log.warning("serving cached %r: cannot reach the cluster (%s)", key, exc)
            known = _Known(known.meta, now)
            with self._lock:
                self._remote[key] = known
            return known, False
        fresh = _Known(meta, now)
        with self._lock:
            self._remote[key] = fresh
        return fresh, True

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

    def _check_path(self, kd: str) -> Path:
        return self._blobs / kd / "checks" / key_dirname(self._user)

    def _read_check(self, kd: str) -> _Known | None:
        try:
            data = json.loads(self._check_path(kd).read_bytes())
            if data["user"] != self._user:
                return None
            meta = _Remote(
                int(data["version"]), str(data["digest"]), int(data["size"]),
                float(data["created_at"]),
            )
            return _Known(meta, float(data["checked_at"]))
        except (OSError, ValueError, TypeError, KeyError):
            return None  # none yet, or unreadable: ask the cluster

    def _write_check(self, kd: str, known: _Known) -> bool:
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
        path = self._check_path(kd)
        try:
            path.parent.mkdir(exist_ok=True)
            self._write_atomic(path, json.dumps(record).encode())
        except FileNotFoundError:
            return False  # no key directory: evicted meanwhile
        except OSError as exc:  # only costs other processes a round trip
            log.warning("cannot record the version check in %s: %s", path, exc)
            return False
        return True

    def _mark_deleted(self, kd: str) -> None:
        kdir = self._blobs / kd
        if kdir.is_dir():
            with contextlib.suppress(OSError):
                self._write_atomic(kdir / "deleted", str(self._clock()).encode())
            # No user's version check may vouch for a key the cluster no longer has.
            with contextlib.suppress(OSError):
                for name in os.listdir(kdir / "checks"):
                    _unlink(kdir / "checks" / name)

    # -- getting a blob --------------------------------------------------------------------

    def _obtain(
        self, key: str, kd: str, meta: _Remote, spec: _RefSpec, check: _Known | None
    ) -> tuple[_Version, bool]:
        """Under the key's lock: the version to serve (downloaded if missing) with a reference
        recorded, so no cleanup can remove it, and ``check`` recorded for the node if given.
        True if this call downloaded it."""
        with self._key_lock(kd) as held:
            assert held is not None
            self._ensure_key_dir(key, kd)
            if check is not None:
                self._write_check(kd, check)
            scan = self._scan_key(kd)
            version = _choose(scan, meta)
            downloaded = version is None
            if version is None:
                version = self._download(key, kd, meta)
            now = self._clock()
            self._write_ref(kd, spec, version.version, now)
            _touch(version.dir / "used", now)
            _unlink(version.dir / "staged")
            _unlink(self._blobs / kd / "deleted")
            self._tidy(kd, keep=version.version)
        return version, downloaded

    def _download(self, key: str, kd: str, meta: _Remote) -> _Version:
        stage = Path(tempfile.mkdtemp(prefix="d-", dir=self._scratch()))
        try:
            name = _file_name(key)
            (stage / "file").mkdir()
            target = stage / "file" / name
            try:
                # Version 0 = the current one: a version pruned since get_meta cannot stall us,
                # and an update that landed meanwhile is simply the newer answer.
                info = self._cluster().download(key, target)
            except KeyNotFound:
                self._mark_deleted(kd)
                raise
            target.chmod(0o444)  # shared by every job on the node: nobody may write it
            now = self._clock()
            record = {
                "key": key,
                "version": info.version,
                "size": info.size,
                "digest": info.digest,
                "created_at": meta.created_at,
                "installed_at": now,
                "name": name,
            }
            with open(stage / "meta.json", "wb") as f:
                f.write(json.dumps(record).encode())
                f.flush()
                os.fsync(f.fileno())
            _touch(stage / "used", now)
            stage.chmod(0o755)
            dest = self._blobs / kd / f"v{info.version}"
            if dest.exists():
                # Another copy of that version number: a key deleted and created again, or a
                # file that failed its check. We hold the key lock; take it out of view first.
                self._discard(dest)
            os.rename(stage, dest)
            _fsync_dir(dest.parent)
        finally:
            if stage.exists():
                _rmtree(stage)
        # The client checked the digest end to end: recorded so the node's other processes
        # need not hash it again (see _verified_on_node).
        self._record_verified(dest / "file" / name, dest, info.digest)
        self._bump(downloads=1, bytes_downloaded=info.size)
        with self._lock:
            self._verified.add((kd, info.version, info.digest))  # the client checked it
        installed = self._read_version(key, dest, info.version)
        if installed is None:  # pragma: no cover - we just wrote it
            raise ChecksumMismatch(f"the copy of {key!r} just installed cannot be read back")
        return installed

    def _record_verified(self, file: Path, vdir: Path, digest: str,
                         st: os.stat_result | None = None) -> None:
        """Write ``vdir``'s verification record for ``file`` as it was (``st``) or is now."""
        try:
            self._write_atomic(vdir / _VERIFIED, _verification_record(st or os.stat(file),
                                                                      digest))
        except OSError as exc:  # only costs the next process a hash
            log.debug("cannot record the verification of %s: %s", file, exc)

    def _verify(self, key: str, kd: str, version: _Version) -> bool:
        """Digest check on the node's first use of a file its cache did not download or
        check since the node started (Flink checks on first use too; see _verified_on_node).
        A corrupt file is removed; False then, so the caller fetches again."""
        marker = (kd, version.version, version.digest)
        with self._lock:
            if marker in self._verified:
                return True
        if _verified_on_node(version.file, version.dir / _VERIFIED, version.digest,
                             version.size):
            with self._lock:
                self._verified.add(marker)
            return True
        # Outside the key lock: hashing a large file must not hold up other processes, and
        # our reference already keeps cleanup away from it.
        self._bump(verifications=1)
        try:
            digest, size, st = _hash_file(version.file)
            identity = (st.st_dev, st.st_ino)
        except FileNotFoundError:
            digest, size, identity, st = "", -1, (0, 0), None
        if st is not None and digest == version.digest and size == version.size:
            # Recorded for the node only if the file is still the one opened before hashing
            # (as that status): a change meanwhile leaves the next process to hash it again.
            with contextlib.suppress(OSError):
                if _same_file(os.stat(version.file), st):
                    self._record_verified(version.file, version.dir, digest, st)
            with self._lock:
                self._verified.add(marker)
            return True
        log.warning(
            "cached %r version %d is corrupt (digest %s over %d bytes, expected %s over %d);"
            " fetching it again",
            key, version.version, digest, size, version.digest, version.size,
        )
        with self._key_lock(kd):
            try:
                st = os.stat(version.file)
                now_identity: tuple[int, int] | None = (st.st_dev, st.st_ino)
            except FileNotFoundError:
                now_identity = None
            # Only the file we hashed: another process may have replaced it meanwhile.
            if version.dir.exists() and now_identity in (identity, None):
                self._discard(version.dir)
                self._bump(corrupt=1)
        return False

    def _unpacked(self, key: str, kd: str, version: _Version) -> Path | None:
        target = version.dir / "unpacked"
        if target.is_dir():
            return target
        with self._key_lock(kd):
            if not version.dir.is_dir():
                return None
            if target.is_dir():
                return target
            # Here, not at the top: most processes never unpack anything (see blobha.cache.unpack).
            from blobha.cache.unpack import unpack

            stage = Path(tempfile.mkdtemp(prefix="x-", dir=self._scratch()))
            try:
                size = unpack(version.file, key, stage, max_bytes=_room_to_unpack(stage))
                # Read-only, like its files: the tree is shared by every job on the node, and
                # only the archive's digest is checked on later uses.
                for sub, dirs, _files in os.walk(stage):
                    for d in dirs:
                        path = os.path.join(sub, d)
                        if not os.path.islink(path):
                            os.chmod(path, 0o555)
                # Readable by all before it is visible (mkdtemp made it 0700): a crash before
                # the chmod below leaves it usable.
                stage.chmod(0o755)
                os.rename(stage, target)
                # After the rename, which moving a directory needs write permission on it for.
                target.chmod(0o555)
                _fsync_dir(version.dir)
            finally:
                if stage.exists():
                    _rmtree(stage)
            self._write_atomic(version.dir / "unpacked.size", str(size).encode())
        return target

    # -- disk state ------------------------------------------------------------------------

    def _open_dir(self) -> None:
        self._root.mkdir(parents=True, exist_ok=True)
        layout = self._root / "LAYOUT"
        try:
            found = layout.read_text().strip()
        except FileNotFoundError:
            found = ""
            # The marker is written first, so a process starting at the same moment sees it;
            # a directory holding anything else is not ours to fill (a mistyped --cache-dir).
            others = [n for n in os.listdir(self._root) if not n.startswith(".LAYOUT.")]
            if others and "LAYOUT" not in others:
                raise InvalidArgument(
                    f"{self._root} is not empty and is not a blobha cache (no LAYOUT file);"
                    " give a new or empty directory"
                ) from None
            tmp = self._root / f".LAYOUT.{os.getpid()}.{secrets.token_hex(4)}"
            tmp.write_text(_LAYOUT + "\n")
            os.replace(tmp, layout)
        if found and found != _LAYOUT:
            raise InvalidArgument(
                f"{self._root} holds a cache of another format ({found!r}, expected"
                f" {_LAYOUT!r}); use another --cache-dir or empty it"
            )
        for sub in (self._blobs, self._locks, self._tmp_root):
            sub.mkdir(exist_ok=True)

    def _sweep_temps(self) -> None:
        """Remove the scratch directories of processes that died (half downloads, half
        extractions, half-written files)."""
        try:
            names = os.listdir(self._tmp_root)
        except FileNotFoundError:
            return
        for name in names:
            if not _tag_alive(name):
                log.info("removing %s, left by a process that ended", self._tmp_root / name)
                path = self._tmp_root / name
                if path.is_dir() and not path.is_symlink():
                    _rmtree(path)
                else:
                    _unlink(path)

    def _write_atomic(self, path: Path, data: bytes) -> None:
        # Written in our scratch directory, which a crash leaves to the sweeper.
        fd, tmp = tempfile.mkstemp(prefix="w-", dir=self._scratch())
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            _unlink(Path(tmp))
            raise

    def _discard(self, path: Path) -> None:
        """Take a directory out of view at once (one rename), then delete it."""
        trash = self._scratch() / f"trash-{secrets.token_hex(6)}"
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return
        _rmtree(trash)

    def _ensure_key_dir(self, key: str, kd: str) -> None:
        kdir = self._blobs / kd
        (kdir / "refs").mkdir(parents=True, exist_ok=True)
        if not (kdir / "key").exists():
            self._write_atomic(kdir / "key", key.encode("utf-8"))

    def _key_dirs(self) -> list[str]:
        try:
            return sorted(os.listdir(self._blobs))
        except FileNotFoundError:
            return []

    def _read_version(self, key: str, vdir: Path, number: int) -> _Version | None:
        try:
            meta = json.loads((vdir / "meta.json").read_bytes())
            version = _Version(
                key=key,
                version=int(meta["version"]),
                dir=vdir,
                size=int(meta["size"]),
                digest=str(meta["digest"]),
                created_at=float(meta["created_at"]),
                name=str(meta["name"]),
                last_used=float(meta["installed_at"]),
                staged=None,
                unpacked_size=None,
            )
        except (OSError, ValueError, TypeError, KeyError):
            return None
        if version.version != number or "/" in version.name or version.name in ("", ".", ".."):
            return None
        with contextlib.suppress(OSError):
            version.last_used = os.stat(vdir / "used").st_mtime
        with contextlib.suppress(OSError, ValueError):
            version.staged = float((vdir / "staged").read_text())
        if (vdir / "unpacked").is_dir():
            try:
                version.unpacked_size = int((vdir / "unpacked.size").read_text())
            except (OSError, ValueError):
                version.unpacked_size = _tree_size(vdir / "unpacked")
        return version

    def _scan_key(self, kd: str, key: str | None = None) -> _KeyScan:
        kdir = self._blobs / kd
        if key is None:
            try:
                key = (kdir / "key").read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                key = ""
        scan = _KeyScan(key, kd, deleted=(kdir / "deleted").exists())
        try:
            names = os.listdir(kdir)
        except OSError:
            return scan
        for name in names:
            m = _VERSION_DIR.fullmatch(name)
            if m is None:
                continue
            version = self._read_version(key, kdir / name, int(m.group(1)))
            if version is None:
                scan.junk.append(kdir / name)
            else:
                scan.versions[version.version] = version
        return scan

    def _scan_all(self) -> list[_KeyScan]:
        scans = [self._scan_key(kd) for kd in self._key_dirs()]
        return [s for s in scans if s.key]

    def _read_stats(self) -> dict[str, int]:
        counters = dict.fromkeys(_STAT_FIELDS, 0)
        try:
            data = json.loads((self._root / "stats.json").read_bytes())
        except FileNotFoundError:
            return counters
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable %s: %s", self._root / "stats.json", exc)
            return counters
        for name in _STAT_FIELDS:
            with contextlib.suppress(KeyError, TypeError, ValueError):
                counters[name] = int(data[name])
        return counters

    def _bump(self, **deltas: int) -> None:
        """Add to the counters on disk; a read-modify-write under a lock every process takes.
        Best effort: counters lost on a full disk must not fail a read or a cleanup."""
        with self._stats_lock:
            try:
                fd = lock_file(self._root / "stats.lock", blocking=True)
                assert fd is not None
                try:
                    counters = self._read_stats()
                    for name, delta in deltas.items():
                        counters[name] += delta
                    self._write_atomic(self._root / "stats.json", json.dumps(counters).encode())
                finally:
                    os.close(fd)
            except OSError as e:
                log.debug("cache counters under %s not updated: %s", self._root, e)

    @contextlib.contextmanager
    def _key_lock(self, kd: str, blocking: bool = True) -> Iterator[_Held | None]:
        """The key's lock for this thread and process: a thread lock (threads of one process
        would otherwise each open the file) and then the ``flock`` other processes see.
        Yields None when not blocking and busy."""
        with self._lock:
            thread_lock = self._key_locks.setdefault(kd, threading.Lock())
        if not thread_lock.acquire(blocking):
            yield None
            return
        try:
            path = self._locks / f"{kd}.lock"
            fd = lock_file(path, blocking)
            if fd is None:
                yield None
                return
            held = _Held(path)
            try:
                yield held
            finally:
                if held.remove_file:
                    _unlink(path)
                os.close(fd)
        finally:
            thread_lock.release()

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument("this BlobCache is closed; create a new one")
        if os.getpid() != self._me.pid:
            # References would name the parent, and the gRPC client does not survive a fork.
            raise InvalidArgument(
                f"this BlobCache was opened in process {self._me.pid} and cannot be used in a"
                " forked child; open one in each process"
            )

    def _scratch(self) -> Path:
        # Recreated if someone emptied tmp/ under us: every atomic step needs it.
        self._tmp.mkdir(mode=0o700, exist_ok=True)
        return self._tmp

    # -- cleanup ---------------------------------------------------------------------------

    def _tidy(self, kd: str, keep: int | None) -> _Tidied:
        """With the key's lock held: remove stale references, damaged version directories and
        every version but ``keep`` (None: the current one) that no live process references."""
        scan = self._scan_key(kd)
        live, stale = self._refs(kd)
        stale_count = sum(_unlink(path) for path in stale)
        for junk in scan.junk:
            self._discard(junk)
        if keep is None:
            current = scan.current()
            keep = current.version if current else None
        gone: list[tuple[str, int, int]] = []
        for number, version in list(scan.versions.items()):
            if number != keep and not live.get(number):
                self._discard(version.dir)
                del scan.versions[number]
                gone.append((scan.key, number, version.disk_bytes))
        if gone:
            self._bump(removed_versions=len(gone))
        return _Tidied(scan, live, stale_count, gone)

    def _maybe_cleanup(self) -> None:
        now = self._clock()
        with self._lock:
            due = self._last_cleanup is None or now - self._last_cleanup >= self._cleanup_interval
            if due:
                self._last_cleanup = now
        if not due:
            return
        # Every Spark Python worker is a new process with no pass of its own yet: a node
        # starting many makes one pass per interval (each one reads every key), not one each.
        last = self._node_last_cleanup()
        if last is not None and 0 <= now - last < self._cleanup_interval:
            with self._lock:
                self._last_cleanup = last
            return
        try:
            self._cleanup(blocking=False)
        except Exception:  # the get itself succeeded; the next pass will try again
            log.exception("cache cleanup failed under %s", self._root)

    def _node_last_cleanup(self) -> float | None:
        try:
            return os.stat(self._root / _CLEANUP_LOCK).st_mtime
        except OSError:
            return None

    def _cleanup(self, blocking: bool, urgent: bool = False) -> CleanupReport:
        if not self._cleanup_lock.acquire(blocking):
            return CleanupReport(ran=False)
        try:
            fd = lock_file(self._root / _CLEANUP_LOCK, blocking)
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
        self._sweep_temps()
        with self._lock:
            self._last_cleanup = self._clock()
        staged: list[tuple[str, int]] = []
        removed: list[tuple[str, int]] = []
        busy: list[str] = []
        stale_refs = 0
        freed = 0
        total = 0
        candidates: list[tuple[_KeyScan, _Version]] = []
        for kd in self._key_dirs():
            with self._key_lock(kd, blocking=False) as held:
                if held is None:
                    scan = self._scan_key(kd)
                    busy.append(scan.key or kd)
                    total += sum(v.disk_bytes for v in scan.versions.values())
                    continue
                tidied = self._tidy(kd, keep=None)
                scan, live = tidied.scan, tidied.live
                stale_refs += tidied.stale_refs
                for key, number, size in tidied.gone:
                    removed.append((key, number))
                    freed += size
                total += sum(v.disk_bytes for v in scan.versions.values())
                current = scan.current()
                if current is None:
                    if not live:
                        self._remove_key_dir(kd, held)
                    continue
                if live.get(current.version):
                    _unlink(current.dir / "staged")
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
                        self._write_atomic(current.dir / "staged", repr(now).encode())
                    except OSError as e:
                        if e.errno not in _DISK_FULL:
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
            self._bump(evictions=len(evicted))
        return CleanupReport(
            staged=tuple(staged),
            evicted=tuple(evicted),
            removed_versions=tuple(removed),
            stale_refs=stale_refs,
            freed_bytes=freed,
            total_bytes=total,
            busy=tuple(busy),
        )

    def _evict(self, scan: _KeyScan, chosen: _Version) -> bool:
        """Delete a staged version unless, since it was chosen, it was used or referenced."""
        with self._key_lock(scan.kd, blocking=False) as held:
            if held is None:
                return False
            again = self._scan_key(scan.kd, scan.key)
            version = again.versions.get(chosen.version)
            live, _stale = self._refs(scan.kd)
            if (
                version is None
                or live.get(chosen.version)
                or version.last_used != chosen.last_used
                or version.staged != chosen.staged
            ):
                return False
            self._discard(version.dir)
            if not live and not again.versions.keys() - {chosen.version}:
                self._remove_key_dir(scan.kd, held)
        log.info("evicted %r version %d from %s", scan.key, chosen.version, self._root)
        return True

    def _remove_key_dir(self, kd: str, held: _Held) -> None:
        """Remove a key's directory and lock file (its lock held, nothing left in it)."""
        self._discard(self._blobs / kd)
        held.remove()

    def _probe_deleted(self, scans: list[_KeyScan]) -> None:
        """Ask the cluster whether the keys of eviction candidates still exist, so that those
        deleted remotely go first; at most once per update interval per key."""
        for scan in scans:
            now = self._clock()
            with self._lock:
                last = self._probed.get(scan.key)
            if last is not None and now - last < self._update_interval:
                continue
            try:
                _readable_meta(self._cluster(), scan.key)
            except KeyNotFound:
                self._mark_deleted(scan.kd)
                scan.deleted = True
            except NotAuthorized:
                # It exists; this user may no longer read it, and the node's record of an
                # earlier answer must not serve the user's next process in an outage.
                _unlink(self._check_path(scan.kd))
            except NO_ANSWER:
                return  # no answers now; plain LRU this time
            with self._lock:
                self._probed[scan.key] = now


def _choose(scan: _KeyScan, meta: _Remote) -> _Version | None:
    """The installed version to serve for ``meta``, or None to download."""
    current = scan.current()
    if current is None:
        return None
    if current.order > (meta.created_at, meta.version):
        # Another process learnt of a newer version first.
        return current
    exact = scan.versions.get(meta.version)
    if exact is not None and exact.digest == meta.digest:
        return exact
    return None

