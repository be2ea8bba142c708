"""Randomized faults against the containerised deployment, one at a time, under several writer
and reader clients, then the whole history checked (tests/chaos/fault_checker.py).

The seed is printed and recorded in the chaos report; ``BLOBHA_FAULT_SEED=N`` replays a run,
``BLOBHA_FAULT_SECS`` sets how long faults are injected (about 150 s by default, some 4 minutes
with the cluster's start and the checks).
"""

from __future__ import annotations

import os
import random
import threading
import time
from typing import Any

import grpc
import pytest
from chaos_harness import SESSION_TIMEOUT_MS, ChaosCluster, LeaderSampler, Node, md, verify
from fault_checker import OK, RandomWorkload, check_history
from support.prefill import prefill_data, prefill_key
from support.waiting import wait_until

from blobha.ops.zkserver import heap_mb_for
from blobha.v1 import blobha_pb2 as pb

pytestmark = pytest.mark.timeout(1200)

SESSION_S = SESSION_TIMEOUT_MS / 1000
#: The longest time without an acknowledged write that a fault may cause, counted from the
#: fault, or from a ZooKeeper quorum's return for a ZooKeeper restart.
OUTAGE_BOUND_S = SESSION_S + 3
#: ``BLOBHA_FAULT_KEYS=100000`` adds a run in a store of that many keys, put in place first.
#: Not in the suite yet: on a loaded machine a master still reconciling every key after a new
#: session (ha-rule 6) starves its own writes and the election for seconds, past the bound.
SCALE_KEYS = int(os.environ.get("BLOBHA_FAULT_KEYS", "").strip() or 0)
#: Not in a store of 100,000 keys yet: on a loaded machine, a survivor still reconciling every
#: key after its own restart stops its writes for seconds while the wiped follower returns.
NOT_AT_SCALE = ("wipe_follower",)
FAULTS = ("kill_leader", "kill_follower", "pause_leader", "term_leader", "wipe_follower",
          "zk_restart")


def _seed() -> int:
    text = os.environ.get("BLOBHA_FAULT_SEED", "").strip()
    return int(text) if text else random.SystemRandom().randrange(1, 1_000_000)


def _follower(c: ChaosCluster, leader: Node, rng: random.Random) -> Node:
    return rng.choice([m for m in c.masters if m is not leader])


def _inject(c: ChaosCluster, w: RandomWorkload, kind: str, rng: random.Random,
            ready_s: float) -> dict[str, Any]:
    """One fault, and the cluster back to every master ready; its figures."""
    leader = c.wait_leader(30)
    wall = time.time()  # for reading the fault against the masters' logs
    t0 = time.monotonic()
    since = t0  # the outage is counted from here
    target = leader
    steps: dict[str, float] = {}
    if kind == "kill_leader":
        leader.docker.kill(signal="SIGKILL")
        c.wait_leader(60, not_in=(leader,))
        leader.docker.start()
    elif kind == "kill_follower":
        target = _follower(c, leader, rng)
        target.docker.kill(signal="SIGKILL")
        wait_until(lambda: w.history.acked_writes() > 0 and _acked_since(w, t0) >= 3, 60,
                   "writes with a follower down")
        target.docker.start()
    elif kind == "pause_leader":
        c.pause(leader)
        try:
            c.wait_leader(60, not_in=(leader,))
            steps["successor_s"] = time.monotonic() - t0
            # Past the session timeout (a successor exists), and then some: this wait is the
            # fault's length (the pause a leader suffers), not a synchronisation.
            threading.Event().wait(rng.uniform(0.0, 3.0))
        finally:
            leader.docker.unpause()
    elif kind == "term_leader":
        leader.docker.stop(timeout=10)
        c.wait_leader(60, not_in=(leader,))
        leader.docker.start()
    elif kind == "wipe_follower":
        target = _follower(c, leader, rng)
        target.docker.stop(timeout=10)
        c.wipe(target)
        target.docker.start()
    elif kind == "zk_restart":
        for z in c.zks:
            z.docker.kill(signal="SIGKILL")
        for z in c.zks:
            z.docker.start()
        # Counted from a quorum's return: until then no write can be made.
        wait_until(lambda: sum(c.zk_mode(z) in ("leader", "follower") for z in c.zks) >= 2,
                   90, "a ZooKeeper quorum")
        since = time.monotonic()
        c.wait_zk_quorum(90)
    else:
        raise AssertionError(kind)
    mark = time.monotonic()
    steps["fault_s"] = mark - t0
    wait_until(lambda: _acked_since(w, mark) >= 3, 120, f"writes to resume after {kind}")
    c.wait_ready(ready_s)
    recovered = time.monotonic()
    return {"kind": kind, "target": target.name, "outage_s": round(w.history.write_gaps(
        since, recovered), 2), "recovered_after_s": round(recovered - t0, 2),
        "at": time.strftime("%H:%M:%S", time.gmtime(wall)) + f".{int(wall % 1 * 1000):03d}",
        "clock": round(t0, 2),  # the history's clock (time.monotonic), to place its problems
        **{k: round(v, 2) for k, v in steps.items()}}


def _acked_since(w: RandomWorkload, t: float) -> int:
    return sum(1 for o in w.history.snapshot()
               if o.kind == "write" and o.outcome == OK and o.end > t)


