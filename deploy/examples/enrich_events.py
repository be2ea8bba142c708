#!/usr/bin/env python3
"""Example PySpark job: enrich generated events with a geo table and a text model, both
served to every executor by blobha's node-local cache.

Blobs it needs (local names; see make_blobs.py for the formats):

* ``geo.bin``: an IPv4 geolocation table, memory-mapped and binary-searched in place;
* ``model``: the unpacked ``event-model.tgz`` archive (``model/model.json`` and
  ``model/embeddings.f32``).

Launch it with ``blobha spark-submit`` (which waits for replication and hands the blob map to
every executor)::

    blobha spark-submit --blob geo-table:geo.bin --blob event-model.tgz:model:uncompress \\
        --min-replication 3 --max-wait 60 \\
        -- --master 'local-cluster[2,1,1024]' deploy/examples/enrich_events.py \\
           --events 1000000 --out /tmp/enriched

Run with plain ``spark-submit``, it calls ``blobha.spark.prepare`` itself with the keys given
by ``--geo-key``/``--model-key`` (cluster from ``$BLOBHA_CLUSTER``): the same wait, in code.

Output: ``OUT/events`` (Parquet: one row per event with country, city, coordinates, AS
number, sentiment score and the blob versions used) and ``OUT/summary.json``.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import mmap
import os
import struct
import sys
import time
from collections.abc import Iterator
from typing import Any

from blobha import spark as blobspark

GEO_MAGIC = b"BHGEO001"
# Format strings, not struct.Struct objects: Spark pickles this module's globals into every
# task, and Struct objects cannot be pickled.
GEO_HEADER = "<8sII4Q"
LOCATION = "<2s22sii"
LOCATION_SIZE = struct.calcsize(LOCATION)

#: Words events are made of (the same list as make_blobs.VOCAB).
VOCAB = [
    "refund", "great", "broken", "love", "slow", "fast", "late", "thanks", "error", "perfect",
    "cancel", "happy", "angry", "works", "fails", "crash", "smooth", "awful", "excellent",
    "delay", "support", "price", "cheap", "expensive", "quality", "return", "damaged",
    "recommend", "never", "again", "best", "worst",
]
EPOCH = 1_714_521_600  # 2024-05-01T00:00:00Z


def _mix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def make_event(event_id: int) -> dict[str, Any]:
    """A deterministic synthetic event: an IPv4 address, a timestamp and a few words."""
    h = _mix(event_id)
    words = [VOCAB[(h >> (32 + 5 * k)) % len(VOCAB)] for k in range(4)]
    return {
        "event_id": event_id,
        "ts": EPOCH + event_id % 86_400,
        "ip": h & 0xFFFFFFFF,
        "user": f"u{(h >> 52) % 100_000}",
        "text": " ".join(words),
    }


class GeoTable:
    """The geo table of make_blobs.py, memory-mapped: opening it costs nothing, and every
    process on the node shares its pages."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        magic, self.ranges, self.locations, starts, locs, asn, names = struct.unpack_from(
            GEO_HEADER, self._map, 0
        )
        if magic != GEO_MAGIC:
            raise ValueError(f"{path} is not a geo table (magic {magic!r})")
        self._locs, self._asn, self._names = locs, asn, names
        view = memoryview(self._map)[starts : starts + 4 * self.ranges]
        # bisect runs in C over a typed view; only a big-endian host needs the slow path.
        self._starts: Any = view.cast("I") if sys.byteorder == "little" else _BigEndianView(view)

    def lookup(self, ip: int) -> tuple[str, str, float, float, int]:
        """(country, city, latitude, longitude, AS number) of an IPv4 address."""
        i = bisect.bisect_right(self._starts, ip) - 1
        (loc,) = struct.unpack_from("<I", self._map, self._locs + 4 * i)
        (asn,) = struct.unpack_from("<I", self._map, self._asn + 4 * i)
        cc, city, lat, lon = struct.unpack_from(
            LOCATION, self._map, self._names + LOCATION_SIZE * loc
        )
        return (cc.decode(), city.rstrip(b"\0").decode(), lat / 1e4, lon / 1e4, asn)


class _BigEndianView:
    def __init__(self, view: memoryview) -> None:
        self._view = view

    def __len__(self) -> int:
        return len(self._view) // 4

    def __getitem__(self, i: int) -> int:
        return int(struct.unpack_from("<I", self._view, 4 * i)[0])


