"""``blobha bench``'s pure parts: statistics, formatting, parsing, options, the load driver.

No cluster here: the end-to-end run is tests/integration/test_bench_smoke.py.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from blobha import cli
from blobha.master.config import parse_cpu_list
from blobha.ops import bench
from blobha.ops.bench import (
    LOCAL_ONLY,
    METRIC_GROUPS,
    BenchOptions,
    Driver,
    Metric,
    format_json,
    format_number,
    format_table,
    mb_per_s,
    parse_metrics,
    parse_mntr,
    parse_vmrss_kib,
    parse_wchs,
    percentile,
    unjournaled_ext4,
)
from blobha.ops.localcluster import cpus_allowed

# ---- statistics --------------------------------------------------------------------------


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 0) == 1
    assert percentile(values, 50) == 51  # round(49.5) -> 50 (banker's), index 50 -> 51
    assert percentile(values, 99) == 99
    assert percentile(values, 100) == 100


def test_percentile_ignores_order_and_handles_one_value() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([7.0], 99) == 7.0


def test_percentile_of_nothing_is_an_error() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)


def test_mb_per_s_is_decimal_megabytes_like_dd() -> None:
    assert mb_per_s(1_000_000, 1.0) == 1.0
    assert mb_per_s(1024 * 1024 * 1024, 2.0) == pytest.approx(536.87, rel=1e-3)
    assert mb_per_s(10, 0.0) == math.inf


# ---- metrics and output ------------------------------------------------------------------


def test_ratio_is_value_over_baseline() -> None:
    m = Metric("upload_mbps", 300.0, "MB/s", "disk_fdatasync_write_mbps", 400.0)
    assert m.ratio == 0.75
    assert m.as_dict() == {
        "name": "upload_mbps", "value": 300.0, "unit": "MB/s",
        "baseline_name": "disk_fdatasync_write_mbps", "baseline_value": 400.0, "ratio": 0.75,
    }


@pytest.mark.parametrize("baseline", [0.0, math.nan, math.inf])
def test_no_usable_baseline_means_no_ratio(baseline: float) -> None:
    m = Metric("x", 1.0, "s", "b", baseline)
    assert math.isnan(m.ratio)
    assert m.as_dict()["ratio"] is None


def test_json_is_valid_json_one_object_per_metric() -> None:
    metrics = [Metric("a", 1.0, "s", "b", 2.0), Metric("c", 3.0, "ms", "d", 0.0)]
    parsed = json.loads(format_json(metrics))  # no NaN literals: strict JSON parses it
    assert [o["name"] for o in parsed] == ["a", "c"]
    assert parsed[0]["ratio"] == 0.5 and parsed[1]["ratio"] is None
    for o in parsed:
        assert set(o) == {"name", "value", "unit", "baseline_name", "baseline_value", "ratio"}


@pytest.mark.parametrize(("value", "text"), [
    (12345.6, "12,346"), (1000.0, "1,000"), (123.45, "123.5"), (10.0, "10.0"),
    (1.23456, "1.235"), (0.0004, "0.000"), (-15.0, "-15.0"), (math.nan, "-"), (math.inf, "-"),
])
def test_format_number(value: float, text: str) -> None:
    assert format_number(value) == text


def test_table_aligns_columns_and_shows_ratios() -> None:
    table = format_table([
        Metric("upload_mbps", 350.0, "MB/s", "disk_fdatasync_write_mbps", 367.0),
        Metric("failover_kill_s", 6.5, "s", "session_timeout_s", 6.0),
        Metric("no_baseline", 2.0, "s", "", 0.0),
    ])
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["metric", "value", "unit"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert "0.95x" in lines[2] and "1.08x" in lines[3]
    assert lines[4].split()[-3:] == ["-", "-", "-"]
    # Right-aligned numbers: the value column ends at the same place on every row.
    ends = {line.index(v) + len(v) for line, v in zip(lines[2:4], ["350.0", "6.500"],
                                                      strict=True)}
    assert len(ends) == 1


# ---- ZooKeeper and /proc parsing ---------------------------------------------------------


def test_parse_wchs() -> None:
    assert parse_wchs("3 connections watching 200005 paths\nTotal watches:400010\n") == 400010
    with pytest.raises(ValueError):
        parse_wchs("wchs is not executed because it is not in the whitelist.\n")


def test_parse_mntr() -> None:
    text = "zk_version\t3.8.0-abc, built on x\nzk_znode_count\t1217\nzk_approximate_data_size\t9\n"
    stats = parse_mntr(text)
    assert stats["zk_znode_count"] == "1217"
    assert stats["zk_version"].startswith("3.8.0")
    assert parse_mntr("garbage without tabs") == {}


def test_parse_vmrss() -> None:
    status = "Name:\tpython\nVmPeak:\t  900 kB\nVmRSS:\t   76800 kB\nThreads:\t12\n"
    assert parse_vmrss_kib(status) == 76800
    with pytest.raises(ValueError):
        parse_vmrss_kib("Name:\tkthreadd\n")


def test_rss_of_this_process_is_positive() -> None:
    assert bench.rss_kib(os.getpid()) > 0


_DISKSTATS = (
    " 254       0 vda 9100 12 812340 2201 51200 9 4194304 88123 0 61234 90321 0 0 0 0 0 0\n"
    " 254       1 vda1 9000 12 810000 2190 51100 9 4194000 88100 0 61200 90300\n"
    "   7       0 loop0 0 0 0 0 0 0 0 0 0 0 0\n"
    "   8      16 sdb 1 2 3\n"
)


def test_parse_diskstats_reads_sectors_written_and_busy_time() -> None:
    from blobha.ops.bench.baselines import DiskCounters, parse_diskstats

    # Sectors are 512 bytes whatever the device's block size; io_ticks is the 13th field.
    assert parse_diskstats(_DISKSTATS, 254, 0) == DiskCounters(4194304 * 512, 61234)
    assert parse_diskstats(_DISKSTATS, 254, 1) == DiskCounters(4194000 * 512, 61200)
    assert parse_diskstats(_DISKSTATS, 254, 2) is None  # no such device
    assert parse_diskstats(_DISKSTATS, 8, 16) is None  # a line too short to read


def test_disk_counters_are_those_of_the_device_holding_the_path(tmp_path: Path) -> None:
    from blobha.ops.bench.baselines import DiskCounters, disk_counters

    dev = os.stat(tmp_path).st_dev
    proc = tmp_path / "proc"
    proc.mkdir()
    other = f" {os.major(dev) + 1} {os.minor(dev)} other 1 0 8 1 7 0 64 5 0 11 40\n"
    (proc / "diskstats").write_text(
        other + f" {os.major(dev)} {os.minor(dev)} mine 1 0 8 1 7 0 96 5 0 33 40\n")
    assert disk_counters(tmp_path, proc) == DiskCounters(96 * 512, 33)
    (proc / "diskstats").write_text(other)  # a file system with no device (tmpfs)
    assert disk_counters(tmp_path, proc) is None
    assert disk_counters(tmp_path / "missing", proc) is None
    assert disk_counters(tmp_path, tmp_path / "no-proc") is None


def test_parse_cpu_secs_counts_user_and_system_time_past_the_command() -> None:
    from blobha.ops.bench.baselines import parse_cpu_secs

    # The command may hold spaces and parentheses: fields are counted after the last ")".
    stat = "4242 (python (x) y) S 1 4242 4242 0 -1 4194560 900 0 3 0 250 75 0 0 20 0 12 0"
    assert parse_cpu_secs(stat, 100) == pytest.approx(3.25)
    with pytest.raises(ValueError):
        parse_cpu_secs("4242 (short) S 1 2", 100)


def test_file_system_type_is_that_of_the_longest_mount_point_holding_the_path(
        tmp_path: Path) -> None:
    from blobha.ops.bench.apart import file_system_type

    mounts = tmp_path / "mounts"
    mounts.write_text(
        "/dev/vda / ext4 rw 0 0\n"
        "tmpfs /dev/shm tmpfs rw 0 0\n"
        "tmpfs /dev/shm/with\\040space tmpfs rw 0 0\n"
        "shm /dev/shmem overlay rw 0 0\n"
        "broken\n"
    )
    assert file_system_type(Path("/dev/shm"), mounts) == "tmpfs"
    assert file_system_type(Path("/dev/shm/x/y"), mounts) == "tmpfs"
    assert file_system_type(Path("/dev/shmem/x"), mounts) == "overlay"  # not under /dev/shm
    assert file_system_type(Path("/dev/shm/with space/z"), mounts) == "tmpfs"
    assert file_system_type(Path("/srv/data"), mounts) == "ext4"
    assert file_system_type(Path("/srv"), tmp_path / "no-mounts") is None


def test_pin_threads_moves_every_thread_of_a_process(tmp_path: Path) -> None:
    from blobha.core.affinity import pin_threads

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one CPU: nothing to pin to but what every thread already has")
    release = threading.Event()
    ready = threading.Event()

    def wait() -> None:
        ready.set()
        release.wait(10)

    t = threading.Thread(target=wait)
    t.start()
    ready.wait(10)
    before = os.sched_getaffinity(0)
    try:
        pin_threads(os.getpid(), {cpus[1]})
        for tid in os.listdir("/proc/self/task"):
            assert os.sched_getaffinity(int(tid)) == {cpus[1]}, tid
    finally:
        pin_threads(os.getpid(), before)
        release.set()
        t.join()
    assert os.sched_getaffinity(0) == before


def test_warm_memory_gives_back_what_it_touched() -> None:
    from blobha.ops.bench.apart import warm_memory

    before = bench.rss_kib(os.getpid())
    warm_memory(256 * 1024 * 1024 + 5)
    warm_memory(0)
    assert bench.rss_kib(os.getpid()) < before + 32 * 1024


def test_cpu_secs_of_a_process_grow_with_the_work_it_does() -> None:
    from blobha.ops.bench.baselines import cpu_secs

    before = cpu_secs(os.getpid())
    deadline = time.monotonic() + 5.0
    spent = time.process_time()
    while time.process_time() - spent < 0.3 and time.monotonic() < deadline:
        sum(range(10_000))
    assert cpu_secs(os.getpid()) - before >= 0.2


def test_cpus_allowed_reads_the_kernels_list(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "status").write_text(
        "Name:\tpython\nCpus_allowed:\t3\nCpus_allowed_list:\t0-1\nMems_allowed:\t1\n")
    assert cpus_allowed(42, tmp_path) == "0-1"
    assert cpus_allowed(43, tmp_path) == "?"  # gone
    assert parse_cpu_list(cpus_allowed(os.getpid())) == os.sched_getaffinity(0)


# ---- the file system's note ---------------------------------------------------------------


def _fake_kernel(tmp_path: Path, device: str, ext4: list[str], journals: list[str] | None
                 ) -> tuple[Path, Path, Path]:
    """A data directory, and /proc and /sys trees in which its file system's device is
    ``device``, the ext4 devices are ``ext4``, and /proc/fs/jbd2 lists ``journals`` (None:
    no such directory, as when jbd2 is not loaded)."""
    data = tmp_path / "data"
    data.mkdir()
    proc, sys_dir = tmp_path / "proc", tmp_path / "sys"
    for name in ext4:
        (proc / "fs" / "ext4" / name).mkdir(parents=True)
    if journals is not None:
        (proc / "fs" / "jbd2").mkdir(parents=True)
        for j in journals:
            (proc / "fs" / "jbd2" / j).mkdir()
    st = os.stat(data).st_dev
    target = sys_dir / "devices" / device
    target.mkdir(parents=True)
    (sys_dir / "dev" / "block").mkdir(parents=True)
    (sys_dir / "dev" / "block" / f"{os.major(st)}:{os.minor(st)}").symlink_to(target)
    return data, proc, sys_dir


@pytest.mark.parametrize(("device", "ext4", "journals", "expected"), [
    ("vda", ["vda"], [], "vda"),  # ext4, no journal
    ("vda", ["vda"], None, "vda"),  # jbd2 not even loaded
    ("vda", ["vda"], ["vda-8"], None),  # journaled
    ("dm-1", ["dm-1", "dm-10"], ["dm-10-8"], "dm-1"),  # another device's journal
    ("dm-10", ["dm-1", "dm-10"], ["dm-10-8"], None),
    ("sda1", ["vda"], [], None),  # not ext4 (xfs, btrfs, ...)
])
def test_unjournaled_ext4_is_told_by_the_kernels_lists(
        tmp_path: Path, device: str, ext4: list[str], journals: list[str] | None,
        expected: str | None) -> None:
    data, proc, sys_dir = _fake_kernel(tmp_path, device, ext4, journals)
    assert unjournaled_ext4(data, proc, sys_dir) == expected


def test_unjournaled_ext4_is_none_when_the_device_cannot_be_found(tmp_path: Path) -> None:
    # An overlay or tmpfs has no block device entry; a missing path is no error either.
    assert unjournaled_ext4(tmp_path, tmp_path / "proc", tmp_path / "sys") is None
    assert unjournaled_ext4(tmp_path / "missing") is None


# ---- options -----------------------------------------------------------------------------


def test_parse_metrics_default_and_subset_in_run_order() -> None:
    assert parse_metrics(None) == METRIC_GROUPS
    assert parse_metrics("all") == METRIC_GROUPS
    assert parse_metrics(" scale , upload_mbps,scale") == ("upload_mbps", "scale")


def test_parse_metrics_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown metric upload; choose from upload_mbps"):
        parse_metrics("upload,scale")


def test_options_validation() -> None:
    BenchOptions().check(local=True, explicit_metrics=False)
    # A remote run simply skips the local-only groups unless they were asked for by name.
    BenchOptions().check(local=False, explicit_metrics=False)
    with pytest.raises(ValueError, match="failover_kill_s, scale: only with a cluster of our own"):
        BenchOptions(metrics=("failover_kill_s", "scale")).check(False, explicit_metrics=True)
    with pytest.raises(ValueError, match="positive"):
        BenchOptions(small_ops_seconds=0).check(True, False)
    with pytest.raises(ValueError, match="at least 1"):
        BenchOptions(size_mb=0).check(True, False)
    with pytest.raises(ValueError, match="at least 1"):
        BenchOptions(repeat=0).check(True, False)
    with pytest.raises(ValueError, match="spark-size-mb and --spark-env-size-mb must be at"):
        BenchOptions(spark_size_mb=0).check(True, False)
    with pytest.raises(ValueError, match="at least 1"):
        BenchOptions(spark_env_size_mb=0).check(True, False)
    assert {"failover_term_s", "failover_kill_s", "failover_kill_restart_s", "scale",
            "upload_tls_mbps", "download_tls_mbps", "upload_w2_apart_mbps"} == LOCAL_ONLY
    with pytest.raises(ValueError, match="--tls starts a TLS cluster of its own"):
        BenchOptions(tls=True).check(False, False)
    BenchOptions(tls=True).check(True, False)
    assert BenchOptions().session_timeout_ms == 6000
    BenchOptions(session_timeout_ms=1000).check(True, False)
    with pytest.raises(ValueError, match="--session-timeout-ms must be at least 1000"):
        BenchOptions(session_timeout_ms=999).check(True, False)


def test_cli_bench_options_reach_main(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def fake_main(cluster: str | None, local: bool, as_json: bool, **kw: Any) -> int:
        seen.update(cluster=cluster, local=local, as_json=as_json, **kw)
        return 0

    monkeypatch.setattr(bench, "main", fake_main)
    assert cli.main(["bench", "--local", "--json", "--size-mb", "4", "--count", "5",
                     "--small-ops-seconds", "0.5", "--scale-keys", "200", "--repeat", "1",
                     "--metrics", "scale,upload_mbps", "--spark-size-mb", "8",
                     "--spark-env-size-mb", "16", "--tls", "--session-timeout-ms", "2000",
                     "--spark-java-options=-XX:TieredStopAtLevel=1"]) == 0
    assert seen == {
        "cluster": None, "local": True, "as_json": True, "count": 5, "size_mb": 4,
        "small_ops_seconds": 0.5, "scale_keys": 200, "repeat": 1,
        "metrics": "scale,upload_mbps", "zookeeper": None, "baseline_dir": None,
        "spark_size_mb": 8, "spark_env_size_mb": 16, "tls": True,
        "fanout_nodes": 8, "fanout_rate_mbit": 200.0, "fanout_peers": True,
        "session_timeout_ms": 2000, "spark_java_options": "-XX:TieredStopAtLevel=1",
    }


def test_cli_bench_defaults_are_the_full_benchmark(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(bench, "main", lambda *a, **kw: seen.update(kw) or 0)
    monkeypatch.setenv("BLOBHA_CLUSTER", "m1:6627")
    assert cli.main(["bench"]) == 0
    assert (seen["size_mb"], seen["count"], seen["scale_keys"]) == (1024, 100, 100_000)
    assert seen["repeat"] == 3
    assert seen["small_ops_seconds"] == 10.0 and seen["metrics"] is None
    assert seen["session_timeout_ms"] is None  # the bench's own default
    assert seen["spark_java_options"] == ""  # the JVMs' own defaults


@pytest.mark.parametrize("argv", [
    ["bench", "--size-mb", "0"], ["bench", "--count", "-1"], ["bench", "--scale-keys", "x"],
    ["bench", "--small-ops-seconds", "soon"], ["bench", "--repeat", "0"],
])
def test_cli_bench_rejects_bad_numbers(argv: list[str]) -> None:
    assert cli.main(argv) == cli.EXIT_USAGE


def test_main_usage_errors_before_touching_any_cluster(capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    assert bench.main(None, local=False, as_json=False) == 2
    assert "give --local or --cluster" in capsys.readouterr().err
    assert bench.main("m1:6627", local=False, as_json=False, metrics="nope") == 2
    assert "unknown metric nope" in capsys.readouterr().err
    assert bench.main("m1:6627", local=False, as_json=False, metrics="scale") == 2
    assert "scale: only with a cluster of our own; add --local" in capsys.readouterr().err
    assert bench.main("m1:6627", local=False, as_json=False, session_timeout_ms=2000) == 2
    assert "--session-timeout-ms sets the local cluster's: add --local" in (
        capsys.readouterr().err)
    assert bench.main(None, local=True, as_json=False, session_timeout_ms=500) == 2
    assert "--session-timeout-ms must be at least 1000" in capsys.readouterr().err


# ---- load driver and machine baselines ---------------------------------------------------


def _driver(op: Any, opened: list[int] | None = None) -> Driver[int]:
    count = iter(range(1000))

    def open_conn() -> int:
        n = next(count)
        if opened is not None:
            opened.append(n)
        return n

    return Driver(open_conn, lambda c: None, op)


def test_driver_total_runs_each_sequence_number_once() -> None:
    seen: list[int] = []
    lock = threading.Lock()

    def op(conn: int, i: int) -> None:
        with lock:
            seen.append(i)

    opened: list[int] = []
    result = _driver(op, opened).run(4, total=100)
    assert sorted(seen) == list(range(100))
    assert result.ops == 100 and len(result.latencies_ms) == 100
    assert len(opened) == 4  # one connection per thread
    assert result.rate > 0


def test_driver_for_a_time_stops_at_the_deadline() -> None:
    # A clock of the test's own, on which each operation takes 10 ms: the deadline falls
    # mid-run, after 20 operations, give or take one per thread that checked it just before.
    now = [0.0]
    lock = threading.Lock()

    def op(conn: int, i: int) -> None:
        with lock:
            now[0] += 0.01

    result = Driver(lambda: 0, lambda c: None, op, clock=lambda: now[0]).run(2, seconds=0.2)
    assert 20 <= result.ops <= 22
    assert 0.2 <= result.secs <= 0.23
    assert result.secs == pytest.approx(now[0])  # the clock started with the first operation


def test_driver_keeps_going_when_one_thread_fails_after_some_work() -> None:
    def op(conn: int, i: int) -> None:
        if i == 5:
            raise RuntimeError("boom")

    result = _driver(op).run(1, total=50)
    assert result.ops == 5 and len(result.errors) == 1


def test_driver_raises_when_nothing_succeeded() -> None:
    def op(conn: int, i: int) -> None:
        raise RuntimeError("always")

    with pytest.raises(RuntimeError, match="always"):
        _driver(op).run(3, total=10)


def test_driver_raises_when_a_connection_cannot_open() -> None:
    def bad_open() -> int:
        raise ConnectionError("no server")

    with pytest.raises(ConnectionError):
        Driver(bad_open, lambda c: None, lambda c, i: None).run(3, seconds=1)


def test_driver_needs_a_bound() -> None:
    with pytest.raises(ValueError):
        _driver(lambda c, i: None).run(1)


def test_pattern_has_the_size_asked_for() -> None:
    data = bench.pattern(3 * 1024 * 1024 + 5)
    assert len(data) == 3 * 1024 * 1024 + 5
    assert len(set(data[:4096])) > 200  # random, not zeros


def test_disk_write_baseline_cleans_up(tmp_path: Path) -> None:
    secs = bench.disk_write_secs(tmp_path, 3 * 1024 * 1024 + 7, block=1024 * 1024)
    assert secs > 0
    assert list(tmp_path.iterdir()) == []


def test_writes_at_once_each_write_a_file_of_their_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from blobha.ops.bench import baselines

    made: list[str] = []
    real_open = os.open

    def recording(path: str, flags: int, mode: int = 0o777) -> int:
        made.append(os.path.basename(path))
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", recording)
    # A coarse clock must not give two writers one name (each file is made exclusively).
    monkeypatch.setattr(time, "monotonic_ns", lambda: 42)
    secs = baselines.disk_writes_at_once_secs(tmp_path, 2 * 1024 * 1024 + 3, 3)
    assert secs > 0
    assert len(made) == 3 and len(set(made)) == 3, made
    assert list(tmp_path.iterdir()) == []


def test_the_fanout_group_runs_only_when_named_and_only_as_root(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from blobha.ops.bench import options, runner

    assert "fanout" not in options.parse_metrics("all")
    assert options.parse_metrics("fanout") == ("fanout",)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert runner.main(None, False, False, metrics="fanout") == 2
    assert "run it as root" in capsys.readouterr().err
    assert runner.main(None, True, False, metrics="fanout,scale") == 2
    assert "runs alone" in capsys.readouterr().err


def test_bench_fanout_is_the_fanout_group_with_its_own_options(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from blobha.cli import main
    from blobha.ops.bench import fanout

    ran: list[tuple[object, ...]] = []
    monkeypatch.setattr(fanout, "run_fanout_group",
                        lambda *a: ran.append(a) or 0)  # type: ignore[func-returns-value]
    assert main(["bench", "--fanout", "--nodes", "4", "--rate-mbit", "100",
                 "--spark-size-mb", "32", "--no-peers", "--json"]) == 0
    assert main(["bench", "--fanout"]) == 0
    assert ran[0] == (32, True, 4, 100.0, False)
    assert ran[1][0] == 256 and not ran[1][1] and ran[1][2:] == (8, 200.0, True)
    assert main(["bench", "--fanout", "--rate-mbit", "0"]) == 2
    assert len(ran) == 2


def test_spark_java_options_reach_every_spark_jvm_of_the_env_group(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each application's driver and executors (both sides' spark-submit arguments), and the
    standalone cluster's daemons; none without the option."""
    from blobha.ops import sparkstandalone
    from blobha.ops.bench import spark_env as bench_spark_env

    opts = "-XX:TieredStopAtLevel=1 -Xss1m"
    spark = sparkstandalone.StandaloneSpark(tmp_path, workers=2, java_options=opts)
    for archive in (None, tmp_path / "env.tgz"):
        args = bench_spark_env._spark_args(spark, archive, opts)
        confs = {args[i + 1] for i, a in enumerate(args) if a == "--conf"}
        assert {f"spark.driver.extraJavaOptions={opts}",
                f"spark.executor.extraJavaOptions={opts}"} <= confs
        assert "extraJavaOptions" not in " ".join(bench_spark_env._spark_args(spark, archive))

    started: list[dict[str, str]] = []

    class Recorded:
        def __init__(self, cmd: list[str], env: dict[str, str], **kw: object) -> None:
            started.append(env)

    monkeypatch.setattr(sparkstandalone, "spark_home", lambda: tmp_path)
    monkeypatch.setattr(sparkstandalone.subprocess, "Popen", Recorded)
    spark._start("master", [], {"HOME": str(tmp_path)})
    plain = sparkstandalone.StandaloneSpark(tmp_path, workers=2)
    plain._start("worker-1", [], {"HOME": str(tmp_path)})
    assert started[0] == {"HOME": str(tmp_path), "SPARK_DAEMON_JAVA_OPTS": opts}
    assert started[1] == {"HOME": str(tmp_path)}


