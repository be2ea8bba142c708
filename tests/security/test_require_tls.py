"""A token sent in clear because --ca was forgotten: with TLS required (an option, a variable
or the profile), a client refuses before it connects to anything, so no credential leaves the
machine; without it, the same client connects and sends its token."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.harness import client_for
from test_zookeeper_tls import RecordingProxy

from blobha.client import Client
from blobha.core.auth import new_token
from blobha.core.errors import BlobError, InvalidArgument
from blobha.ops.localcluster import LocalCluster
from blobha.wire.credentials import Credentials

BLOBHA = str(Path(sys.executable).with_name("blobha"))


class Listener:
    """A plain TCP server on 127.0.0.1 that counts the connections made to it and the bytes
    they sent."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self.received = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            conn.settimeout(1)
            try:
                while data := conn.recv(65536):
                    self.received += len(data)
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.sock.close()


@pytest.fixture
def listener() -> object:
    server = Listener()
    yield server
    server.close()


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "alice.token"
    path.write_text(new_token("alice") + "\n")
    path.chmod(0o600)
    return path


def test_a_client_that_requires_tls_sends_nothing_without_a_ca(
        listener: Listener, token_file: Path) -> None:
    creds = Credentials(token_file=str(token_file), require_tls=True)
    with pytest.raises(InvalidArgument, match=r"TLS is required .* pass --ca"):
        Client(listener.address, credentials=creds, timeout=2)
    assert listener.connections == 0
    # The same client without the requirement connects, token and all.
    with Client(listener.address, credentials=Credentials(token_file=str(token_file)),
                timeout=2, unreachable_after=2) as c, pytest.raises(BlobError):
        c.cluster_summary()
    assert listener.connections > 0 and listener.received > 0


@pytest.mark.parametrize("how", ["option", "variable", "profile"])
def test_the_cli_requires_tls_by_option_variable_or_profile(
        listener: Listener, token_file: Path, tmp_path: Path, how: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLOBHA_")}
    env["BLOBHA_CONFIG"] = str(tmp_path / "client.toml")
    (tmp_path / "client.toml").write_text("[default]\n" + (
        "require_tls = true\n" if how == "profile" else ""))
    args = [BLOBHA, "--cluster", listener.address, "--token-file", str(token_file), "cat", "k"]
    if how == "option":
        args.insert(1, "--require-tls")
    if how == "variable":
        env["BLOBHA_REQUIRE_TLS"] = "1"
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 6, proc.stderr  # invalid argument (docs/cli.md)
    assert "TLS is required" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert listener.connections == 0


# ---- every client path: fsspec and Spark's executors, against a real plaintext cluster -------


@pytest.fixture
def recording(cluster: LocalCluster) -> Iterator[RecordingProxy]:
    """A proxy in front of one master of the (plaintext) cluster: what would cross the
    network, and whether anything did."""
    host, port = cluster.masters[0].address.rsplit(":", 1)
    proxy = RecordingProxy((host, int(port)))
    yield proxy
    proxy.stop()


def _no_variables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in [n for n in os.environ if n.startswith("BLOBHA_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("BLOBHA_CONFIG", str(tmp_path / "no-profile.toml"))
    (tmp_path / "no-profile.toml").write_text("[default]\n")


@pytest.mark.parametrize("how", ["storage option", "variable", "profile"])
def test_fsspec_that_requires_tls_sends_nothing_to_a_plaintext_cluster(
        recording: RecordingProxy, cluster: LocalCluster, token_file: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    fsspec = pytest.importorskip("fsspec")
    _no_variables(monkeypatch, tmp_path)
    with client_for(cluster, "alice") as alice:
        alice.create(f"fs-tls-{how}", b"x", acl="u:alice:rwa")
    options: dict[str, object] = {"cluster": recording.address, "token_file": str(token_file),
                                  "skip_instance_cache": True}
    if how == "storage option":
        options["require_tls"] = True
    elif how == "variable":
        monkeypatch.setenv("BLOBHA_REQUIRE_TLS", "1")
    else:
        (tmp_path / "no-profile.toml").write_text("[default]\nrequire_tls = true\n")
    with pytest.raises(InvalidArgument, match=r"TLS is required .* pass --ca"):
        fsspec.filesystem("blobha", **options).ls("")
    assert recording.captured == b""
    # The same filesystem without the requirement reaches the cluster, token and all: what
    # the refusal kept off the network.
    monkeypatch.delenv("BLOBHA_REQUIRE_TLS", raising=False)
    (tmp_path / "no-profile.toml").write_text("[default]\n")
    options["require_tls"] = False
    fs = fsspec.filesystem("blobha", **options)
    try:
        assert f"fs-tls-{how}" in fs.ls("", detail=False)
    finally:
        fs.client.close()
    assert token_file.read_text().strip().encode() in recording.captured


_EXECUTOR = """
import sys
from blobha.spark import blob_path
try:
    blob_path("side.txt")
except Exception as exc:
    print(type(exc).__name__, exc, file=sys.stderr)
    sys.exit(3)
"""


@pytest.mark.parametrize("required_by", ["launcher", "node"])
def test_an_executor_that_requires_tls_sends_no_job_token_to_a_plaintext_cluster(
        recording: RecordingProxy, cluster: LocalCluster, tmp_path: Path,
        required_by: str) -> None:
    # A Python worker as Spark starts it: the launcher's spark.executorEnv.* in its
    # environment (the job token; BLOBHA_REQUIRE_TLS when the launcher required TLS), or the
    # node's own BLOBHA_REQUIRE_TLS. No CA reached it: the cluster is plaintext.
    from blobha.core.auth import new_job_token
    from blobha.spark.blobmap import BlobSpec
    from blobha.spark.conf import ENV_CONF
    from blobha.spark.jobcode import secret_properties
    from blobha.spark.settings import SparkBlobSettings

    with client_for(cluster, "alice") as alice:
        alice.create(f"executor-tls-{required_by}", b"7", acl="u:alice:rwa,o::r")
    token = new_job_token()[0]
    executor_env = {k.removeprefix("spark.executorEnv."): v for k, v in secret_properties(
        token, None, require_tls=required_by == "launcher").items()
        if k.startswith("spark.executorEnv.")}
    settings = SparkBlobSettings(
        blobs=(BlobSpec(f"executor-tls-{required_by}", "side.txt"),), cluster=recording.address,
        user="alice", cache_dir=str(tmp_path / "cache"), client_timeout_secs=5, app_id="app-1")
    (tmp_path / "client.toml").write_text("[default]\n")  # the node's profile: no opinion
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLOBHA_")}
    env.update(executor_env, **{ENV_CONF: settings.to_json(),
                                "BLOBHA_CONFIG": str(tmp_path / "client.toml")})
    if required_by == "node":
        env["BLOBHA_REQUIRE_TLS"] = "1"
    proc = subprocess.run([sys.executable, "-c", _EXECUTOR], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 3, proc.stderr
    assert "TLS is required" in proc.stderr
    assert recording.captured == b""
    # Without the requirement the same worker sends its job token in clear.
    env.pop("BLOBHA_REQUIRE_TLS")
    proc = subprocess.run([sys.executable, "-c", _EXECUTOR], capture_output=True, text=True,
                          timeout=60, env=env)
    assert token.encode() in recording.captured, proc.stderr
