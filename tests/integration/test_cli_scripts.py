"""The `blobha` command as scripts use it (issue 46 §3), against a real cluster: put and stat,
long listings, and failing fast when no master answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from blobha.ops.localcluster import LocalCluster

pytestmark = pytest.mark.integration

BLOBHA = str(Path(sys.executable).with_name("blobha"))


def run(cluster: LocalCluster, *args: str, stdin: bytes | None = None,
        user: str = "alice") -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "BLOBHA_CLUSTER": cluster.cluster, "BLOBHA_USER": user}
    return subprocess.run([BLOBHA, *args], input=stdin, capture_output=True, env=env,
                          timeout=120)


def test_put_stat_and_long_listing(cluster: LocalCluster, tmp_path: Path) -> None:
    r = run(cluster, "put", "scripts-put", "-a", "u:alice:rwa,o::r", "-r", "2", stdin=b"one")
    assert r.returncode == 0, r.stderr
    src = tmp_path / "two"
    src.write_bytes(b"second")
    r = run(cluster, "put", "scripts-put", "-f", str(src), "--wait-replication", "2",
            "--timeout", "30")
    assert r.returncode == 0, r.stderr
    assert run(cluster, "cat", "scripts-put").stdout == b"second"
    stat = json.loads(run(cluster, "stat", "scripts-put", "--json").stdout)
    assert (stat["version"], stat["size"], stat["replication_factor"]) == (2, 6, 2)
    assert stat["acl"][:2] == ["u:alice:rwa", "o::r--"]  # the create's ACL, kept by the update

    r = run(cluster, "list", "-l", "--prefix", "scripts-put")
    assert r.returncode == 0, r.stderr
    key, version, size, updated, replication = r.stdout.decode().strip().split("\t")
    assert (key, version, size) == ("scripts-put", "2", "6") and int(replication) >= 1
    assert datetime.fromisoformat(updated).utcoffset() is not None
    rows = json.loads(run(cluster, "list", "-l", "--json", "--prefix", "scripts-put").stdout)
    assert rows == [{"key": "scripts-put", "version": 2, "size": 6, "updated": updated,
                     "replication": int(replication)}]


def test_every_command_speaks_json(cluster: LocalCluster, tmp_path: Path) -> None:
    key = "scripts-json"
    src = tmp_path / "src"
    src.write_bytes(b"payload")

    spoken: set[str] = set()

    def ok(*args: str, stdin: bytes | None = None) -> object:
        spoken.add(args[0])
        r = run(cluster, *args, "--json", stdin=stdin)
        assert r.returncode == 0, (args, r.stdout, r.stderr)
        return json.loads(r.stdout)

    written = ok("create", key, "-f", str(src), "-r", "2")
    assert isinstance(written, dict) and (written["version"], written["size"]) == (1, 7)
    assert len(written["digest"]) == 32
    assert ok("update", key, stdin=b"v2") == {**written, "version": 2, "size": 2,
                                               "digest": ok("meta", key)["digest"]}  # type: ignore[index]
    put = ok("put", key, "-f", str(src))
    assert isinstance(put, dict) and (put["version"], put["digest"]) == (3, written["digest"])
    got = ok("cat", key, "-f", str(tmp_path / "out"))
    assert got == {**put, "path": str(tmp_path / "out")}
    assert (tmp_path / "out").read_bytes() == b"payload"
    fetched = ok("fetch", key, "--cache-dir", str(tmp_path / "cache"))
    assert isinstance(fetched, list) and Path(fetched[0]["path"]).read_bytes() == b"payload"
    assert key in ok("list")  # type: ignore[operator]
    assert ok("list", "-l", "--prefix", key)[0]["version"] == 3  # type: ignore[index]
    assert ok("stat", key) == ok("meta", key)
    acl = ok("set-acl", key, "-s", "u:alice:rwa,o::r")
    assert isinstance(acl, dict) and acl["acl"][:2] == ["u:alice:rwa", "o::r--"]
    factor = ok("replication", "--update", "-r", "3", key)
    assert isinstance(factor, dict) and factor["replication_factor"] == 3
    waited = ok("wait-replication", key, "--min", "1", "--timeout", "30")
    assert isinstance(waited, dict) and waited["reached"] is True
    assert waited["keys"][0]["key"] == key and waited["keys"][0]["replication"] >= 1
    read = ok("replication", "--read", key)
    assert isinstance(read, dict) and read["replication"] >= 1 and read["holders"]
    summary = ok("cluster")
    assert isinstance(summary, dict) and summary["leader"]
    health = ok("health", cluster.masters[0].address)
    assert isinstance(health, dict) and health["address"] == cluster.masters[0].address
    made = ok("token", "create", "carol")
    assert isinstance(made, dict) and made["user"] == "carol"
    hashed = ok("token", "hash", stdin=made["token"].encode())
    assert isinstance(hashed, dict) and hashed["user"] == "carol" and "token" not in hashed
    assert ok("delete", key) == [{"key": key, "deleted": True}]
    script = ok("completion", "bash")
    assert isinstance(script, dict) and "wait-replication" in script["script"]
    # Only an admin may rotate the cluster secret (this cluster has none): refused, in JSON.
    r = run(cluster, "admin", "rotate-secret", "--json")
    assert r.returncode == 5, (r.stdout, r.stderr)
    assert json.loads(r.stdout)["error"]["code"] == "not_authorized"
    spoken.add("admin")

    # Every command of "blobha --help" was heard above, but for those that run until stopped
    # (serve, local-cluster), spark-submit (whose options are spark-submit's launcher's) and
    # bench (tests/integration/test_bench_smoke.py reads its --json).
    exempt = {"serve", "local-cluster", "spark-submit", "bench"}
    assert set(_commands()) - spoken - exempt == set()

    # Errors: JSON on stdout, the usual exit status, nothing on stderr to parse.
    for args, status, code in ((("cat", key, "-f", str(tmp_path / "gone")), 3, "key_not_found"),
                               (("create", "bad/key"), 6, "invalid_argument"),
                               (("list", "--no-such-option"), 2, "usage")):
        r = run(cluster, *args, "--json", stdin=b"x")
        assert r.returncode == status, (args, r.stdout, r.stderr)
        error = json.loads(r.stdout)["error"]
        assert (error["code"], error["exit"]) == (code, status) and error["message"]


def _commands() -> list[str]:
    """The commands "blobha --help" lists (aliases left out)."""
    import argparse

    from blobha.cli import build_parser

    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return [choice.dest for choice in action._choices_actions]
    raise AssertionError("no commands")


def test_no_master_answering_fails_fast_naming_it() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("BLOBHA_CLUSTER", "BLOBHA_TIMEOUT")}
    start = time.monotonic()
    r = subprocess.run([BLOBHA, "--cluster", "127.0.0.1:1", "list"], capture_output=True,
                       env=env, timeout=60)
    took = time.monotonic() - start
    assert r.returncode == 11, r.stderr
    assert took < 5.0, took
    assert b"none of the 1 masters answered (127.0.0.1:1: " in r.stderr
    assert b"Connection refused" in r.stderr

