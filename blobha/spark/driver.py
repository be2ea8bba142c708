"""The driver's side: check access and wait for replication before launch (prepare)."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from blobha.core.addresses import parse_cluster
from blobha.core.errors import (
    BlobError,
    DeadlineExceeded,
    InvalidArgument,
    KeyNotFound,
    NotAuthorized,
    Unavailable,
)
from blobha.core.keys import validate_key
from blobha.spark.blobmap import parse_blob_map
from blobha.spark.conf import (
    CONF_MAP,
    CONF_ON_TIMEOUT,
    DEFAULT_CLIENT_TIMEOUT_SECS,
    ENV_CONF,
    LOCAL_PROPERTY,
    ON_TIMEOUT_FAIL,
    ON_TIMEOUT_PROCEED,
    check_policy,
    conf_of,
)
from blobha.spark.executor import adopt_prepared
from blobha.spark.minimums import SeenVersion, merge_min_versions
from blobha.spark.settings import NotConfigured, SparkBlobSettings

if TYPE_CHECKING:
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    from blobha.client import BlobMeta, Client
    from blobha.wire.status import ReplicationStatus

__all__ = [
    "BlobsNotAccessible",
    "ReplicationReport",
    "ReplicationTimeout",
    "check_access",
    "job_user",
    "prepare",
    "wait_for_replication",
]

log = logging.getLogger("blobha.spark")


class BlobsNotAccessible(BlobError):
    """Some keys of the blob map are missing or not readable by the job's user.

    ``missing`` and ``forbidden`` list them; the exit status is that of
    :class:`~blobha.core.errors.NotAuthorized` (5) when any key is forbidden, else that of
    :class:`~blobha.core.errors.KeyNotFound` (3).
    """

    def __init__(self, user: str, missing: Sequence[str], forbidden: Sequence[str]) -> None:
        self.user = user
        self.missing = tuple(missing)
        self.forbidden = tuple(forbidden)
        self.exit_code = NotAuthorized.exit_code if self.forbidden else KeyNotFound.exit_code
        parts = []
        if self.forbidden:
            parts.append(f"forbidden (user {user!r} lacks READ): {', '.join(self.forbidden)}")
        if self.missing:
            parts.append(f"missing: {', '.join(self.missing)}")
        count = len(self.missing) + len(self.forbidden)
        super().__init__(
            f"not launching: {count} blob(s) of the blob map cannot be read; "
            + "; ".join(parts)
            + ". Create them, fix their ACL (blobha set-acl KEY -s u:USER:r) or remove them"
            " from the map"
        )


class ReplicationTimeout(DeadlineExceeded):
    """The wait ended short of the minimum and the policy is ``fail``; ``report`` says more."""

    def __init__(self, report: ReplicationReport) -> None:
        self.report = report
        super().__init__(
            f"not launching: replication below {report.min_replication} after"
            f" {report.waited_secs:.1f} s: {report.describe_under_replicated()}"
            f" ({CONF_ON_TIMEOUT}=fail; use 'proceed' to launch anyway)"
        )



class ReplicationReport(NamedTuple):
    """What the pre-launch wait found. ``reached`` is False only under the ``proceed`` policy
    (``fail`` raises :class:`ReplicationTimeout` instead)."""

    keys: tuple[str, ...]
    user: str
    min_replication: int
    max_wait_secs: float
    on_timeout: str
    reached: bool
    waited_secs: float
    statuses: tuple[ReplicationStatus, ...]
    #: Problems noticed before waiting, e.g. a replication factor below the minimum.
    warnings: tuple[str, ...] = ()
    #: The version of each key seen before launch, with its creation time: the job's reads
    #: return it or a newer one (passed to executors as ``spark.blobha.min.versions``).
    seen: tuple[SeenVersion, ...] = ()

    @property
    def under_replicated(self) -> tuple[ReplicationStatus, ...]:
        return tuple(s for s in self.statuses if s.replication < self.min_replication)

    def describe_under_replicated(self) -> str:
        return ", ".join(
            f"{s.key} has {s.replication} (version {s.version}, factor {s.replication_factor})"
            for s in self.under_replicated
        ) or "none"

    def describe(self) -> str:
        """One line for logs."""
        state = "reached" if self.reached else "NOT reached"
        per_key = ", ".join(f"{s.key}={s.replication}" for s in self.statuses)
        return (
            f"min replication {self.min_replication} {state} for {len(self.keys)} blob(s) after"
            f" {self.waited_secs:.2f} s ({per_key})"
        )


def _forever(secs: float) -> bool:
    return secs < 0


def check_access(client: Client, keys: Sequence[str]) -> dict[str, BlobMeta]:
    """Metadata of every key, or :class:`BlobsNotAccessible` naming every key that is missing
    or that the client's user may not read (all of them, not just the first)."""

    from blobha.client import require_read

    def meta(key: str) -> BlobMeta | BlobError:
        try:
            # READ, not only the metadata: masters show that to writers and admins too.
            return require_read(client.get_meta(key), client.user)
        except (KeyNotFound, NotAuthorized) as exc:
            return exc

    # Here, not at the top: only drivers ask (this module loads in every Python worker).
    from concurrent.futures import ThreadPoolExecutor

    # Asked together: a map of many blobs costs one round trip, not one per key.
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(keys)))) as pool:
        answers = dict(zip(keys, pool.map(meta, keys), strict=True))
    missing = [k for k, a in answers.items() if isinstance(a, KeyNotFound)]
    forbidden = [k for k, a in answers.items() if isinstance(a, NotAuthorized)]
    if missing or forbidden:
        raise BlobsNotAccessible(client.user, missing, forbidden)
    return {k: a for k, a in answers.items() if not isinstance(a, BlobError)}


