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

from typing import TYPE_CHECKING

from blobha.core.lazy import lazy_attributes

# What a task needs, loaded with the package: the conf, the blob map, the settings, blob_path.
# Names imported "as" themselves are not in __all__ but importable from here, as before.
from blobha.spark.blobmap import BlobSpec, parse_blob_arg, parse_blob_map
from blobha.spark.blobmap import blob_map_json as blob_map_json
from blobha.spark.conf import (
    CONF_APP_ID as CONF_APP_ID,
)
from blobha.spark.conf import (
    CONF_CACHE_DIR,
    CONF_CACHE_RETENTION,
    CONF_CACHE_SOFT_LIMIT,
    CONF_CLIENT_TIMEOUT,
    CONF_CLUSTER,
    CONF_MAP,
    CONF_MAX_WAIT,
    CONF_MIN_REPLICATION,
    CONF_ON_TIMEOUT,
    CONF_UPDATE_INTERVAL,
    CONF_USER,
    ENV_CONF,
    LOCAL_PROPERTY,
    OPTIONS,
)
from blobha.spark.conf import (
    CONF_PREFIX as CONF_PREFIX,
)
from blobha.spark.conf import (
    DEFAULT_CLIENT_TIMEOUT_SECS as DEFAULT_CLIENT_TIMEOUT_SECS,
)
from blobha.spark.conf import (
    DEFAULT_MAX_WAIT_SECS as DEFAULT_MAX_WAIT_SECS,
)
from blobha.spark.conf import (
    DEFAULT_MIN_REPLICATION as DEFAULT_MIN_REPLICATION,
)
from blobha.spark.conf import (
    DEFAULT_RETENTION_SECS as DEFAULT_RETENTION_SECS,
)
from blobha.spark.conf import (
    DEFAULT_SOFT_LIMIT_BYTES as DEFAULT_SOFT_LIMIT_BYTES,
)
from blobha.spark.conf import (
    DEFAULT_UPDATE_INTERVAL_SECS as DEFAULT_UPDATE_INTERVAL_SECS,
)
from blobha.spark.conf import (
    ON_TIMEOUT_FAIL as ON_TIMEOUT_FAIL,
)
from blobha.spark.conf import (
    ON_TIMEOUT_PROCEED as ON_TIMEOUT_PROCEED,
)
from blobha.spark.conf import (
    GiB as GiB,
)
from blobha.spark.conf import (
    SparkOption as SparkOption,
)
from blobha.spark.executor import (
    application_id as application_id,
)
from blobha.spark.executor import (
    blob_info,
    blob_path,
    blob_version,
)
from blobha.spark.executor import (
    current_settings as current_settings,
)
from blobha.spark.settings import BlobNotMapped, NotConfigured, SparkBlobSettings
from blobha.spark.settings import default_cache_dir as default_cache_dir

if TYPE_CHECKING:
    from blobha.spark.driver import (
        BlobsNotAccessible,
        ReplicationReport,
        ReplicationTimeout,
        prepare,
        wait_for_replication,
    )
    from blobha.spark.driver import (
        check_access as check_access,
    )
    from blobha.spark.submit import build_submit_command, submit_main
    from blobha.spark.submit import pyspark_submit_path as pyspark_submit_path

# The driver's and the launcher's names, imported on first access: a Python worker imports
# this package for blob_path and never waits for replication or runs spark-submit.
_EXPORTS = {
    "BlobsNotAccessible": "blobha.spark.driver",
    "ReplicationReport": "blobha.spark.driver",
    "ReplicationTimeout": "blobha.spark.driver",
    "check_access": "blobha.spark.driver",
    "prepare": "blobha.spark.driver",
    "wait_for_replication": "blobha.spark.driver",
    "build_submit_command": "blobha.spark.submit",
    "pyspark_submit_path": "blobha.spark.submit",
    "submit_main": "blobha.spark.submit",
}


__getattr__, __dir__ = lazy_attributes("blobha.spark", _EXPORTS, globals())


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
