"""The link between the masters and ZooKeeper: with ``zookeeper.ssl.*`` it is TLS, so what
crosses it (the digest password, the cluster secret, job-token records, key names) cannot be
read on the path; a master whose TLS settings do not fit its ZooKeeper refuses to start with
one line saying what to set. Real ZooKeeper, real ``blobha serve`` processes.

The capture: a TCP proxy on 127.0.0.1 between the masters and ZooKeeper records every byte
both ways, as someone on the path would; without TLS the secrets are in it (which shows the
capture sees what crosses), with TLS they are not.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient
from support.harness import FAST, client_for, wait_until

from blobha.ops import certgen
from blobha.ops.localcluster import LocalCluster
from blobha.zk.layout import JOB_TOKENS, MASTER_SECRET


class RecordingProxy:
    """Forwards connections from a port on 127.0.0.1 to ``target`` and records every byte
    each way (one stream per direction, connections one after another)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._captured = bytearray()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._stopped = threading.Event()
        self._start(self._accept)

    def _start(self, target: Any, *args: Any) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets += [client, upstream]
            self._start(self._pump, client, upstream)
            self._start(self._pump, upstream, client)

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while chunk := source.recv(65536):
                with self._lock:
                    self._captured += chunk
                sink.sendall(chunk)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    @property
    def captured(self) -> bytes:
        with self._lock:
            return bytes(self._captured)

    def stop(self) -> None:
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept: close alone does not
        self._listener.close()
        with self._lock:
            sockets = list(self._sockets)
        for s in sockets:
            s.close()
        for t in self._threads:
            t.join(5)


def _zk_client(cluster: LocalCluster, chroot: str = "") -> KazooClient:
    """A client with the masters' ZooKeeper credentials (and TLS when ZooKeeper serves it)."""
    user, password = (cluster.secure_dir / "zookeeper.auth").read_text().strip().split(":", 1)
    tls = cluster.zk.tls.client_args() if cluster.zk.tls is not None else {}
    return KazooClient(hosts=cluster.zk.connect_string + chroot,
                       auth_data=[("digest", f"{user}:{password}")], **tls)


@pytest.fixture(scope="module")
def tls_zk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """The secure set-up: TLS, tokens, ZooKeeper locked down and serving TLS only."""
    c = LocalCluster(tmp_path_factory.mktemp("zk-tls"), nodes=2, base_port=0, overrides=FAST,
                     tls=True)
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def plain_zk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("zk-plain"), nodes=1, base_port=0, overrides=FAST)
    try:
        c.start()
        yield c
    finally:
        c.stop()


def _connect_request() -> bytes:
    """A ZooKeeper ConnectRequest for a new session, as every client sends first: protocol
    version, last zxid seen, timeout, session id, password (16 bytes), read-only flag."""
    body = struct.pack(">iqiqi", 0, 0, 10000, 0, 16) + b"\0" * 16 + b"\0"
    return struct.pack(">i", len(body)) + body


def _answer(address: str, request: bytes) -> bytes:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(request)
        answer = b""
        with contextlib.suppress(OSError):  # a reset is no answer either
            while chunk := s.recv(4096):
                answer += chunk
    return answer


def test_a_cluster_whose_zookeeper_serves_only_tls_works(tls_zk: LocalCluster) -> None:
    config = tls_zk.zk.config_path.read_text()
    assert "secureClientPort=" in config and "clientPort=" not in config.replace(
        "secureClientPort=", "")
    for m in tls_zk.masters:
        text = m.config_path.read_text()
        assert '"zookeeper.ssl.enabled" = true' in text, text
        assert f'"zookeeper.servers" = "{tls_zk.zk.connect_string}"' in text
    with client_for(tls_zk, credentials=tls_zk.credentials("alice")) as alice:
        alice.create("over-zk-tls", b"payload", acl="u:alice:rwa", replication_factor=2)
        assert alice.wait_for_replication(["over-zk-tls"], min_replication=2,
                                          timeout=30).reached
        assert alice.read("over-zk-tls") == b"payload"
    # And ZooKeeper holds it: the masters' state went over the TLS port, the only one.
    zk = _zk_client(tls_zk, "/blobha")
    zk.start(timeout=15)
    try:
        assert "over-zk-tls" in zk.get_children("/blobstore")
    finally:
        zk.stop()
        zk.close()


def test_a_plaintext_client_gets_nothing_from_the_secure_port(
        tls_zk: LocalCluster, plain_zk: LocalCluster) -> None:
    request = _connect_request()
    # The same request gets a session from a plaintext ZooKeeper: it is well formed.
    answer = _answer(plain_zk.zk.connect_string, request)
    assert len(answer) >= 4 and struct.unpack(">i", answer[:4])[0] == len(answer) - 4 > 16
    assert _answer(tls_zk.zk.connect_string, request) == b""
    assert _answer(tls_zk.zk.connect_string, b"ruok") == b""  # no four-letter words in clear


