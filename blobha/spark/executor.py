"""The executor's side: blob_path and what a Python worker runs (no client loaded at import)."""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from blobha.cache import BlobCache, CachedBlob
from blobha.core.errors import NO_ANSWER, BlobError
from blobha.core.lazy import LazyLogger
from blobha.spark.conf import ENV_CA_PEM, ENV_CONF, ENV_JOB_TOKEN, LOCAL_PROPERTY, conf_of
from blobha.spark.settings import NotConfigured, SparkBlobSettings

if TYPE_CHECKING:
    from pyspark import SparkContext

    from blobha.client import Client
    from blobha.wire.credentials import Credentials

__all__ = [
    "adopt_prepared",
    "application_id",
    "blob_info",
    "blob_path",
    "blob_version",
    "current_settings",
    "job_credentials",
    "open_cache",
    "require_seen",
]

log = LazyLogger("blobha.spark")

_driver_lock = threading.Lock()
#: What prepare() decided in this (driver) process, keyed by application id.
_driver_settings: dict[str, SparkBlobSettings] = {}

# --------------------------------------------------------------------------------------------
# Where the configuration and the application id come from
# --------------------------------------------------------------------------------------------

_json_memo: dict[str, SparkBlobSettings] = {}


def _from_json_memo(text: str) -> SparkBlobSettings:
    # blob_path may run once per record: parse each distinct carrier once per process.
    settings = _json_memo.get(text)
    if settings is None:
        settings = SparkBlobSettings.from_json(text)
        if len(_json_memo) > 64:
            _json_memo.clear()
        _json_memo[text] = settings
    return settings


def _task_context() -> Any:
    if "pyspark" not in sys.modules:
        return None  # never import Spark into a process that does not use it
    try:
        from pyspark import TaskContext
    except ImportError:
        return None
    return TaskContext.get()


def _task_property() -> str | None:
    tc = _task_context()
    if tc is None:
        return None
    try:
        value = tc.getLocalProperty(LOCAL_PROPERTY)
    except Exception:  # a TaskContext left over from an earlier task may be half torn down
        return None
    return str(value) if value else None


def _active_context() -> SparkContext | None:
    if "pyspark" not in sys.modules:
        return None  # never import Spark into a process that does not use it
    try:
        from pyspark import SparkContext
    except ImportError:
        return None
    return SparkContext._active_spark_context


def current_settings() -> SparkBlobSettings:
    """The settings this process sees: task local property, then ``$BLOBHA_SPARK_CONF``,
    then (on the driver) what :func:`prepare` decided or the active ``SparkContext``'s conf."""
    prop = _task_property()
    if prop:
        return _from_json_memo(prop)
    env = os.environ.get(ENV_CONF)
    if env:
        return _from_json_memo(env)
    sc = _active_context()
    if sc is not None:
        with _driver_lock:
            prepared = _driver_settings.get(sc.applicationId)
        if prepared is not None:
            return prepared
        # Launched by 'blobha spark-submit': the driver's own conf holds the settings. Read
        # once per application (each read is a round trip to the JVM).
        settings = SparkBlobSettings.from_conf(conf_of(sc))
        if settings.blobs:
            if settings.user is None:
                settings = settings.replace(user=sc.sparkUser() or None)
            with _driver_lock:
                _driver_settings.setdefault(sc.applicationId, settings)
            return settings
    raise NotConfigured(
        "no blob map in this process: launch with 'blobha spark-submit --blob ...', call"
        " blobha.spark.prepare(spark, ...) on the driver before running jobs, or set"
        f" spark.executorEnv.{ENV_CONF}"
    )


_APP_ID_RE = re.compile(r"--app-id\x00([^\x00]+)")


def _parent_pid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (2nd field) may hold spaces and parentheses: split after the last ')'.
    return int(stat.rsplit(")", 1)[1].split()[1])


_jvm_memo: list[tuple[int | None, str | None]] = []


def _executor_jvm() -> tuple[int | None, str | None]:
    """(pid, ``--app-id``) of the JVM this Python worker serves, found among its ancestors
    (worker -> PySpark daemon -> executor JVM); (None, None) where /proc cannot tell."""
    if _jvm_memo:
        return _jvm_memo[0]
    found: tuple[int | None, str | None] = (None, None)
    pid: int | None = os.getppid()
    for _ in range(4):
        if pid is None or pid <= 1:
            break
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode("utf-8", "replace")
        except OSError:
            break
        m = _APP_ID_RE.search(argv)
        if m:
            found = (pid, m.group(1))
            break
        if os.path.basename(argv.split("\x00", 1)[0]) == "java":
            found = (pid, None)  # local mode: the driver's JVM runs the tasks
            break
        pid = _parent_pid(pid)
    _jvm_memo.append(found)
    return found


