"""A user who holds many waits for replication without a deadline (the launcher's default is to
wait until the replicas come) cannot take the call threads that other users and the masters
need: long waits count against caps of their own, per user and for all users together."""

from __future__ import annotations

import os
from collections.abc import Iterator

import grpc
import pytest
from support.harness import client_for, md, scrape, stub, value, wait_until

from blobha.ops.localcluster import LocalCluster
from blobha.v1 import blobha_pb2 as pb

#: master.max.calls.per.client's default, 32: a user holds at most a quarter of it in waits.
PER_USER = 8
#: All users' waits together: half of the 48 of 64 call threads open to users.
ALL_USERS = 24


def _wait(address: str, key: str, user: str) -> grpc.Future:
    # Never reached (one replica of a key with a factor of 1), waiting for ever.
    return stub(address).WaitForReplication.future(  # type: ignore[no-any-return]
        pb.WaitForReplicationRequest(keys=[key], min_replication=3, timeout_secs=-1),
        metadata=md(user))


def _refused_busy(future: grpc.Future) -> bool:
    try:
        future.result(timeout=10)
    except grpc.RpcError as e:
        return e.code() is grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[no-any-return]
    return False


@pytest.fixture
def held() -> Iterator[list[grpc.Future]]:
    futures: list[grpc.Future] = []
    yield futures
    for f in futures:
        f.cancel()


def test_long_waits_leave_call_threads_for_everyone_else(
        cluster: LocalCluster, held: list[grpc.Future]) -> None:
    key = f"long-waits-{os.getpid()}"
    with client_for(cluster, "alice") as alice:
        alice.create(key, b"x", acl="u:alice:rwa,o::r", replication_factor=1)
    address = cluster.leader().address
    waiters = [f"waiter{i}" for i in range(ALL_USERS // PER_USER)]
    for user in waiters:
        held.extend(_wait(address, key, user) for _ in range(PER_USER))
    # Sent as futures: all of them admitted before the next, which must then find the caps full.
    leader = cluster.leader()
    wait_until(lambda: value(scrape(leader), "blobha_rpc_in_progress",
                             grpc_method="WaitForReplication") >= ALL_USERS,
               timeout=20, what="the held waits admitted")
    # One more of the same user's is refused at once, as busy; so is any user's past the
    # cap on all users' waits.
    assert _refused_busy(_wait(address, key, waiters[0]))
    assert _refused_busy(_wait(address, key, "latecomer"))
    assert not any(f.done() for f in held)  # every one of them still waiting
    # Everyone else is served meanwhile: status, a W=2 write, reads.
    with client_for(cluster, "bob", timeout=10) as bob:
        bob.create(f"{key}-bob", os.urandom(4096), acl="u:bob:rwa", replication_factor=3,
                   write_quorum=2)
        assert bob.read(f"{key}-bob")
    stub(address).NodeStatus(pb.NodeStatusRequest(), metadata=md("carol"), timeout=5)
    for f in held:
        f.cancel()
    # Once they leave, a wait is admitted again.
    with client_for(cluster, "latecomer", timeout=10) as latecomer:
        assert latecomer.wait_for_replication([key], 1, timeout=5).reached
