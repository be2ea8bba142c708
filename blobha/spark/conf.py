"""Spark conf keys of blobha (``spark.blobha.*``), their defaults, and parsing their values."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

from blobha.core import settings
from blobha.core.errors import InvalidArgument

if TYPE_CHECKING:
    from pyspark import SparkContext

__all__ = [
    "CONF_APP_ID",
    "CONF_CACHE_DIR",
    "CONF_CACHE_RETENTION",
    "CONF_CACHE_SOFT_LIMIT",
    "CONF_CLIENT_TIMEOUT",
    "CONF_CLUSTER",
    "CONF_CODE_MAP",
    "CONF_JOB_TOKEN",
    "CONF_MAP",
    "CONF_MAX_WAIT",
    "CONF_MIN_REPLICATION",
    "CONF_MIN_VERSIONS",
    "CONF_ON_TIMEOUT",
    "CONF_PREFIX",
    "CONF_UPDATE_INTERVAL",
    "CONF_USER",
    "DEFAULT_CLIENT_TIMEOUT_SECS",
    "DEFAULT_MAX_WAIT_SECS",
    "DEFAULT_MIN_REPLICATION",
    "DEFAULT_RETENTION_SECS",
    "DEFAULT_SOFT_LIMIT_BYTES",
    "DEFAULT_UPDATE_INTERVAL_SECS",
    "ENV_CA_PEM",
    "ENV_CONF",
    "ENV_JOB_TOKEN",
    "ENV_PYTHON",
    "KNOWN_KEYS",
    "LOCAL_PROPERTY",
    "ON_TIMEOUT_FAIL",
    "ON_TIMEOUT_PROCEED",
    "OPTIONS",
    "POLICIES",
    "GiB",
    "SparkOption",
    "check_policy",
    "conf_float",
    "conf_int",
    "conf_of",
    "conf_size",
    "fmt_secs",
]

GiB = 1024**3

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
CONF_CODE_MAP = "spark.blobha.code.map"
#: The versions the launcher (or prepare) saw before launch, which every read of the job
#: reaches at least: a JSON object of key -> [version, creation time of the key].
CONF_MIN_VERSIONS = "spark.blobha.min.versions"
#: The job token, for the driver: Spark redacts a conf whose name matches
#: ``(?i)secret|password|token`` from its UI, logs and event log.
CONF_JOB_TOKEN = "spark.blobha.job.token"

#: Environment variables set on executors (``spark.executorEnv.*``), apart from the JSON
#: carrier because the token must never be in it (it would show in the Spark UI): the job
#: token (its name matches Spark's redaction pattern), the cluster's CA certificate (PEM
#: content; the worker hook writes it to a file on the node) and the interpreter the job asked
#: for, which the hook runs.
ENV_JOB_TOKEN = "BLOBHA_JOB_TOKEN"
ENV_CA_PEM = "BLOBHA_CA_PEM"
ENV_PYTHON = "BLOBHA_PYSPARK_PYTHON"

#: Environment variable carrying the configuration to executors (a JSON object of conf keys).
ENV_CONF = "BLOBHA_SPARK_CONF"
#: Task local property carrying the same JSON for jobs of the thread that called prepare().
LOCAL_PROPERTY = "blobha.spark.conf"

ON_TIMEOUT_PROCEED = "proceed"
ON_TIMEOUT_FAIL = "fail"
POLICIES = (ON_TIMEOUT_PROCEED, ON_TIMEOUT_FAIL)

DEFAULT_MIN_REPLICATION = 1
DEFAULT_MAX_WAIT_SECS = 60.0
DEFAULT_UPDATE_INTERVAL_SECS = 30.0
DEFAULT_SOFT_LIMIT_BYTES = 10 * GiB
DEFAULT_RETENTION_SECS = 600.0
DEFAULT_CLIENT_TIMEOUT_SECS = 60.0


# The records of blobha.spark are named tuples, not dataclasses: it loads in every Python
# worker of a job that reads a blob, and a frozen dataclass costs several times a named tuple
# to create (it compiles six methods).
class SparkOption(NamedTuple):
    key: str
    default: str
    doc: str


#: Every ``spark.blobha.*`` key, its default and meaning (docs/configuration.md is made from this).
OPTIONS: tuple[SparkOption, ...] = (
    SparkOption(
        CONF_MAP,
        "(required)",
        'JSON blob map, Storm\'s shape: {"key": {"localname": "name", "uncompress": false}}.'
        " localname defaults to the key, uncompress to false.",
    ),
    SparkOption(CONF_CLUSTER, "$BLOBHA_CLUSTER", "Masters, HOST:PORT[,HOST:PORT...]."),
    SparkOption(
        CONF_CODE_MAP,
        "(set by blobha spark-submit)",
        "JSON list of [key, kind, name, version, sha256]: the job's --py-files, --files and"
        " --archives as blobs, laid out in each executor's working directory by the"
        " blobha-python hook only at that version and with that SHA-256.",
    ),
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
#: The job token and the versions seen are no options: the launcher (or prepare) sets them.
KNOWN_KEYS = frozenset(o.key for o in OPTIONS) | {CONF_JOB_TOKEN, CONF_MIN_VERSIONS}


def conf_int(conf: Mapping[str, str], key: str, default: int, minimum: int) -> int:
    text = conf.get(key)
    if text is None or str(text).strip() == "":
        return default
    try:
        value = settings.whole(str(text))
    except settings.SettingError as e:
        raise InvalidArgument(f"{key}={text!r}: {e}") from None
    if value < minimum:
        raise InvalidArgument(f"{key}={text!r}: must be at least {minimum}")
    return value


def conf_size(conf: Mapping[str, str], key: str, default: int) -> int:
    """A non-negative size: bytes, or Spark's size strings (``512m``, ``10g``)."""
    text = conf.get(key)
    if text is None or str(text).strip() == "":
        return default
    try:
        value = settings.size(str(text))
    except settings.SettingError as e:
        raise InvalidArgument(f"{key}={text!r}: {e}") from None
    if value < 0:
        raise InvalidArgument(f"{key}={text!r}: must be at least 0")
    return value


def conf_float(
    conf: Mapping[str, str], key: str, default: float, *, allow_forever: bool = False
) -> float:
    """A duration in seconds: a number of seconds, or Spark's time strings (``500ms``,
    ``5min``, ``2h``); with ``allow_forever``, -1 means no limit."""
    text = conf.get(key)
    if text is None or str(text).strip() == "":
        return default
    try:
        value = settings.seconds(settings.duration(str(text)), forever=allow_forever)
    except settings.SettingError as e:
        raise InvalidArgument(f"{key}={text!r}: {e}") from None
    return -1.0 if value < 0 else value


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise InvalidArgument(
            f"{CONF_ON_TIMEOUT}={policy!r}: expected {' or '.join(repr(p) for p in POLICIES)}"
        )
    return policy


def fmt_secs(value: float) -> str:
    return str(int(value)) if value == int(value) else repr(value)



def conf_of(sc: SparkContext) -> dict[str, str]:
    """The ``spark.blobha.*`` settings (and ``spark.app.id``) of a running application."""
    return {
        k: v for k, v in sc.getConf().getAll() if k.startswith(CONF_PREFIX) or k == CONF_APP_ID
    }

