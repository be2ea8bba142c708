"""A token file or TLS key that other accounts can read is refused at start, as ssh refuses an
unprotected private key: before the client connects to anything, so no credential from it
leaves the machine; at mode 600 the same client connects. ``blobha token job --out`` writes
its token where the clients take it: a file of mode 600."""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.clusters import running_cluster
from support.harness import wait_until
from test_require_tls import Listener

from blobha.client import Client
from blobha.core.auth import new_token
from blobha.core.errors import InvalidArgument
from blobha.ops.localcluster import LocalCluster
from blobha.wire.credentials import Credentials

BLOBHA = [sys.executable, "-m", "blobha"]


@pytest.fixture
def listener() -> Iterator[Listener]:
    server = Listener()
    yield server
    server.close()


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("BLOBHA_")}


def _key_pair(tmp_path: Path) -> tuple[Path, Path, Path]:
    from blobha.ops import certgen

    ca = certgen.make_ca(tmp_path / "ca")
    client = certgen.issue(ca, tmp_path, "alice", "alice")
    return ca.cert, client.cert, client.key


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_a_token_file_other_accounts_can_reach_is_refused_before_any_connection(
        listener: Listener, tmp_path: Path, mode: int) -> None:
    token = tmp_path / "alice.token"
    token.write_text(new_token("alice") + "\n")
    token.chmod(mode)
    r = subprocess.run([*BLOBHA, "--cluster", listener.address, "--token-file", str(token),
                        "--timeout", "2", "meta", "k"],
                       capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode == 6, r.stderr
    line = r.stderr.strip()
    assert "\n" not in line, line
    assert f"--token-file (BLOBHA_TOKEN_FILE) {token} is open to other accounts" in line
    assert f"(mode {mode:04o})" in line and f"run 'chmod 600 {token}'" in line
    # The library says the same, from the environment too, before a channel exists.
    with pytest.raises(InvalidArgument, match=r"BLOBHA_TOKEN_FILE.*chmod 600"):
        Client(listener.address, timeout=2,
               credentials=Credentials.from_env({"BLOBHA_TOKEN_FILE": str(token)}))
    assert listener.connections == 0

    token.chmod(0o600)  # the fix the message names: the same command now reaches the "cluster"
    r = subprocess.run([*BLOBHA, "--cluster", listener.address, "--token-file", str(token),
                        "--timeout", "2", "meta", "k"],
                       capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode != 0 and "open to other accounts" not in r.stderr
    assert listener.connections > 0 and listener.received > 0


def test_a_tls_key_other_accounts_can_read_is_refused_before_any_connection(
        listener: Listener, tmp_path: Path) -> None:
    ca, cert, key = _key_pair(tmp_path)
    key.chmod(0o644)
    base = [*BLOBHA, "--cluster", listener.address, "--ca", str(ca), "--cert", str(cert),
            "--tls-key", str(key), "--timeout", "2", "meta", "k"]
    r = subprocess.run(base, capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode == 6, r.stderr
    assert (f"--tls-key (BLOBHA_KEY) {key} is open to other accounts (mode 0644); run"
            f" 'chmod 600 {key}'") in r.stderr
    assert listener.connections == 0

    key.chmod(0o600)
    r = subprocess.run(base, capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode != 0 and "open to other accounts" not in r.stderr
    assert listener.connections > 0


def test_a_secret_file_of_another_account_is_left_to_its_owner(tmp_path: Path) -> None:
    # As ssh: a file someone else (root, a provisioning tool, a secret mounted 0440 for a
    # group) shares with this account on purpose is theirs to judge; we could not chmod it.
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file to another account")
    token = tmp_path / "shared.token"
    token.write_text(new_token("alice") + "\n")
    token.chmod(0o644)
    os.chown(token, 65534, 65534)
    assert Credentials(token_file=str(token)).check().token_user() == "alice"


@pytest.fixture
def secure(tmp_path: Path) -> Iterator[LocalCluster]:
    """One master with TLS and token authentication: enough to issue a job token."""
    with running_cluster(tmp_path / "secure", nodes=1, tls=True) as c:
        yield c


def test_token_job_out_writes_the_token_mode_600(secure: LocalCluster, tmp_path: Path) -> None:
    creds = secure.credentials("alice")
    base = [*BLOBHA, "--cluster", secure.cluster, "--ca", creds.ca or "",
            "--token-file", creds.token_file or ""]
    with Client(secure.cluster, credentials=creds, timeout=30) as c:
        c.create("modes-k", b"hello", acl="u:alice:rwa")
    out = tmp_path / "job.token"
    out.write_text("an old token\n")
    out.chmod(0o644)  # an existing file keeps its mode unless changed
    r = subprocess.run([*base, "token", "job", "modes-k", "--lifetime", "600", "--out",
                        str(out), "--json"],
                       capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode == 0, r.stderr
    answer = json.loads(r.stdout)
    assert "token" not in answer and answer["token_file"] == str(out)
    assert out.stat().st_mode & 0o777 == 0o600
    assert out.read_text().startswith("bjt1." + answer["token_id"] + ".")
    assert "bjt1." not in r.stdout + r.stderr  # shown nowhere but in the file
    r = subprocess.run([*BLOBHA, "--cluster", secure.cluster, "--ca", creds.ca or "",
                        "--token-file", str(out), "cat", "modes-k"],
                       capture_output=True, timeout=60, env=_env())
    assert r.returncode == 0 and r.stdout == b"hello", r.stderr


def _served_certificate(address: str, ca: str) -> bytes:
    """The certificate a master's gRPC port presents to a new TLS connection (DER)."""
    host, port = address.rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=ca)
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection((host, int(port)), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname=host) as conn:
        der = conn.getpeercert(binary_form=True)
    assert der is not None
    return der


def test_a_renewed_tls_key_other_accounts_can_read_is_not_taken_by_a_running_master(
        secure: LocalCluster, tmp_path: Path) -> None:
    # At start such a key is refused; a renewal that leaves it open is refused the same way
    # while the master runs: the old pair serves on, one log line says why and what to run.
    from blobha.ops import certgen

    m = secure.masters[0]
    d = secure.secure_dir
    cert, key, ca = d / "master-1.pem", d / "master-1-key.pem", str(d / "ca.pem")
    served = _served_certificate(m.address, ca)
    renewed = certgen.issue(certgen.CertFiles(d / "ca.pem", d / "ca-key.pem"), tmp_path,
                            "renewed", m.address, hosts=["127.0.0.1", "localhost"])
    key.chmod(0o644)
    key.write_bytes(renewed.key.read_bytes())
    cert.write_bytes(renewed.cert.read_bytes())
    said = (f"tls.key {key} can be read by other accounts (mode 0644); run 'chmod 600 {key}'")

    def refused() -> bool:
        assert _served_certificate(m.address, ca) == served  # each handshake looks again
        return said in m.log_path.read_text()

    wait_until(refused, 30, "the master to refuse the key, in its log")
    with Client(secure.cluster, credentials=secure.credentials("alice"), timeout=30) as c:
        c.create("modes-served-on", b"still served", acl="u:alice:rwa")

    key.chmod(0o600)  # the fix the line names: the renewed pair comes in, no restart
    new = ssl.PEM_cert_to_DER_cert(renewed.cert.read_text())
    wait_until(lambda: _served_certificate(m.address, ca) == new, 30,
               "the renewed certificate served")
