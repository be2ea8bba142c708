"""Fan-out on one machine: N node caches fetch one blob from 3 masters at once, every host in
a network namespace of its own, every link shaped with ``tc``.

Namespaces: one per master, one for ZooKeeper, one per node, and one holding the bridge that
joins them (``10.77.0.0/24``). Each host's veth has a token-bucket filter on both ends, so a
master's egress and a node's ingress are each held to the link's rate. Everything is made
with ``ip -n``/``ip netns exec`` inside those namespaces: the host's own interfaces and routes
are never touched, no traffic leaves them, and everything made is removed on the way out,
on failure too (and namespaces an earlier run left behind, once its process is gone).

Root only. ``python -P -m blobha.ops.bench.fanout_net --nodes 4 --size-mib 32 --rate-mbit 100``
prints one node's fetch time alone, then all N at once, their ratio, the median and slowest
node, each master's egress, and the bytes the nodes took from peers and from the masters.
Node caches serve each other (docs/cache.md, "Peer serving") unless ``--no-peers`` is given
(the baseline: every node from the masters); every node keeps serving until all are done, as
long-lived executors would.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

__all__ = ["FanoutResult", "Namespaces", "main", "run_fanout"]

_PREFIX = "bhfan"
_SUBNET = "10.77.0"
_ZK_PORT = 2181
_MASTER_PORT = 6627
_KEY = "fanout-blob"


class FanoutRefused(Exception):
    """The run cannot be made here (not root, no ip or tc): the message says why."""


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _tc(ns: str, *args: str) -> None:
    done = subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True,
                          text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)} in {ns}: {done.stderr.strip()}")


def _leftovers() -> list[str]:
    """Namespaces of earlier runs whose process is gone."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                         timeout=30).stdout
    stale = []
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if len(parts) >= 3 and parts[0] == _PREFIX and parts[1].isdigit():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(parts[1]), 0)
                continue  # its run is alive
            stale.append(name)
    return stale


class Namespaces:
    """A bridge namespace and hosts attached to it, each host's link shaped at ``rate_mbit``
    in both directions; all removed by :meth:`close`."""

    def __init__(self, rate_mbit: float) -> None:
        self.rate_mbit = rate_mbit
        self.tag = f"{_PREFIX}-{os.getpid()}"
        self.bridge = f"{self.tag}-br"
        self.hosts: dict[str, str] = {}  # name -> address
        self._made: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []

    def __enter__(self) -> Namespaces:
        for stale in _leftovers():
            with contextlib.suppress(RuntimeError):
                _ip("netns", "del", stale)
        self._add_ns(self.bridge)
        _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge, "link", "set", "br0", "up")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def add_host(self, host: str) -> str:
        """A namespace for ``host`` on the bridge; its address."""
        ns = self.ns(host)
        self._add_ns(ns)
        address = f"{_SUBNET}.{len(self.hosts) + 2}"
        port = f"b-{host}"[:15]
        # Both ends made inside the bridge's namespace, one moved to the host's: nothing is
        # ever made in the machine's own namespace.
        _ip("-n", self.bridge, "link", "add", port, "type", "veth", "peer", "name", "eth0",
            "netns", ns)
        _ip("-n", self.bridge, "link", "set", port, "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        rate = f"{self.rate_mbit:g}mbit"
        burst = f"{max(32, int(self.rate_mbit * 1000 / 8 / 100))}kb"  # 10 ms of the rate
        for where, dev in ((ns, "eth0"), (self.bridge, port)):
            _tc(where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
                "latency", "200ms")
        self.hosts[host] = address
        return address

    def spawn(self, host: str, argv: Sequence[str], cwd: Path, log: IO[bytes] | int,
              stdin: int | None = subprocess.DEVNULL) -> subprocess.Popen[Any]:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns(host), *argv], cwd=cwd, stdin=stdin,
            stdout=log if stdin is subprocess.DEVNULL else subprocess.PIPE, stderr=log,
            env={**os.environ, "BLOBHA_EXIT_WITH_PARENT": str(os.getpid())},
            start_new_session=True, text=True)
        self._procs.append(proc)
        return proc

    def tx_bytes(self, host: str) -> int:
        out = subprocess.run(["ip", "netns", "exec", self.ns(host), "cat",
                              "/sys/class/net/eth0/statistics/tx_bytes"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return int(out.strip())

    def close(self) -> None:
        # Agents end on their stdin's end: the ZooKeeper agent stops its server then (which
        # runs in a session of its own, out of reach of a signal to the agent's group).
        for proc in self._procs:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
        deadline = time.monotonic() + 20
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 15)
        for proc in self._procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 9)
                proc.wait(10)
        # Deleting a namespace takes its end of every veth, and with it the other end.
        for name in reversed(self._made):
            with contextlib.suppress(RuntimeError):
                _ip("netns", "del", name)
        self._made.clear()


