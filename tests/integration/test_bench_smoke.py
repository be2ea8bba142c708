"""``blobha bench --local --json`` end to end, tiny sizes: every metric is there, with a
baseline and a ratio. Structure only: how fast things are belongs to the benchmark itself, not
to a pass/fail test on a shared, noisy machine.

One run over every group (:func:`local_run`) serves the tests that read its figures: the
structure of every metric, and the accounting of the W=2 uploads, whose blobs are one
:data:`COPY_MB` each. Its knobs keep it short without leaving anything out: a short ZooKeeper
session timeout (``failover_kill_s`` waits one out) and Spark JVMs without the optimising JIT
(most of a Spark application's start here is its JVMs starting).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from blobha.client import Client
from blobha.ops.bench import unjournaled_ext4
from blobha.ops.bench.apart import MEMORY_DIR, file_system_type
from blobha.ops.bench.baselines import disk_counters
from blobha.ops.localcluster import LocalCluster

# Alone: the W=2 accounting reads the disk's own counters, which count every process's writes
# (tests/run runs these after the others, on their own).
pytestmark = [pytest.mark.integration, pytest.mark.alone]

BLOBHA = str(Path(sys.executable).with_name("blobha"))

EXPECTED = {
    "upload_mbps", "replication_1g_s", "download_mbps",
    "replication_latency_ms_p50", "replication_latency_ms_p99",
    "small_ops_per_s_create_c1", "small_ops_per_s_create_c1_floor", "small_ops_per_s_create_c8",
    "small_ops_per_s_read_c1", "small_ops_per_s_read_c8",
    "upload_w2_mbps", "upload_w2_disk_mbps", "upload_w2_cpu_s", "upload_w2_leader_cpu_s",
    "small_ops_w2_per_s_create_c1", "small_ops_w2_per_s_create_c8",
    "replication_latency_w2_ms_p50", "replication_latency_w2_ms_p99",
    "upload_tls_mbps", "download_tls_mbps", "sha256_mbps", "peer_plan_first_s",
    "spark_first_app_blob_ready_s", "spark_second_app_blob_ready_s",
    "spark_second_app_blob_ready_client_loaded_s",
    "spark_env_start_first_app_s", "spark_env_start_second_app_s", "spark_env_start_third_app_s",
    "failover_term_s", "failover_kill_s", "failover_kill_restart_s",
    "scale_create_per_s", "scale_keys", "scale_leader_rss_mib", "scale_leader_rss_per_key_b",
    "scale_follower_rss_mib", "scale_follower_rss_per_key_b", "scale_zk_watches",
    "scale_zk_znodes", "scale_list_s", "scale_catchup_s", "scale_restart_s",
    "failover_term_at_scale_s", "failover_kill_restart_at_scale_s", "failover_kill_at_scale_s",
}
# RSS growth per key over a few hundred keys can be zero or negative (the allocator reuses
# memory freed by earlier phases); only its presence and a baseline are checked.
MAY_BE_NON_POSITIVE = {"scale_leader_rss_per_key_b", "scale_follower_rss_per_key_b"}
# The masters' CPU time over a 4 MiB upload may stay under one clock tick.
MAY_BE_ZERO = {"upload_w2_cpu_s", "upload_w2_leader_cpu_s"}
# What the masters' disk wrote during each upload: only where its file system has a device.
ON_A_DEVICE = {"upload_w2_disk_written_mb", "upload_w2_disk_ceiling_mbps"}
# The holder's copy kept apart needs two CPUs and memory to keep it in.
APART = {"upload_w2_apart_mbps"}
APART_ON_A_DEVICE = {"upload_w2_apart_disk_written_mb"}
#: The size of the run's big blobs, in MiB; one copy of it, in MB.
SIZE_MIB = 48
COPY_MB = SIZE_MIB * 1024 * 1024 / 1e6
#: The run's ZooKeeper session timeout, which failover_kill_s waits out (the bench's default
#: is 6 s). Not much below the test clusters' 4 s: the masters' sessions must outlast the
#: Spark groups' JVMs starting on both CPUs.
SESSION_TIMEOUT_MS = 3000


@dataclass(frozen=True)
class LocalRun:
    """What the shared ``blobha bench --local`` run left: its directory, log and figures."""

    tmp_path: Path
    stderr: str
    metrics: list[dict[str, Any]]
    #: The run's own directories in memory (/dev/shm) are the ones not there before it.
    memory_dirs_before: set[Path]

    @property
    def by_name(self) -> dict[str, dict[str, Any]]:
        return {m["name"]: m for m in self.metrics}


@pytest.fixture(scope="module")
def local_run(tmp_path_factory: pytest.TempPathFactory) -> LocalRun:
    tmp_path = tmp_path_factory.mktemp("bench")
    memory_dirs_before = set(MEMORY_DIR.glob("blobha-bench-*"))
    started = time.monotonic()
    proc = subprocess.run(
        [BLOBHA, "bench", "--local", "--json", "--size-mb", str(SIZE_MIB), "--count", "5",
         "--small-ops-seconds", "0.3", "--scale-keys", "150", "--repeat", "1",
         "--spark-size-mb", "4", "--spark-env-size-mb", "2",
         "--session-timeout-ms", str(SESSION_TIMEOUT_MS),
         "--spark-java-options=-XX:TieredStopAtLevel=1"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    # Its progress lines, for `pytest -s` and for a failure's report: where the time went.
    print(proc.stderr, end="")
    print(f"bench smoke took {time.monotonic() - started:.1f} s")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return LocalRun(tmp_path, proc.stderr, json.loads(proc.stdout), memory_dirs_before)


def test_bench_local_json_reports_every_metric_with_baseline_and_ratio(local_run: LocalRun
                                                                       ) -> None:
    tmp_path, metrics, by_name = local_run.tmp_path, local_run.metrics, local_run.by_name
    stderr = local_run.stderr
    on_device = disk_counters(tmp_path) is not None
    apart = _can_keep_apart()
    expected = (EXPECTED | (ON_A_DEVICE if on_device else set()) | (APART if apart else set())
                | (APART_ON_A_DEVICE if apart and on_device else set()))
    assert set(by_name) == expected, stderr[-2000:]
    assert len(metrics) == len(by_name)  # one object per metric
    for m in metrics:
        assert set(m) == {"name", "value", "unit", "baseline_name", "baseline_value", "ratio"}
        assert m["unit"] and m["baseline_name"], m
        assert isinstance(m["value"], (int, float)) and math.isfinite(m["value"]), m
        if m["name"] in MAY_BE_ZERO:
            assert m["value"] >= 0 and m["baseline_value"] >= 0, m
            if not m["baseline_value"]:
                assert m["ratio"] is None, m
                continue
        elif m["name"] not in MAY_BE_NON_POSITIVE:
            assert m["value"] > 0, m
        assert m["baseline_value"] > 0, m
        assert isinstance(m["ratio"], (int, float)), m
        assert m["ratio"] == pytest.approx(m["value"] / m["baseline_value"], rel=1e-3, abs=1e-4)
    assert by_name["scale_keys"]["value"] >= 150
    # Every failover group is set against the session timeout its clusters were given.
    for name in ("failover_term_s", "failover_kill_s", "failover_kill_restart_s",
                 "failover_term_at_scale_s", "failover_kill_restart_at_scale_s",
                 "failover_kill_at_scale_s"):
        assert by_name[name]["baseline_value"] == SESSION_TIMEOUT_MS / 1000, by_name[name]
    # The note on an ext4 without a journal comes exactly where the kernel says it is one.
    noted = "ext4 without a journal" in stderr
    assert noted == (unjournaled_ext4(tmp_path) is not None), stderr[-2000:]
    # The run cleans up after itself: the throw-away cluster's directory is gone.
    assert not list(tmp_path.glob("blobha-bench-*"))


def test_bench_local_tls_measures_over_tls_against_a_plaintext_cluster(tmp_path: Path) -> None:
    proc = subprocess.run(
        [BLOBHA, "bench", "--local", "--tls", "--json", "--size-mb", "2", "--count", "3",
         "--small-ops-seconds", "0.3", "--repeat", "1",
         "--metrics", "upload_mbps,small_ops_w2_per_s,upload_tls_mbps,download_tls_mbps"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    by_name = {m["name"]: m for m in json.loads(proc.stdout)}
    assert {"upload_mbps", "small_ops_w2_per_s_create_c1", "upload_tls_mbps",
            "download_tls_mbps"} <= set(by_name)
    assert by_name["download_tls_mbps"]["baseline_name"] == "download_plaintext_mbps"
    assert "starting a local TLS cluster" in proc.stderr
    assert "starting a plaintext local cluster beside" in proc.stderr
    assert not list(tmp_path.glob("blobha-bench-*"))


def test_bench_tls_needs_a_cluster_of_its_own(tmp_path: Path) -> None:
    proc = subprocess.run([BLOBHA, "bench", "--cluster", "127.0.0.1:1", "--tls"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2
    assert "--tls starts a TLS cluster of its own: add --local" in proc.stderr


def test_bench_runs_against_a_secure_cluster_with_the_given_credentials(tmp_path: Path) -> None:
    lc = LocalCluster(tmp_path / "secure", nodes=3, base_port=0, tls=True,
                      overrides={"blobstore.disk.reserved.bytes": 0})
    try:
        lc.start()
        creds = lc.credentials("alice")
        assert creds.ca and creds.token_file
        proc = subprocess.run(
            [BLOBHA, "--cluster", lc.cluster, "--ca", creds.ca, "--token-file", creds.token_file,
             "bench", "--json", "--size-mb", "2", "--count", "3", "--small-ops-seconds", "0.3",
             "--repeat", "1", "--metrics", "upload_mbps,download_mbps,small_ops_per_s"],
            capture_output=True, text=True, timeout=240, cwd=tmp_path,
            env={**os.environ, "TMPDIR": str(tmp_path)},
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        names = {m["name"] for m in json.loads(proc.stdout)}
        assert {"upload_mbps", "download_mbps", "small_ops_per_s_create_c1"} <= names
        # It left nothing behind on a cluster not its own (an admin sees every key).
        with Client(lc.cluster, credentials=lc.credentials("admin")) as admin:
            assert list(admin.list()) == []
    finally:
        lc.stop()


def test_bench_accounts_for_each_upload_on_the_masters_disk(local_run: LocalRun) -> None:
    """W=2 waits for two copies on the one disk the local masters share, W=1 for one: the
    disk's counters over each upload show it, and the ceiling they give bounds W=2."""
    if disk_counters(local_run.tmp_path) is None:
        pytest.skip(f"{local_run.tmp_path} is on a file system with no block device of its own")
    stderr, by_name = local_run.stderr, local_run.by_name
    written = by_name["upload_w2_disk_written_mb"]
    assert written["baseline_name"] == "upload_w1_disk_written_mb"
    # Each copy is 48 MiB (50.3 MB): W=1 waits for one, W=2 for two (the third holder syncs
    # after). The margin is for writes of the cluster's own, and other processes', meanwhile.
    assert COPY_MB <= written["baseline_value"] < 2 * COPY_MB, written
    assert 2 * COPY_MB <= written["value"] < 3 * COPY_MB, written
    ceiling = by_name["upload_w2_disk_ceiling_mbps"]
    assert ceiling["value"] >= by_name["upload_w2_mbps"]["value"] * 0.999, by_name
    assert "the disk wrote" in stderr and "busy" in stderr
    cpu, leader = by_name["upload_w2_cpu_s"], by_name["upload_w2_leader_cpu_s"]
    assert leader["baseline_name"] == "upload_w1_leader_cpu_s"
    # The leader's share is part of every master's.
    assert leader["value"] <= cpu["value"] and leader["baseline_value"] <= cpu["baseline_value"]


def _can_keep_apart() -> bool:
    return len(os.sched_getaffinity(0)) >= 2 and file_system_type(MEMORY_DIR) == "tmpfs"


def test_bench_keeps_the_holders_copy_apart_off_the_masters_disk(local_run: LocalRun) -> None:
    """upload_w2_apart_mbps: only the leader's copy reaches the disk, for either quorum."""
    if disk_counters(local_run.tmp_path) is None or not _can_keep_apart():
        pytest.skip("needs a block device under the tmp directory, two CPUs and /dev/shm")
    stderr, by_name = local_run.stderr, local_run.by_name
    assert by_name["upload_w2_apart_mbps"]["baseline_name"] == "upload_w1_apart_mbps"
    written = by_name["upload_w2_apart_disk_written_mb"]
    assert COPY_MB <= written["baseline_value"] < 2 * COPY_MB, written
    assert COPY_MB <= written["value"] < 2 * COPY_MB, written  # W=2's second copy is elsewhere
    assert "followers keep their data in memory" in stderr
    # The followers' data lived in a directory of the run's own, gone with it.
    assert set(MEMORY_DIR.glob("blobha-bench-*")) <= local_run.memory_dirs_before
