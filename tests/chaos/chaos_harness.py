"""The chaos harness: a 3-node ZooKeeper ensemble and blobha masters in real containers on a
network made for the test, a workload that records every acknowledged write, a verifier that
reads everything back from every replica, and a leadership sampler for the single-leader check.

The test process reaches the containers only through ports published on 127.0.0.1; the client
maps the masters' advertised names (``master1:6627``) to those ports (``address_map``).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import xxhash
from docker.errors import APIError
from support.prefill import prefill
from support.waiting import wait_until
from testcontainers.core.container import DockerContainer
from testcontainers.core.network import Network

from blobha.client import Client
from blobha.core.errors import BlobError, KeyAlreadyExists
from blobha.ops.zkserver import four_letter_word
from blobha.v1 import blobha_pb2 as pb
from blobha.v1 import blobha_pb2_grpc as pb_grpc
from blobha.wire.peers import CHANNEL_OPTIONS, USER_METADATA_KEY

IMAGE = os.environ.get("BLOBHA_CHAOS_IMAGE", "blobha:latest")
#: Every container and network of the suite carries this label; leftovers are swept by it.
LABEL = "org.blobha.chaos"
SESSION_TIMEOUT_MS = 6000
ZK_TICK_MS = 1000
MASTER_PORT = 6627
USER = "chaos"
MIB = 1024 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: Starts of one container tried with fresh ports (see ChaosCluster._start).
START_ATTEMPTS = 5


def _port_taken(error: Exception) -> bool:
    """Whether Docker refused a start because a published host port was taken: a port free
    when chosen may be taken before Docker binds it (by another container's mapping, which
    holds no socket with the userland proxy off, or by any process's outgoing connection)."""
    text = str(error)
    return "port is already allocated" in text or "address already in use" in text


def digest(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def sweep_leftovers() -> int:
    """Remove containers and networks left by an earlier, aborted run."""
    import docker

    client = docker.from_env()
    removed = 0
    try:
        for c in client.containers.list(all=True, filters={"label": LABEL}):
            c.remove(force=True, v=True)
            removed += 1
        for n in client.networks.list(filters={"label": LABEL}):
            n.remove()
            removed += 1
    finally:
        client.close()
    return removed


# ---------------------------------------------------------------------------------------------
# The cluster
# ---------------------------------------------------------------------------------------------


@dataclass
class Node:
    name: str
    container: DockerContainer
    host_port: int
    data_dir: Path | None = None

    @property
    def docker(self) -> Any:
        return self.container.get_wrapped_container()

    @property
    def address(self) -> str:
        """The advertised address (the master's identity)."""
        return f"{self.name}:{MASTER_PORT}"

    @property
    def dial(self) -> str:
        return f"127.0.0.1:{self.host_port}"


class ChaosCluster:
    """``zk_nodes`` ZooKeeper containers and ``masters`` blobha masters on a fresh network."""

    def __init__(self, workdir: Path, masters: int = 3, zk_nodes: int = 3,
                 extra_env: dict[str, str] | None = None, zk_heap_mb: int | None = None
                 ) -> None:
        self.workdir = workdir
        self.run_id = uuid.uuid4().hex[:8]
        self.labels = {LABEL: self.run_id}
        self.network = Network(docker_network_kw={"labels": dict(self.labels)})
        self.zks: list[Node] = []
        self.masters: list[Node] = []
        self.n_masters = masters
        self.n_zk = zk_nodes
        self.extra_env = extra_env or {}
        self.zk_heap_mb = zk_heap_mb  # None: the image's default (256 MiB)
        self._clients: list[Client] = []

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> ChaosCluster:
        self.network.create()
        servers = " ".join(f"server.{i}=zk{i}:2888:3888;2181" for i in range(1, self.n_zk + 1))

        def zk_node(i: int) -> Node:
            c = self._container(f"zk{i}", [], 2181)
            c.with_env("ZOO_MY_ID", str(i)).with_env("ZOO_SERVERS", servers)
            c.with_env("ZOO_TICK_TIME", str(ZK_TICK_MS))
            if self.zk_heap_mb is not None:
                c.with_env("ZOO_HEAP", f"{self.zk_heap_mb}m")
            # The same image runs ZooKeeper (its Debian base ships it); the master's health
            # check does not apply to it.
            c.with_kwargs(labels=dict(self.labels), user="root", entrypoint=["zk-run"],
                          healthcheck={"test": ["NONE"]})
            return Node(f"zk{i}", c, c.ports["2181/tcp"][1])  # type: ignore[index]

        for i in range(1, self.n_zk + 1):
            self._start(self.zks, functools.partial(zk_node, i))
        self.wait_zk_quorum(90)
        for i in range(1, self.n_masters + 1):
            self.add_master(i, wait=False)
        self.wait_ready(120)
        return self

    def prefill(self, keys: int, ready_s: float) -> float:
        """Stop the masters, put ``keys`` keys in place on each (tests/support/prefill.py),
        and start them again, until ready: a cluster restarted with that many keys. The
        seconds the keys took to put in place."""
        for m in self.masters:
            m.docker.stop(timeout=10)
        took = prefill(",".join(z.dial for z in self.zks),
                       {m.address: m.data_dir for m in self.masters if m.data_dir is not None},
                       keys, creator=USER, write_quorum=2)
        for m in self.masters:
            m.docker.start()
        self.wait_ready(ready_s)
        return took

    def _start(self, nodes: list[Node], make: Callable[[], Node]) -> Node:
        """Start the container of the node ``make`` builds, listed in ``nodes`` first so a
        failed start is still cleaned up; built again, with other ports, when Docker finds a
        port chosen for it taken meanwhile."""
        for attempt in range(1, START_ATTEMPTS + 1):
            node = make()
            nodes.append(node)
            try:
                node.container.start()
                return node
            except Exception as e:
                if attempt == START_ATTEMPTS or not _port_taken(e):
                    raise
                print(f"{node.name}: {e}; starting it again with other ports")
                nodes.remove(node)
                node.container.stop()  # removes the container created before the refusal
        raise AssertionError("unreachable")

    def _container(self, name: str, command: list[str], port: int) -> DockerContainer:
        c = DockerContainer(IMAGE)
        c.with_name(f"blobha-chaos-{self.run_id}-{name}")
        c.with_network(self.network).with_network_aliases(name)
        c.with_command(command)
        # Published on loopback only: the tests reach the containers and nothing else does.
        c.ports[f"{port}/tcp"] = ("127.0.0.1", free_port())  # type: ignore[assignment]
        return c

    def add_master(self, i: int, wait: bool = True) -> Node:
        name = f"master{i}"
        data = self.workdir / name
        data.mkdir(parents=True, exist_ok=True)
        data.chmod(0o777)  # the container's user (uid 10001) writes here
        node = self._start(self.masters, lambda: self._master_node(name, data))
        if wait:
            wait_until(lambda: self.status(node) is not None, 60, f"{name} to answer")
        return node

    def _master_node(self, name: str, data: Path) -> Node:
        c = self._container(name, ["serve", "--config", "/etc/blobha/master.toml"],
                            MASTER_PORT)
        # The data channel on the same port number inside and out: masters offer the port
        # they listen on, and the tests dial it on 127.0.0.1 as they dial the gRPC port.
        data_port = free_port()
        c.ports[f"{data_port}/tcp"] = ("127.0.0.1", data_port)  # type: ignore[assignment]
        env = {
            "BLOBHA_ZOOKEEPER_SERVERS": ",".join(f"zk{j}:2181" for j in range(1, self.n_zk + 1)),
            "BLOBHA_ZOOKEEPER_SESSION_TIMEOUT_MS": str(SESSION_TIMEOUT_MS),
            "BLOBHA_MASTER_ADVERTISE": f"{name}:{MASTER_PORT}",
            "BLOBHA_MASTER_LISTEN": f"0.0.0.0:{MASTER_PORT}",
            "BLOBHA_BLOBSTORE_DATA_PORT": str(data_port),
            "BLOBHA_BLOBSTORE_DIR": "/var/lib/blobha",
            "BLOBHA_BLOBSTORE_WRITE_QUORUM": "2",
            "BLOBHA_BLOBSTORE_DISK_RESERVED_BYTES": "0",
            "BLOBHA_BLOBSTORE_REPLICA_GRACE_SECS": "5",
            "BLOBHA_BLOBSTORE_SYNC_PERIOD_SECS": "5",
            "BLOBHA_BLOBSTORE_UPLOAD_EXPIRATION_SECS": "120",
            "BLOBHA_BLOBSTORE_SCRUB_INTERVAL_SECS": "2",
            "BLOBHA_BLOBSTORE_SCRUB_RATE_BYTES_PER_SEC": str(256 * MIB),
            **self.extra_env,
        }
        for k, v in env.items():
            c.with_env(k, v)
        c.with_volume_mapping(str(data), "/var/lib/blobha", "rw")
        c.with_kwargs(labels=dict(self.labels))
        return Node(name, c, c.ports[f"{MASTER_PORT}/tcp"][1], data)  # type: ignore[index]

    def stop(self) -> None:
        for client in self._clients:
            client.close()
        for node in [*self.masters, *self.zks]:
            try:
                node.container.stop()
            except Exception as e:  # keep removing the rest
                print(f"could not remove {node.name}: {e}")
        try:
            self.network.remove()
        except Exception as e:
            print(f"could not remove the network: {e}")

    def logs(self, node: Node, lines: int | None = 60) -> str:
        """The last ``lines`` lines of ``node``'s log (all of it for None)."""
        try:
            out = node.docker.logs(tail="all" if lines is None else lines)
        except Exception as e:
            return f"(no logs: {e})"
        return bytes(out).decode(errors="replace")

    # -- views ----------------------------------------------------------------------------

    @property
    def address_map(self) -> dict[str, str]:
        return {m.address: m.dial for m in self.masters}

    def client(self, timeout: float = 60.0) -> Client:
        c = Client([m.address for m in self.masters], user=USER, timeout=timeout,
                   address_map=self.address_map)
        self._clients.append(c)
        return c

    def stub(self, node: Node) -> Any:
        channel = grpc.insecure_channel(node.dial, options=CHANNEL_OPTIONS)
        return pb_grpc.BlobStoreStub(channel)  # type: ignore[no-untyped-call]

    def status(self, node: Node, timeout: float = 2.0) -> pb.MasterSummary | None:
        try:
            reply: pb.MasterSummary = self.stub(node).NodeStatus(
                pb.NodeStatusRequest(), timeout=timeout, metadata=md())
            return reply
        except grpc.RpcError:
            return None

    def wait_leader(self, timeout: float, not_in: tuple[Node, ...] = ()) -> Node:
        found: list[Node] = []

        def elected() -> bool:
            for m in self.masters:
                if m in not_in:
                    continue
                s = self.status(m)
                if s is not None and s.is_leader:
                    found.append(m)
                    return True
            return False
        wait_until(elected, timeout, "a leader to be elected")
        return found[-1]

    def wait_ready(self, timeout: float, expect: int | None = None) -> None:
        """Every master answers, one leads, and none lags."""
        want = expect or len(self.masters)

        def ready() -> bool:
            statuses = [self.status(m) for m in self.masters]
            live = [s for s in statuses if s is not None]
            return (len(live) >= want and sum(s.is_leader for s in live) == 1
                    and all(s.lag_blobs == 0 for s in live))
        wait_until(ready, timeout, f"{want} masters ready with a leader and no lag")

    def zk_mode(self, node: Node) -> str:
        try:
            answer = four_letter_word("127.0.0.1", node.host_port, "srvr", timeout=1.0)
        except OSError:
            return ""
        for line in answer.splitlines():
            if line.startswith("Mode:"):
                return line.split(":", 1)[1].strip()
        return ""

    def wait_zk_quorum(self, timeout: float, nodes: list[Node] | None = None) -> None:
        nodes = nodes if nodes is not None else self.zks
        wait_until(lambda: all(self.zk_mode(z) in ("leader", "follower") for z in nodes),
                   timeout, "the ZooKeeper ensemble to form a quorum")

    # -- faults ---------------------------------------------------------------------------

    def pause(self, node: Node, timeout: float = 30.0) -> None:
        """Freeze every process of ``node``: its connections stay open, and nothing answers.
        The kernel's freezer gives up on a process it cannot stop in time (one in the middle
        of disk I/O on a loaded machine: "unable to freeze", and the container runs on): that
        is tried again, for up to ``timeout`` seconds."""

        def frozen() -> bool:
            try:
                node.docker.pause()
            except APIError as e:
                if "unable to freeze" not in str(e):
                    raise
                return False
            return True

        wait_until(frozen, timeout, f"{node.name} to be paused")

    def disconnect(self, node: Node) -> None:
        self.network._unwrap_network.disconnect(node.docker.id)

    def reconnect(self, node: Node) -> None:
        self.network.connect(node.docker.id, network_aliases=[node.name])

    def wipe(self, node: Node) -> None:
        """Delete everything a stopped master kept on disk."""
        assert node.data_dir is not None
        for p in sorted(node.data_dir.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            if p.is_dir() and not p.is_symlink():
                p.rmdir()
            else:
                p.unlink()

    def exec_python(self, node: Node, code: str, **args: Any) -> dict[str, Any]:
        """Run Python inside a master's container (reaching it even when partitioned), with
        ``args`` as JSON in ``sys.argv[1]``, and return the JSON object it prints last."""
        result = node.container.exec(["python3", "-c", code, json.dumps(args)])
        out = result.output.decode(errors="replace").strip()
        assert result.exit_code == 0, f"in-container script failed: {out}"
        return dict(json.loads(out.splitlines()[-1]))


def md(user: str = USER) -> tuple[tuple[str, str], ...]:
    return ((USER_METADATA_KEY, user),)


# ---------------------------------------------------------------------------------------------
# Workload and verification
# ---------------------------------------------------------------------------------------------


@dataclass
class Ack:
    key: str
    version: int
    digest: str
    size: int
    at: float


@dataclass
class Failure:
    key: str
    digest: str
    error: str
    at: float


@dataclass
class Records:
    acks: list[Ack] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def latest(self, before: float | None = None) -> dict[str, Ack]:
        """Each key's newest acknowledged version (of those acknowledged ``before``, if given)."""
        out: dict[str, Ack] = {}
        with self.lock:
            for a in self.acks:
                if before is not None and a.at >= before:
                    continue
                if a.key not in out or a.version > out[a.key].version:
                    out[a.key] = a
        return out

    def ack_times(self) -> list[float]:
        with self.lock:
            return sorted(a.at for a in self.acks)

    def acks_between(self, start: float, end: float) -> int:
        return sum(1 for t in self.ack_times() if start <= t <= end)

    def max_gap(self, start: float, end: float) -> float:
        """The longest time in [start, end] with no acknowledged write."""
        points = [start, *[t for t in self.ack_times() if start < t < end], end]
        return max(b - a for a, b in itertools.pairwise(points))


def payload(size: int, rng: random.Random, tag: str) -> bytes:
    # A random 64 KiB block repeated, behind a unique header: distinct digests, cheap to make.
    head = f"{tag}:{rng.random()}:".encode()
    block = rng.randbytes(min(size, 64 * 1024)) or b"x"
    body = (block * (size // len(block) + 1))[: max(size - len(head), 0)]
    return (head + body)[:size] if size >= len(head) else head[:size]


def mixed_size(rng: random.Random, big: bool) -> int:
    r = rng.random()
    if r < 0.55:
        return rng.randint(1024, 64 * 1024)
    if r < 0.85:
        return rng.randint(64 * 1024, MIB)
    if r < 0.97 or not big:
        return rng.randint(MIB, 8 * MIB)
    return rng.randint(16 * MIB, 64 * MIB)


class Workload:
    """Writes and updates blobs of mixed sizes (1 KiB to 64 MiB) from ``threads`` threads,
    recording every acknowledged and every failed write. Bounded by ``max_ops`` and
    ``max_secs``."""

    def __init__(self, cluster: ChaosCluster, prefix: str, keys: int = 12, threads: int = 2,
                 max_ops: int = 400, max_secs: float = 120.0, big: bool = True,
                 op_timeout: float = 30.0, seed: int = 7) -> None:
        self.cluster = cluster
        self.prefix = prefix
        self.keys = keys
        self.threads = threads
        self.max_ops = max_ops
        self.max_secs = max_secs
        self.big = big
        self.op_timeout = op_timeout
        self.records = Records()
        self._stop = threading.Event()
        self._ops = 0
        self._ops_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._seed = seed
        self.started = 0.0

    def __enter__(self) -> Workload:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.started = time.monotonic()
        for t in range(self.threads):
            th = threading.Thread(target=self._run, args=(t,), name=f"workload-{t}", daemon=True)
            th.start()
            self._threads.append(th)

    def stop(self) -> None:
        self._stop.set()
        for th in self._threads:
            th.join(self.op_timeout + 30)
        assert not any(th.is_alive() for th in self._threads), "workload threads did not stop"

    def acked(self) -> int:
        """Writes acknowledged so far: a mark for :meth:`wait_acks`."""
        with self.records.lock:
            return len(self.records.acks)

    def wait_acks(self, n: int, timeout: float, since: int | None = None) -> None:
        """Wait for ``n`` acknowledged writes after the mark ``since`` (default: now). Take
        the mark before a fault's end when the wait comes after a longer check: writes
        resume meanwhile and may spend the workload's op budget before the wait starts."""
        target = (self.acked() if since is None else since) + n
        wait_until(lambda: len(self.records.acks) >= target, timeout,
                   f"{n} more acknowledged writes")

    def _take(self) -> bool:
        with self._ops_lock:
            if self._ops >= self.max_ops or time.monotonic() - self.started > self.max_secs:
                return False
            self._ops += 1
            return True

    def _run(self, index: int) -> None:
        rng = random.Random(self._seed * 1000 + index)
        client = self.cluster.client(timeout=self.op_timeout)
        created: set[str] = set()
        # Each thread owns its keys, so versions per key are ordered by this thread's acks.
        mine = [f"{self.prefix}-{index}-{k}" for k in range(self.keys)]
        while not self._stop.is_set() and self._take():
            key = rng.choice(mine)
            data = payload(mixed_size(rng, self.big), rng, key)
            d = digest(data)
            try:
                if key in created:
                    meta = client.update(key, data)
                else:
                    meta = client.create(key, data, replication_factor=3)
                    created.add(key)
            except KeyAlreadyExists:
                created.add(key)  # an earlier create of ours landed though it reported failure
                self._fail(key, d, "already exists")
                continue
            except BlobError as e:
                self._fail(key, d, f"{type(e).__name__}: {e}")
                continue
            with self.records.lock:
                self.records.acks.append(Ack(key, meta.version, meta.digest, len(data),
                                             time.monotonic()))
            assert meta.digest == d, f"acknowledged digest of {key} differs from what was sent"

    def _fail(self, key: str, d: str, error: str) -> None:
        with self.records.lock:
            self.records.failures.append(Failure(key, d, error, time.monotonic()))


@dataclass
class Verdict:
    acknowledged: int
    failed: int
    keys: int
    lost: int
    corrupt_reads: int
    replica_reads: int
    problems: list[str]
    #: Keys whose committed version is a newer copy of the last acknowledged bytes.
    rolled_back: int = 0

    def figures(self) -> dict[str, Any]:
        return {"writes_acknowledged": self.acknowledged, "writes_failed": self.failed,
                "keys": self.keys, "lost": self.lost, "corrupt_reads": self.corrupt_reads,
                "replica_reads": self.replica_reads, "rolled_back_versions": self.rolled_back}


def verify(cluster: ChaosCluster, records: Records, min_replication: int = 3,
           wait_secs: float = 180.0) -> Verdict:
    """Read back the latest acknowledged version of every key from every replica."""
    client = cluster.client(timeout=60)
    latest = records.latest()
    failed_digests: dict[str, set[str]] = {}
    with records.lock:
        for f in records.failures:
            failed_digests.setdefault(f.key, set()).add(f.digest)
    problems: list[str] = []
    lost = corrupt = reads = rolled_back = 0
    keys = sorted(latest)
    by_address = {m.address: m for m in cluster.masters}
    if keys:
        result = client.wait_for_replication(keys, min_replication, timeout=wait_secs)
        if not result.reached:
            problems.append(f"replication {min_replication} not reached for every key:"
                            f" {[(s.key, s.replication) for s in result.statuses][:5]}")
    for key in keys:
        ack = latest[key]
        meta = client.get_meta(key)
        if meta.version < ack.version or (meta.version == ack.version
                                          and meta.digest != ack.digest):
            lost += 1
            problems.append(f"{key}: acknowledged v{ack.version} but the cluster has"
                            f" v{meta.version}")
            continue
        if meta.version > ack.version:
            if meta.digest == ack.digest:
                # A newer version holding exactly the last acknowledged bytes: the leader
                # rolled back a version that was committed but never acknowledged (its old
                # leader died or paused before the write quorum), or an upload was retried
                # after its first commit's answer was lost. Readers see what was acknowledged.
                rolled_back += 1
            elif meta.digest not in failed_digests.get(key, set()):
                history = sorted((a.version, a.digest[:8]) for a in records.acks if a.key == key)
                problems.append(
                    f"{key}: v{meta.version} ({meta.digest[:8]}) matches no write that was"
                    f" attempted; acknowledged {history}, failed"
                    f" {sorted(d[:8] for d in failed_digests.get(key, set()))}")
        holders = client.get_replication(key).holders
        for h in holders:
            node = by_address.get(h)
            if node is None:
                continue
            reads += 1
            try:
                chunks = cluster.stub(node).Download(
                    pb.DownloadRequest(key=key, version=meta.version), metadata=md(), timeout=120)
                data = b"".join(c.data for c in chunks)
            except grpc.RpcError as e:
                problems.append(f"{key}: replica {h} failed to serve v{meta.version}: {e.code()}")
                continue
            if digest(data) != meta.digest:
                corrupt += 1
                problems.append(f"{key}: replica {h} served bytes that fail the digest")
    with records.lock:
        n_acks, n_failed = len(records.acks), len(records.failures)
    return Verdict(n_acks, n_failed, len(keys), lost, corrupt, reads, problems, rolled_back)


class LeaderSampler:
    """Samples every reachable master's (is_leader, epoch) to check that each epoch had a
    single leader."""

    def __init__(self, cluster: ChaosCluster, period: float = 0.2) -> None:
        self.cluster = cluster
        self.period = period
        self.samples: list[tuple[float, str, bool, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="leader-sampler", daemon=True)

    def __enter__(self) -> LeaderSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            for m in list(self.cluster.masters):
                s = self.cluster.status(m, timeout=0.5)
                if s is not None:
                    self.samples.append((time.monotonic(), m.name, s.is_leader, s.epoch))
            self._stop.wait(self.period)

    def leaders_by_epoch(self) -> dict[int, set[str]]:
        out: dict[int, set[str]] = {}
        for _, name, is_leader, epoch in self.samples:
            if is_leader:
                out.setdefault(epoch, set()).add(name)
        return out

    def violations(self) -> list[str]:
        return [f"epoch {e} had leaders {sorted(names)}"
                for e, names in self.leaders_by_epoch().items() if len(names) > 1]


def begin_inflight(cluster: ChaosCluster, node: Node, key: str, data: bytes) -> str:
    """Start an upload on ``node`` and send all its bytes, without committing."""
    s = cluster.stub(node)
    begun = s.BeginUpload(pb.BeginUploadRequest(key=key, create=True, replication_factor=3),
                          metadata=md(), timeout=10)
    s.AppendUpload(iter([pb.UploadChunk(upload_id=begun.upload_id, offset=0, data=data)]),
                   metadata=md(), timeout=30)
    return str(begun.upload_id)