@dataclass
class FanoutResult:
    nodes: int
    size_mib: float
    rate_mbit: float
    one_node_s: float
    all_nodes_s: float
    node_secs: list[float]
    master_egress_mib: dict[str, float] = field(default_factory=dict)
    peers: bool = True
    #: MiB the nodes of the all-at-once run took from other nodes' caches.
    peer_mib: float = 0.0
    #: Nodes of the all-at-once run whose installed copy has the blob's digest.
    copies_verified: int = 0

    @property
    def ratio(self) -> float:
        return self.all_nodes_s / self.one_node_s

    def figures(self) -> dict[str, Any]:
        total = sum(self.master_egress_mib.values())
        return {
            "nodes": self.nodes, "size_mib": self.size_mib, "rate_mbit": self.rate_mbit,
            "one_node_s": round(self.one_node_s, 2), "all_nodes_s": round(self.all_nodes_s, 2),
            "ratio": round(self.ratio, 2),
            "p50_node_s": round(statistics.median(self.node_secs), 2),
            "max_node_s": round(max(self.node_secs), 2),
            "master_egress_mib": {k: round(v, 1) for k, v in self.master_egress_mib.items()},
            "master_egress_x_blob": round(total / self.size_mib, 2),
            "peers": self.peers,
            "from_peers_mib": round(self.peer_mib, 1),
            "from_masters_mib": round(self.nodes * self.size_mib - self.peer_mib, 1),
            "copies_verified": self.copies_verified,
        }


#: What runs in a node's namespace: one cache fetch of the blob, after a "go" on stdin, its
#: time and the bytes it took from peers on stdout; then it serves its peers until its stdin
#: ends. The cache verifies the copy's digest as every fetch does.
_FETCH = textwrap.dedent("""
    import json, sys, time
    from blobha.cache import BlobCache
    from blobha.cache.peers.fetch import Totals
    from blobha.core.digest import digest_stream
    cluster, cache_dir, key, peers = sys.argv[1:5]
    with BlobCache(cache_dir, cluster=cluster, user="fanout", peers=peers == "1") as cache:
        print("ready", flush=True)
        sys.stdin.readline()
        t0 = time.monotonic()
        path = cache.get(key).path
        secs = time.monotonic() - t0
        with open(path, "rb") as f:  # the copy as installed, hashed again
            digest = digest_stream(f)[0]
        print(json.dumps({"secs": secs, "peer_bytes": Totals.peer_bytes, "digest": digest}),
              flush=True)
        sys.stdin.read()
""")

#: The blob, written from the first node's namespace, replicated to every master.
_LOAD = textwrap.dedent("""
    import os, sys
    from blobha.client import Client
    cluster, key, size, masters = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    with Client(cluster, user="fanout", timeout=120) as c:
        data = os.urandom(size)
        meta = c.create(key, data, replication_factor=masters)
        assert c.wait_for_replication([key], masters, timeout=120).reached
    print(meta.digest, flush=True)
""")

_ZK = textwrap.dedent("""
    import signal, sys
    from pathlib import Path
    from blobha.ops.zkserver import EmbeddedZooKeeper
    # A SIGTERM ends the agent through its finally: the server stops with it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    zk = EmbeddedZooKeeper(Path(sys.argv[1]), port=int(sys.argv[3]), host=sys.argv[2])
    zk.start()
    print("ready", flush=True)
    try:
        sys.stdin.read()
    finally:
        zk.stop()
""")


def _python(code: str) -> list[str]:
    # -P: a source checkout in the working directory never shadows the installed package.
    return [sys.executable, "-P", "-c", code]


def _line(proc: subprocess.Popen[Any], what: str, timeout: float) -> str:
    import selectors

    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise TimeoutError(f"{what}: nothing within {timeout:.0f} s")
    line: str = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"{what}: the process ended (exit {proc.wait()}); see its log")
    return line.strip()