class Model:
    """The sentiment model unpacked from event-model.tgz."""

    def __init__(self, directory: str) -> None:
        with open(os.path.join(directory, "model", "model.json")) as f:
            spec = json.load(f)
        self.version = int(spec["version"])
        self.bias = float(spec["bias"])
        self.weights: dict[str, float] = spec["weights"]
        self.scale = float(spec["embedding_scale"])
        with open(os.path.join(directory, "model", "embeddings.f32"), "rb") as f:
            head = f.read(4 * len(VOCAB))
        self.embedding = dict(zip(VOCAB, struct.unpack(f"<{len(VOCAB)}f", head), strict=True))

    def score(self, text: str) -> float:
        z = self.bias + sum(
            self.weights.get(w, 0.0) + self.scale * self.embedding.get(w, 0.0)
            for w in text.split()
        )
        return 1.0 / (1.0 + math.exp(-z))


def ip_text(ip: int) -> str:
    return ".".join(str((ip >> s) & 0xFF) for s in (24, 16, 8, 0))


def enrich(event: dict[str, Any], geo: GeoTable, model: Model) -> dict[str, Any]:
    country, city, lat, lon, asn = geo.lookup(event["ip"])
    score = model.score(event["text"])
    return {
        **event,
        "ip": ip_text(event["ip"]),
        "country": country,
        "city": city,
        "lat": lat,
        "lon": lon,
        "asn": asn,
        "score": round(score, 6),
        "label": "positive" if score >= 0.5 else "negative",
    }


_loaded: dict[str, Any] = {}


def _blobs() -> tuple[GeoTable, Model, int, int]:
    """This process's geo table and model, reopened when blob_path shows a new version."""
    geo_info = blobspark.blob_info("geo.bin")
    model_info = blobspark.blob_info("model")
    if _loaded.get("geo_path") != str(geo_info.path):
        _loaded["geo"] = GeoTable(str(geo_info.path))
        _loaded["geo_path"] = str(geo_info.path)
    if _loaded.get("model_path") != str(model_info.path):
        _loaded["model"] = Model(str(model_info.path))
        _loaded["model_path"] = str(model_info.path)
    return _loaded["geo"], _loaded["model"], geo_info.version, model_info.version


def enrich_partition(index: int, ids: Iterator[int]) -> Iterator[tuple[Any, ...]]:
    geo, model, geo_version, model_version = _blobs()
    host = f"{os.uname().nodename}:{os.getpid()}"
    for event_id in ids:
        row = enrich(make_event(event_id), geo, model)
        yield (
            row["event_id"], row["ts"], row["ip"], row["user"], row["text"], row["country"],
            row["city"], row["lat"], row["lon"], row["asn"], row["score"], row["label"],
            geo_version, model_version, host,
        )


COLUMNS = (
    "event_id long, ts long, ip string, user string, text string, country string,"
    " city string, lat double, lon double, asn long, score double, label string,"
    " geo_version long, model_version long, worker string"
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Enrich generated events with blobha blobs.")
    p.add_argument("--events", type=int, default=1_000_000)
    p.add_argument("--partitions", type=int, default=8)
    p.add_argument("--out", required=True)
    p.add_argument("--sample", type=int, default=20, help="rows copied into summary.json")
    p.add_argument("--geo-key", default="geo-table", help="used without blobha spark-submit")
    p.add_argument("--model-key", default="event-model.tgz")
    args = p.parse_args(argv)

    from pyspark.sql import SparkSession

    spark = SparkSession.builder.appName("blobha-enrich-events").getOrCreate()
    sc = spark.sparkContext
    sc.setLogLevel("WARN")
    started = time.time()
    if not sc.getConf().get(blobspark.CONF_MAP):
        # Not launched by 'blobha spark-submit': do its wait here, in code.
        blobspark.prepare(spark, {
            args.geo_key: {"localname": "geo.bin"},
            args.model_key: {"localname": "model", "uncompress": True},
        })
    ids = sc.parallelize(range(args.events), args.partitions)
    df = spark.createDataFrame(ids.mapPartitionsWithIndex(enrich_partition), COLUMNS).persist()
    df.write.mode("overwrite").parquet(os.path.join(args.out, "events"))

    total = df.count()
    by_country = {r["country"]: r["count"] for r in df.groupBy("country").count().collect()}
    versions = sorted(
        (r["geo_version"], r["model_version"], r["count"])
        for r in df.groupBy("geo_version", "model_version").count().collect()
    )
    workers = sorted(r["worker"] for r in df.select("worker").distinct().collect())
    sample = [r.asDict() for r in df.where(df.event_id < args.sample).orderBy("event_id").collect()]
    positive = df.where(df.label == "positive").count()
    summary = {
        "application_id": sc.applicationId,
        "events": total,
        "positive": positive,
        "by_country": dict(sorted(by_country.items())),
        "blob_versions": [
            {"geo_version": g, "model_version": m, "rows": n} for g, m, n in versions
        ],
        "workers": workers,
        "seconds": round(time.time() - started, 3),
        "sample": sample,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(
        f"enriched {total} events in {summary['seconds']} s on {len(workers)} worker(s);"
        f" blob versions {summary['blob_versions']}; summary in {args.out}/summary.json"
    )
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
