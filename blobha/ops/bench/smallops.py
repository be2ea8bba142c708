"""The small_ops_per_s group: 4 KiB creates and reads per second, and one client's floor."""

from __future__ import annotations

import os
import threading

from blobha.client import Client
from blobha.ops.bench.baselines import fenced_commit_ms, small_install_ms
from blobha.ops.bench.context import Bench
from blobha.ops.bench.driver import timed_ms, zk_get_rate
from blobha.ops.bench.options import CONCURRENT_CLIENTS, FLOOR_ROUNDS, SMALL_BLOB


def small_ops(bench: Bench) -> None:
    secs = bench.opts.small_ops_seconds
    data = os.urandom(SMALL_BLOB)
    created: list[str] = []
    created_lock = threading.Lock()
    for threads in (1, CONCURRENT_CLIENTS):
        tag = f"{bench.prefix}-s{threads}"

        def create(c: Client, i: int, tag: str = tag) -> None:
            key = f"{tag}-{i}"
            c.create(key, data)
            with created_lock:
                created.append(key)

        bench.log.say(f"4 KiB creates with {threads} client(s) for {secs:g} s")
        res = bench.driver(create).run(threads, seconds=secs)
        bench.note_errors("small creates", res)
        bench.add(f"small_ops_per_s_create_c{threads}", res.rate, "op/s",
                  f"zk_sync_create_per_s_c{threads}", bench.zk_create_rate(threads))
        if threads == 1:
            create_floor(bench, min(secs, 3.0))
    if bench.lc is None:
        bench.created.extend(created)
    keys = list(created)
    for threads in (1, CONCURRENT_CLIENTS):

        def read(c: Client, i: int) -> None:
            c.read(keys[i % len(keys)])

        bench.log.say(f"4 KiB reads with {threads} client(s) for {secs:g} s")
        res = bench.driver(read).run(threads, seconds=secs)
        bench.note_errors("small reads", res)
        zk_gets = 0.0
        if bench.zk_connect is not None:
            zk_gets = zk_get_rate(bench.zk_connect, threads, min(secs, 10.0)).rate
        bench.add(f"small_ops_per_s_read_c{threads}", res.rate, "op/s",
                  f"zk_sync_get_per_s_c{threads}", zk_gets)


def create_floor(bench: Bench, seconds: float) -> None:
    """What one client's creates could reach at most on this design: one create waits for
    a fenced ZooKeeper transaction, a durable install and a gRPC round trip, one after
    the other, whatever else it costs. Each part is measured alone, here and now."""
    if bench.zk_connect is None:
        bench.log.note("small_ops_per_s_create_c1_floor skipped: it needs --zookeeper")
        return
    commit = fenced_commit_ms(bench.zk_connect, FLOOR_ROUNDS, seconds)
    install = small_install_ms(bench.disk_dir, FLOOR_ROUNDS, seconds)
    with bench.client() as c:
        summary = c.cluster_summary()
        target = summary.leader or summary.masters[0].address
        rpc = timed_ms(lambda i: c.node_status(target), FLOOR_ROUNDS, seconds)
    floor = commit + install + rpc
    bench.log.say(f"one create's floor: fenced ZooKeeper transaction {commit:.2f} ms, durable"
                  f" install {install:.2f} ms, gRPC round trip {rpc:.2f} ms")
    bench.add("small_ops_per_s_create_c1_floor", 1000 / floor, "op/s",
              "zk_sync_create_per_s_c1", bench.zk_create_rate(1))