def test_the_spark_benchmarks_lines_join_the_runs_progress_while_a_spark_group_runs() -> None:
    import io
    import logging

    from blobha.ops.bench import Log, spark

    stream = io.StringIO()
    logger = logging.getLogger(spark.SPARK_LOGGER)
    with spark._progress(Log(stream)):
        logger.info("application %d: blobha %.2f s", 1, 0.5)
    logger.info("after the group")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].endswith("s]   application 1: blobha 0.50 s"), lines
    assert logger.handlers == [] and logger.level == logging.NOTSET


def test_the_standalone_spark_workers_start_once_the_master_leads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that reaches a master not yet leading tries again only 5-15 s later; a
    starting master's status page may answer with nothing at all."""
    from blobha.ops import sparkstandalone

    spark = sparkstandalone.StandaloneSpark(tmp_path / "spark", workers=2)
    started: list[str] = []
    answers: list[Any] = [OSError("refused"), json.JSONDecodeError("empty", "", 0),
                          {"status": "STANDBY"}, {"status": "ALIVE", "aliveworkers": 0}]

    asked: list[list[str]] = []  # what had started at each question

    def state() -> dict[str, Any]:
        asked.append(list(started))
        answer = answers.pop(0) if answers else {"status": "ALIVE", "aliveworkers": 2}
        if isinstance(answer, Exception):
            raise answer
        return dict(answer)

    monkeypatch.setattr(sparkstandalone, "spark_home", lambda: tmp_path)
    monkeypatch.setattr(spark, "_start", lambda name, args, env: started.append(name))
    monkeypatch.setattr(spark, "state", state)
    spark.start()
    assert started == ["master", "worker-1", "worker-2"] and not answers
    # The master alone until it said ALIVE (the fourth answer), the workers after.
    assert asked[:4] == [["master"]] * 4
    assert asked[4:] == [["master", "worker-1", "worker-2"]] * (len(asked) - 4)