def wait_for_replication(
    keys: Iterable[str],
    min_replication: int,
    max_wait_secs: float,
    cluster: str | Sequence[str] | None = None,
    user: str | None = None,
    on_timeout: str = ON_TIMEOUT_PROCEED,
    *,
    client: Client | None = None,
    timeout: float = DEFAULT_CLIENT_TIMEOUT_SECS,
) -> ReplicationReport:
    """Storm's pre-launch wait, done right: check access, then wait on the server.

    1. Every key must exist and be readable by ``user``; otherwise
       :class:`BlobsNotAccessible` lists all the missing and forbidden keys at once.
    2. Wait (a server-side wait driven by ZooKeeper watches, no polling) until each key has
       ``min_replication`` live replicas of its committed version, at most ``max_wait_secs``
       (-1 = forever).
    3. If the deadline passes first: ``on_timeout="proceed"`` (Storm's behaviour) logs a
       warning and returns a report with ``reached=False``; ``"fail"`` raises
       :class:`ReplicationTimeout`.

    What it waited for and how long is logged on the ``blobha.spark`` logger.

    >>> report = wait_for_replication(["geo"], 2, 60, cluster="m1:6627")  # doctest: +SKIP
    >>> report.reached, round(report.waited_secs, 1)                      # doctest: +SKIP
    (True, 0.2)
    """
    names = list(dict.fromkeys(keys))
    if not names:
        raise InvalidArgument("no blobs to wait for: the blob map is empty")
    for key in names:
        validate_key(key)
    check_policy(on_timeout)
    if min_replication < 0:
        raise InvalidArgument(f"min replication must be 0 or more, not {min_replication}")
    if max_wait_secs < 0 and max_wait_secs != -1:
        raise InvalidArgument("max wait must be seconds >= 0, or -1 to wait forever")
    own = client is None
    if client is None:
        from blobha.client import Client

        if cluster is None:
            cluster = os.environ.get("BLOBHA_CLUSTER", "")
        client = Client(cluster, user=user, timeout=timeout)
    try:
        return _wait(client, names, min_replication, max_wait_secs, on_timeout)
    finally:
        if own:
            client.close()


def _already_replicated(
    client: Client, keys: list[str], minimum: int
) -> Sequence[ReplicationStatus] | None:
    """The usual launch: every blob is replicated already. One call says so: no cluster
    summary to wait for before the job starts. None for any other answer, which goes the
    whole way (_check_and_wait); none of its warnings could apply here, since each key has
    its minimum, hence as many masters and at least that replication factor."""
    if minimum == 0:
        return None
    try:
        now = client.wait_for_replication(keys, minimum, 0)
    except (KeyNotFound, NotAuthorized, Unavailable, DeadlineExceeded):
        # The whole way answers better: its calls retry unreachable masters for the client's
        # own timeout (a zero wait gives up within its short grace), so a failover costs no
        # job.
        return None
    return now.statuses if now.reached else None


