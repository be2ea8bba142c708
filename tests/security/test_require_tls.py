"""A token sent in clear because --ca was forgotten: with TLS required (an option, a variable
or the profile), a client refuses before it connects to anything, so no credential leaves the
machine; without it, the same client connects and sends its token."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from blobha.client import Client
from blobha.core.auth import new_token
from blobha.core.errors import BlobError, InvalidArgument
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