def _deleted_everywhere(c: ChaosCluster, key: str) -> list[str]:
    """The masters that still know ``key`` (it must be gone from every one)."""
    still = []
    for m in c.masters:
        try:
            c.stub(m).GetMeta(pb.GetMetaRequest(key=key), metadata=md(), timeout=10)
            still.append(m.name)
        except grpc.RpcError as e:
            if e.code() is not grpc.StatusCode.NOT_FOUND:
                still.append(f"{m.name} ({e.code().name})")
    return still


def _prefilled_wrong(c: ChaosCluster, keys: int, rng: random.Random) -> list[str]:
    """A sample of the keys put in place first, read from every master: each must still be
    there with its bytes (a wipe's catch-up fetched them; no fault may take one away)."""
    wrong = []
    for i in rng.sample(range(keys), min(keys, 50)):
        key = prefill_key("fill", i)
        for m in c.masters:
            try:
                got = b"".join(r.data for r in c.stub(m).Download(
                    pb.DownloadRequest(key=key), metadata=md(), timeout=10))
            except grpc.RpcError as e:
                wrong.append(f"{key} on {m.name}: {e.code().name}")
                continue
            if got != prefill_data(key):
                wrong.append(f"{key} on {m.name}: {len(got)} bytes, not its own")
    return wrong


@pytest.mark.parametrize(("chaos_cluster", "keys"), [
    pytest.param({}, 0, id="empty"),
    # ZooKeeper's heap as the embedded one's for that many keys.
    *([pytest.param({"zk_heap_mb": heap_mb_for(SCALE_KEYS)}, SCALE_KEYS,
                    id=f"{SCALE_KEYS}-keys")] if SCALE_KEYS else []),
], indirect=["chaos_cluster"])
def test_random_faults_keep_every_guarantee(chaos_cluster: ChaosCluster, keys: int,
                                            scenario: dict[str, Any]) -> None:
    """The faults and checks in an empty store, and with BLOBHA_FAULT_KEYS in one of that many
    keys put in place first (a restart with them on every master)."""
    c = chaos_cluster
    seed = _seed()
    budget = float(os.environ.get("BLOBHA_FAULT_SECS", "150"))
    # A wiped follower's catch-up: well within this at a few thousand keys a second.
    ready_s = 180 + keys / 250
    fault_kinds = [k for k in FAULTS if not keys or k not in NOT_AT_SCALE]
    if keys:
        scenario["prefilled_keys"] = keys
        scenario["prefill_s"] = round(c.prefill(keys, ready_s), 1)
    print(f"random faults: seed {seed} (replay with BLOBHA_FAULT_SEED={seed})")
    scenario["seed"] = seed
    rng = random.Random(seed)
    faults: list[dict[str, Any]] = []
    with LeaderSampler(c) as sampler, RandomWorkload(c, seed) as w:
        wait_until(lambda: w.history.acked_writes() >= 20, 90, "the workload to start")
        started = time.monotonic()
        while time.monotonic() - started < budget:
            faults.append(_inject(c, w, rng.choice(fault_kinds), rng, ready_s))
            mark = time.monotonic()
            wait_until(lambda m=mark: _acked_since(w, m) >= 5, 60, "writes between faults")
    ops = w.history.snapshot()
    deletes = [o.key for o in ops if o.kind == "delete" and o.outcome == OK]
    verdict = verify(c, w.history.records())
    deleted_still = []
    for key in deletes:
        still = _deleted_everywhere(c, key)
        if still:
            deleted_still.append(f"{key} was deleted but {', '.join(still)} still hold it")
    # By kind, a few of each: one kind's many must not hide another's first.
    kinds = {"workload": w.errors, "history": check_history(ops),
             "final state": verdict.problems, "leaders": sampler.violations(),
             "deletes": deleted_still, "prefilled keys": _prefilled_wrong(c, keys, rng)}
    problems = [f"{kind} ({len(found)}): " + "; ".join(found[:8])
                for kind, found in kinds.items() if found]
    worst: dict[str, float] = {}
    for f in faults:
        worst[f["kind"]] = max(worst.get(f["kind"], 0.0), f["outage_s"])
    scenario.update(
        faults=[f"{f['kind']}({f['target']}): outage {f['outage_s']} s" for f in faults],
        fault_timeline=faults,
        longest_outage_by_kind_s=worst,
        operations=len(ops),
        reads_served=sum(1 for o in ops if o.kind == "read" and o.outcome == OK),
        deletes_acknowledged=len(deletes), epochs_seen=sorted(sampler.leaders_by_epoch()),
        **verdict.figures(),
    )
    print(f"random faults, seed {seed}: {scenario}")
    assert not problems, f"seed {seed}: " + " | ".join(problems)
    # At 100,000 keys one fault's recovery (every master back with no lag) can take minutes.
    assert len(faults) >= (1 if keys else 2), (
        f"seed {seed}: only {len(faults)} faults in {budget} s")
    over = {k: v for k, v in worst.items() if v > OUTAGE_BOUND_S}
    assert not over, (f"seed {seed}: writes stopped longer than {OUTAGE_BOUND_S} s: {over}"
                      f" ({faults})")
