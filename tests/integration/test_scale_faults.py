"""Faults in a store of 100,000 keys, on real masters and a real ZooKeeper: the leader killed
while eight clients create keys at full rate loses nothing acknowledged, and writes resume
within the bound that holds at a few keys (failover does not grow with the keys)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import pytest
from kazoo.client import KazooClient
from support.clusters import FAST, SESSION_TIMEOUT_MS
from support.harness import client_for, wait_until
from support.prefill import prefill, prefill_data, prefill_key

from blobha.core.errors import BlobError
from blobha.ops.localcluster import LocalCluster
from blobha.ops.zkserver import heap_mb_for
from blobha.zk.layout import HOLDERS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

KEYS = 100_000
WRITERS = 8
#: As the random-fault test's bound: the session timeout, then an election and a first commit.
OUTAGE_BOUND_S = SESSION_TIMEOUT_MS / 1000 + 3


class Writers:
    """``WRITERS`` clients creating keys of their own as fast as they are answered."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.acked: dict[str, tuple[bytes, float]] = {}  # key -> (data, acknowledged at)
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(WRITERS)]

    def __enter__(self) -> Writers:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def _run(self, index: int) -> None:
        with client_for(self.cluster, timeout=30) as c:
            n = 0
            while not self.stop.is_set():
                key = f"w{index}-{n}"
                data = f"{key} {random.random()}".encode()
                try:
                    c.create(key, data, write_quorum=2)
                except BlobError as e:
                    with self.lock:
                        self.errors.append(f"{key}: {e}")
                else:
                    with self.lock:
                        self.acked[key] = (data, time.monotonic())
                n += 1

    def acks_since(self, t: float) -> list[float]:
        with self.lock:
            return sorted(at for _, at in self.acked.values() if at > t)


@pytest.fixture(scope="module")
def store_of_100000_keys(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A cluster whose masters were restarted with 100,000 keys each (ZooKeeper's heap sized
    for them), every master counting again."""
    root = tmp_path_factory.mktemp("scale")
    lc = LocalCluster(root / "cluster", nodes=3, base_port=0, overrides=FAST,
                      zk_heap_mb=heap_mb_for(KEYS))
    with lc:
        for m in lc.masters:
            m.terminate()
        took = prefill(lc.zk.connect_string, {m.address: lc.store_dir(m) for m in lc.masters},
                       KEYS)
        print(f"{KEYS} keys put in place in {took:.1f} s")
        for m in lc.masters:
            lc.start_master(m)
        # Each master counts once it has checked its 100,000 replica nodes (ha-rule 6).
        zk = KazooClient(hosts=lc.zk.connect_string + "/blobha")
        zk.start()
        try:
            wait_until(lambda: len(zk.get_children(HOLDERS)) == 3, 120,
                       "every master to check its replica nodes and count")
        finally:
            zk.stop()
            zk.close()
        lc.wait_ready(60)
        yield lc


def _longest_stop(w: Writers, since: float) -> float:
    """The longest time without an acknowledged write from ``since`` to the last one."""
    acks = w.acks_since(since)
    return max(b - a for a, b in zip([since, *acks], acks, strict=False))


def _all_there(lc: LocalCluster, acked: dict[str, tuple[bytes, float]]) -> None:
    """Every acknowledged create at 3 replicas with its bytes, and the keys put in place."""
    with client_for(lc, timeout=30) as c:
        result = c.wait_for_replication(sorted(acked), 3, timeout=180)
        assert result.reached, [s for s in result.statuses if s.replication < 3][:5]
        lost = [k for k, (data, _) in acked.items() if c.read(k) != data]
        assert not lost, f"{len(lost)} acknowledged creates read back wrong: {lost[:5]}"
        listed = set(c.list())
        assert set(acked) <= listed
        assert sum(k.startswith("fill-") for k in listed) == KEYS
        for i in random.sample(range(KEYS), 200):
            key = prefill_key("fill", i)
            assert c.read(key) == prefill_data(key), key


def test_the_leader_killed_under_eight_writers_in_a_store_of_100000_keys(
        store_of_100000_keys: LocalCluster) -> None:
    lc = store_of_100000_keys
    with Writers(lc) as w:
        wait_until(lambda: len(w.acks_since(0)) >= 200, 60, "the writers to get going")
        leader = lc.leader()
        killed = time.monotonic()
        leader.kill()
        wait_until(lambda: len(w.acks_since(killed)) >= 200, 60,
                   "writes to go on after the leader's SIGKILL")
    outage = _longest_stop(w, killed)
    print(f"{len(w.acked)} creates acknowledged; writes stopped {outage:.2f} s after the"
          f" leader's SIGKILL; {len(w.errors)} failed")
    assert not w.errors, w.errors[:5]
    assert outage <= OUTAGE_BOUND_S, (
        f"no write acknowledged for {outage:.2f} s after the leader's SIGKILL, in a store of"
        f" {KEYS} keys (bound {OUTAGE_BOUND_S} s)")
    lc.start_master(leader)
    _all_there(lc, w.acked)
