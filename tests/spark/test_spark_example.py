"""The example pipeline of deploy/examples, end to end: generate and upload the blobs, launch
the job with ``blobha spark-submit`` (a real spark-submit), check its output row by row
against the generator, and check the node cache downloaded each blob once.

Data sizes are scaled down for CI; ``BLOBHA_SPARK_EXAMPLE_GEO_MB`` (comma-separated MiB,
default ``5``) runs it at other sizes, e.g. ``128`` for the full example.
"""

from __future__ import annotations

import bisect
import importlib.util
import json
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from blobha_spark_helpers import EXAMPLES, require_spark, spark_env
from support.clusters import running_cluster

from blobha import spark as blobspark
from blobha.cache import BlobCache
from blobha.client import Client
from blobha.ops.localcluster import LocalCluster

require_spark()

pytestmark = pytest.mark.spark

MiB = 1024 * 1024
SIZES_MB = [float(x) for x in os.environ.get("BLOBHA_SPARK_EXAMPLE_GEO_MB", "5").split(",")]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


make_blobs = _load("make_blobs")
enrich_events = _load("enrich_events")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with running_cluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


class _Starts:
    """The geo table's range starts, as the generator defines them (no file involved)."""

    def __init__(self, ranges: int, seed: int) -> None:
        self.ranges, self.seed = ranges, seed

    def __len__(self) -> int:
        return self.ranges

    def __getitem__(self, i: int) -> int:
        return int(make_blobs.geo_range(i, self.ranges, self.seed)[0])


def _expected(event_id: int, geo_bytes: int, seed: int) -> dict[str, Any]:
    """An enriched event computed from the generators' definitions alone."""
    event = enrich_events.make_event(event_id)
    layout = make_blobs.geo_layout(geo_bytes)
    i = bisect.bisect_right(_Starts(layout.ranges, seed), event["ip"]) - 1
    _, loc, asn = make_blobs.geo_range(i, layout.ranges, seed)
    country, city, lat, lon = make_blobs.geo_location(loc, seed)
    weights = make_blobs.model_weights(seed)
    z = -0.2 + sum(weights.get(w, 0.0) for w in event["text"].split())
    return {
        "ip": enrich_events.ip_text(event["ip"]),
        "country": country,
        "city": city[:22],
        "lat": round(lat, 4),
        "lon": round(lon, 4),
        "asn": asn,
        "z_without_embeddings": z,
        "text": event["text"],
    }


@pytest.mark.parametrize("geo_mb", SIZES_MB, ids=[f"geo{m:g}MiB" for m in SIZES_MB])
def test_example_pipeline(
    cluster: LocalCluster,
    tmp_path: Path,
    geo_mb: float,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="blobha.spark")
    seed = 7
    geo_bytes = int(geo_mb * MiB)
    suffix = f"{geo_mb:g}".replace(".", "_")
    geo_key, model_key = f"ex-geo-{suffix}", f"ex-model-{suffix}.tgz"
    versions = make_blobs.make_and_upload(
        cluster.cluster, "alice", geo_bytes=geo_bytes, model_mb=1, geo_key=geo_key,
        model_key=model_key, seed=seed, workdir=tmp_path,
    )
    assert versions == {geo_key: 1, model_key: 1}

    out = tmp_path / "out"
    cache_dir = tmp_path / "node-cache"
    events = 20_000
    with pytest.MonkeyPatch.context() as mp:
        for k, v in spark_env(tmp_path / "spark-work").items():
            mp.setenv(k, v)
        status = blobspark.submit_main([
            "--blob", f"{geo_key}:geo.bin",
            "--blob", f"{model_key}:model:uncompress",
            "--min-replication", "3", "--max-wait", "60",
            "--cluster", cluster.cluster, "--user", "bob", "--cache-dir", str(cache_dir),
            "--",
            "--master", "local[2]",
            "--conf", "spark.ui.enabled=false",
            "--conf", "spark.ui.showConsoleProgress=false",
            "--driver-memory", "768m",
            str(EXAMPLES / "enrich_events.py"),
            "--events", str(events), "--partitions", "4", "--out", str(out), "--sample", "50",
        ])
    printed = capfd.readouterr()
    assert status == 0, printed.err[-5000:]
    assert "min replication 3 reached for 2 blob(s)" in caplog.text

    summary = json.loads((out / "summary.json").read_text())
    assert summary["events"] == events
    assert sum(summary["by_country"].values()) == events
    assert set(summary["by_country"]) <= set(make_blobs.COUNTRIES)
    assert summary["blob_versions"] == [{"geo_version": 1, "model_version": 1, "rows": events}]
    assert list((out / "events").glob("*.parquet")), "the Parquet output is missing"

    # Every sampled row matches the generators, independently of the job's own code.
    embeddings = _model_embeddings(seed)
    assert len(summary["sample"]) == 50
    for row in summary["sample"]:
        want = _expected(row["event_id"], geo_bytes, seed)
        for field in ("ip", "country", "city", "lat", "lon", "asn", "text"):
            assert row[field] == want[field], (field, row, want)
        z = want["z_without_embeddings"] + 0.05 * sum(embeddings[w] for w in row["text"].split())
        assert math.isclose(row["score"], 1 / (1 + math.exp(-z)), abs_tol=2e-6), row

    # One download per blob for the node, whatever the number of tasks and workers.
    with BlobCache(cache_dir, cluster.cluster, user="bob") as cache:
        stats = cache.stats()
        assert stats.downloads == 2
        assert {e.key for e in cache.entries()} == {geo_key, model_key}
    with Client(cluster.cluster, user="bob") as c:
        assert c.get_meta(geo_key).size == make_blobs.geo_layout(geo_bytes).size


def _model_embeddings(seed: int) -> dict[str, float]:
    import array
    import random

    rng = random.Random(seed)
    values = array.array("f", (rng.uniform(-1.0, 1.0) for _ in range(len(make_blobs.VOCAB))))
    return dict(zip(make_blobs.VOCAB, values, strict=True))


def test_job_and_generator_agree_on_the_vocabulary() -> None:
    # The job carries its own copy so that it needs nothing but blobha on executors.
    assert enrich_events.VOCAB == make_blobs.VOCAB
