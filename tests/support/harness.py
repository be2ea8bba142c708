"""The integration harness's helpers: clusters, clients, raw stubs, metrics and the masters'
files (its fixtures are in tests/integration/conftest.py). Imported by name from here, never
from ``conftest``: several folders have a conftest.py, and which one ``import conftest``
finds depends on what ran before."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, TypeVar

import grpc
from prometheus_client.parser import text_string_to_metric_families

from blobha.client import Client
from blobha.core.keys import key_dirname
from blobha.ops.localcluster import LocalCluster, MasterProcess
from blobha.store.segments import scan
from blobha.v1 import blobha_pb2_grpc as pb_grpc
from blobha.wire.peers import CHANNEL_OPTIONS, USER_METADATA_KEY
from support.clusters import FAST, SESSION_TIMEOUT_MS
from support.waiting import wait_until

__all__ = [
    "FAST", "SESSION_TIMEOUT_MS", "VersionCopy", "_dump_logs", "client_for", "followers",
    "http_get", "make_cluster", "master_metadata", "md", "scrape", "store_dir", "stub", "value",
    "version_files", "wait_until",
]

T = TypeVar("T")



def make_cluster(root: Path, nodes: int = 3, **overrides: Any) -> LocalCluster:
    return LocalCluster(root, nodes=nodes, base_port=0, overrides={**FAST, **overrides})





def _dump_logs(cluster: LocalCluster) -> None:
    for m in cluster.masters:
        try:
            lines = m.log_path.read_text(errors="replace").splitlines()[-40:]
        except OSError:
            continue
        print(f"\n----- {m.address} ({m.log_path}) -----\n" + "\n".join(lines))










def client_for(cluster: LocalCluster, user: str = "alice", **kw: Any) -> Client:
    return Client(cluster.cluster, user=user, timeout=kw.pop("timeout", 30.0), **kw)






def stub(address: str) -> Any:
    """A raw gRPC stub for calls a test must make to one specific master."""
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return pb_grpc.BlobStoreStub(channel)


def md(user: str) -> tuple[tuple[str, str], ...]:
    return ((USER_METADATA_KEY, user),)


def master_metadata(cluster: LocalCluster) -> tuple[tuple[str, str], ...]:
    """Call metadata by which a test speaks as the masters: their principal and the cluster
    secret, read from ZooKeeper."""
    from kazoo.client import KazooClient

    from blobha.core.auth import MASTER_SECRET_METADATA_KEY
    from blobha.zk.layout import MASTER_SECRET

    tls = cluster.zk.tls.client_args() if cluster.zk.tls is not None else {}
    zk = KazooClient(hosts=cluster.zk.connect_string + "/blobha", **tls)
    zk.start()
    try:
        secret = zk.get(MASTER_SECRET)[0].decode()
    finally:
        zk.stop()
        zk.close()
    return (*md("blobha-master"), (MASTER_SECRET_METADATA_KEY, secret))


def store_dir(m: MasterProcess) -> Path:
    return m.config_path.parent / f"master-{m.index + 1}"


class VersionCopy:
    """One version of a key as a master holds it on disk: a ``.blob`` file (beside its
    ``.json``) or a record of a segment file (small versions, see blobha.store.segments)."""

    def __init__(self, seq: int, path: Path, offset: int, size: int) -> None:
        self.seq = seq
        self.stem = f"v{seq}"
        self.path = path
        self.offset = offset
        self.size = size

    def __repr__(self) -> str:
        return f"VersionCopy({self.stem}, {self.path}@{self.offset})"

    @property
    def identity(self) -> tuple[str, int, int]:
        """Which copy this is: a copy installed again has another (a new file or record)."""
        return str(self.path), self.path.stat().st_ino, self.offset

    def read_bytes(self) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            return f.read(self.size)

    def write_bytes(self, data: bytes) -> None:
        """Overwrite the version's bytes in place (the same length: damage, not a change)."""
        assert len(data) == self.size
        with open(self.path, "r+b") as f:
            f.seek(self.offset)
            f.write(data)


def version_files(m: MasterProcess, key: str) -> list[VersionCopy]:
    """``key``'s versions on ``m``, oldest first: its ``.blob`` files and its live segment
    records (of two records of one version, the later; what the master's own index holds)."""
    copies: dict[int, VersionCopy] = {}
    segments = store_dir(m) / "segments"
    for path in sorted(segments.glob("*.seg")) if segments.exists() else []:
        try:
            records = list(scan(path))
        except FileNotFoundError:
            continue  # compacted away meanwhile
        for offset, length, record in records:
            if record is not None and record.get("key") == key:
                size = int(record["size"])
                seq = int(record["seq"])
                copies[seq] = VersionCopy(seq, path, offset + length - size, size)
    d = store_dir(m) / "keys" / key_dirname(key)
    for blob in d.glob("v*.blob") if d.exists() else []:
        seq = int(blob.stem[1:])
        if seq not in copies and blob.with_suffix(".json").exists():
            copies[seq] = VersionCopy(seq, blob, 0, blob.stat().st_size)
    return [copies[seq] for seq in sorted(copies)]


def followers(cluster: LocalCluster) -> list[MasterProcess]:
    leader = cluster.leader()
    return [m for m in cluster.masters if m is not leader and m.alive()]


def http_get(url: str, timeout: float = 10.0) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()


def scrape(m: MasterProcess) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    status, ctype, body = http_get(m.status_url + "metrics")
    assert status == 200 and ctype.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **labels: str) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)