def run_fanout(nodes: int, size_mib: float, rate_mbit: float, work: Path,
               masters: int = 3, peers: bool = True) -> FanoutResult:
    if os.geteuid() != 0:
        raise FanoutRefused("the fan-out run builds network namespaces: run it as root")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise FanoutRefused(f"the fan-out run needs '{tool}' (Debian: iproute2)")
    size = int(size_mib * 1024 * 1024)
    log = open(work / "fanout.log", "ab")  # noqa: SIM115 - shared by the children, closed below
    try:
        with Namespaces(rate_mbit) as net:
            zk_address = net.add_host("zk")
            names = [f"m{i + 1}" for i in range(masters)]
            addresses = [net.add_host(m) for m in names]
            for i in range(nodes):
                net.add_host(f"n{i + 1}")
            zk = net.spawn("zk", [*_python(_ZK), str(work / "zk"), zk_address, str(_ZK_PORT)],
                           work, log, stdin=subprocess.PIPE)
            _line(zk, "ZooKeeper", 60)
            cluster = ",".join(f"{a}:{_MASTER_PORT}" for a in addresses)
            for name, address in zip(names, addresses, strict=True):
                config = work / f"{name}.toml"
                config.write_text(
                    f'"blobstore.dir" = "{work / name}"\n'
                    f'"zookeeper.servers" = "{zk_address}:{_ZK_PORT}"\n'
                    f'"master.listen" = "{address}:{_MASTER_PORT}"\n'
                    '"zookeeper.session.timeout.ms" = 6000\n'
                    '"blobstore.disk.reserved.bytes" = 67108864\n')
                net.spawn(name, [sys.executable, "-P", "-m", "blobha", "serve", "--config",
                                 str(config)], work, log)
            loader = net.spawn("n1", [*_python(_LOAD), cluster, _KEY, str(size), str(masters)],
                               work, log, stdin=subprocess.PIPE)
            digest = _line(loader, "writing the blob", 300)
            one = _fetch_at_once(net, ["n1"], cluster, work / "alone", log, peers)[0][0]
            before = {m: net.tx_bytes(m) for m in names}
            done = _fetch_at_once(net, [f"n{i + 1}" for i in range(nodes)], cluster,
                                  work / "all", log, peers)
            egress = {m: (net.tx_bytes(m) - before[m]) / 2**20 for m in names}
            secs = [t for t, _, _ in done]
            # All nodes start at one "go": the fan-out takes its slowest node's time.
            return FanoutResult(nodes, size_mib, rate_mbit, one, max(secs), secs, egress,
                                peers, sum(b for _, b, _ in done) / 2**20,
                                sum(d == digest for _, _, d in done))
    finally:
        log.close()


def _fetch_at_once(net: Namespaces, hosts: list[str], cluster: str, root: Path,
                   log: IO[bytes], peers: bool) -> list[tuple[float, int, str]]:
    """Each node's fetch time, the bytes it took from peers and its copy's digest; the
    nodes end after the slowest one is done (they serve their peers until then)."""
    procs = []
    for host in hosts:
        cache = root / host
        cache.mkdir(parents=True)
        procs.append(net.spawn(host, [*_python(_FETCH), cluster, str(cache), _KEY,
                                      "1" if peers else "0"], root, log,
                               stdin=subprocess.PIPE))
    for host, proc in zip(hosts, procs, strict=True):
        _line(proc, f"the cache on {host}", 120)
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    out = []
    for host, proc in zip(hosts, procs, strict=True):
        answer = json.loads(_line(proc, f"the fetch on {host}", 3600))
        out.append((float(answer["secs"]), int(answer["peer_bytes"]), str(answer["digest"])))
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.close()  # the node stops serving and ends
    for host, proc in zip(hosts, procs, strict=True):
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the cache on {host} did not end") from None
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -P -m blobha.ops.bench.fanout_net", description=__doc__
                                .split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--size-mib", type=float, default=32.0)
    p.add_argument("--rate-mbit", type=float, default=100.0)
    p.add_argument("--no-peers", action="store_true",
                   help="node caches neither serve nor use each other (the baseline)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="blobha-fanout-") as tmp:
        try:
            result = run_fanout(args.nodes, args.size_mib, args.rate_mbit, Path(tmp),
                                peers=not args.no_peers)
        except FanoutRefused as e:
            print(f"blobha fanout: {e}", file=sys.stderr)
            return 2
    figures = result.figures()
    if args.json:
        print(json.dumps(figures))
    else:
        for k, v in figures.items():
            print(f"{k:22} {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
