"""The standalone Spark cluster of the tests (blobha.ops.sparkstandalone), and what the masters
served, counted from their metrics."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from blobha.ops.localcluster import LocalCluster
from blobha.ops.sparkstandalone import StandaloneSpark, node_env, spark_home

__all__ = ["StandaloneSpark", "master_downloads", "node_env", "spark_home"]


def master_downloads(cluster: LocalCluster) -> int:
    """Downloads the masters served, all told, from their metrics: a node cache's fetch of a
    blob is one, and so is a master's copy of a blob it syncs; a refused read is none."""
    total = 0.0
    for m in cluster.masters:
        with urllib.request.urlopen(m.status_url + "metrics", timeout=10) as r:
            text = r.read().decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if (s.name == "grpc_server_handled_total"
                        and s.labels.get("grpc_method") == "Download"
                        and s.labels.get("grpc_code") == "OK"):
                    total += s.value
    return int(total)