def application_id(settings: SparkBlobSettings | None = None) -> str:
    """The Spark application id this process works for: the owner of its cache references.

    From the carried configuration (``spark.app.id``), else on the driver from the active
    ``SparkContext``, else in a Python worker from the executor JVM's ``--app-id``. Only a
    local-mode worker of a job that did not call :func:`prepare` has none of these; it uses
    ``spark-local-<JVM pid>``, unique on the node for as long as the application runs.
    """
    if settings is not None and settings.app_id:
        return settings.app_id
    if _task_context() is None:
        sc = _active_context()
        if sc is not None:
            return str(sc.applicationId)
    jvm, app = _executor_jvm()
    if app:
        return app
    return f"spark-local-{jvm if jvm is not None else os.getppid()}"



# --------------------------------------------------------------------------------------------
# The localizer
# --------------------------------------------------------------------------------------------


class _Held:
    # A slotted class (``checked`` changes), not a dataclass: see SparkOption.
    __slots__ = ("blob", "checked")

    def __init__(self, blob: CachedBlob, checked: float) -> None:
        self.blob = blob
        self.checked = checked


def _ca_file(pem: str, cache_dir: str) -> str:
    # The CA's content travels in the Spark conf; the TLS layer reads a file. One per content,
    # written once per node, beside the cache.
    import tempfile

    from blobha.core.digest import digest_bytes

    folder = Path(cache_dir) / "tls"
    path = folder / f"ca-{digest_bytes(pem.encode())}.pem"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".ca-", dir=folder)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(pem)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    return str(path)


def job_credentials(cache_dir: str) -> Credentials | None:
    """The credentials ``blobha spark-submit`` gave this executor (``spark.executorEnv.*``):
    the job token and the cluster's CA (its content, written to a file under ``cache_dir``);
    None when it gave none (the node's own then: ``$BLOBHA_CA``, ``$BLOBHA_TOKEN_FILE``...)."""
    token = os.environ.get(ENV_JOB_TOKEN, "").strip()
    pem = os.environ.get(ENV_CA_PEM, "")
    if not token and not pem.strip():
        return None
    from blobha.wire.credentials import Credentials

    own = Credentials.from_env()
    ca = _ca_file(pem, cache_dir) if pem.strip() else own.ca
    # TLS required by the node (its environment or profile) or by the launcher (which passes
    # BLOBHA_REQUIRE_TLS on when it required it): no job token goes out without it.
    if token:
        return Credentials(ca=ca, bearer=token, require_tls=own.require_tls)
    return Credentials(ca=ca, cert=own.cert, key=own.key, token_file=own.token_file,
                       require_tls=own.require_tls)


def open_cache(settings: SparkBlobSettings) -> BlobCache:
    """The node cache these settings name, connecting to the cluster only when it must."""
    cluster = settings.resolved_cluster()
    cache_dir = settings.resolved_cache_dir()

    def connect() -> Client:
        # Made (and grpc loaded) only when the cache must ask the cluster or download: a
        # task served by the node's records, as every task of a second application within
        # the update interval is, never needs it.
        from blobha.client import Client

        return Client(cluster, user=settings.user, timeout=settings.client_timeout_secs,
                      credentials=job_credentials(cache_dir))

    return BlobCache(
        cache_dir,
        user=settings.user,
        soft_limit_bytes=settings.cache_soft_limit_bytes,
        retention_secs=settings.cache_retention_secs,
        update_interval_secs=settings.update_interval_secs,
        connect=connect,
    )


