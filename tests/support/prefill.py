"""A store of many keys made in seconds: what a cluster restarted with that many keys finds.

Creating 100,000 keys through the masters takes minutes (at a few hundred creates a second,
slower under the suite's load). The fault tests at scale need the keys to be there, not their
creation, so :func:`prefill` writes the same state the commits would have written, with the
project's own code: each stopped master's store gets the versions through
``LocalStore.install_many`` (the group commit's install), and ZooKeeper gets each key's record
(:class:`BlobState`) and one replica node per master in multi transactions. The masters then
start on it as after a restart: each checks its replica nodes against its disk before they
count (ha-rule 6), and its synchroniser reconciles every key.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from kazoo.client import KazooClient

from blobha.core.acl import normalize_for_create
from blobha.core.blobstate import BlobState
from blobha.core.digest import digest_bytes
from blobha.store.local import LocalStore
from blobha.zk.layout import EPOCH, EpochRecord, key_path, replica_path

#: Keys per ZooKeeper transaction (four operations each with three masters) and per install.
BATCH = 250
#: Transactions in flight at once.
IN_FLIGHT = 8


def prefill_key(prefix: str, i: int) -> str:
    return f"{prefix}-{i:07d}"


def prefill_data(key: str) -> bytes:
    """Each key's content: its own name, so a read shows which key it came from."""
    return key.encode()


def _batches(keys: int, prefix: str) -> Iterator[list[tuple[str, bytes, str]]]:
    """The keys in batches, each key with its content and that content's digest."""
    for start in range(0, keys, BATCH):
        batch = []
        for i in range(start, min(keys, start + BATCH)):
            key = prefill_key(prefix, i)
            blob = prefill_data(key)
            batch.append((key, blob, digest_bytes(blob)))
        yield batch


def prefill(zk_servers: str, stores: Mapping[str, Path], keys: int, *, prefix: str = "fill",
            creator: str = "alice", write_quorum: int = 1, chroot: str = "/blobha") -> float:
    """Put ``keys`` keys (:func:`prefill_key`) at version 1 on every master of ``stores``
    (advertised address -> data directory; the masters must be stopped), under ZooKeeper
    ``zk_servers`` and the masters' ``chroot`` (``zookeeper.chroot``), each held by all
    of them (replication factor ``len(stores)``), acknowledged. The seconds it took.

    Files are given the owner of the data directory's ``keys`` folder (a container's user)."""
    started = time.monotonic()
    now = time.time()
    zk = KazooClient(hosts=zk_servers + chroot, timeout=30.0)
    zk.start(timeout=30.0)
    try:
        data, _ = zk.get(EPOCH)
        epoch = EpochRecord.decode(data).epoch
        batches = list(_batches(keys, prefix))
        for root in stores.values():
            _fill_store(root, batches)
        acl = tuple(normalize_for_create([], creator))
        pending = []
        for batch in batches:
            txn = zk.transaction()
            for key, blob, digest in batch:
                state = BlobState(seq=1, size=len(blob), digest=digest, acl=acl,
                                  replication_factor=len(stores), creator=creator,
                                  created_at=now, updated_at=now, epoch=epoch, acked=True,
                                  write_quorum=write_quorum)
                txn.create(key_path(key), state.encode())
                for address in stores:
                    txn.create(replica_path(key, address, 1), b"")
            pending.append(txn.commit_async())
            if len(pending) >= IN_FLIGHT:
                _check(pending.pop(0).get(timeout=60))
        for p in pending:
            _check(p.get(timeout=60))
    finally:
        zk.stop()
        zk.close()
    return time.monotonic() - started


def _check(results: list[object]) -> None:
    failed = [r for r in results if isinstance(r, Exception)]
    assert not failed, f"a prefill transaction failed: {failed[0]!r}"


def _fill_store(root: Path, batches: list[list[tuple[str, bytes, str]]]) -> None:
    store = LocalStore(root)  # takes the directory's lock: its master must be stopped
    try:
        for batch in batches:
            installed = store.install_many(
                [(key, 1, blob, len(blob), digest) for key, blob, digest in batch])
            assert all(not isinstance(r, Exception) for r in installed), installed
    finally:
        store.close()
    owner = (root / "keys").stat()
    if (owner.st_uid, owner.st_gid) != (os.getuid(), os.getgid()):
        for path in [root, *root.rglob("*")]:
            os.chown(path, owner.st_uid, owner.st_gid, follow_symlinks=False)
