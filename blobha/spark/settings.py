"""SparkBlobSettings: everything blobha.spark reads from the conf, and where it resolves."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

from blobha.cache import default_cache_dir as _cache_default_dir
from blobha.core.addresses import parse_cluster
from blobha.core.errors import InvalidArgument
from blobha.core.lazy import LazyLogger
from blobha.spark.blobmap import BlobSpec, blob_map_json, parse_blob_map
from blobha.spark.codemap import CodeSpec, code_map_json, parse_code_map
from blobha.spark.conf import (
    CONF_APP_ID,
    CONF_CACHE_DIR,
    CONF_CACHE_RETENTION,
    CONF_CACHE_SOFT_LIMIT,
    CONF_CLIENT_TIMEOUT,
    CONF_CLUSTER,
    CONF_CODE_MAP,
    CONF_MAP,
    CONF_MAX_WAIT,
    CONF_MIN_REPLICATION,
    CONF_MIN_VERSIONS,
    CONF_ON_TIMEOUT,
    CONF_PREFIX,
    CONF_UPDATE_INTERVAL,
    CONF_USER,
    DEFAULT_CLIENT_TIMEOUT_SECS,
    DEFAULT_MAX_WAIT_SECS,
    DEFAULT_MIN_REPLICATION,
    DEFAULT_RETENTION_SECS,
    DEFAULT_SOFT_LIMIT_BYTES,
    DEFAULT_UPDATE_INTERVAL_SECS,
    ENV_CONF,
    KNOWN_KEYS,
    ON_TIMEOUT_PROCEED,
    check_policy,
    conf_float,
    conf_int,
    conf_size,
    fmt_secs,
)
from blobha.spark.minimums import SeenVersion, min_versions_json, parse_min_versions

__all__ = ["BlobNotMapped", "NotConfigured", "SparkBlobSettings", "default_cache_dir"]

log = LazyLogger("blobha.spark")


class NotConfigured(InvalidArgument):
    """No blob map reached this process (see the module docstring for the carriers)."""


class BlobNotMapped(InvalidArgument):
    """:func:`blob_path` was asked for a local name that is not in the blob map."""


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
    #: The job's own code as blobs (``blobha spark-submit`` fills it; see
    #: :mod:`blobha.spark.codemap`).
    code: tuple[CodeSpec, ...] = ()
    #: What the launcher or prepare() saw of the job's blobs before launch: every read of
    #: the job returns that version or a newer one (see :mod:`blobha.spark.minimums`).
    min_versions: tuple[SeenVersion, ...] = ()

    @classmethod
    def from_conf(cls, conf: Mapping[str, str]) -> SparkBlobSettings:
        """Read ``spark.blobha.*`` (and ``spark.app.id``) from a conf mapping; other keys are
        ignored, unknown ``spark.blobha.*`` keys are logged (they are usually typos)."""
        unknown = sorted(k for k in conf if k.startswith(CONF_PREFIX) and k not in KNOWN_KEYS)
        if unknown:
            log.warning("ignoring unknown configuration key(s): %s", ", ".join(unknown))

        def text(key: str) -> str | None:
            value = conf.get(key)
            return str(value).strip() or None if value is not None else None

        cluster = text(CONF_CLUSTER)
        if cluster is not None:
            parse_cluster(cluster)  # fail here, with the key named, not deep in a task
        timeout = conf_float(conf, CONF_CLIENT_TIMEOUT, DEFAULT_CLIENT_TIMEOUT_SECS)
        if timeout <= 0:
            raise InvalidArgument(f"{CONF_CLIENT_TIMEOUT} must be positive")
        return cls(
            blobs=parse_blob_map(conf.get(CONF_MAP)),
            cluster=cluster,
            user=text(CONF_USER),
            min_replication=conf_int(conf, CONF_MIN_REPLICATION, DEFAULT_MIN_REPLICATION, 0),
            max_wait_secs=conf_float(
                conf, CONF_MAX_WAIT, DEFAULT_MAX_WAIT_SECS, allow_forever=True
            ),
            on_timeout=check_policy(text(CONF_ON_TIMEOUT) or ON_TIMEOUT_PROCEED),
            cache_dir=text(CONF_CACHE_DIR),
            cache_soft_limit_bytes=conf_size(
                conf, CONF_CACHE_SOFT_LIMIT, DEFAULT_SOFT_LIMIT_BYTES
            ),
            cache_retention_secs=conf_float(conf, CONF_CACHE_RETENTION, DEFAULT_RETENTION_SECS),
            update_interval_secs=conf_float(
                conf, CONF_UPDATE_INTERVAL, DEFAULT_UPDATE_INTERVAL_SECS
            ),
            client_timeout_secs=timeout,
            app_id=text(CONF_APP_ID),
            code=parse_code_map(text(CONF_CODE_MAP)),
            min_versions=parse_min_versions(text(CONF_MIN_VERSIONS)),
        )

    def to_conf(self) -> dict[str, str]:
        """The conf keys that reproduce these settings (unset optional values are left out)."""
        out = {
            CONF_MAP: blob_map_json(self.blobs),
            CONF_MIN_REPLICATION: str(self.min_replication),
            CONF_MAX_WAIT: fmt_secs(self.max_wait_secs),
            CONF_ON_TIMEOUT: self.on_timeout,
            CONF_CACHE_SOFT_LIMIT: str(self.cache_soft_limit_bytes),
            CONF_CACHE_RETENTION: fmt_secs(self.cache_retention_secs),
            CONF_UPDATE_INTERVAL: fmt_secs(self.update_interval_secs),
            CONF_CLIENT_TIMEOUT: fmt_secs(self.client_timeout_secs),
        }
        for key, value in (
            (CONF_CLUSTER, self.cluster),
            (CONF_USER, self.user),
            (CONF_CACHE_DIR, self.cache_dir),
            (CONF_APP_ID, self.app_id),
        ):
            if value is not None:
                out[key] = value
        if self.code:
            out[CONF_CODE_MAP] = code_map_json(self.code)
        if self.min_versions:
            out[CONF_MIN_VERSIONS] = min_versions_json(self.min_versions)
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

    def min_version(self, key: str) -> SeenVersion | None:
        """The version of ``key`` the job reads at least, if the driver saw one."""
        for m in self.min_versions:
            if m.key == key:
                return m
        return None

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
        """The side files' keys (the blob map)."""
        return tuple(s.key for s in self.blobs)

    @property
    def all_keys(self) -> tuple[str, ...]:
        """Every key the job reads: the side files', then its code's (each once)."""
        return tuple(dict.fromkeys([*self.keys, *(c.key for c in self.code)]))