class _Localizer:
    """Per-process state behind :func:`blob_path`: one :class:`BlobCache` per configuration,
    and what each local name resolved to last.

    The cache is node-wide (its state and locks are on disk); this layer keeps ``blob_path``
    cheap when a job calls it once per record, and keeps serving the copy it has when the
    cluster cannot be reached in the middle of fetching a newer version.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._caches: dict[tuple[Any, ...], BlobCache] = {}
        self._held: dict[tuple[Any, ...], _Held] = {}
        # One lookup per blob at a time in this process; different blobs do not wait for
        # each other's downloads.
        self._entry_locks: dict[tuple[Any, ...], threading.Lock] = {}
        #: Applications this process took references for.
        self._owners: set[str] = set()

    def switch_application(self, owner: str) -> None:
        """On the driver: ``owner`` is now the application. A driver runs one SparkContext at
        a time, so any earlier application it took references for has ended; release them
        (the cache would only drop them once this process exits, and a notebook or a test
        run keeps its driver for a long time)."""
        with self._lock:
            ended = self._owners - {owner}
            self._owners = {owner}
            caches = list(self._caches.values())
            for ident in [i for i in self._held if i[2] in ended]:
                del self._held[ident]
        for old in ended:
            for cache in caches:
                try:
                    count = cache.release(old)
                except (BlobError, OSError) as exc:  # housekeeping must not fail the job
                    log.warning("could not release %s's cache references: %s", old, exc)
                    continue
                if count:
                    log.info("released %d cache reference(s) of ended application %s", count,
                             old)

    def _cache(self, settings: SparkBlobSettings) -> BlobCache:
        cluster = settings.resolved_cluster()
        ident = (
            settings.resolved_cache_dir(),
            cluster,
            settings.user,
            settings.cache_soft_limit_bytes,
            settings.cache_retention_secs,
            settings.update_interval_secs,
            settings.client_timeout_secs,
        )
        with self._lock:
            found = self._caches.get(ident)
            if found is not None:
                return found
            cache = open_cache(settings)
            self._caches[ident] = cache
            return cache

    def get(self, settings: SparkBlobSettings, localname: str) -> CachedBlob:
        spec = settings.spec(localname)
        cache = self._cache(settings)
        seen = settings.min_version(spec.key)
        owner = application_id(settings)
        if owner not in self._owners:
            if _task_context() is None and _active_context() is not None:
                self.switch_application(owner)
            else:
                with self._lock:
                    self._owners.add(owner)
        # The version seen at launch too: a copy held for an earlier one may be older.
        ident = (id(cache), spec, owner, seen)
        with self._lock:
            entry_lock = self._entry_locks.setdefault(ident, threading.Lock())
        with entry_lock:
            held = self._held.get(ident)
            now = time.monotonic()
            if (
                held is not None
                and now - held.checked < _recheck_secs(settings)
                and held.blob.path.exists()
            ):
                return held.blob
            require_seen(cache, settings, spec.key)  # here: not on every reuse of the memo
            try:
                blob = cache.get(spec.key, uncompress=spec.uncompress, owner=owner)
            except NO_ANSWER as exc:
                if held is not None and held.blob.path.exists():
                    # Availability over freshness: the copy we hold was current moments ago,
                    # and failing the task would not bring the cluster back any sooner.
                    log.warning(
                        "blob store unreachable (%s); still using %s version %d",
                        exc, spec.key, held.blob.version,
                    )
                    held.checked = now
                    return held.blob
                raise
            if held is not None and held.blob.version != blob.version:
                log.info("%s: now version %d (was %d)", spec.key, blob.version,
                         held.blob.version)
            self._held[ident] = _Held(blob, now)
            return blob

    def close(self) -> None:
        with self._lock:
            for cache in self._caches.values():
                with contextlib.suppress(Exception):
                    cache.close()
            self._caches.clear()
            self._held.clear()


def require_seen(cache: BlobCache, settings: SparkBlobSettings, key: str) -> None:
    """Make ``cache`` serve ``key`` at least at the version the driver saw before launch (the
    job's input updated just before it, and a master behind may still have the one before)."""
    seen = settings.min_version(key)
    if seen is not None:  # None: a configuration from before minimums
        cache.remember_version(key, seen.version, seen.created_at)


def _recheck_secs(settings: SparkBlobSettings) -> float:
    # How long this process reuses an answer without asking the cache again. The cache asks
    # the cluster at most once per update interval anyway; this only spares a job that calls
    # blob_path per record the cache's file locks and stat calls, and adds at most a tenth of
    # the interval (at most 1 s) to the time a new version takes to show.
    return min(1.0, settings.update_interval_secs / 10)


_localizer = _Localizer()
atexit.register(_localizer.close)


def adopt_prepared(app_id: str, settings: SparkBlobSettings) -> None:
    """On the driver, once prepare() decided: ``settings`` are what this process sees for
    ``app_id`` (see current_settings), and ``app_id`` owns its cache references from now on."""
    with _driver_lock:
        _driver_settings[app_id] = settings
    _localizer.switch_application(app_id)


def blob_info(localname: str) -> CachedBlob:
    """The cached blob behind ``localname``: ``path``, ``version``, ``size``, ``digest``,
    consistent with each other (one lookup).

    >>> info = blob_info("geo.bin")          # doctest: +SKIP
    >>> info.version, info.path              # doctest: +SKIP
    (3, '/tmp/blobha-cache-0/.../geo')
    """
    return _localizer.get(current_settings(), localname)


def blob_path(localname: str) -> str:
    """A local path to the current version of the blob mapped to ``localname``, like
    ``SparkFiles.get``: a file, or a directory for ``"uncompress": true`` entries.

    Works in tasks on executors and on the driver. The first call on a node downloads the blob
    into the node's cache (once, whatever the number of executors); later calls return the
    cached copy, and a new version appears within ``spark.blobha.update.interval.secs``
    (call ``blob_path`` again to get it: an open file keeps the version it was opened at).

    >>> def lookup(rows):                                     # doctest: +SKIP
    ...     with open(blob_path("geo.bin"), "rb") as f:
    ...         table = load(f)
    ...     for row in rows:
    ...         yield enrich(row, table)
    >>> df.rdd.mapPartitions(lookup)                           # doctest: +SKIP
    """
    return str(blob_info(localname).path)


def blob_version(localname: str) -> int:
    """The version of ``localname`` this process holds now (the one :func:`blob_path`
    returns), e.g. to tag results or to notice an update.

    >>> blob_version("geo.bin")   # doctest: +SKIP
    3
    """
    return int(blob_info(localname).version)
