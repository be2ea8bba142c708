"""PySpark integration: Storm's ``topology.blobstore.map`` for Spark applications.

What a PySpark user does today is ``sc.addFile`` / ``spark-submit --files`` and
``SparkFiles.get``: the driver alone serves every executor, every application transfers the
files again, nothing checks their integrity and nothing makes sure they are replicated before
the job starts. This module gives Spark what Storm gives topologies:

* a **blob map**, same shape as Storm's: ``{"key": {"localname": "name", "uncompress": false}}``,
  given in code or as the Spark conf ``spark.blobha.blobstore.map`` (JSON);
* a **wait before launch** on the driver: every key must exist and be readable by the job's
  user (else it fails at once, listing the missing and forbidden keys), then a server-side wait
  until every key has ``spark.blobha.min.replication`` replicas, with Storm's policy by default
  (after ``spark.blobha.max.replication.wait.secs``, go ahead with a warning);
* on executors, :func:`blob_path` (like ``SparkFiles.get``) returns a local path to the blob's
  current version through the node-local :class:`~blobha.cache.BlobCache`, shared by every
  executor and application on the node: one verified download per node, atomic installs, safe
  unpacking, reference-counted eviction (the owner is the Spark application id) and new
  versions picked up within ``spark.blobha.update.interval.secs``.

Launching (no code change in the job beyond :func:`blob_path`)::

    blobha spark-submit --blob geo-table:geo.bin --blob model.tgz:model:uncompress \\
        --min-replication 2 --max-wait 120 -- --master yarn job.py --day 2024-05-01

or, in code, before the first job::

    from blobha import spark as blobspark

    blobspark.prepare(spark, {"geo-table": {"localname": "geo.bin"}},
                      cluster="m1:6627,m2:6627,m3:6627", min_replication=2)

and in any task::

    def enrich(rows):
        path = blobspark.blob_path("geo.bin")      # a local file, current version
        ...

How executors get the configuration
-----------------------------------
Python worker processes on executors cannot read ``SparkConf``. Three carriers, most specific
first:

1. the task's local property ``blobha.spark.conf`` (set by :func:`prepare` for jobs submitted
   from the calling thread);
2. the environment variable ``BLOBHA_SPARK_CONF``: a JSON object of ``spark.blobha.*`` keys
   (plus ``spark.app.id`` when known). ``blobha spark-submit`` sets it with
   ``--conf spark.executorEnv.BLOBHA_SPARK_CONF=...`` so every executor process and every
   Python worker inherits it; :func:`prepare` also puts it in ``SparkContext.environment``,
   which PySpark hands to every Python worker it starts afterwards;
3. on the driver itself, the active ``SparkContext``'s ``spark.blobha.*`` conf.

The cache owner (the application id) comes from ``spark.app.id`` in that configuration, else
from the executor JVM's ``--app-id`` argument (standalone, YARN and Kubernetes executors all
have one), else from the driver's ``SparkContext``. The cache records each reference with the
process that took it (a Python worker, which lives as long as its executor), so the references
of an application that ended, or crashed, stop pinning blobs by themselves; eviction then
follows the cache's LRU and retention rules.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from blobha.cache import BlobCache, CachedBlob
from blobha.cache import default_cache_dir as _cache_default_dir
from blobha.core.addresses import parse_cluster
from blobha.core.errors import (
    NO_ANSWER,
    BlobError,
    DeadlineExceeded,
    InvalidArgument,
    KeyNotFound,
    NotAuthorized,
    Unavailable,
)
from blobha.core.keys import validate_key

if TYPE_CHECKING:
    import argparse

    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    from blobha.client import BlobMeta, Client
    from blobha.wire.status import ReplicationStatus

__all__ = [
    "CONF_CACHE_DIR",
    "CONF_CACHE_RETENTION",
    "CONF_CACHE_SOFT_LIMIT",
    "CONF_CLIENT_TIMEOUT",
    "CONF_CLUSTER",
    "CONF_MAP",
    "CONF_MAX_WAIT",
    "CONF_MIN_REPLICATION",
    "CONF_ON_TIMEOUT",
    "CONF_UPDATE_INTERVAL",
    "CONF_USER",
    "ENV_CONF",
    "LOCAL_PROPERTY",
    "OPTIONS",
    "BlobNotMapped",
    "BlobSpec",
    "BlobsNotAccessible",
    "NotConfigured",
    "ReplicationReport",
    "ReplicationTimeout",
    "SparkBlobSettings",
    "blob_info",
    "blob_path",
    "blob_version",
    "build_submit_command",
    "parse_blob_arg",
    "parse_blob_map",
    "prepare",
    "submit_main",
    "wait_for_replication",
]

log = logging.getLogger("blobha.spark")

GiB = 1024**3

# --------------------------------------------------------------------------------------------
# Configuration keys
# --------------------------------------------------------------------------------------------

CONF_PREFIX = "spark.blobha."
CONF_MAP = "spark.blobha.blobstore.map"
CONF_CLUSTER = "spark.blobha.cluster"
CONF_USER = "spark.blobha.user"
CONF_MIN_REPLICATION = "spark.blobha.min.replication"
CONF_MAX_WAIT = "spark.blobha.max.replication.wait.secs"
CONF_ON_TIMEOUT = "spark.blobha.on.replication.timeout"
CONF_CACHE_DIR = "spark.blobha.cache.dir"
CONF_CACHE_SOFT_LIMIT = "spark.blobha.cache.soft.limit.bytes"
CONF_CACHE_RETENTION = "spark.blobha.cache.retention.secs"
CONF_UPDATE_INTERVAL = "spark.blobha.update.interval.secs"
CONF_CLIENT_TIMEOUT = "spark.blobha.client.timeout.secs"
CONF_APP_ID = "spark.app.id"

#: Environment variable carrying the configuration to executors (a JSON object of conf keys).
ENV_CONF = "BLOBHA_SPARK_CONF"
#: Task local property carrying the same JSON for jobs of the thread that called prepare().
LOCAL_PROPERTY = "blobha.spark.conf"

ON_TIMEOUT_PROCEED = "proceed"
ON_TIMEOUT_FAIL = "fail"
_POLICIES = (ON_TIMEOUT_PROCEED, ON_TIMEOUT_FAIL)

DEFAULT_MIN_REPLICATION = 1
DEFAULT_MAX_WAIT_SECS = 60.0
DEFAULT_UPDATE_INTERVAL_SECS = 30.0
DEFAULT_SOFT_LIMIT_BYTES = 10 * GiB
DEFAULT_RETENTION_SECS = 600.0
DEFAULT_CLIENT_TIMEOUT_SECS = 60.0


# This module's records are named tuples, not dataclasses: it loads in every Python worker of a
# job that reads a blob, and a frozen dataclass costs about 1.2 ms to create (it compiles six
# methods), a named tuple 0.2 ms.
class SparkOption(NamedTuple):
    key: str
    default: str
    doc: str


#: Every ``spark.blobha.*`` key, its default and meaning (the README table is made from this).
OPTIONS: tuple[SparkOption, ...] = (
    SparkOption(
        CONF_MAP,
        "(required)",
        'JSON blob map, Storm\'s shape: {"key": {"localname": "name", "uncompress": false}}.'
        " localname defaults to the key, uncompress to false.",
    ),
    SparkOption(CONF_CLUSTER, "$BLOBHA_CLUSTER", "Masters, HOST:PORT[,HOST:PORT...]."),
    SparkOption(
        CONF_USER,
        "$BLOBHA_USER, else the Spark user",
        "Identity used for ACL checks on the driver and on every executor.",
    ),
    SparkOption(
        CONF_MIN_REPLICATION,
        str(DEFAULT_MIN_REPLICATION),
        "Replicas every blob must have before launch (Storm's topology.min.replication.count).",
    ),
    SparkOption(
        CONF_MAX_WAIT,
        str(int(DEFAULT_MAX_WAIT_SECS)),
        "Longest wait for that, in seconds; -1 waits forever"
        " (Storm's topology.max.replication.wait.time.sec).",
    ),
    SparkOption(
        CONF_ON_TIMEOUT,
        ON_TIMEOUT_PROCEED,
        "What to do when the wait ends short of the minimum: 'proceed' (Storm: launch anyway,"
        " with a warning) or 'fail'.",
    ),
    SparkOption(
        CONF_CACHE_DIR,
        "$BLOBHA_CACHE_DIR, else ~/.cache/blobha",
        "Node-local cache directory, shared by every executor and application on the node.",
    ),
    SparkOption(
        CONF_CACHE_SOFT_LIMIT,
        str(DEFAULT_SOFT_LIMIT_BYTES),
        "Cache size above which unreferenced blobs are evicted, least recently used first.",
    ),
    SparkOption(
        CONF_CACHE_RETENTION,
        str(int(DEFAULT_RETENTION_SECS)),
        "Seconds an unreferenced blob is kept at least before it may be evicted.",
    ),
    SparkOption(
        CONF_UPDATE_INTERVAL,
        str(int(DEFAULT_UPDATE_INTERVAL_SECS)),
        "Seconds within which a new version of a blob reaches running jobs.",
    ),
    SparkOption(
        CONF_CLIENT_TIMEOUT,
        str(int(DEFAULT_CLIENT_TIMEOUT_SECS)),
        "Seconds one blob store operation may retry before it fails.",
    ),
)
_KNOWN_KEYS = frozenset(o.key for o in OPTIONS)


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


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


class NotConfigured(InvalidArgument):
    """No blob map reached this process (see the module docstring for the carriers)."""


class BlobNotMapped(InvalidArgument):
    """:func:`blob_path` was asked for a local name that is not in the blob map."""


# --------------------------------------------------------------------------------------------
# The blob map
# --------------------------------------------------------------------------------------------

_SPEC_FIELDS = ("localname", "uncompress")


class BlobSpec(NamedTuple):
    """One entry of the blob map: ``key`` appears to the job as ``localname``.

    >>> BlobSpec("model.tgz", "model", uncompress=True).as_map_entry()
    {'localname': 'model', 'uncompress': True}
    """

    key: str
    localname: str
    uncompress: bool = False

    def as_map_entry(self) -> dict[str, Any]:
        return {"localname": self.localname, "uncompress": self.uncompress}


def _check_localname(name: str, key: str) -> str:
    # The local name becomes a file name the job opens; nothing in it may point elsewhere.
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise InvalidArgument(
            f"invalid localname {name!r} for key {key!r}: use a plain file name without '/'"
        )
    if len(name.encode("utf-8")) > 255:
        raise InvalidArgument(f"localname of key {key!r} is longer than 255 bytes")
    return name


def parse_blob_map(value: str | Mapping[str, Any] | None) -> tuple[BlobSpec, ...]:
    """Validate a blob map (a JSON string or a mapping) in Storm's shape.

    ``localname`` defaults to the key and ``uncompress`` to false; unknown fields, invalid
    keys, unsafe local names and two keys sharing a local name are errors.

    >>> parse_blob_map('{"geo": {"localname": "geo.bin"}, "model.tgz": {"uncompress": true}}')
    (BlobSpec(key='geo', localname='geo.bin', uncompress=False), \
BlobSpec(key='model.tgz', localname='model.tgz', uncompress=True))
    """
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        try:
            raw = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(
                f"{CONF_MAP} is not valid JSON ({exc}); expected e.g."
                ' {"key": {"localname": "name", "uncompress": false}}'
            ) from None
    else:
        raw = value
    if not isinstance(raw, Mapping):
        raise InvalidArgument(f"{CONF_MAP} must be a JSON object of key -> options")
    specs: list[BlobSpec] = []
    by_local: dict[str, str] = {}
    for key, options in raw.items():
        if not isinstance(key, str):
            raise InvalidArgument(f"blob map keys must be strings, not {key!r}")
        validate_key(key)
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise InvalidArgument(
                f"blob map entry for {key!r} must be an object like"
                ' {"localname": "name", "uncompress": false}'
            )
        unknown = sorted(set(options) - set(_SPEC_FIELDS))
        if unknown:
            raise InvalidArgument(
                f"blob map entry for {key!r} has unknown field(s) {', '.join(unknown)};"
                f" allowed: {', '.join(_SPEC_FIELDS)}"
            )
        localname = options.get("localname", key)
        if not isinstance(localname, str):
            raise InvalidArgument(f"localname of {key!r} must be a string")
        uncompress = options.get("uncompress", False)
        if not isinstance(uncompress, bool):
            raise InvalidArgument(f"uncompress of {key!r} must be true or false")
        _check_localname(localname, key)
        if localname in by_local:
            raise InvalidArgument(
                f"keys {by_local[localname]!r} and {key!r} both map to localname {localname!r}"
            )
        by_local[localname] = key
        specs.append(BlobSpec(key, localname, uncompress))
    return tuple(specs)


def blob_map_json(specs: Iterable[BlobSpec]) -> str:
    """The canonical JSON form of a blob map (what goes into ``spark.blobha.blobstore.map``)."""
    return json.dumps({s.key: s.as_map_entry() for s in specs}, separators=(",", ":"))


def parse_blob_arg(text: str) -> BlobSpec:
    """Parse a launcher ``--blob KEY[:LOCALNAME][:uncompress]`` argument.

    Keys cannot contain ``:``, so the split is unambiguous; a last field ``uncompress`` is
    the flag (write ``KEY:uncompress:uncompress`` for a local name that is literally
    "uncompress").

    >>> parse_blob_arg("model.tgz:model:uncompress")
    BlobSpec(key='model.tgz', localname='model', uncompress=True)
    >>> parse_blob_arg("geo")
    BlobSpec(key='geo', localname='geo', uncompress=False)
    """
    parts = text.split(":")
    uncompress = False
    if len(parts) > 1 and parts[-1] == "uncompress":
        uncompress = True
        parts.pop()
    if len(parts) > 2:
        raise InvalidArgument(
            f"bad --blob {text!r}: expected KEY[:LOCALNAME][:uncompress] (keys have no ':')"
        )
    key = validate_key(parts[0])
    localname = parts[1] if len(parts) == 2 and parts[1] else key
    return BlobSpec(key, _check_localname(localname, key), uncompress)


# --------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------


def _conf_int(conf: Mapping[str, str], key: str, default: int, minimum: int) -> int:
    text = conf.get(key)
    if text is None or str(text).strip() == "":
        return default
    try:
        value = int(str(text).strip())
    except ValueError:
        raise InvalidArgument(f"{key}={text!r}: expected a whole number") from None
    if value < minimum:
        raise InvalidArgument(f"{key}={text!r}: must be at least {minimum}")
    return value


def _conf_float(
    conf: Mapping[str, str], key: str, default: float, *, allow_forever: bool = False
) -> float:
    text = conf.get(key)
    if text is None or str(text).strip() == "":
        return default
    try:
        value = float(str(text).strip())
    except ValueError:
        raise InvalidArgument(f"{key}={text!r}: expected a number of seconds") from None
    if allow_forever and value < 0:
        if value != -1:
            raise InvalidArgument(f"{key}={text!r}: use -1 to wait forever")
        return -1.0
    if value != value or value < 0 or value == float("inf"):  # NaN and infinities too
        raise InvalidArgument(f"{key}={text!r}: expected a non-negative number of seconds")
    return value


def _check_policy(policy: str) -> str:
    if policy not in _POLICIES:
        raise InvalidArgument(
            f"{CONF_ON_TIMEOUT}={policy!r}: expected {' or '.join(repr(p) for p in _POLICIES)}"
        )
    return policy


def default_cache_dir() -> str:
    """This node's cache directory when none is configured: the one every blobha tool on the
    node shares (``$BLOBHA_CACHE_DIR``, else ``~/.cache/blobha`` of the executor's user)."""
    return str(_cache_default_dir())


class SparkBlobSettings(NamedTuple):
    """Everything ``blobha.spark`` reads from ``spark.blobha.*`` (see :data:`OPTIONS`).

    ``None`` means "resolve where used": the cluster falls back to ``$BLOBHA_CLUSTER`` and the
    cache directory to each node's own default, so one job can run on nodes whose disks
    differ.

    >>> s = SparkBlobSettings.from_conf({
    ...     "spark.blobha.blobstore.map": '{"geo": {"localname": "geo.bin"}}',
    ...     "spark.blobha.cluster": "m1:6627", "spark.blobha.min.replication": "2"})
    >>> s.spec("geo.bin").key, s.min_replication, s.max_wait_secs
    ('geo', 2, 60.0)
    """

    blobs: tuple[BlobSpec, ...] = ()
    cluster: str | None = None
    user: str | None = None
    min_replication: int = DEFAULT_MIN_REPLICATION
    max_wait_secs: float = DEFAULT_MAX_WAIT_SECS
    on_timeout: str = ON_TIMEOUT_PROCEED
    cache_dir: str | None = None
    cache_soft_limit_bytes: int = DEFAULT_SOFT_LIMIT_BYTES
    cache_retention_secs: float = DEFAULT_RETENTION_SECS
    update_interval_secs: float = DEFAULT_UPDATE_INTERVAL_SECS
    client_timeout_secs: float = DEFAULT_CLIENT_TIMEOUT_SECS
    app_id: str | None = None

    @classmethod
    def from_conf(cls, conf: Mapping[str, str]) -> SparkBlobSettings:
        """Read ``spark.blobha.*`` (and ``spark.app.id``) from a conf mapping; other keys are
        ignored, unknown ``spark.blobha.*`` keys are logged (they are usually typos)."""
        unknown = sorted(k for k in conf if k.startswith(CONF_PREFIX) and k not in _KNOWN_KEYS)
        if unknown:
            log.warning("ignoring unknown configuration key(s): %s", ", ".join(unknown))

        def text(key: str) -> str | None:
            value = conf.get(key)
            return str(value).strip() or None if value is not None else None

        cluster = text(CONF_CLUSTER)
        if cluster is not None:
            parse_cluster(cluster)  # fail here, with the key named, not deep in a task
        timeout = _conf_float(conf, CONF_CLIENT_TIMEOUT, DEFAULT_CLIENT_TIMEOUT_SECS)
        if timeout <= 0:
            raise InvalidArgument(f"{CONF_CLIENT_TIMEOUT} must be positive")
        return cls(
            blobs=parse_blob_map(conf.get(CONF_MAP)),
            cluster=cluster,
            user=text(CONF_USER),
            min_replication=_conf_int(conf, CONF_MIN_REPLICATION, DEFAULT_MIN_REPLICATION, 0),
            max_wait_secs=_conf_float(
                conf, CONF_MAX_WAIT, DEFAULT_MAX_WAIT_SECS, allow_forever=True
            ),
            on_timeout=_check_policy(text(CONF_ON_TIMEOUT) or ON_TIMEOUT_PROCEED),
            cache_dir=text(CONF_CACHE_DIR),
            cache_soft_limit_bytes=_conf_int(
                conf, CONF_CACHE_SOFT_LIMIT, DEFAULT_SOFT_LIMIT_BYTES, 0
            ),
            cache_retention_secs=_conf_float(conf, CONF_CACHE_RETENTION, DEFAULT_RETENTION_SECS),
            update_interval_secs=_conf_float(
                conf, CONF_UPDATE_INTERVAL, DEFAULT_UPDATE_INTERVAL_SECS
            ),
            client_timeout_secs=timeout,
            app_id=text(CONF_APP_ID),
        )

    def to_conf(self) -> dict[str, str]:
        """The conf keys that reproduce these settings (unset optional values are left out)."""
        out = {
            CONF_MAP: blob_map_json(self.blobs),
            CONF_MIN_REPLICATION: str(self.min_replication),
            CONF_MAX_WAIT: _fmt_secs(self.max_wait_secs),
            CONF_ON_TIMEOUT: self.on_timeout,
            CONF_CACHE_SOFT_LIMIT: str(self.cache_soft_limit_bytes),
            CONF_CACHE_RETENTION: _fmt_secs(self.cache_retention_secs),
            CONF_UPDATE_INTERVAL: _fmt_secs(self.update_interval_secs),
            CONF_CLIENT_TIMEOUT: _fmt_secs(self.client_timeout_secs),
        }
        for key, value in (
            (CONF_CLUSTER, self.cluster),
            (CONF_USER, self.user),
            (CONF_CACHE_DIR, self.cache_dir),
            (CONF_APP_ID, self.app_id),
        ):
            if value is not None:
                out[key] = value
        return out

    def to_json(self) -> str:
        """The executor carrier: :meth:`to_conf` as one JSON object."""
        return json.dumps(self.to_conf(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> SparkBlobSettings:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"{ENV_CONF} is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise InvalidArgument(f"{ENV_CONF} must be a JSON object of spark.blobha.* keys")
        return cls.from_conf({str(k): str(v) for k, v in raw.items()})

    def replace(self, **changes: Any) -> SparkBlobSettings:
        return self._replace(**changes)

    # -- resolution ---------------------------------------------------------------------------

    def spec(self, localname: str) -> BlobSpec:
        for s in self.blobs:
            if s.localname == localname:
                return s
        mapped = ", ".join(sorted(s.localname for s in self.blobs)) or "nothing"
        raise BlobNotMapped(
            f"no blob with localname {localname!r} in {CONF_MAP} (mapped: {mapped})"
        )

    def resolved_cluster(self) -> str:
        cluster = self.cluster or os.environ.get("BLOBHA_CLUSTER", "").strip()
        if not cluster:
            raise NotConfigured(
                f"no cluster: set {CONF_CLUSTER} (or BLOBHA_CLUSTER) to HOST:PORT[,HOST:PORT...]"
            )
        return cluster

    def resolved_cache_dir(self) -> str:
        return self.cache_dir or default_cache_dir()

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(s.key for s in self.blobs)


def _fmt_secs(value: float) -> str:
    return str(int(value)) if value == int(value) else repr(value)


# --------------------------------------------------------------------------------------------
# The wait before launch
# --------------------------------------------------------------------------------------------


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
    _check_policy(on_timeout)
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
    """The usual launch: every blob is readable and replicated already. One call says so (the
    server answers only a user who may read every key): no per-key metadata and no cluster
    summary, a third of the time before the job starts. None for any other answer, which goes
    the whole way (_check_and_wait); none of its warnings could apply here, since each key
    has its minimum, hence as many masters and at least that replication factor."""
    if minimum == 0:
        return None
    try:
        now = client.wait_for_replication(keys, minimum, 0)
    except (KeyNotFound, NotAuthorized, Unavailable, DeadlineExceeded):
        # The whole way answers better: check_access names every missing or forbidden key,
        # not only the first, and its calls retry unreachable masters for the client's own
        # timeout (a zero wait gives up within its short grace), so a failover costs no job.
        return None
    return now.statuses if now.reached else None


def _check_and_wait(
    client: Client, keys: list[str], minimum: int, max_wait: float
) -> tuple[Sequence[ReplicationStatus], bool, list[str]]:
    """Check access (every refused key named), warn of what cannot be reached, then wait:
    the statuses, whether the minimum was reached, and the warnings."""
    metas = check_access(client, keys)
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


def _wait(
    client: Client, keys: list[str], minimum: int, max_wait: float, policy: str
) -> ReplicationReport:
    started = time.monotonic()
    warnings: list[str] = []
    ready = _already_replicated(client, keys, minimum)
    if ready is not None:
        statuses, reached = ready, True
    else:
        statuses, reached, warnings = _check_and_wait(client, keys, minimum, max_wait)
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


# --------------------------------------------------------------------------------------------
# Driver helper
# --------------------------------------------------------------------------------------------

_driver_lock = threading.Lock()
#: What prepare() decided in this (driver) process, keyed by application id.
_driver_settings: dict[str, SparkBlobSettings] = {}


def _spark_context(spark: SparkSession | SparkContext) -> SparkContext:
    # A SparkSession has one; a SparkContext is its own (no import of pyspark needed here).
    sc = getattr(spark, "sparkContext", None)
    return cast("SparkContext", spark if sc is None else sc)


def _conf_of(sc: SparkContext) -> dict[str, str]:
    return {
        k: v for k, v in sc.getConf().getAll() if k.startswith(CONF_PREFIX) or k == CONF_APP_ID
    }


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
    settings = SparkBlobSettings.from_conf(_conf_of(sc))
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

        settings = settings.replace(user=_job_user(lambda: sc.sparkUser() or default_user()))
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
    carrier = settings.to_json()
    # sc.environment is the environment of every Python function PySpark wraps from now on
    # (so of every worker running it); the local property also covers jobs of this thread
    # whose functions were wrapped before this call.
    sc.environment[ENV_CONF] = carrier
    sc.setLocalProperty(LOCAL_PROPERTY, carrier)
    with _driver_lock:
        _driver_settings[sc.applicationId] = settings
    _localizer.switch_application(sc.applicationId)
    return report


# --------------------------------------------------------------------------------------------
# Executors: where the configuration and the application id come from
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
        settings = SparkBlobSettings.from_conf(_conf_of(sc))
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
# Executors: the localizer
# --------------------------------------------------------------------------------------------


class _Held:
    # A slotted class (``checked`` changes), not a dataclass: see SparkOption.
    __slots__ = ("blob", "checked")

    def __init__(self, blob: CachedBlob, checked: float) -> None:
        self.blob = blob
        self.checked = checked


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

            def connect() -> Client:
                # Made (and grpc loaded) only when the cache must ask the cluster or download:
                # a task served by the node's records, as every task of a second application
                # within the update interval is, never needs it.
                from blobha.client import Client

                return Client(cluster, user=settings.user, timeout=settings.client_timeout_secs)

            cache = BlobCache(
                ident[0],
                user=settings.user,
                soft_limit_bytes=settings.cache_soft_limit_bytes,
                retention_secs=settings.cache_retention_secs,
                update_interval_secs=settings.update_interval_secs,
                connect=connect,
            )
            self._caches[ident] = cache
            return cache

    def get(self, settings: SparkBlobSettings, localname: str) -> CachedBlob:
        spec = settings.spec(localname)
        cache = self._cache(settings)
        owner = application_id(settings)
        if owner not in self._owners:
            if _task_context() is None and _active_context() is not None:
                self.switch_application(owner)
            else:
                with self._lock:
                    self._owners.add(owner)
        ident = (id(cache), spec, owner)
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


def _recheck_secs(settings: SparkBlobSettings) -> float:
    # How long this process reuses an answer without asking the cache again. The cache asks
    # the cluster at most once per update interval anyway; this only spares a job that calls
    # blob_path per record the cache's file locks and stat calls, and adds at most a tenth of
    # the interval (at most 1 s) to the time a new version takes to show.
    return min(1.0, settings.update_interval_secs / 10)


_localizer = _Localizer()
atexit.register(_localizer.close)


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


# --------------------------------------------------------------------------------------------
# The launcher: blobha spark-submit
# --------------------------------------------------------------------------------------------

_SUBMIT_USAGE = (
    "blobha spark-submit [--blob KEY[:LOCALNAME][:uncompress]]... [--blob-map JSON]"
    " [--min-replication N] [--max-wait SECS] [--on-timeout {proceed,fail}]"
    " [--cluster HOST:PORT[,...]] [--user USER] [--cache-dir DIR] [--update-interval SECS]"
    " [--spark-submit PATH] [--dry-run] -- SPARK_SUBMIT_ARGS..."
)


def _submit_parser() -> argparse.ArgumentParser:
    import argparse  # the launcher's only: not loaded in the workers

    p = argparse.ArgumentParser(
        prog="blobha spark-submit",
        usage=_SUBMIT_USAGE,
        description=(
            "Wait until the job's blobs are readable and replicated, then run spark-submit with"
            " the blob map and cluster in its configuration; the job reads blobs with"
            " blobha.spark.blob_path(LOCALNAME)."
        ),
        epilog=(
            "Settings already given as --conf spark.blobha.*=... in SPARK_SUBMIT_ARGS are read"
            " too; the options here win. Exit status: that of spark-submit, or 3 (a blob is"
            " missing), 5 (a blob is not readable), 12 (replication not reached, policy"
            " fail), 6 (an invalid setting), 2 (bad command line)."
        ),
    )
    p.add_argument(
        "--blob", action="append", default=[], metavar="KEY[:LOCALNAME][:uncompress]",
        help="a blob the job needs; repeat for more",
    )
    p.add_argument("--blob-map", metavar="JSON", help=f"a whole blob map, as {CONF_MAP}")
    p.add_argument("--min-replication", type=int, metavar="N",
                   help=f"replicas required before launch (default {DEFAULT_MIN_REPLICATION})")
    p.add_argument("--max-wait", type=float, metavar="SECS",
                   help=f"longest wait, -1 = forever (default {DEFAULT_MAX_WAIT_SECS:g})")
    p.add_argument("--on-timeout", choices=_POLICIES,
                   help="after the wait: launch anyway (default) or fail")
    p.add_argument("--cluster", metavar="HOST:PORT[,...]",
                   help="masters (default: $BLOBHA_CLUSTER)")
    p.add_argument("--user", help="the job's identity, on the driver and every executor"
                   " (default: $BLOBHA_USER, $SPARK_USER, then the OS user)")
    p.add_argument("--cache-dir", metavar="DIR",
                   help="node-local cache directory on every node (default: $BLOBHA_CACHE_DIR"
                   " there, else ~/.cache/blobha)")
    p.add_argument("--update-interval", type=float, metavar="SECS",
                   help="how soon running jobs see new versions")
    p.add_argument("--spark-submit", dest="spark_submit", metavar="PATH",
                   help="spark-submit to run (default: the pyspark package's)")
    p.add_argument("--dry-run", action="store_true",
                   help="check the blobs and print the command, without waiting or running it")
    return p


_CONF_FLAGS = ("--conf", "-c")


def _split_confs(args: Sequence[str]) -> tuple[dict[str, str], list[str], bool]:
    """Take ``spark.blobha.*`` settings out of spark-submit arguments.

    Returns (those settings, the other arguments, whether ``spark.pyspark.python`` is set).
    Only options before the application file are spark-submit's; what follows belongs to the
    application and is left alone.
    """
    blobha: dict[str, str] = {}
    rest: list[str] = []
    python_set = False
    i = 0
    takes_value = {
        "--master", "--deploy-mode", "--class", "--name", "--jars", "--packages",
        "--exclude-packages", "--repositories", "--py-files", "--files", "--archives",
        "--properties-file", "--driver-memory", "--driver-java-options",
        "--driver-library-path", "--driver-class-path", "--executor-memory", "--proxy-user",
        "--driver-cores", "--total-executor-cores", "--executor-cores", "--num-executors",
        "--queue", "--principal", "--keytab", "--kill", "--status", "--remote",
    }
    while i < len(args):
        arg = args[i]
        value: str | None = None
        if arg in _CONF_FLAGS and i + 1 < len(args):
            value, step = args[i + 1], 2
        elif arg.startswith("--conf="):
            value, step = arg[len("--conf="):], 1
        if value is not None:
            key, _, v = value.partition("=")
            if key.startswith(CONF_PREFIX):
                blobha[key] = v
            else:
                python_set = python_set or key == "spark.pyspark.python"
                rest.extend(args[i : i + step])
            i += step
            continue
        if not arg.startswith("-"):
            rest.extend(args[i:])  # the application and its own arguments
            break
        rest.append(arg)
        if arg in takes_value and i + 1 < len(args):
            rest.append(args[i + 1])
            i += 1
        i += 1
    return blobha, rest, python_set


def pyspark_submit_path() -> str:
    """The ``spark-submit`` script shipped in the installed pyspark package."""
    spec = importlib.util.find_spec("pyspark")
    if spec is None or not spec.submodule_search_locations:
        raise NotConfigured(
            "pyspark is not installed: pip install 'blobha[spark]', or pass --spark-submit PATH"
        )
    home = Path(next(iter(spec.submodule_search_locations)))
    script = home / "bin" / "spark-submit"
    if not script.exists():
        raise NotConfigured(f"no spark-submit in {home}/bin; pass --spark-submit PATH")
    return str(script)


def build_submit_command(
    settings: SparkBlobSettings, spark_submit: str, spark_args: Sequence[str]
) -> list[str]:
    """``spark-submit`` with the blob configuration in front of the user's arguments: every
    ``spark.blobha.*`` key for the driver, and the same as one JSON environment variable for
    every executor (``spark.executorEnv.BLOBHA_SPARK_CONF``)."""
    confs: list[str] = []
    for key, value in settings.to_conf().items():
        confs += ["--conf", f"{key}={value}"]
    confs += ["--conf", f"spark.executorEnv.{ENV_CONF}={settings.to_json()}"]
    return [spark_submit, *confs, *spark_args]


def _settings_from_args(
    args: argparse.Namespace, conf: Mapping[str, str]
) -> SparkBlobSettings:
    merged = dict(conf)
    blobs = list(parse_blob_map(merged.get(CONF_MAP)))
    if args.blob_map:
        blobs += parse_blob_map(args.blob_map)
    blobs += [parse_blob_arg(b) for b in args.blob]
    by_key: dict[str, BlobSpec] = {}
    for spec in blobs:
        by_key[spec.key] = spec  # later mentions of a key win: the command line over --conf
    merged[CONF_MAP] = blob_map_json(by_key.values())
    for key, value in (
        (CONF_MIN_REPLICATION, args.min_replication),
        (CONF_MAX_WAIT, args.max_wait),
        (CONF_ON_TIMEOUT, args.on_timeout),
        (CONF_CLUSTER, args.cluster),
        (CONF_USER, args.user),
        (CONF_CACHE_DIR, args.cache_dir),
        (CONF_UPDATE_INTERVAL, args.update_interval),
    ):
        if value is not None:
            merged[key] = str(value)
    settings = SparkBlobSettings.from_conf(merged)  # re-validates localname clashes too
    if not settings.blobs:
        raise InvalidArgument("no blobs given: use --blob KEY[:LOCALNAME][:uncompress]")
    from blobha.client import default_user

    # The job runs as spark-submit's user (or its --proxy-user, which Spark checks); the blob
    # store must see the same identity on the driver and on every executor, whatever OS user
    # the executors run as.
    user = settings.user or _job_user(
        lambda: os.environ.get("SPARK_USER", "").strip() or default_user())
    return settings.replace(user=user, cluster=settings.resolved_cluster())


def _job_user(otherwise: Callable[[], str]) -> str:
    """The blob-store user of a job that names none: ``BLOBHA_USER``, else the user the
    token names (the masters see that user whatever name is sent, and the client refuses a
    token of another user than the one given), else ``otherwise()`` (Spark's user)."""
    from blobha.wire.credentials import Credentials

    return (os.environ.get("BLOBHA_USER", "").strip()
            or Credentials.from_env().check().token_user() or otherwise())


def _configure_logging() -> None:
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("blobha spark-submit: %(levelname)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def _run(command: list[str], env: dict[str, str]) -> int:
    proc = subprocess.Popen(command, env=env)
    previous: Any = None
    forwarding = threading.current_thread() is threading.main_thread()
    if forwarding:
        # A scheduler stopping the launcher (SIGTERM) must stop the Spark application too;
        # Ctrl-C already reaches the child through the terminal's process group.
        def forward(signum: int, frame: FrameType | None) -> None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)

        previous = signal.signal(signal.SIGTERM, forward)
    try:
        while True:
            try:
                return proc.wait()
            except KeyboardInterrupt:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                return 130
    finally:
        if forwarding:
            signal.signal(signal.SIGTERM, previous)


def submit_main(argv: list[str]) -> int:
    """``blobha spark-submit``: wait for the blobs, then run spark-submit; returns the exit
    status (spark-submit's own once it ran).

    Usage::

        blobha spark-submit --blob KEY[:LOCALNAME][:uncompress] ... [--blob-map JSON]
            [--min-replication N] [--max-wait SECS] [--on-timeout proceed|fail]
            [--cluster HOST:PORT,...] [--user USER] [--cache-dir DIR]
            [--update-interval SECS] [--spark-submit PATH] [--dry-run]
            -- SPARK_SUBMIT_ARGS...

    Example::

        blobha spark-submit --blob geo-table:geo.bin --blob model.tgz:model:uncompress \\
            --min-replication 2 --max-wait 120 -- --master yarn enrich.py --day 2024-05-01

    ``PYSPARK_PYTHON`` defaults to this interpreter (which has blobha installed) unless the
    environment or ``--conf spark.pyspark.python`` says otherwise.
    """
    parser = _submit_parser()
    if "--" in argv:
        cut = argv.index("--")
        ours, spark_args = list(argv[:cut]), list(argv[cut + 1 :])
    else:
        ours, spark_args = list(argv), []
    try:
        args = parser.parse_args(ours)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    _configure_logging()
    try:
        conf, rest, python_set = _split_confs(spark_args)
        if not rest:
            raise InvalidArgument(
                "nothing to submit: put the spark-submit arguments after '--', e.g."
                " -- --master local[2] job.py"
            )
        settings = _settings_from_args(args, conf)
        spark_submit = args.spark_submit or pyspark_submit_path()
        command = build_submit_command(settings, spark_submit, rest)
        if args.dry_run:
            from blobha.client import Client

            with Client(settings.resolved_cluster(), user=settings.user,
                        timeout=settings.client_timeout_secs) as c:
                check_access(c, settings.keys)
            print(shlex.join(command))
            return 0
        wait_for_replication(
            settings.keys,
            settings.min_replication,
            settings.max_wait_secs,
            cluster=settings.cluster,
            user=settings.user,
            on_timeout=settings.on_timeout,
            timeout=settings.client_timeout_secs,
        )
    except BlobError as exc:
        log.error("%s", " ".join(str(exc).split()))
        return exc.exit_code
    except KeyboardInterrupt:
        log.error("interrupted")
        return 130
    env = dict(os.environ)
    if not python_set and "PYSPARK_PYTHON" not in env:
        env["PYSPARK_PYTHON"] = sys.executable
    log.info("running %s", shlex.join([*command[:1], "(blobha --conf ...)", *rest]))
    try:
        return _run(command, env)
    except OSError as exc:
        log.error("cannot run %s: %s", spark_submit, exc.strerror or exc)
        return 1


if __name__ == "__main__":
    sys.exit(submit_main(sys.argv[1:]))