def _check_and_wait(
    client: Client, keys: list[str], minimum: int, max_wait: float, metas: Mapping[str, BlobMeta]
) -> tuple[Sequence[ReplicationStatus], bool, list[str]]:
    """Warn of what cannot be reached (``metas``: what check_access read), then wait: the
    statuses, whether the minimum was reached, and the warnings."""
    warnings = []
    for key, meta in metas.items():
        if meta.replication_factor < minimum:
            warnings.append(
                f"{key} has replication factor {meta.replication_factor} < {minimum}: the"
                f" minimum cannot be reached (raise it with 'blobha replication --update"
                f" --replication-factor {minimum} {key}')"
            )
    if minimum > 1:
        # The summary asks every master; it can only warn when more than one replica is
        # needed (a master answered above), so a minimum of 1 does not pay for it.
        with contextlib.suppress(BlobError):
            live = sum(1 for m in client.cluster_summary().masters if m.reachable)
            if live < minimum:
                warnings.append(f"only {live} master(s) are reachable, fewer than {minimum}")
    for w in warnings:
        log.warning("%s", w)
    wait_text = "forever" if _forever(max_wait) else f"up to {max_wait:g} s"
    log.info(
        "waiting %s for %d blob(s) to reach %d replica(s) (user %s): %s",
        wait_text, len(keys), minimum, client.user, ", ".join(keys),
    )
    if minimum == 0:
        return [client.get_replication(k) for k in keys], True, warnings
    try:
        result = client.wait_for_replication(keys, minimum, max_wait)
    except (Unavailable, DeadlineExceeded) as e:
        # No master answered within the wait (a failover, ZooKeeper down): the minimum is not
        # known to be reached, which the launch policy decides on like any other timeout.
        # The statuses are what the access check read; their holders are unknown.
        from blobha.wire.status import ReplicationStatus  # drivers only, as above

        warnings.append(f"no master answered the replication wait: {e}")
        log.warning("%s", warnings[-1])
        return [ReplicationStatus(key, metas[key].version, metas[key].replication,
                                  metas[key].replication_factor, ()) for key in keys
                ], False, warnings
    return result.statuses, result.reached, warnings


def _seen_versions(client: Client, metas: Mapping[str, BlobMeta],
                   statuses: Sequence[ReplicationStatus]) -> tuple[SeenVersion, ...]:
    """Each key's version as of launch, with its creation time, for the executors to read at
    least: the metadata read before the wait, or, when the wait found a newer committed
    version (the master that answered was behind, or an update landed meanwhile), that one
    read again with the newer minimum, which any master still behind refuses."""
    from blobha.client import require_read  # drivers only (as check_access)

    committed = {s.key: s.version for s in statuses}
    seen = []
    for key, meta in metas.items():
        if meta.created_at <= 0 or meta.version <= 0:
            continue  # a master of an older release does not say when: no minimum
        version = max(meta.version, committed.get(key, 0))
        found = SeenVersion(key, version, meta.created_at)
        if version > meta.version:
            # The metadata came first, so the wait's version is of that incarnation or of a
            # later one, which this minimum lets through whatever its version.
            client.remember_version(key, version, meta.created_at)
            with contextlib.suppress(BlobError):
                again = require_read(client.get_meta(key), client.user)
                found = SeenVersion(key, again.version, again.created_at)
        seen.append(found)
    return tuple(seen)


def _wait(
    client: Client, keys: list[str], minimum: int, max_wait: float, policy: str
) -> ReplicationReport:
    started = time.monotonic()
    warnings: list[str] = []
    # The metadata before the wait: each key's creation time (the wait does not say it), and
    # the access check, which names every missing or forbidden key, not only the first.
    metas = check_access(client, keys)
    ready = _already_replicated(client, keys, minimum)
    if ready is not None:
        statuses, reached = ready, True
    else:
        statuses, reached, warnings = _check_and_wait(client, keys, minimum, max_wait, metas)
    seen = _seen_versions(client, metas, statuses)
    waited = time.monotonic() - started
    report = ReplicationReport(
        keys=tuple(keys),
        user=client.user,
        min_replication=minimum,
        max_wait_secs=max_wait,
        on_timeout=policy,
        reached=reached,
        waited_secs=waited,
        statuses=tuple(statuses),
        warnings=tuple(warnings),
        seen=seen,
    )
    if reached:
        log.info("%s", report.describe())
        return report
    if policy == ON_TIMEOUT_FAIL:
        raise ReplicationTimeout(report)  # its message says what was waited for and how long
    log.warning(
        "%s; launching anyway (%s=proceed): under-replicated: %s",
        report.describe(), CONF_ON_TIMEOUT, report.describe_under_replicated(),
    )
    unserved = [s.key for s in report.statuses if s.replication == 0]
    if unserved:
        log.warning(
            "no live master holds %s: tasks cannot fetch it until one does",
            ", ".join(unserved),
        )
    return report



