"""The command line against a TLS cluster (issue 46 §3): a plain-text command is told at once
that the masters speak TLS (exit 16, with --ca as the fix) instead of retrying for its whole
timeout; a peer that closes every connection and speaks no TLS stays "unavailable" (exit 11);
and a client profile carries the TLS settings."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.clusters import running_cluster

from blobha.ops.localcluster import LocalCluster

pytestmark = pytest.mark.integration

BLOBHA = str(Path(sys.executable).with_name("blobha"))


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with running_cluster(tmp_path_factory.mktemp("tls-cli"), tls=True) as c:
        yield c


def run(*args: str, timeout: float = 120, stdin: bytes | None = None,
        **env: str) -> tuple[subprocess.CompletedProcess[str], float]:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("BLOBHA_") and k != "XDG_CONFIG_HOME"}
    started = time.monotonic()
    r = subprocess.run([BLOBHA, *args], capture_output=True, env={**clean, **env},
                       input=None if stdin is None else stdin.decode(), text=True,
                       timeout=timeout)
    return r, time.monotonic() - started


@pytest.mark.parametrize("args", [("list",), ("cat", "k"), ("put", "k"), ("cluster",)])
def test_plain_text_against_tls_fails_fast_suggesting_ca(secure: LocalCluster,
                                                         args: tuple[str, ...],
                                                         tmp_path: Path) -> None:
    r, took = run("--cluster", secure.cluster, *args, stdin=b"x", HOME=str(tmp_path))
    assert r.returncode == 16, r.stderr
    assert took < 5.0, (took, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1, lines
    assert "uses TLS and this client does not; pass --ca / BLOBHA_CA" in lines[0]
    r, _ = run("--cluster", secure.cluster, *args, "--json", stdin=b"x", HOME=str(tmp_path))
    if args[0] != "cat":  # cat to stdout takes no --json
        assert json.loads(r.stdout)["error"]["code"] == "tls_mismatch"


@contextlib.contextmanager
def closing_at_once() -> Iterator[str]:
    """A listener that closes every connection at once and speaks no TLS: a proxy with no
    master behind it."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=10)
        server.close()


def test_a_peer_closing_connections_without_tls_is_unavailable(tmp_path: Path) -> None:
    with closing_at_once() as address:
        r, took = run("--cluster", address, "--timeout", "3", "list", HOME=str(tmp_path))
    assert r.returncode == 11, r.stderr
    assert "if the masters use TLS, pass --ca" in r.stderr
    assert took < 30


def test_a_profile_holds_the_tls_settings(secure: LocalCluster, tmp_path: Path) -> None:
    creds = secure.credentials("alice")
    config = tmp_path / "blobha"
    config.mkdir()
    # Relative paths in the file: to the file's directory.
    shutil.copy(creds.ca or "", config / "ca.pem")
    shutil.copy(creds.token_file or "", config / "alice.token")
    (config / "client.toml").write_text(
        f'[profiles.secure]\ncluster = "{secure.cluster}"\nca = "ca.pem"\n'
        'token_file = "alice.token"\n')
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path)}
    r, _ = run("--profile", "secure", "put", "tls-profiled", stdin=b"over tls", **env)
    assert r.returncode == 0, r.stderr
    r, _ = run("cat", "tls-profiled", BLOBHA_PROFILE="secure", **env)
    assert r.returncode == 0 and r.stdout == "over tls", r.stderr
    # The same profile without its CA: told at once.
    (config / "client.toml").write_text(f'[default]\ncluster = "{secure.cluster}"\n')
    r, took = run("cat", "tls-profiled", **env)
    assert r.returncode == 16 and took < 5.0, r.stderr
