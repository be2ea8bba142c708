"""The scale group: many keys; their creation, memory, ZooKeeper load, listing, catch-up."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
from kazoo.client import KazooClient

from blobha.ops.bench.baselines import node_status, parse_mntr, parse_wchs, rss_kib
from blobha.ops.bench.context import Bench
from blobha.ops.bench.driver import zk_close, zk_open
from blobha.ops.bench.failover import failover
from blobha.ops.bench.options import CATCHUP_TIMEOUT, CHROOT, CONCURRENT_CLIENTS, SCALE_BLOB
from blobha.ops.bench.report import Log
from blobha.ops.localcluster import LocalCluster, MasterProcess
from blobha.zk.layout import BLOBSTORE, HOLDERS


def scale(bench: Bench) -> None:
    lc = bench.lc
    assert lc is not None and bench.zk_connect is not None
    target = bench.opts.scale_keys
    zk = zk_open(bench.zk_connect)
    try:
        _fill_and_measure(bench, lc, zk, target)
    finally:
        zk_close(zk)


def _keys_in_zk(zk: KazooClient) -> int:
    return len(zk.get_children(CHROOT + BLOBSTORE))


def _restart_until_counted(bench: Bench, lc: LocalCluster, zk: KazooClient,
                           m: MasterProcess) -> float:
    """SIGTERM ``m``, start it again on its disk: seconds until its replica nodes count again
    (it checked them against its disk and announced a /holders node of its new session),
    followed by a watch on that node."""
    path = f"{CHROOT}{HOLDERS}/{m.address}"
    before = zk.exists(path)
    old = before.ephemeralOwner if before is not None else None
    m.terminate()
    t0 = time.monotonic()
    lc.start_master(m)
    deadline = t0 + CATCHUP_TIMEOUT
    moved = threading.Event()
    while True:
        moved.clear()
        stat = zk.exists(path, watch=lambda event: moved.set())
        if stat is not None and stat.ephemeralOwner != old:
            break
        left = deadline - time.monotonic()
        if left <= 0 or not moved.wait(left):
            bench.log.note(f"{m.address} did not count again within {CATCHUP_TIMEOUT:.0f} s")
            break
    return time.monotonic() - t0


def _fill_and_measure(bench: Bench, lc: LocalCluster, zk: KazooClient, target: int) -> None:
    lc.wait_ready(120, expect=len(lc.masters))
    leader = lc.leader()
    followers = [m for m in lc.masters if m is not leader]
    before_keys = _keys_in_zk(zk)
    # A follower's restart before the keys: the baseline of the one after them.
    restart_before = _restart_until_counted(bench, lc, zk, followers[-1])
    lc.wait_ready(120, expect=len(lc.masters))
    rss_before = {m.index: rss_kib(m.pid) for m in lc.masters}

    # 1. Fill the cluster up to the target, concurrently.
    # Earlier phases' keys count towards the target, but a few are always created here so
    # the creation rate is measured even when they already reach a tiny smoke-test target.
    missing = max(target - before_keys, min(target, 10 * CONCURRENT_CLIENTS))
    data = os.urandom(SCALE_BLOB)
    tag = f"{bench.prefix}-k"
    last = [time.monotonic()]

    def progress(n: int) -> None:
        if time.monotonic() - last[0] >= 30:
            last[0] = time.monotonic()
            bench.log.say(f"  ... {min(n, missing):,} of {missing:,} keys")

    bench.log.say(f"scale: creating {missing:,} keys ({before_keys:,} exist) with"
                  f" {CONCURRENT_CLIENTS} clients")
    res = bench.driver(lambda c, i: c.create(f"{tag}-{i}", data)).run(
        CONCURRENT_CLIENTS, total=missing, progress=progress)
    bench.note_errors("scale creates", res)
    bench.add("scale_create_per_s", res.rate, "op/s",
              f"zk_sync_create_per_s_c{CONCURRENT_CLIENTS}",
              bench.zk_create_rate(CONCURRENT_CLIENTS))
    keys = _keys_in_zk(zk)
    bench.add("scale_keys", keys, "keys", "scale_keys_requested", target)

    # 2. Steady state: every master holds every key, so memory is measured at rest.
    bench.log.say("scale: waiting until every master holds every key")
    t0 = time.monotonic()
    for m in lc.masters:
        _wait_holds(bench.log, m, keys, CATCHUP_TIMEOUT)
    bench.log.say(f"scale: replicated everywhere {time.monotonic() - t0:.1f} s after the"
                  " last create")

    # 3. Memory.
    zk_stats = parse_mntr(lc.zk.command("mntr"))
    znodes = int(zk_stats["zk_znode_count"])
    zk_bytes_per_znode = int(zk_stats["zk_approximate_data_size"]) / max(znodes, 1)
    added = max(keys - before_keys, 1)
    rss_after = {m.index: rss_kib(m.pid) for m in lc.masters}
    worst = max(followers, key=lambda m: rss_after[m.index])
    for role, m in (("leader", leader), ("follower", worst)):
        bench.add(f"scale_{role}_rss_mib", rss_after[m.index] / 1024, "MiB",
                  f"{role}_rss_before_keys_mib", rss_before[m.index] / 1024)
        per_key = (rss_after[m.index] - rss_before[m.index]) * 1024 / added
        bench.add(f"scale_{role}_rss_per_key_b", per_key, "B",
                  "zk_data_bytes_per_znode", zk_bytes_per_znode)

    # 4. ZooKeeper load.
    wchs = lc.zk.command("wchs")
    bench.add("scale_zk_watches", parse_wchs(wchs), "watches", "zk_znodes", znodes)
    bench.add("scale_zk_znodes", znodes, "znodes", "keys", keys)

    # 5. Listing.
    with bench.client() as c:
        c.cluster_summary()
        t0 = time.perf_counter()
        listed = sum(1 for _ in c.list())
        list_secs = time.perf_counter() - t0
    t0 = time.perf_counter()
    raw = len(zk.get_children(CHROOT + BLOBSTORE))
    raw_secs = time.perf_counter() - t0
    if listed != raw:
        bench.log.note(f"the listing returned {listed:,} keys, ZooKeeper holds {raw:,}")
    bench.add("scale_list_s", list_secs, "s", "zk_get_children_s", raw_secs)

    # 6. A follower restarted on its disk, every key on it, until its copies count again.
    bench.log.say(f"scale: restarting {followers[-1].address} on its disk")
    bench.add("scale_restart_s", _restart_until_counted(bench, lc, zk, followers[-1]), "s",
              f"restart_at_{before_keys}_keys_s", restart_before)
    lc.wait_ready(120, expect=len(lc.masters))

    # 7. Failover at this size: the same three cases as the failover groups, whose figures
    # (with a few thousand keys at most) are the ones to compare with.
    for name, sig, restart in (("failover_term_at_scale_s", signal.SIGTERM, False),
                               ("failover_kill_restart_at_scale_s", signal.SIGKILL, True),
                               ("failover_kill_at_scale_s", signal.SIGKILL, False)):
        failover(bench, name, sig, restart)
    leader = lc.leader()
    followers = [m for m in lc.masters if m is not leader]
    # Every key at its factor first: a failover's last write (W=1) may still have one copy,
    # and wiping it would lose it and leave the catch-up waiting for it for ever.
    for m in lc.masters:
        _wait_holds(bench.log, m, keys, CATCHUP_TIMEOUT)

    # 8. A follower with an empty disk catches up.
    new = followers[0]
    bench.log.say(f"scale: wiping {new.address}'s data and restarting it")
    new.terminate()
    wiped = lc.store_dir(new)
    # Renamed aside, not removed: removing that many key directories can stall the disk
    # (ext4 with discard) long enough to end the other masters' ZooKeeper sessions, which
    # then reconcile every key during the catch-up measured here. It goes with the
    # cluster's directory once the bench is over.
    wiped.rename(wiped.with_name(wiped.name + ".wiped"))
    t0 = time.monotonic()
    lc.start_master(new)
    done = _wait_holds(bench.log, new, keys, CATCHUP_TIMEOUT, progress=True)
    secs = time.monotonic() - t0
    if not done:
        bench.log.note(f"the wiped follower did not catch up within {CATCHUP_TIMEOUT:.0f} s")
    zk_floor = keys / bench.zk_create_rate(1) if bench.zk_create_rate(1) else 0.0
    bench.add("scale_catchup_s", secs, "s", "zk_sync_creates_for_all_keys_s", zk_floor)


def _wait_holds(log: Log, m: MasterProcess, keys: int, timeout: float,
                progress: bool = False) -> bool:
    """Wait until master ``m`` reports at least ``keys`` blobs and no lag."""
    deadline = time.monotonic() + timeout
    last_say = time.monotonic()
    held = 0
    # From 50 ms up to a second: a wait over a few hundred keys ends within a poll of its end,
    # one over 100,000 asks once a second, as before.
    pause = 0.05
    while time.monotonic() < deadline:
        try:
            s = node_status(m.address)
            held = s.blob_count
            if s.blob_count >= keys and s.lag_blobs == 0:
                return True
        except grpc.RpcError:
            pass  # starting up, or busy: ask again
        if progress and time.monotonic() - last_say >= 30:
            last_say = time.monotonic()
            log.say(f"  ... {m.address} holds {held:,} of {keys:,} keys")
        time.sleep(pause)
        pause = min(2 * pause, 1.0)
    return False
