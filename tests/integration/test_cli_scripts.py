"""The `blobha` command as scripts use it (issue 46 §3), against a real cluster: put and stat,
long listings, and failing fast when no master answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
