#!/usr/bin/env python3
"""Generate the example pipeline's two blobs and upload them to a blobha cluster.

* ``geo-table`` (local name ``geo.bin``): an IPv4 geolocation table, ``--geo-mb`` MiB
  (default 128): sorted range starts, a location id and an AS number per range, and a table
  of locations. Columnar and fixed-width, so a job memory-maps it and binary-searches it
  without parsing: every executor on a node shares one copy in the page cache.
* ``event-model.tgz`` (local name ``model``, unpacked): a small text-scoring model as a
  compressed archive: ``model/model.json`` (weights), ``model/vocab.txt`` and
  ``model/embeddings.f32`` (``--model-mb`` MiB of per-token values).

Both are deterministic for a given ``--seed``, so a test can recompute any enriched row.
Existing keys are updated (a new version), missing ones created.

Example::

    export BLOBHA_CLUSTER=127.0.0.1:6627,127.0.0.1:6628,127.0.0.1:6629 BLOBHA_USER=alice
    python deploy/examples/make_blobs.py --geo-mb 128
"""

from __future__ import annotations

import argparse
import array
import io
import json
import os
import random
import struct
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

GEO_MAGIC = b"BHGEO001"
# magic, ranges, locations, then the byte offsets of the four sections.
GEO_HEADER = struct.Struct("<8sII4Q")
GEO_HEADER_SIZE = 64
LOCATION = struct.Struct("<2s22sii")  # country code, city, latitude and longitude * 1e4
LOCATIONS = 4096
MiB = 1024 * 1024

COUNTRIES = [
    "US", "DE", "FR", "GB", "JP", "BR", "IN", "CN", "CA", "AU", "NL", "SE", "ES", "IT",
    "MX", "KR", "PL", "ZA", "NG", "AR",
]
CITY_SYLLABLES = ["ber", "lin", "ham", "port", "ville", "ton", "dorf", "burg", "sk", "ia"]

#: Words the generated events are made of; the model knows most of them.
VOCAB = [
    "refund", "great", "broken", "love", "slow", "fast", "late", "thanks", "error", "perfect",
    "cancel", "happy", "angry", "works", "fails", "crash", "smooth", "awful", "excellent",
    "delay", "support", "price", "cheap", "expensive", "quality", "return", "damaged",
    "recommend", "never", "again", "best", "worst",
]
POSITIVE = {"great", "love", "fast", "thanks", "perfect", "happy", "works", "smooth",
            "excellent", "recommend", "best", "cheap", "quality"}
NEGATIVE = {"refund", "broken", "slow", "late", "error", "cancel", "angry", "fails", "crash",
            "awful", "delay", "expensive", "return", "damaged", "never", "worst"}


