"""The `blobha` command as users run it, against real clusters (the issue's "done when")."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.harness import SESSION_TIMEOUT_MS, wait_until

from blobha.ops.localcluster import LocalCluster

pytestmark = pytest.mark.integration

BLOBHA = str(Path(sys.executable).with_name("blobha"))


def run(cluster: LocalCluster, *args: str, stdin: bytes | None = None, user: str = "alice",
        cwd: Path | None = None) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "BLOBHA_CLUSTER": cluster.cluster, "BLOBHA_USER": user}
    return subprocess.run([BLOBHA, *args], input=stdin, capture_output=True, env=env,
                          timeout=120, cwd=cwd)


def test_create_wait_cat_cluster_then_kill_the_leader(fresh_cluster: LocalCluster,
                                                      tmp_path: Path) -> None:
    blobs = {}
    for i in range(3):
        path = tmp_path / f"blob{i}.bin"
        path.write_bytes(os.urandom(1024 * 1024))
        blobs[f"k{i}"] = path
        r = run(fresh_cluster, "create", f"k{i}", "-f", str(path), "--replication-factor", "3")
        assert r.returncode == 0, r.stderr
    r = run(fresh_cluster, "wait-replication", *blobs, "--min", "3", "--timeout", "5")
    assert r.returncode == 0, r.stderr

    r = run(fresh_cluster, "cluster", "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert len(summary["masters"]) == 3
    assert sum(m["is_leader"] for m in summary["masters"]) == 1
    table = run(fresh_cluster, "cluster").stdout.decode()
    assert table.count("leader") >= 1 and all(m.address in table for m in fresh_cluster.masters)

    old = fresh_cluster.leader()
    old.kill()
    t0 = time.monotonic()

    def new_leader() -> str:
        r = run(fresh_cluster, "cluster", "--json")
        leader = json.loads(r.stdout)["leader"] if r.returncode == 0 else ""
        return leader if leader and leader != old.address else ""
    wait_until(new_leader, SESSION_TIMEOUT_MS / 1000 + 2 + 5, "blobha cluster to name a new leader")
    print(f"blobha cluster named a new leader {time.monotonic() - t0:.2f}s after kill -9")
    for key, path in blobs.items():
        out = tmp_path / f"{key}.out"
        r = run(fresh_cluster, "cat", key, "-f", str(out))
        assert r.returncode == 0, r.stderr
        assert out.read_bytes() == path.read_bytes()
        r = run(fresh_cluster, "cat", key)
        assert r.stdout == path.read_bytes()


@pytest.mark.smoke
def test_commands_and_exit_codes(cluster: LocalCluster, tmp_path: Path) -> None:
    r = run(cluster, "create", "cli-key", "-a", "u:alice:rwa,o::r", stdin=b"from stdin")
    assert r.returncode == 0, r.stderr
    assert run(cluster, "cat", "cli-key").stdout == b"from stdin"
    assert "cli-key" in run(cluster, "list").stdout.decode().splitlines()
    meta = json.loads(run(cluster, "meta", "cli-key", "--json").stdout)
    assert meta["version"] == 1 and meta["size"] == len(b"from stdin")
    r = run(cluster, "update", "cli-key", stdin=b"v2")
    assert r.returncode == 0, r.stderr
    assert run(cluster, "replication", "--read", "cli-key").returncode == 0
    r = run(cluster, "replication", "--update", "--replication-factor", "2", "cli-key")
    assert r.returncode == 0, r.stderr
    assert run(cluster, "set-acl", "cli-key", "-s", "u:alice:rwa").returncode == 0

    # Errors: one line, no traceback, the documented exit code.
    r = run(cluster, "cat", "cli-key", user="mallory")
    assert r.returncode == 5 and b"Traceback" not in r.stderr
    assert len(r.stderr.decode().strip().splitlines()) == 1
    # Listings show mallory only keys she may read (the default visibility), named or not.
    for listing in (("list",), ("list", "cli-key")):
        r = run(cluster, *listing, user="mallory")
        assert r.returncode == 0 and "cli-key" not in r.stdout.decode().split(), listing
    assert run(cluster, "cat", "no-such-key").returncode == 3
    assert run(cluster, "create", "cli-key", stdin=b"again").returncode == 4
    assert run(cluster, "create", "bad/key", stdin=b"x").returncode == 6
    # Bytes that are not UTF-8 (as a shell passes $'\xff'): a usage error (6), not an
    # internal one (14, "report it").
    bad = os.fsdecode(b"k\xff")
    r = run(cluster, "cat", bad)
    assert r.returncode == 6 and b"not valid UTF-8" in r.stderr, r.stderr
    r = run(cluster, "create", "utf8-acl", "-a", f"u:{bad}:r", stdin=b"x")
    assert r.returncode == 6 and b"valid UTF-8" in r.stderr, r.stderr
    r = run(cluster, "wait-replication", "cli-key", "--min", "4", "--timeout", "1")
    assert r.returncode == 12
    assert run(cluster, "delete", "cli-key").returncode == 0
    assert run(cluster, "cat", "cli-key").returncode == 3


def test_cat_into_a_pipe_a_link_or_a_long_name(cluster: LocalCluster, tmp_path: Path) -> None:
    # cat -f wrote a temporary file beside the path and renamed it over the path: a named pipe
    # (or /dev/null, /dev/stdout as root) was replaced by a file and its reader hung, a link
    # was replaced instead of its target, and a long valid name failed (temporary too long).
    assert run(cluster, "create", "cat-into", stdin=b"some bytes").returncode == 0
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    r = run(cluster, "cat", "cat-into", "-f", str(fifo))
    assert r.returncode == 0, r.stderr
    reader.join(30)
    assert got == [b"some bytes"] and stat.S_ISFIFO(fifo.lstat().st_mode)

    target = tmp_path / "target.bin"
    target.write_bytes(b"old")
    link = tmp_path / "link.bin"
    link.symlink_to(target)
    assert run(cluster, "cat", "cat-into", "-f", str(link)).returncode == 0
    assert link.is_symlink() and target.read_bytes() == b"some bytes"

    long_name = tmp_path / ("n" * 250)
    r = run(cluster, "cat", "cat-into", "-f", str(long_name))
    assert r.returncode == 0, r.stderr
    assert long_name.read_bytes() == b"some bytes"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["fifo", "target.bin", "link.bin", "n" * 250])


def test_sigterm_during_cat_removes_the_partial_file(cluster: LocalCluster,
                                                     tmp_path: Path) -> None:
    # SIGTERM (a timeout, a service manager) killed the command outright: its hidden partial
    # file stayed beside the destination. The masters are frozen so the download is surely
    # under way (its partial file made, its first call unanswered) when the signal comes.
    assert run(cluster, "create", "cat-term", stdin=b"bytes never fetched").returncode == 0
    out = tmp_path / "out.bin"
    env = {**os.environ, "BLOBHA_CLUSTER": cluster.cluster, "BLOBHA_USER": "alice"}
    frozen = []
    try:
        for m in cluster.masters:
            m.signal(signal.SIGSTOP)
            frozen.append(m)
        child = subprocess.Popen([BLOBHA, "cat", "cat-term", "-f", str(out)], env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            wait_until(lambda: list(tmp_path.glob(".out.bin.*.part")), 30, "the partial file")
            child.send_signal(signal.SIGTERM)
            code = child.wait(timeout=30)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    finally:
        for m in frozen:
            m.signal(signal.SIGCONT)
    assert child.stderr is not None
    err = child.stderr.read().decode(errors="replace")
    assert code == 143, err
    assert err.strip() == "blobha: error: terminated" and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_health_asks_one_master_directly(cluster: LocalCluster) -> None:
    leader = cluster.leader()
    follower = next(m for m in cluster.masters if m is not leader)
    r = run(cluster, "health", leader.address)
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().startswith(f"ok {leader.address} leader epoch ")
    r = run(cluster, "health", follower.address)
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().startswith(f"ok {follower.address} follower blobs "), r.stdout
    status = json.loads(run(cluster, "health", follower.address, "--json").stdout)
    assert status["address"] == follower.address and status["is_leader"] is False
    # A master that does not answer is "unavailable" (exit 11), in one line.
    r = run(cluster, "health", "127.0.0.1:1")
    assert r.returncode == 11 and b"Traceback" not in r.stderr


@pytest.mark.parametrize("background", [False, True], ids=["terminal", "background-job"])
def test_local_cluster_command_starts_and_stops_cleanly(tmp_path: Path, background: bool) -> None:
    data = tmp_path / "local"
    command = [BLOBHA, "local-cluster", "--data-dir", str(data), "--base-port", "0"]
    if background:
        # A shell starts background jobs with SIGINT ignored, and exec keeps an ignored
        # signal ignored; Ctrl-C must still work then. A shell sets it up rather than a
        # preexec_fn, which runs Python in a fork of this multi-threaded test process.
        command = ["sh", "-c", 'trap "" INT; exec "$0" "$@"', *command]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            cwd=tmp_path)
    output: list[str] = []
    try:
        assert proc.stdout is not None
        cluster = ""
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not cluster:
            line = proc.stdout.readline().decode()
            if not line:
                break
            output.append(line)
            if "export BLOBHA_CLUSTER=" in line:
                cluster = line.split("=", 1)[1].strip()
        assert cluster, (
            f"local-cluster never printed BLOBHA_CLUSTER (exit {proc.poll()}):\n"
            + "".join(output)
        )
        env = {**os.environ, "BLOBHA_CLUSTER": cluster}
        r = subprocess.run([BLOBHA, "cluster", "--json"], capture_output=True, env=env,
                           timeout=60)
        summary = json.loads(r.stdout)
        assert len(summary["masters"]) == 3 and summary["leader"]
        pids = _children(proc.pid)
        assert len(pids) >= 4  # ZooKeeper and three masters
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        proc.wait(60)
    assert proc.returncode == 0
    wait_until(lambda: not any(_alive(p) for p in pids), 30, "every child to exit")


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True)
    return [int(x) for x in out.stdout.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_storm_acl_spellings_grant_what_they_say(cluster: LocalCluster) -> None:
    # Storm's longer and shorter entry forms: user:, other:, NAME:PERMS and PERMS alone.
    r = run(cluster, "create", "storm-acl", "-a", "user:alice:rwa,bob:r", stdin=b"spelled")
    assert r.returncode == 0, r.stderr
    meta = json.loads(run(cluster, "meta", "storm-acl", "--json").stdout)
    assert meta["acl"] == ["u:alice:rwa", "u:bob:r--"]
    assert run(cluster, "cat", "storm-acl", user="bob").stdout == b"spelled"
    assert run(cluster, "cat", "storm-acl", user="mallory").returncode == 5
    assert run(cluster, "update", "storm-acl", stdin=b"no", user="bob").returncode == 5

    r = run(cluster, "set-acl", "storm-acl", "-s", "user:alice:rwa,other::r")
    assert r.returncode == 0, r.stderr
    assert run(cluster, "cat", "storm-acl", user="mallory").stdout == b"spelled"
    r = run(cluster, "set-acl", "storm-acl", "-s", "alice:rwa,-")
    assert r.returncode == 0, r.stderr
    assert run(cluster, "cat", "storm-acl", user="mallory").returncode == 5

    # "o:r" reads as a user named "o" in Storm; here it is refused, saying what to write.
    r = run(cluster, "set-acl", "storm-acl", "-s", "o:r")
    assert r.returncode == 6 and b"Traceback" not in r.stderr
    assert b"o::r" in r.stderr and b"ambiguous" in r.stderr
    meta = json.loads(run(cluster, "meta", "storm-acl", "--json").stdout)
    assert meta["acl"] == ["u:alice:rwa", "o::---"]


def test_a_file_argument_that_is_a_pipe_is_read_as_a_stream(cluster: LocalCluster,
                                                            tmp_path: Path) -> None:
    # -f /dev/stdin, a named pipe or a shell's <(command) cannot seek: that failed with
    # "Illegal seek" (exit 1) before anything was sent.
    data = os.urandom(300 * 1024)
    r = run(cluster, "create", "from-dev-stdin", "-f", "/dev/stdin", stdin=data)
    assert r.returncode == 0, r.stderr
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    source = tmp_path / "reversed"
    source.write_bytes(data[::-1])
    # The writer blocks opening the pipe until the command opens it to read.
    writer = subprocess.Popen(["sh", "-c", 'cat "$0" > "$1"', str(source), str(fifo)])
    try:
        r = run(cluster, "update", "from-dev-stdin", "-f", str(fifo))
        assert writer.wait(timeout=60) == 0
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    assert r.returncode == 0, r.stderr
    assert run(cluster, "cat", "from-dev-stdin").stdout == data[::-1]
    meta = json.loads(run(cluster, "meta", "from-dev-stdin", "--json").stdout)
    assert meta["version"] == 2 and meta["size"] == len(data)


def test_metadata_is_shown_to_writers_and_admins_and_reading_takes_read(
        cluster: LocalCluster, tmp_path: Path) -> None:
    # As Storm's getBlobMeta: any permission shows the metadata. Before, READ was needed: an
    # admin-only user could not run set-acl without -s (it re-reads the ACL), and a writer's
    # delete could not name the key it meant.
    acl = "u:alice:rwa,u:wendy:-w-,u:adam:--a"
    assert run(cluster, "create", "meta-perms", "-a", acl, stdin=b"secret").returncode == 0
    for user, access in (("wendy", "-w-"), ("adam", "--a"), ("alice", "rwa")):
        r = run(cluster, "meta", "meta-perms", "--json", user=user)
        assert r.returncode == 0, r.stderr
        meta = json.loads(r.stdout)
        assert meta["version"] == 1 and meta["access"] == access
        assert bool(meta["digest"]) == (user == "alice")  # READ alone sees the digest
    shown = run(cluster, "meta", "meta-perms", user="wendy").stdout.decode()
    assert re.search(r"^your access: +-w-$", shown, re.MULTILINE), shown
    assert re.search(r"^digest: +- \(needs READ\)$", shown, re.MULTILINE), shown
    # Reading the blob, through the cluster or the node cache, still takes READ.
    for args in (("cat", "meta-perms"), ("fetch", "meta-perms", "--cache-dir", str(tmp_path)),
                 ("replication", "--read", "meta-perms")):
        r = run(cluster, *args, user="wendy")
        assert r.returncode == 5 and b"READ" in r.stderr and r.stdout == b"", (args, r.stderr)
    # The default listing shows only readable keys; so does a listing by name.
    assert run(cluster, "list", "meta-perms", user="wendy").stdout == b""
    assert run(cluster, "list", "meta-perms", user="alice").stdout == b"meta-perms\n"
    r = run(cluster, "meta", "meta-perms", user="mallory")
    assert r.returncode == 5 and b"any of READ, WRITE or ADMIN" in r.stderr
    # set-acl without -s sets the ACL read again: an admin-only user can do it now.
    before = json.loads(run(cluster, "meta", "meta-perms", "--json").stdout)
    r = run(cluster, "set-acl", "meta-perms", user="adam")
    assert r.returncode == 0, r.stderr
    after = json.loads(run(cluster, "meta", "meta-perms", "--json").stdout)
    assert after["meta_version"] > before["meta_version"] and after["acl"] == before["acl"]