def _spark_context(spark: SparkSession | SparkContext) -> SparkContext:
    # A SparkSession has one; a SparkContext is its own (no import of pyspark needed here).
    sc = getattr(spark, "sparkContext", None)
    return cast("SparkContext", spark if sc is None else sc)



def prepare(
    spark: SparkSession | SparkContext,
    blob_map: str | Mapping[str, Any] | None = None,
    *,
    cluster: str | None = None,
    user: str | None = None,
    min_replication: int | None = None,
    max_wait_secs: float | None = None,
    on_timeout: str | None = None,
    cache_dir: str | None = None,
    update_interval_secs: float | None = None,
    cache_soft_limit_bytes: int | None = None,
    cache_retention_secs: float | None = None,
) -> ReplicationReport:
    """On the driver, before the first job: wait for the blobs, then make them available to
    every task of this application (for jobs that are not launched by ``blobha
    spark-submit``, or that add blobs in code).

    Arguments override the ``spark.blobha.*`` conf of the running application; the user
    defaults to ``spark.blobha.user``, ``$BLOBHA_USER``, then the Spark user. Raises
    :class:`BlobsNotAccessible` or :class:`ReplicationTimeout` as
    :func:`wait_for_replication` does.

    Example::

        spark = SparkSession.builder.getOrCreate()
        report = prepare(spark, {"geo": {"localname": "geo.bin"}}, cluster="m1:6627",
                         min_replication=2, max_wait_secs=120)
        spark.sparkContext.parallelize(range(8)).map(lambda i: blob_path("geo.bin")).collect()
    """
    sc = _spark_context(spark)
    settings = SparkBlobSettings.from_conf(conf_of(sc))
    changes: dict[str, Any] = {}
    if blob_map is not None:
        changes["blobs"] = parse_blob_map(blob_map)
    for name, value in (
        ("cluster", cluster),
        ("user", user),
        ("min_replication", min_replication),
        ("max_wait_secs", max_wait_secs),
        ("on_timeout", on_timeout),
        ("cache_dir", cache_dir),
        ("update_interval_secs", update_interval_secs),
        ("cache_soft_limit_bytes", cache_soft_limit_bytes),
        ("cache_retention_secs", cache_retention_secs),
    ):
        if value is not None:
            changes[name] = value
    if cluster is not None:
        parse_cluster(cluster)
    settings = settings.replace(**changes)
    # Round-trip through the conf form so values given in code get the same validation.
    settings = SparkBlobSettings.from_conf(settings.to_conf())
    if not settings.blobs:
        raise NotConfigured(f"no blobs: pass blob_map or set {CONF_MAP}")
    if settings.user is None:
        from blobha.client import default_user

        settings = settings.replace(user=job_user(lambda: sc.sparkUser() or default_user()))
    settings = settings.replace(cluster=settings.resolved_cluster(), app_id=sc.applicationId)
    report = wait_for_replication(
        settings.keys,
        settings.min_replication,
        settings.max_wait_secs,
        cluster=settings.cluster,
        user=settings.user,
        on_timeout=settings.on_timeout,
        timeout=settings.client_timeout_secs,
    )
    # The executors read at least what the wait saw: an update just before launch is read,
    # even from a master still behind it.
    settings = settings.replace(min_versions=merge_min_versions(settings.min_versions,
                                                                report.seen))
    carrier = settings.to_json()
    # sc.environment is the environment of every Python function PySpark wraps from now on
    # (so of every worker running it); the local property also covers jobs of this thread
    # whose functions were wrapped before this call.
    sc.environment[ENV_CONF] = carrier
    sc.setLocalProperty(LOCAL_PROPERTY, carrier)
    adopt_prepared(sc.applicationId, settings)
    return report



def job_user(otherwise: Callable[[], str]) -> str:
    """The blob-store user of a job that names none: ``BLOBHA_USER``, else the user the
    token names (the masters see that user whatever name is sent, and the client refuses a
    token of another user than the one given), else ``otherwise()`` (Spark's user)."""
    from blobha.wire.credentials import Credentials

    return (os.environ.get("BLOBHA_USER", "").strip()
            or Credentials.from_env().check().token_user() or otherwise())
