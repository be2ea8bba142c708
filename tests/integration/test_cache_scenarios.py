"""The node-local cache against 3 real masters: Storm's cache scenarios 17-22
(storm-reference.md), and ``blobha fetch`` as users run it.

(Named apart from tests/unit/cache/test_cache_*.py: without packages, pytest cannot collect two test
modules of the same base name in one run.)
"""

from __future__ import annotations

import fcntl
import io
import json
import multiprocessing
import os
import stat
import subprocess
import sys
import tarfile
import threading
import zipfile
from pathlib import Path
from typing import Any

import pytest
from support.harness import wait_until

from blobha import BlobCache, KeyNotFound, NotAuthorized
from blobha.client import Client
from blobha.core.keys import key_dirname
from blobha.ops.localcluster import LocalCluster

pytestmark = pytest.mark.integration

BLOBHA = str(Path(sys.executable).with_name("blobha"))
MiB = 1024 * 1024


def fetch(cluster: LocalCluster, *args: str, user: str = "alice",
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "BLOBHA_CLUSTER": cluster.cluster, "BLOBHA_USER": user,
                **(env or {})}
    return subprocess.run([BLOBHA, "fetch", *args], capture_output=True, text=True,
                          env=full_env, timeout=120)


class Clock:
    """Wall-clock time that a test can move forward (retention, LRU order)."""

    def __init__(self) -> None:
        import time

        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def advance(self, secs: float) -> None:
        self.now += secs


def version_dirs(cache_dir: Path, key: str) -> list[str]:
    d = cache_dir / "blobs" / key_dirname(key)
    return sorted(p.name for p in d.glob("v*")) if d.exists() else []


# --------------------------------------------------------------------------------------------
# 17: one download per node, however many processes ask at once
# --------------------------------------------------------------------------------------------


