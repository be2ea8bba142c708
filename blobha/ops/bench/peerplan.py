"""The ``peer_plan_s`` group: what checking peers' pieces with SHA-256 costs. The hashing
rates of this machine (SHA-256 against XXH3, which it replaced for peers' pieces), and a
version's first plan, on which its master hashes every chunk it stores, against a verified
download of the same blob."""

from __future__ import annotations

import hashlib
import statistics
import time

import xxhash

from blobha.ops.bench.baselines import pattern
from blobha.ops.bench.bigblob import download_secs
from blobha.ops.bench.context import Bench
from blobha.ops.bench.options import MiB
from blobha.ops.bench.report import mb_per_s

#: Bytes each hashing rate is taken over (in 1 MiB chunks, as the masters and caches hash).
HASH_BYTES = 256 * MiB


def _hash_secs(data: memoryview, hasher: str) -> float:
    t0 = time.perf_counter()
    for off in range(0, len(data), MiB):
        piece = data[off:off + MiB]
        if hasher == "sha256":
            hashlib.sha256(piece).digest()
        else:
            xxhash.xxh3_128_digest(piece)
    return time.perf_counter() - t0


def peer_plan(bench: Bench) -> None:
    rounds = bench.opts.repeat
    sample = memoryview(pattern(min(HASH_BYTES, bench.opts.size_mb * MiB)))
    sha = statistics.median(_hash_secs(sample, "sha256") for _ in range(rounds))
    xxh = statistics.median(_hash_secs(sample, "xxh3") for _ in range(rounds))
    bench.add("sha256_mbps", mb_per_s(len(sample), sha), "MB/s", "xxh3_128_mbps",
              mb_per_s(len(sample), xxh))
    del sample

    size = bench.opts.size_mb * MiB
    firsts: list[float] = []
    downs: list[float] = []
    data = pattern(size)
    with bench.client() as c:
        c.cluster_summary()
        for r in range(rounds):
            key = f"{bench.prefix}-plan-{r}"
            c.create(key, data, replication_factor=3, write_quorum=1)
            bench.created.append(key)
            c.wait_for_replication([key], 3, timeout=max(600.0, size / 20e6))
            downs.append(download_secs(bench.lc, c, key, size))
            t0 = time.perf_counter()
            plan = c.peer_plan(key)
            firsts.append(time.perf_counter() - t0)
            if len(plan.chunk_sha256) != max(1, -(-size // plan.chunk_size)):
                raise RuntimeError(f"the plan of {key} carries {len(plan.chunk_sha256)}"
                                   " SHA-256 chunk digests")
            bench.log.say(f"round {r + 1}/{rounds} of {size // MiB} MiB: first plan"
                          f" {firsts[-1]:.3f} s, download {downs[-1]:.3f} s")
        # Deleted once every round is done: a download's warm-up reads every replica's file
        # and must not meet a key directory being removed.
        for r in range(rounds):
            c.delete(f"{bench.prefix}-plan-{r}")
            bench.created.remove(f"{bench.prefix}-plan-{r}")
    bench.add("peer_plan_first_s", statistics.median(firsts), "s", "download_s",
              statistics.median(downs))
