"""Another OS account on a node reads nothing of the node cache: the blobs are whatever their
users may read, and each version's meta.json holds the key peers' grants verify under."""

from __future__ import annotations

import os
import pwd
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from support.harness import client_for

from blobha.cache import BlobCache
from blobha.ops.localcluster import LocalCluster

BLOBHA = str(Path(sys.executable).with_name("blobha"))


def _nobody() -> int:
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        pytest.fail("no 'nobody' account to play the other OS account")


def _can_read_as(uid: int, path: Path) -> bool:
    """Whether a process of OS account ``uid`` can read ``path`` (needs root to switch)."""
    proc = subprocess.run(["head", "-c", "1", str(path)], capture_output=True, timeout=60,
                          user=uid, cwd="/")
    return proc.returncode == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another OS account needs root")
def test_another_os_account_reads_no_cached_blob_nor_its_meta(
        cluster: LocalCluster, tmp_path: Path) -> None:
    key = f"private-{os.getpid()}"
    with client_for(cluster, "alice") as alice:
        alice.create(key, b"secret model weights", acl="u:alice:rwa")
    tmp_path.chmod(0o755)  # the account can reach the cache's parent, as under /var
    root = tmp_path / "cache"
    with BlobCache(root, cluster.cluster, user="alice") as cache:
        blob = cache.get(key)
    meta = next(root.rglob("meta.json"))
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    nobody = _nobody()
    assert not _can_read_as(nobody, blob.path)
    assert not _can_read_as(nobody, meta)
    assert _can_read_as(0, blob.path)  # the check itself can succeed


def test_a_root_an_older_release_left_open_is_closed_to_others(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir(mode=0o755)
    root.chmod(0o775)
    with BlobCache(root, "127.0.0.1:1"):
        pass
    assert stat.S_IMODE(root.stat().st_mode) == 0o770  # a group keeps what it had


@pytest.mark.skipif(os.geteuid() != 0, reason="a directory of another OS account needs root")
def test_a_cache_root_another_account_made_first_is_refused(tmp_path: Path) -> None:
    # The attack: another account makes the cache's path first (a shared /tmp path), open to
    # it, with a LAYOUT that makes it look like a cache. Used, it would read every blob this
    # account caches there and could swap them.
    tmp_path.chmod(0o1777)
    root = tmp_path / "blobha-cache"
    root.mkdir()
    (root / "LAYOUT").write_text("blobha-cache 1\n")
    nobody = _nobody()
    os.chown(root / "LAYOUT", nobody, nobody)
    os.chown(root, nobody, nobody)
    root.chmod(0o777)
    proc = subprocess.run([BLOBHA, "--cluster", "127.0.0.1:1", "--user", "alice", "fetch", "k",
                           "--cache-dir", str(root)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 6, proc.stderr  # invalid argument, at start
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{root} belongs to another account ('nobody'" in lines[0]
    assert "--cache-dir" in lines[0]
    assert os.listdir(root) == ["LAYOUT"]  # nothing of ours went in