def test_17_many_fetch_processes_download_once(cluster: LocalCluster, alice: Client,
                                               unique_key: str, tmp_path: Path) -> None:
    data = os.urandom(16 * MiB)
    alice.create(unique_key, data, acl="o::r")
    cache_dir = tmp_path / "node"
    env = {**os.environ, "BLOBHA_CLUSTER": cluster.cluster, "BLOBHA_USER": "alice"}
    procs = [
        subprocess.Popen([BLOBHA, "fetch", unique_key, "--cache-dir", str(cache_dir)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(8)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 8, [err for _, err in outputs]
    lines = {out.strip() for out, _ in outputs}
    assert len(lines) == 1
    key, version, path = lines.pop().split("\t")
    assert (key, version) == (unique_key, "1")
    assert Path(path).read_bytes() == data
    with BlobCache(cache_dir, client=alice) as cache:
        stats = cache.stats()
    assert (stats.downloads, stats.hits) == (1, 7)
    assert stats.bytes_downloaded == len(data)


def _spawned_worker(cache_dir: str, cluster: str, key: str, threads: int,
                    go: Any, results: Any) -> None:
    """Runs in a spawned process: one cache, several threads asking for ``key`` at once."""
    with BlobCache(cache_dir, cluster, user="alice") as cache:
        results.put(("ready", os.getpid()))
        go.wait(60)

        def ask() -> None:
            try:
                blob = cache.get(key, owner="spawned-job")
                results.put(("ok", str(blob.path), blob.version))
            except Exception as exc:
                results.put(("error", repr(exc)))

        workers = [threading.Thread(target=ask) for _ in range(threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()


def _together(cache_dir: Path, cluster: LocalCluster, key: str, processes: int,
              threads: int) -> list[tuple[Any, ...]]:
    """Runs _spawned_worker in ``processes`` spawned processes, all asking once every one has
    its cache open; their answers, each checked to be a success."""
    ctx = multiprocessing.get_context("spawn")
    go = ctx.Event()
    results = ctx.Queue()
    procs = [ctx.Process(target=_spawned_worker,
                         args=(str(cache_dir), cluster.cluster, key, threads, go, results))
             for _ in range(processes)]
    for p in procs:
        p.start()
    try:
        ready = [results.get(timeout=60) for _ in procs]
        assert all(r[0] == "ready" for r in ready)
        go.set()  # every process has its cache open: all ask together
        answers = [results.get(timeout=120) for _ in range(processes * threads)]
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    assert all(a[0] == "ok" for a in answers), answers
    return answers


def test_17_spawned_processes_and_threads_download_once(cluster: LocalCluster, alice: Client,
                                                        unique_key: str,
                                                        tmp_path: Path) -> None:
    data = os.urandom(8 * MiB)
    alice.create(unique_key, data, acl="o::r")
    cache_dir = tmp_path / "node"
    answers = _together(cache_dir, cluster, unique_key, processes=4, threads=3)
    assert len({a[1] for a in answers}) == 1
    assert Path(answers[0][1]).read_bytes() == data
    with BlobCache(cache_dir, client=alice) as cache:
        stats = cache.stats()
        assert (stats.downloads, stats.hits) == (1, 11)
        # The spawned processes ended: their references are stale.
        assert [e.refs for e in cache.entries()] == [0]


def test_17_processes_finding_the_check_aged_ask_the_cluster_once(
    cluster: LocalCluster, alice: Client, unique_key: str, tmp_path: Path
) -> None:
    alice.create(unique_key, b"v1" * 1000, acl="o::r")
    cache_dir = tmp_path / "node"
    with BlobCache(cache_dir, client=alice, update_interval_secs=3600) as cache:
        assert cache.get(unique_key).version == 1
    alice.update(unique_key, b"v2" * 1000)
    # The last answer about the key is now two hours old, as the next application finds it.
    record = cache_dir / "blobs" / key_dirname(unique_key) / "checks" / key_dirname("alice")
    answer = json.loads(record.read_bytes())
    answer["checked_at"] -= 7200
    record.write_text(json.dumps(answer))
    answers = _together(cache_dir, cluster, unique_key, processes=4, threads=1)
    assert {(a[1], a[2]) for a in answers} == {(answers[0][1], 2)}
    assert Path(answers[0][1]).read_bytes() == b"v2" * 1000
    with BlobCache(cache_dir, client=alice) as cache:
        stats = cache.stats()
    # One question for the node (after the first application's), one download of version 2.
    assert (stats.checks, stats.downloads) == (2, 2)


# --------------------------------------------------------------------------------------------
# 18: archives unpack to the expected tree
# --------------------------------------------------------------------------------------------

TREE = {
    "README": b"top level\n",
    "lib/one.py": b"print(1)\n",
    "lib/nested/deep/two.bin": bytes(range(256)) * 8,
    "bin/run.sh": b"#!/bin/sh\necho hi\n",
}


def _tar(mode: str) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode=mode) as tf:  # type: ignore[call-overload]
        for name, data in TREE.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o755 if name.endswith(".sh") else 0o644
            tf.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("lib/current")
        link.type = tarfile.SYMTYPE
        link.linkname = "nested/deep"
        tf.addfile(link)
    return out.getvalue()


def _zip() -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("lib/", b"")
        for name, data in TREE.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFREG | (0o755 if name.endswith(".sh") else 0o644)) << 16
            zf.writestr(info, data)
    return out.getvalue()


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes()
            for p in root.rglob("*") if p.is_file() and not p.is_symlink()}


@pytest.mark.parametrize("suffix", [".tgz", ".tar", ".tar.gz", ".zip", ".jar", ""])
def test_18_archives_unpack_to_the_expected_tree(alice: Client, unique_key: str,
                                                 tmp_path: Path, suffix: str) -> None:
    key = unique_key + suffix
    data = {".tgz": _tar("w:gz"), ".tar": _tar("w"), ".tar.gz": _tar("w:gz"), ".zip": _zip(),
            ".jar": _zip(), "": _tar("w:gz")}[suffix]
    alice.create(key, data, acl="o::r")
    with BlobCache(tmp_path / "node", client=alice) as cache:
        blob = cache.get(key, uncompress=True)
        assert blob.path.is_dir()
        assert _tree(blob.path) == TREE
        assert os.access(blob.path / "bin/run.sh", os.X_OK)
        if "tar" in suffix or suffix in (".tgz", ""):
            assert (blob.path / "lib/current/two.bin").read_bytes() == TREE[
                "lib/nested/deep/two.bin"]
        assert cache.get(key).path.read_bytes() == data
        assert cache.stats().downloads == 1


def test_18_fetch_uncompress_prints_the_directory(cluster: LocalCluster, alice: Client,
                                                  unique_key: str, tmp_path: Path) -> None:
    key = unique_key + ".jar"
    alice.create(key, _zip(), acl="o::r")
    r = fetch(cluster, key, "--cache-dir", str(tmp_path / "node"), "--uncompress", "--json")
    assert r.returncode == 0, r.stderr
    [item] = json.loads(r.stdout)
    assert _tree(Path(item["path"])) == TREE


# --------------------------------------------------------------------------------------------
# 19: LRU eviction of unreferenced blobs over the soft limit
# --------------------------------------------------------------------------------------------


def test_19_lru_unreferenced_go_first_and_referenced_never(alice: Client, unique_key: str,
                                                           tmp_path: Path) -> None:
    keys = [f"{unique_key}-{i}" for i in range(4)]
    for key in keys:
        alice.create(key, os.urandom(64 * 1024), acl="o::r")
    clock = Clock()
    cache = BlobCache(tmp_path / "node", client=alice, soft_limit_bytes=150 * 1024,
                      retention_secs=0, clock=clock)
    with cache:
        cache.get(keys[0], owner="running-job")
        for key in (keys[1], keys[2], keys[3], keys[1]):
            clock.advance(1)
            cache.get(key, owner="finished-job")
        assert cache.release("finished-job") == 3
        clock.advance(1)
        assert cache.cleanup().evicted == (), "staged first: kept until the second pass"
        report = cache.cleanup()
        # keys[2] is the least recently used, then keys[3]; two must go to fit 150 KiB.
        assert report.evicted == ((keys[2], 1), (keys[3], 1))
        assert report.total_bytes == 128 * 1024
        assert [e.key for e in cache.entries()] == [keys[0], keys[1]]
    with BlobCache(tmp_path / "node", client=alice, soft_limit_bytes=0, retention_secs=0,
                   clock=clock) as tight:
        tight.cleanup()
        assert [e.key for e in tight.entries()] == [keys[0]], "referenced: never evicted"
        assert tight.stats().evictions == 3


def test_19_keys_deleted_remotely_are_evicted_first(alice: Client, unique_key: str,
                                                    tmp_path: Path) -> None:
    old, gone = unique_key + "-old", unique_key + "-gone"
    alice.create(old, b"o" * 1000, acl="o::r")
    alice.create(gone, b"g" * 1000, acl="o::r")
    clock = Clock()
    with BlobCache(tmp_path / "node", client=alice, soft_limit_bytes=1500, retention_secs=0,
                   update_interval_secs=0, clock=clock) as cache:
        cache.get(old, owner="job")
        clock.advance(1)
        cache.get(gone, owner="job")  # the most recently used...
        cache.release("job")
        alice.delete(gone)  # ...but gone from the cluster
        clock.advance(1)
        cache.cleanup()
        assert cache.cleanup().evicted == ((gone, 1),)
        assert [e.key for e in cache.entries()] == [old]
        with pytest.raises(KeyNotFound):
            cache.get(gone)


# --------------------------------------------------------------------------------------------
# 20: two versions in a row
# --------------------------------------------------------------------------------------------


def test_20_the_job_sees_the_newest_and_old_versions_go(alice: Client, unique_key: str,
                                                        tmp_path: Path) -> None:
    alice.create(unique_key, b"version one", acl="o::r")
    cache_dir = tmp_path / "node"
    with BlobCache(cache_dir, client=alice, update_interval_secs=0) as cache:
        first = cache.get(unique_key, owner="job")
        assert first.path.read_bytes() == b"version one"
        alice.update(unique_key, b"version two")
        alice.update(unique_key, b"version three")
        newest = cache.get(unique_key, owner="job")
        assert (newest.version, newest.path.read_bytes()) == (3, b"version three")
        assert version_dirs(cache_dir, unique_key) == ["v3"]
        assert not first.path.exists()
        assert cache.version(unique_key) == 3
        assert cache.stats().removed_versions == 1


def test_20_a_version_in_use_survives_until_released(alice: Client, unique_key: str,
                                                     tmp_path: Path) -> None:
    alice.create(unique_key, b"one", acl="o::r")
    cache_dir = tmp_path / "node"
    with BlobCache(cache_dir, client=alice, update_interval_secs=0) as cache:
        old = cache.get(unique_key, owner="old-job")
        alice.update(unique_key, b"two")
        assert cache.get(unique_key, owner="new-job").version == 2
        assert old.path.read_bytes() == b"one", "a reader of the old version is undisturbed"
        assert version_dirs(cache_dir, unique_key) == ["v1", "v2"]
        cache.release("old-job")
        assert cache.cleanup().removed_versions == ((unique_key, 1),)
        assert version_dirs(cache_dir, unique_key) == ["v2"]


# --------------------------------------------------------------------------------------------
# 21: no READ, no file
# --------------------------------------------------------------------------------------------


# bob with no permission, or with WRITE and ADMIN but not READ: masters show him the metadata
# then, and the cache must not take that answer for leave to read.
@pytest.mark.parametrize("acl", ["u:alice:rwa", "u:alice:rwa,u:bob:-wa"], ids=["none", "wa"])
def test_21_a_user_without_read_gets_not_authorized(cluster: LocalCluster, alice: Client,
                                                    unique_key: str, tmp_path: Path,
                                                    acl: str) -> None:
    alice.create(unique_key, b"alice only", acl=acl)
    cache_dir = tmp_path / "node"
    with BlobCache(cache_dir, client=alice) as cache:
        assert cache.get(unique_key).path.read_bytes() == b"alice only"
    with BlobCache(cache_dir, cluster.cluster, user="bob", update_interval_secs=3600) as bob:
        for _ in range(2):
            with pytest.raises(NotAuthorized):
                bob.get(unique_key)
        stats = bob.stats()
        assert (stats.downloads, stats.hits) == (1, 0)
    r = fetch(cluster, unique_key, "--cache-dir", str(cache_dir), user="bob")
    assert r.returncode == NotAuthorized.exit_code and r.stdout == ""
    assert r.stderr.startswith("blobha: error:") and r.stderr.count("\n") == 1


@pytest.mark.parametrize("left", ["", ",u:carol:-w-"], ids=["nothing", "write"])
def test_21_revoked_read_is_enforced_on_cache_hits(cluster: LocalCluster, alice: Client,
                                                   unique_key: str, tmp_path: Path,
                                                   left: str) -> None:
    alice.create(unique_key, b"shared", acl="u:alice:rwa,u:carol:r")
    clock = Clock()
    with BlobCache(tmp_path / "node", cluster.cluster, user="carol", update_interval_secs=30,
                   clock=clock) as carol:
        carol.get(unique_key)
        alice.set_acl(unique_key, "u:alice:rwa" + left)
        clock.advance(30)
        with pytest.raises(NotAuthorized):
            carol.get(unique_key)


def test_21_a_warm_node_cache_refuses_tasks_of_a_user_without_read(
    cluster: LocalCluster, alice: Client, unique_key: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The executor path (blob_path): alice's tasks leave the node's records behind (the file
    # checked, the cluster's answer to alice); a task of bob's, within the interval and with
    # the file in place, must still ask the cluster, and be refused.
    from blobha import spark as blobspark

    alice.create(unique_key, b"alice only", acl="u:alice:rwa")

    def carrier(user: str) -> str:
        return blobspark.SparkBlobSettings.from_conf({
            blobspark.CONF_MAP: json.dumps({unique_key: {"localname": "data"}}),
            blobspark.CONF_CLUSTER: cluster.cluster,
            blobspark.CONF_USER: user,
            blobspark.CONF_CACHE_DIR: str(tmp_path / "node"),
            blobspark.CONF_UPDATE_INTERVAL: "3600",
            "spark.app.id": f"app-of-{user}",
        }).to_json()

    monkeypatch.setenv(blobspark.ENV_CONF, carrier("alice"))
    assert Path(blobspark.blob_path("data")).read_bytes() == b"alice only"
    monkeypatch.setenv(blobspark.ENV_CONF, carrier("bob"))
    for _ in range(2):
        with pytest.raises(NotAuthorized):
            blobspark.blob_path("data")
    with BlobCache(tmp_path / "node", client=alice) as cache:
        assert (cache.stats().downloads, cache.stats().hits) == (1, 0)


# --------------------------------------------------------------------------------------------
# 22: restart
# --------------------------------------------------------------------------------------------


def test_22_a_restarted_cache_rebuilds_its_index_from_disk(alice: Client, unique_key: str,
                                                           tmp_path: Path) -> None:
    plain, archive = unique_key + "-plain", unique_key + ".tgz"
    alice.create(plain, os.urandom(300_000), acl="o::r")
    alice.create(archive, _tar("w:gz"), acl="o::r")
    cache_dir = tmp_path / "node"
    with BlobCache(cache_dir, client=alice) as before:
        before.get(plain, owner="job")
        before.get(archive, uncompress=True, owner="job")
        entries = before.entries()
    with BlobCache(cache_dir, client=alice) as after:
        assert after.entries() == entries
        assert after.version(plain) == 1 and after.version(archive) == 1
        assert after.get(plain).path.read_bytes() == alice.read(plain)
        assert _tree(after.get(archive, uncompress=True).path) == TREE
        stats = after.stats()
        assert (stats.downloads, stats.hits) == (2, 2)
        assert after.release("job") == 2
        # A file damaged while no process ran is caught on first use and fetched again.
        damaged = after.get(plain).path
        damaged.chmod(0o644)
        damaged.write_bytes(b"\x00" * 300_000)
    with BlobCache(cache_dir, client=alice) as third:
        assert third.get(plain).path.read_bytes() == alice.read(plain)
        assert third.stats().corrupt == 1 and third.stats().downloads == 3


# --------------------------------------------------------------------------------------------
# blobha fetch
# --------------------------------------------------------------------------------------------


def test_fetch_end_to_end(cluster: LocalCluster, alice: Client, unique_key: str,
                          tmp_path: Path) -> None:
    a, b = unique_key + "-a", unique_key + "-b"
    alice.create(a, b"A" * 1000, acl="o::r")
    alice.create(b, b"B" * 2000, acl="o::r")
    cache_dir = tmp_path / "node"

    r = fetch(cluster, a, b, "--cache-dir", str(cache_dir))
    assert r.returncode == 0 and r.stderr == "", r.stderr
    rows = [line.split("\t") for line in r.stdout.splitlines()]
    assert [(k, v) for k, v, _ in rows] == [(a, "1"), (b, "1")]
    assert Path(rows[0][2]).read_bytes() == b"A" * 1000
    assert Path(rows[1][2]).read_bytes() == b"B" * 2000

    alice.update(a, b"newer")
    r = fetch(cluster, a, "--json", env={"BLOBHA_CACHE_DIR": str(cache_dir)})
    assert r.returncode == 0, r.stderr
    [item] = json.loads(r.stdout)
    assert (item["key"], item["version"], item["size"]) == (a, 2, 5)
    assert Path(item["path"]).read_bytes() == b"newer"
    assert not Path(rows[0][2]).exists(), "nobody references version 1 any more"

    r = fetch(cluster, unique_key + "-missing", "--cache-dir", str(cache_dir))
    assert r.returncode == KeyNotFound.exit_code and r.stdout == ""
    assert r.stderr.startswith("blobha: error:") and r.stderr.count("\n") == 1

    r = fetch(cluster, a, "--cache-dir", str(cache_dir), "--uncompress")
    assert r.returncode == 6 and "neither a tar" in r.stderr

    with BlobCache(cache_dir, client=alice) as cache:
        stats = cache.stats()
        # The refused --uncompress answered nothing: not a hit.
        assert (stats.downloads, stats.hits) == (3, 0)
        assert {(e.key, e.version, e.refs) for e in cache.entries()} == {(a, 2, 0), (b, 1, 0)}

    # Like delete, every key is tried: one missing does not leave the others unfetched.
    r = fetch(cluster, a, unique_key + "-missing", b, "--cache-dir", str(cache_dir))
    assert r.returncode == KeyNotFound.exit_code
    assert [line.split("\t")[0] for line in r.stdout.splitlines()] == [a, b]
    assert r.stderr.count("\n") == 1 and "-missing" in r.stderr


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="needs Linux /proc/locks")
def test_fetch_waits_while_another_process_downloads(cluster: LocalCluster, alice: Client,
                                                     unique_key: str, tmp_path: Path) -> None:
    # Holding the key's lock file, as a downloading process does, makes fetch wait on it;
    # once it is let go, fetch serves the installed copy without downloading again.
    alice.create(unique_key, b"data", acl="o::r")
    cache_dir = tmp_path / "node"
    with BlobCache(cache_dir, client=alice) as cache:
        cache.get(unique_key)
    lock_path = cache_dir / "locks" / f"{key_dirname(unique_key)}.lock"
    fd = os.open(lock_path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    env = {**os.environ, "BLOBHA_CLUSTER": cluster.cluster, "BLOBHA_USER": "alice"}
    try:
        proc = subprocess.Popen([BLOBHA, "fetch", unique_key, "--cache-dir", str(cache_dir)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env)
        wait_until(lambda: _blocked_on(proc.pid, lock_path), 30, "fetch to wait on the lock")
        assert proc.poll() is None
    finally:
        os.close(fd)  # lets the waiter in
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.startswith(f"{unique_key}\t1\t")
    with BlobCache(cache_dir, client=alice) as cache:
        assert (cache.stats().downloads, cache.stats().hits) == (1, 1)


def _blocked_on(pid: int, path: Path) -> bool:
    """Whether ``pid`` waits for a flock on ``path`` (blocked requests are the "->" lines)."""
    inode = os.stat(path).st_ino
    return any("->" in line and f" {pid} " in line and f":{inode} " in line
               for line in Path("/proc/locks").read_text().splitlines())