def _mix(x: int) -> int:
    """splitmix64: a cheap, well-spread deterministic hash of an integer."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


@dataclass(frozen=True)
class GeoLayout:
    ranges: int
    locations: int
    starts_off: int
    locs_off: int
    asn_off: int
    names_off: int
    size: int


def geo_layout(size_bytes: int) -> GeoLayout:
    """Section sizes and offsets for a table of about ``size_bytes`` bytes."""
    names = LOCATIONS * LOCATION.size
    ranges = max(16, (size_bytes - GEO_HEADER_SIZE - names) // 12)
    starts_off = GEO_HEADER_SIZE
    locs_off = starts_off + 4 * ranges
    asn_off = locs_off + 4 * ranges
    names_off = asn_off + 4 * ranges
    return GeoLayout(ranges, LOCATIONS, starts_off, locs_off, asn_off, names_off,
                     names_off + names)


_JITTER_MULT = 2654435761  # Knuth's multiplicative hash constant


def _range_loc(i: int, seed: int) -> int:
    # Neighbouring ranges (blocks of 32) share a location, as real allocations do.
    return _mix(seed + (i >> 5) * 7919) % LOCATIONS


def _range_asn(i: int, seed: int) -> int:
    return 1000 + _mix(seed * 31 + (i >> 3)) % 60000


def geo_range(i: int, ranges: int, seed: int) -> tuple[int, int, int]:
    """(start address, location id, AS number) of range ``i``: starts strictly increase and
    range 0 starts at 0, so every address falls in exactly one range."""
    step = (1 << 32) // ranges
    half = max(1, step // 2)
    return i * step + (i * (_JITTER_MULT + seed)) % half, _range_loc(i, seed), _range_asn(i, seed)


def geo_location(loc: int, seed: int) -> tuple[str, str, float, float]:
    h = _mix(seed * 17 + loc)
    country = COUNTRIES[h % len(COUNTRIES)]
    city = "".join(CITY_SYLLABLES[(h >> (8 + 4 * k)) % len(CITY_SYLLABLES)] for k in range(3))
    city = city.capitalize() + f"-{loc}"
    lat = ((h >> 24) % 1_800_000 - 900_000) / 1e4
    lon = ((h >> 44) % 3_600_000 - 1_800_000) / 1e4
    return country, city, lat, lon


def write_geo_table(path: Path, size_bytes: int, seed: int = 1) -> GeoLayout:
    """Write the table (little-endian) to ``path``, streaming, in ~O(1) memory."""
    lay = geo_layout(size_bytes)
    chunk = 1 << 20
    with open(path, "wb") as f:
        f.write(GEO_HEADER.pack(GEO_MAGIC, lay.ranges, lay.locations, lay.starts_off,
                                lay.locs_off, lay.asn_off, lay.names_off).ljust(GEO_HEADER_SIZE,
                                                                                b"\0"))
        step = (1 << 32) // lay.ranges
        half = max(1, step // 2)
        mult = _JITTER_MULT + seed
        for column in range(3):
            for lo in range(0, lay.ranges, chunk):
                hi = min(lay.ranges, lo + chunk)
                # Same values as geo_range(), computed per block rather than per range: a
                # 128 MiB table has 11 million ranges.
                if column == 0:
                    values = array.array("I", (i * step + (i * mult) % half for i in range(lo, hi)))
                elif column == 1:
                    blocks = {b: _range_loc(b << 5, seed) for b in range(lo >> 5, (hi >> 5) + 1)}
                    values = array.array("I", (blocks[i >> 5] for i in range(lo, hi)))
                else:
                    blocks = {b: _range_asn(b << 3, seed) for b in range(lo >> 3, (hi >> 3) + 1)}
                    values = array.array("I", (blocks[i >> 3] for i in range(lo, hi)))
                if sys.byteorder != "little":
                    values.byteswap()
                f.write(values.tobytes())
        for loc in range(lay.locations):
            country, city, lat, lon = geo_location(loc, seed)
            f.write(LOCATION.pack(country.encode(), city.encode()[:22], round(lat * 1e4),
                                  round(lon * 1e4)))
    return lay


def model_weights(seed: int = 1) -> dict[str, float]:
    weights = {}
    for i, word in enumerate(VOCAB):
        sign = 1.0 if word in POSITIVE else -1.0 if word in NEGATIVE else 0.0
        weights[word] = round(sign * (0.5 + (_mix(seed + i) % 1000) / 1000), 3)
    return weights


def write_model_archive(path: Path, extra_mb: float, seed: int = 1, version: int = 1) -> dict[
    str, object
]:
    """Write ``model/{model.json,vocab.txt,embeddings.f32}`` as a .tar.gz to ``path``."""
    model: dict[str, object] = {
        "name": "event-sentiment",
        "version": version,
        "bias": -0.2,
        "weights": model_weights(seed),
        "embedding_scale": 0.05,
    }
    floats = max(1, int(extra_mb * MiB) // 4)
    rng = random.Random(seed)
    embeddings = array.array("f", (rng.uniform(-1.0, 1.0) for _ in range(floats)))
    if sys.byteorder != "little":
        embeddings.byteswap()
    members = {
        "model/model.json": json.dumps(model, indent=1).encode(),
        "model/vocab.txt": "\n".join(VOCAB).encode() + b"\n",
        "model/embeddings.f32": embeddings.tobytes(),
    }
    with tarfile.open(path, "w:gz", compresslevel=1) as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            tf.addfile(info, io.BytesIO(data))
    return model


def upload(client: object, key: str, path: Path, acl: str, replication_factor: int) -> int:
    """Create ``key`` from ``path``, or update it if it exists; returns the new version."""
    from blobha.client import Client
    from blobha.core.errors import KeyAlreadyExists

    assert isinstance(client, Client)
    try:
        meta = client.create(key, path, acl=acl, replication_factor=replication_factor)
    except KeyAlreadyExists:
        meta = client.update(key, path)
    return meta.version


def make_and_upload(
    cluster: str,
    user: str | None = None,
    *,
    geo_bytes: int = 128 * MiB,
    model_mb: float = 8.0,
    geo_key: str = "geo-table",
    model_key: str = "event-model.tgz",
    acl: str = "o::r",
    replication_factor: int = 3,
    seed: int = 1,
    model_version: int = 1,
    only: str | None = None,
    workdir: Path | None = None,
) -> dict[str, int]:
    """Generate the blobs (both, or ``only`` "geo" or "model") and upload them; returns
    ``{key: version}``."""
    from blobha.client import Client

    versions: dict[str, int] = {}
    with tempfile.TemporaryDirectory(dir=workdir) as tmp, Client(
        cluster, user=user, timeout=120
    ) as c:
        if only in (None, "geo"):
            geo = Path(tmp) / "geo.bin"
            write_geo_table(geo, geo_bytes, seed)
            versions[geo_key] = upload(c, geo_key, geo, acl, replication_factor)
        if only in (None, "model"):
            model = Path(tmp) / "event-model.tgz"
            write_model_archive(model, model_mb, seed, model_version)
            versions[model_key] = upload(c, model_key, model, acl, replication_factor)
    return versions


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", default=os.environ.get("BLOBHA_CLUSTER", ""))
    p.add_argument("--user", default=None, help="default: $BLOBHA_USER, then the OS user")
    p.add_argument("--geo-mb", type=float, default=128.0, help="geo table size (MiB)")
    p.add_argument("--model-mb", type=float, default=8.0, help="model embeddings size (MiB)")
    p.add_argument("--geo-key", default="geo-table")
    p.add_argument("--model-key", default="event-model.tgz")
    p.add_argument("--acl", default="o::r", help="ACL of both blobs (default: all may read)")
    p.add_argument("--replication-factor", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--model-version", type=int, default=1,
                   help="written into model.json, to tell updates apart")
    p.add_argument("--only", choices=("geo", "model"), help="generate and upload just one")
    args = p.parse_args(argv)
    if not args.cluster:
        p.error("no cluster: pass --cluster or set BLOBHA_CLUSTER")
    versions = make_and_upload(
        args.cluster, args.user, geo_bytes=int(args.geo_mb * MiB), model_mb=args.model_mb,
        geo_key=args.geo_key, model_key=args.model_key, acl=args.acl,
        replication_factor=args.replication_factor, seed=args.seed,
        model_version=args.model_version, only=args.only,
    )
    for key, version in versions.items():
        print(f"{key}: version {version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
