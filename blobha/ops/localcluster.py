"""``blobha local-cluster``: an embedded ZooKeeper plus N real master processes on 127.0.0.1.

The same :class:`LocalCluster` drives the integration tests, so what users try is what is
tested. Each master is a separate ``blobha serve`` process with its own data directory and
configuration file, so killing one (``kill -9``) behaves as on a real cluster.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grpc

from blobha.core.auth import AuthMode
from blobha.ops.zkserver import DEFAULT_HEAP_MB, EmbeddedZooKeeper, ServerTls
from blobha.v1 import blobha_pb2 as pb
from blobha.v1 import blobha_pb2_grpc as pb_grpc
from blobha.wire.credentials import Credentials
from blobha.wire.peers import CHANNEL_OPTIONS

DEFAULT_BASE_PORT = 6627
#: Users a secure local cluster makes credentials for; "admin" is in the masters' admins.
SECURE_USERS = ("admin", "alice", "bob")
#: A master's status page and metrics listen on its gRPC port plus this (6727 for 6627).
METRICS_PORT_OFFSET = 100


def _toml_value(v: Any) -> str:
    # json's string/number/bool/list syntax is valid TOML for the values we write.
    return json.dumps(v)


class MasterProcess:
    """One ``blobha serve`` child process."""

    def __init__(self, index: int, address: str, config_path: Path, log_path: Path,
                 metrics_address: str = "") -> None:
        self.index = index
        self.address = address
        #: host:port of its status page and /metrics ('' if not enabled).
        self.metrics_address = metrics_address
        self.config_path = config_path
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        #: Where the log stood when this process was last started.
        self.log_offset = 0

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child from here on
        self.log_offset = log.tell()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "blobha", "serve", "--config", str(self.config_path)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                # Run from the data directory: 'python -m' puts the working directory on
                # sys.path, and a source checkout there would shadow the installed package.
                cwd=self.config_path.parent, start_new_session=True,
                env={**os.environ, "BLOBHA_EXIT_WITH_PARENT": str(os.getpid())},
            )
        finally:
            log.close()

    @property
    def status_url(self) -> str:
        return f"http://{self.metrics_address}/" if self.metrics_address else ""

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.wait(10)

    def terminate(self, timeout: float = 15) -> None:
        """SIGTERM, then SIGKILL if it has not exited after ``timeout``."""
        if not self.alive():
            return
        self.signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        self.signal(signal.SIGTERM)
        if not self.wait(timeout):
            self.kill()

    def log_since_start(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset)
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def wait(self, timeout: float) -> bool:
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False


class MasterExited(RuntimeError):
    """A master of the cluster exited while it was awaited."""

    def __init__(self, master: MasterProcess) -> None:
        code = master.proc.returncode if master.proc is not None else None
        super().__init__(f"master {master.address} exited with code {code}; see"
                         f" {master.log_path}")
        self.master = master


class LocalCluster:
    """An embedded ZooKeeper and ``nodes`` masters under ``data_dir``.

    ``overrides`` are configuration keys applied to every master (e.g. a short session timeout
    for tests). Ports: masters on ``base_port``, ``base_port + 1``, ...; their status pages and
    metrics on those plus :data:`METRICS_PORT_OFFSET`; 0 picks free ports for all.

    ZooKeeper ticks every ``zk_tick_ms`` (200 ms): it expires sessions on tick boundaries, so a
    dead master's session ends up to one tick after its timeout, and a short tick keeps
    failover close to the session timeout.

    ``tls=True`` makes the secure set-up under ``data_dir/secure`` (kept across runs): a
    throwaway CA and a certificate per master, credentials for :data:`SECURE_USERS` (tokens, or
    client certificates with ``auth="mtls"``), and ZooKeeper locked down to the masters and
    serving TLS only: its own certificate from that CA, and each master's certificate as its
    client certificate towards ZooKeeper (no plaintext port: then nothing, the digest password
    and cluster secret included, crosses the loopback in clear, and a tool that forgets TLS
    fails instead of quietly working). ``zk_tls`` overrides that choice.
    :meth:`credentials` gives what a client of that user passes.

    ``spread_cpus=True`` gives each master one CPU of those this process may use, in turn
    (``master.cpus``), unless ``overrides`` or the environment set it: on a machine shared
    by the whole cluster, a master kept on one CPU hands work between its threads without
    cross-CPU wake-ups. The embedded ZooKeeper and the clients run anywhere.
    """

    def __init__(
        self,
        data_dir: Path,
        nodes: int = 3,
        base_port: int = DEFAULT_BASE_PORT,
        zookeeper_home: str | None = None,
        overrides: Mapping[str, Any] | None = None,
        zk_tick_ms: int = 200,
        tls: bool = False,
        auth: str | None = None,
        zk_lockdown: bool | None = None,
        spread_cpus: bool = False,
        zk_tls: bool | None = None,
        zk_heap_mb: int = DEFAULT_HEAP_MB,
    ) -> None:
        if nodes < 1:
            raise ValueError("a cluster needs at least one master")
        self.data_dir = data_dir.resolve()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.overrides = dict(overrides or {})
        self.spread_cpus = spread_cpus
        self.tls = tls
        self.auth = AuthMode(auth or (AuthMode.TOKEN if tls else AuthMode.SIMPLE))
        if self.auth is AuthMode.MTLS and not tls:
            raise ValueError("mtls authentication needs tls=True")
        self.zk_lockdown = tls if zk_lockdown is None else zk_lockdown
        self.secure_dir = self.data_dir / "secure"
        self.zk_tls = tls if zk_tls is None else zk_tls
        if self.zk_tls and not tls:
            raise ValueError("ZooKeeper over TLS (zk_tls) needs tls=True, which makes the CA")
        d = self.secure_dir
        self.zk = EmbeddedZooKeeper(
            self.data_dir / "zookeeper", zookeeper_home=zookeeper_home, tick_ms=zk_tick_ms,
            tls=ServerTls(d / "zookeeper.pem", d / "zookeeper-key.pem", d / "ca.pem")
            if self.zk_tls else None, heap_mb=zk_heap_mb)
        self._auto_ports = base_port == 0
        if self._auto_ports:
            free = _free_ports(2 * nodes)
            ports, metrics_ports = free[:nodes], free[nodes:]
        else:
            ports = [base_port + i for i in range(nodes)]
            metrics_ports = [p + METRICS_PORT_OFFSET for p in ports]
        self.masters = [
            MasterProcess(
                i, f"127.0.0.1:{port}", self.data_dir / f"master-{i + 1}.toml",
                self.data_dir / f"master-{i + 1}.log", f"127.0.0.1:{metrics_port}",
            )
            for i, (port, metrics_port) in enumerate(zip(ports, metrics_ports, strict=True))
        ]

    @property
    def cluster(self) -> str:
        """The value for ``--cluster`` / ``BLOBHA_CLUSTER``."""
        return ",".join(m.address for m in self.masters)

    def store_dir(self, m: MasterProcess) -> Path:
        """Where master ``m`` keeps its blobs (``blobstore.dir``)."""
        return self.data_dir / f"master-{m.index + 1}"

    def write_config(self, m: MasterProcess) -> None:
        values: dict[str, Any] = {
            "blobstore.dir": str(self.store_dir(m)),
            "zookeeper.servers": self.zk.connect_string,
            "zookeeper.session.timeout.ms": 6000,
            "master.listen": m.address,
            "metrics.listen": m.metrics_address,
            "blobstore.disk.reserved.bytes": 64 * 1024 * 1024,
            # Beside random gRPC ports, the gRPC port + 10 may be anyone's: any free port.
            **({"blobstore.data.port": 0} if self._auto_ports else {}),
            **self._cpu_config(m),
            **self._security_config(m),
            **self.overrides,
        }
        m.config_path.write_text(
            "".join(f"{_toml_value(k)} = {_toml_value(v)}\n" for k, v in values.items())
        )

    def _cpu_config(self, m: MasterProcess) -> dict[str, Any]:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if not self.spread_cpus or len(cpus) < 2:
            return {}
        return {"master.cpus": str(cpus[m.index % len(cpus)])}

    # ---- the secure set-up ---------------------------------------------------------------

    def _security_config(self, m: MasterProcess) -> dict[str, Any]:
        d = self.secure_dir
        out: dict[str, Any] = {"auth.mode": self.auth}
        if self.tls or self.auth is not AuthMode.SIMPLE or self.zk_lockdown:
            out["admins"] = ["admin"]
        if self.tls:
            name = f"master-{m.index + 1}"
            out.update({"tls.ca": str(d / "ca.pem"), "tls.cert": str(d / f"{name}.pem"),
                        "tls.key": str(d / f"{name}-key.pem")})
        if self.zk_tls:
            name = f"master-{m.index + 1}"
            # ZooKeeper asks for a client certificate (ssl.clientAuth need): the master's own.
            out.update({"zookeeper.ssl.enabled": True, "zookeeper.ssl.ca": str(d / "ca.pem"),
                        "zookeeper.ssl.cert": str(d / f"{name}.pem"),
                        "zookeeper.ssl.key": str(d / f"{name}-key.pem")})
        if self.auth is AuthMode.TOKEN:
            out["auth.token.file"] = str(d / "tokens.txt")
        if self.zk_lockdown:
            out.update({"zookeeper.auth.scheme": "digest",
                        "zookeeper.auth.file": str(d / "zookeeper.auth")})
        return out

    def prepare_security(self) -> None:
        """Make whatever the secure set-up lacks; what exists is kept (ZooKeeper's data is
        locked with the credentials of the first run)."""
        from blobha.core.auth import hash_token, new_token
        from blobha.ops import certgen

        d = self.secure_dir
        if not (self.tls or self.auth is not AuthMode.SIMPLE or self.zk_lockdown):
            return
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o700)
        if self.zk_lockdown and not (d / "zookeeper.auth").exists():
            import secrets

            _write_private(d / "zookeeper.auth", f"blobha:{secrets.token_urlsafe(24)}\n")
        if self.tls:
            ca = certgen.CertFiles(d / "ca.pem", d / "ca-key.pem")
            if not ca.cert.exists():
                ca = certgen.make_ca(d)
            for m in self.masters:
                host = m.address.rsplit(":", 1)[0]
                if not (d / f"master-{m.index + 1}.pem").exists():
                    certgen.issue(ca, d, f"master-{m.index + 1}", m.address,
                                  hosts=[host, "localhost"])
            if self.zk_tls and not (d / "zookeeper.pem").exists():
                certgen.issue(ca, d, "zookeeper", "zookeeper",
                              hosts=[self.zk.host, "localhost"])
            if self.auth is AuthMode.MTLS:
                for user in SECURE_USERS:
                    if not (d / f"{user}.pem").exists():
                        certgen.issue(ca, d, user, user)
        if self.auth is AuthMode.TOKEN:
            lines = []
            for user in SECURE_USERS:
                path = d / f"{user}.token"
                if not path.exists():
                    _write_private(path, new_token(user) + "\n")
                lines.append(hash_token(path.read_text().strip()))
            if not (d / "tokens.txt").exists():
                _write_private(d / "tokens.txt", "\n".join(lines) + "\n")

    def credentials(self, user: str = "admin") -> Credentials:
        """What a client of ``user`` passes to this cluster (a secure cluster knows
        :data:`SECURE_USERS`)."""
        d = self.secure_dir
        return Credentials(
            # This cluster's own set-up, not a client profile's requirement (which would stop
            # `blobha local-cluster` at its first status call, or with a broken profile file).
            require_tls=self.tls,
            ca=str(d / "ca.pem") if self.tls else None,
            cert=str(d / f"{user}.pem") if self.auth is AuthMode.MTLS else None,
            key=str(d / f"{user}-key.pem") if self.auth is AuthMode.MTLS else None,
            token_file=str(d / f"{user}.token") if self.auth is AuthMode.TOKEN else None,
        )

    def start(self, timeout: float = 60) -> None:
        self.prepare_security()
        self.zk.start(timeout=timeout)
        for m in self.masters:
            self.write_config(m)
            m.start()
        deadline = time.monotonic() + timeout
        moves = 0
        while True:
            try:
                self.wait_ready(max(1.0, deadline - time.monotonic()))
                return
            except MasterExited as e:
                # A port picked free can be taken before the master binds it (by any
                # process's connection, or another test's server); on the first start only
                # the port is at fault, and the master has not registered under its address.
                if moves >= 3 or not self._move_if_port_taken(e.master):
                    raise
                moves += 1

    def _move_if_port_taken(self, m: MasterProcess) -> bool:
        """Restart ``m`` on other free ports if it exited for want of its own; False if the
        ports were asked for (they must not move) or it exited for another reason."""
        if not self._auto_ports or "cannot listen on " not in m.log_since_start():
            return False
        port, metrics_port = _free_ports(2)
        m.address = f"127.0.0.1:{port}"
        m.metrics_address = f"127.0.0.1:{metrics_port}"
        self.start_master(m)
        return True

    def start_master(self, m: MasterProcess) -> None:
        self.write_config(m)
        m.start()

    def stop(self) -> None:
        threads = [threading.Thread(target=m.terminate) for m in self.masters]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.zk.stop()

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def summary(self, via: MasterProcess | None = None, timeout: float = 3.0
                ) -> pb.ClusterSummaryResponse:
        targets = [via] if via else [m for m in self.masters if m.alive()]
        last: Exception | None = None
        user = "admin" if self.auth is not AuthMode.SIMPLE else "blobha-local"
        creds = self.credentials(user)
        for m in targets:
            with creds.channel(m.address, CHANNEL_OPTIONS) as ch:
                try:
                    stub = pb_grpc.BlobStoreStub(ch)  # type: ignore[no-untyped-call]
                    reply: pb.ClusterSummaryResponse = stub.ClusterSummary(
                        pb.ClusterSummaryRequest(), timeout=timeout,
                        metadata=creds.metadata(user),
                    )
                    return reply
                except grpc.RpcError as e:
                    last = e
        raise RuntimeError(f"no master answered: {last}")

    def wait_ready(self, timeout: float, expect: int | None = None) -> pb.ClusterSummaryResponse:
        """Wait until a leader is ready and ``expect`` (default: all live) masters answer."""
        deadline = time.monotonic() + timeout
        want = expect if expect is not None else sum(m.alive() for m in self.masters)
        last = "no answer yet"
        while time.monotonic() < deadline:
            for m in self.masters:
                if m.proc is not None and not m.alive() and expect is None:
                    raise MasterExited(m)
            try:
                s = self.summary(timeout=1.0)
                reachable = [x for x in s.masters if x.reachable]
                if s.leader and len(reachable) >= want:
                    return s
                last = f"leader={s.leader or 'none'}, {len(reachable)} of {want} masters"
            except RuntimeError as e:
                last = str(e)
            time.sleep(0.1)
        raise TimeoutError(f"cluster not ready after {timeout}s: {last}")

    def leader(self, timeout: float = 30) -> MasterProcess:
        s = self.wait_ready(timeout, expect=0)
        return next(m for m in self.masters if m.address == s.leader)


def cpus_allowed(pid: int, proc: Path = Path("/proc")) -> str:
    """The CPUs process ``pid`` may run on, as Linux lists them ("0-1"); "?" if unknown."""
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _free_ports(n: int) -> list[int]:
    """``n`` ports free on 127.0.0.1 now, below the kernel's ephemeral range when it leaves
    room: a port from that range (what binding port 0 gives) is also the source port of any
    outgoing connection, so one made between this probe and the master's bind can take it."""
    import random
    import socket

    low = _ephemeral_low()
    candidates = random.sample(range(10000, low), min(64 * n, low - 10000)) if low > 10000 else []
    socks: list[socket.socket] = []
    try:
        for port in [*candidates, *([0] * n)]:
            if len(socks) == n:
                break
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def main(nodes: int, data_dir: str | None, base_port: int, zookeeper_home: str | None,
         tls: bool = False, auth: str | None = None) -> int:
    """Run a local cluster in the foreground until Ctrl-C or SIGTERM."""
    root = Path(data_dir or os.environ.get("BLOBHA_LOCAL_DIR", "blobha-local"))
    cluster = LocalCluster(root, nodes=nodes, base_port=base_port, zookeeper_home=zookeeper_home,
                           tls=tls, auth=auth, spread_cpus=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"blobha local-cluster: starting ZooKeeper and {nodes} masters in {cluster.data_dir}",
          flush=True)
    try:
        cluster.start()
    except KeyboardInterrupt:
        cluster.stop()
        return 130
    except Exception as e:
        print(f"blobha: error: the local cluster did not start: {e}", file=sys.stderr, flush=True)
        cluster.stop()
        return 1
    # Explicitly, because a process started in the background inherits SIGINT as ignored and
    # Ctrl-C must still stop everything.
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    summary = cluster.summary()
    over = " over TLS only" if cluster.zk_tls else ""
    print(f"ZooKeeper: {cluster.zk.connect_string}{over} (chroot /blobha)")
    for m in cluster.masters:
        role = "leader" if m.address == summary.leader else "follower"
        print(f"master {m.index + 1}: {m.address} pid {m.pid} ({role}, CPU"
              f" {cpus_allowed(m.pid)}); status page {m.status_url}; log {m.log_path}")
    print("\nIn another shell:\n")
    print(f"  export BLOBHA_CLUSTER={cluster.cluster}")
    creds = cluster.credentials("alice")
    for env, value in (("BLOBHA_CA", creds.ca), ("BLOBHA_CERT", creds.cert),
                       ("BLOBHA_KEY", creds.key), ("BLOBHA_TOKEN_FILE", creds.token_file)):
        if value:
            print(f"  export {env}={value}")
    if cluster.auth is not AuthMode.SIMPLE:
        print(f"  # you are alice; other users' credentials are in {cluster.secure_dir}"
              f" ({', '.join(SECURE_USERS)}; admin may do anything)")
    print("  blobha cluster\n")
    print(f"Status page: {cluster.masters[0].status_url} (metrics: {cluster.masters[0].status_url}"
          "metrics; every master serves both)\n")
    print("Ctrl-C stops everything.", flush=True)
    reported: set[int] = set()
    try:
        while not stop.wait(0.5):
            for m in cluster.masters:
                if not m.alive() and m.index not in reported:
                    reported.add(m.index)
                    code = m.proc.returncode if m.proc else None
                    print(f"master {m.index + 1} ({m.address}) exited with code {code}; the"
                          " others carry on", flush=True)
    except KeyboardInterrupt:
        pass
    print("stopping the local cluster...", flush=True)
    cluster.stop()
    return 0