def _serve(config: dict[str, Any], directory: Path) -> subprocess.CompletedProcess[str]:
    """``blobha serve`` with ``config``, run to its end (it is expected to refuse to start)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "master.toml"
    path.write_text("".join(f'"{k}" = {_toml(v)}\n' for k, v in config.items()))
    return subprocess.run([sys.executable, "-m", "blobha", "serve", "--config", str(path)],
                          capture_output=True, text=True, timeout=90, cwd=directory)


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return f'"{v}"' if isinstance(v, str) else str(v)


def _refusal(proc: subprocess.CompletedProcess[str]) -> str:
    """The master's one 'cannot start' line, checked to be alone and the end of the run."""
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "cannot start" in line]
    assert len(lines) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    return lines[0]


def _unused_address() -> str:
    """An address for a master that refuses to start before it listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _master_config(cluster: LocalCluster, directory: Path, **extra: Any) -> dict[str, Any]:
    return {"blobstore.dir": str(directory / "data"), "master.listen": _unused_address(),
            "blobstore.data.port": -1, "zookeeper.servers": cluster.zk.connect_string,
            "zookeeper.session.timeout.ms": 4000, **extra}


def test_a_master_without_tls_refuses_to_start_against_a_tls_only_zookeeper(
        tls_zk: LocalCluster, tmp_path: Path) -> None:
    line = _refusal(_serve(_master_config(tls_zk, tmp_path), tmp_path))
    assert (f"ZooKeeper at {tls_zk.zk.connect_string} serves TLS only (a secureClientPort):"
            " set zookeeper.ssl.enabled = true and zookeeper.ssl.ca") in line


def test_masters_with_tls_settings_that_do_not_fit_their_zookeeper_refuse_to_start(
        tls_zk: LocalCluster, plain_zk: LocalCluster, tmp_path: Path) -> None:
    d = tls_zk.secure_dir
    ours = {"zookeeper.ssl.enabled": True, "zookeeper.ssl.ca": str(d / "ca.pem")}
    client_cert = {"zookeeper.ssl.cert": str(d / "master-1.pem"),
                   "zookeeper.ssl.key": str(d / "master-1-key.pem")}
    other_ca = certgen.make_ca(tmp_path / "other")
    cases = {
        # TLS asked for, but the port serves plaintext.
        "plaintext": (_master_config(plain_zk, tmp_path / "a", **ours, **client_cert),
                      f"ZooKeeper at {plain_zk.zk.connect_string} did not answer a TLS"
                      " handshake: it serves plaintext there"),
        # Another CA: ZooKeeper's certificate cannot be verified.
        "other CA": (_master_config(tls_zk, tmp_path / "b", **{
                         **ours, **client_cert, "zookeeper.ssl.ca": str(other_ca.cert)}),
                     "its TLS certificate failed verification"),
        # No client certificate, which ZooKeeper requires (ssl.clientAuth=need).
        "no client certificate": (_master_config(tls_zk, tmp_path / "c", **ours),
                                  "refused the TLS handshake"),
    }
    for name, (config, expected) in cases.items():
        line = _refusal(_serve(config, tmp_path / name.replace(" ", "-")))
        assert expected in line, (name, line)
        assert "zookeeper." in line.split(expected, 1)[1], (name, line)  # names what to set


@pytest.mark.parametrize("zk_tls", [True, False], ids=["tls", "plaintext"])
def test_the_zookeeper_link_carries_no_secret_in_clear(tmp_path: Path, zk_tls: bool) -> None:
    """A recording proxy between the masters and ZooKeeper: with TLS nothing of the digest
    password, the cluster secret, a job-token record or a key name is in what it saw;
    plaintext (the control) shows each of them."""
    c = LocalCluster(tmp_path / "c", nodes=2, base_port=0, overrides=FAST, tls=True,
                     zk_tls=zk_tls)
    proxy: RecordingProxy | None = None
    try:
        c.prepare_security()
        c.zk.start()
        proxy = RecordingProxy((c.zk.host, c.zk.port))
        c.overrides["zookeeper.servers"] = proxy.address
        c.start()
        key = f"key-name-{tmp_path.name}"
        with client_for(c, credentials=c.credentials("alice")) as alice:
            alice.create(key, b"x", acl="u:alice:rwa", replication_factor=2)
            alice.wait_for_replication([key], min_replication=2, timeout=30)
            token = alice.issue_job_token([key], 600)
        zk = _zk_client(c, "/blobha")
        zk.start(timeout=15)
        try:
            secret = zk.get(MASTER_SECRET)[0]
            token_ids = zk.get_children(JOB_TOKENS)
        finally:
            zk.stop()
            zk.close()
        password = (c.secure_dir / "zookeeper.auth").read_text().strip().split(":", 1)[1]
        assert len(secret) >= 16 and token_ids, (secret, token_ids)
        secrets = {"digest password": password.encode(), "cluster secret": secret,
                   "key name": key.encode(),
                   "job-token record": f"{JOB_TOKENS}/{token_ids[0]}".encode()}
        # No wait: the proxy records each chunk before passing it on, so whatever ZooKeeper
        # acknowledged to the masters (the key, the token's record) is in the capture.
        seen = {name for name, s in secrets.items() if s in proxy.captured}
        if zk_tls:
            assert seen == set(), f"in clear on the ZooKeeper link despite TLS: {seen}"
            assert token.token_id not in proxy.captured.decode("latin-1")
        else:
            assert seen == set(secrets)
    finally:
        c.stop()
        if proxy is not None:
            proxy.stop()


def _secret_files_config(tmp_path: Path) -> tuple[dict[str, Any], dict[str, Path]]:
    """A TLS, token, locked-down master configuration with each secret file private, and
    the files by setting. Its ZooKeeper address is never reached: the check comes first."""
    from blobha.core.auth import hash_token, new_token

    d = tmp_path / "secure"
    ca = certgen.make_ca(d)
    master = certgen.issue(ca, d, "master", "127.0.0.1:1", hosts=["127.0.0.1"])
    zk_key = d / "zk-client-key.pem"
    shutil.copy(master.key, zk_key)
    files = {"tls.key": master.key, "zookeeper.ssl.key": zk_key,
             "zookeeper.auth.file": d / "zookeeper.auth", "auth.token.file": d / "tokens.txt"}
    files["zookeeper.auth.file"].write_text("blobha:a-password\n")
    files["auth.token.file"].write_text(hash_token(new_token("alice")) + "\n")
    for path in files.values():
        path.chmod(0o600)
    config = {
        "blobstore.dir": str(tmp_path / "data"), "master.listen": _unused_address(),
        "blobstore.data.port": -1, "zookeeper.servers": "127.0.0.1:1",
        "tls.cert": str(master.cert), "tls.key": str(master.key), "tls.ca": str(ca.cert),
        "auth.mode": "token", "auth.token.file": str(files["auth.token.file"]),
        "zookeeper.auth.scheme": "digest", "zookeeper.auth.file": str(files["zookeeper.auth.file"]),
        "zookeeper.ssl.enabled": True, "zookeeper.ssl.ca": str(ca.cert),
        "zookeeper.ssl.cert": str(master.cert), "zookeeper.ssl.key": str(zk_key),
    }
    return config, files


@pytest.mark.parametrize("setting,mode", [
    ("tls.key", 0o644), ("zookeeper.ssl.key", 0o640), ("zookeeper.auth.file", 0o604),
    ("auth.token.file", 0o644), ("auth.token.file", 0o660),
])
def test_a_master_refuses_a_secret_file_other_accounts_can_reach(
        tmp_path: Path, setting: str, mode: int) -> None:
    config, files = _secret_files_config(tmp_path)
    files[setting].chmod(mode)
    line = _refusal(_serve(config, tmp_path))
    path = files[setting]
    assert f"{setting} {path} can be" in line and f"by other accounts (mode {mode:04o})" in line
    assert f"'chmod 600 {path}'" in line
    assert not (tmp_path / "data").exists()  # refused before it made anything


def test_a_zookeeper_key_made_readable_by_others_is_not_taken_at_a_reconnection(
        tmp_path: Path) -> None:
    # kazoo loads zookeeper.ssl.key at every connection. A renewal that leaves the key open
    # to other accounts must not come in at the next one: the master reconnects with what it
    # had, says so in one line, and takes the renewal once the key is chmodded.
    from support.zkproxy import ProxiedCluster

    cluster = ProxiedCluster(tmp_path / "cluster", nodes=1, base_port=0, overrides=FAST,
                             tls=True)
    try:
        cluster.start()
        m = cluster.masters[0]
        d = cluster.secure_dir
        cert, key = d / "master-1.pem", d / "master-1-key.pem"  # its zookeeper.ssl.* too
        renewed = certgen.issue(certgen.CertFiles(d / "ca.pem", d / "ca-key.pem"), tmp_path,
                                "renewed", m.address, hosts=["127.0.0.1", "localhost"])
        key.chmod(0o644)
        key.write_bytes(renewed.key.read_bytes())
        cert.write_bytes(renewed.cert.read_bytes())
        said = f"zookeeper.ssl.key {key} can be read by other accounts (mode 0644)"
        proxy = cluster.proxies[m.index]
        proxy.hold()  # the connection drops, and kazoo connects again (through the proxy)
        wait_until(lambda: said in m.log_path.read_text(), 30,
                   "the master to refuse the key at a new connection")
        proxy.release()
        with client_for(cluster, "alice", credentials=cluster.credentials("alice")) as alice:
            alice.create("zk-key-refused", b"x", acl="u:alice:rwa")  # ZooKeeper reached
        assert "ZooKeeper TLS certificate reloaded" not in m.log_path.read_text()

        key.chmod(0o600)
        proxy.hold()
        wait_until(lambda: "ZooKeeper TLS certificate reloaded" in m.log_path.read_text(), 30,
                   "the fixed key taken at the next connection")
        proxy.release()
        with client_for(cluster, "alice", credentials=cluster.credentials("alice")) as alice:
            alice.create("zk-key-taken", b"x", acl="u:alice:rwa")
    finally:
        cluster.stop()
