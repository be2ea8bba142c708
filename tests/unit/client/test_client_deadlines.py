"""A call cut short by its deadline says why it was retrying, and errors keep their class
through the transport and across the wire."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from support.client_fakes import (
    M1,
    M2,
    M3,
    FakeClock,
    FakeCluster,
    _Status,
)

from blobha.client import Client, ClientLimits
from blobha.client import retry as retry_mod
from blobha.core.errors import (
    DeadlineExceeded,
    Refused,
    ResourceExhausted,
    Unavailable,
)
from blobha.v1 import blobha_pb2 as pb


def test_a_retry_cut_short_by_the_deadline_reports_why_it_was_retrying(
    client: Client, cluster: FakeCluster, clock: FakeClock
) -> None:
    # Each master refuses (ZooKeeper is down) and each refusal takes 9 s; the try that the
    # deadline then cuts short must not hide why the client kept trying.
    refusals = []
    real = cluster.unary

    def unary(address: str, method: str, request: Any, timeout: float | None,
              stall: float | None = None, rivals: Any = ()) -> Any:
        if method != "GetMeta":
            return real(address, method, request, timeout)
        assert timeout is not None
        if len(refusals) < 3:
            refusals.append(address)
            clock.now += 9.0
            raise Unavailable(f"master {address} unavailable: no record of 'k' here while"
                              " ZooKeeper is unreachable")
        clock.now += timeout  # the last try runs to the end of the deadline
        raise DeadlineExceeded(f"master {address} did not answer in time (Deadline Exceeded)")

    cluster.unary = unary  # type: ignore[method-assign]
    with pytest.raises(Unavailable, match=r"within 30 s: .*no record of 'k'"):
        client.get_meta("k")
    assert len(refusals) == 3


def _zookeeper_down(cluster: FakeCluster, clock: FakeClock) -> list[float]:
    """Every master refuses ClusterSummary at once, each refusal taking 0.7 s, until the caller
    has less than 2 s left; that last probe runs into the end of the caller's deadline, as a
    gRPC call with only milliseconds left does whatever the master would have answered.
    Returns the probes' timeouts, as they are made."""
    real = cluster.unary
    timeouts: list[float] = []

    def unary(address: str, method: str, request: Any, timeout: float | None,
              stall: float | None = None, rivals: Any = ()) -> Any:
        if method != "ClusterSummary":
            return real(address, method, request, timeout)
        assert timeout is not None
        timeouts.append(timeout)
        if timeout >= 2.0:
            clock.now += 0.7
            raise Unavailable(f"master {address} unavailable: ZooKeeper is unreachable from"
                              f" master {address}; retry shortly or ask another master")
        clock.now += timeout
        raise DeadlineExceeded(f"master {address} did not answer in time (Deadline Exceeded)")

    cluster.unary = unary  # type: ignore[method-assign]
    return timeouts


@pytest.mark.parametrize("path", ["put", "resumable"])
def test_a_leader_search_cut_short_by_the_deadline_reports_why_it_was_retrying(
    client: Client, cluster: FakeCluster, clock: FakeClock, path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # ZooKeeper has lost its quorum: every master says so, until the deadline cuts the
    # client's last look for a leader short. That last look must not hide the reason.
    if path == "resumable":
        client.limits = ClientLimits(put_max_bytes=-1)
    monkeypatch.setattr(client._router.rng, "random", lambda: 0.0)  # no back-off: many rounds
    timeouts = _zookeeper_down(cluster, clock)
    with pytest.raises(Unavailable, match=r"within 30 s: .*ZooKeeper is unreachable"):
        client.create("k", b"never acknowledged")
    # Many refusals, then a last probe that ran into the deadline: the case under test.
    assert len(timeouts) > 3 and timeouts[-1] < 2.0
    assert clock.now >= 1030.0


def test_a_masters_reason_is_reported_before_another_ones_silence(
    client: Client, cluster: FakeCluster
) -> None:
    def unary(address: str, method: str, request: Any, timeout: float | None,
              stall: float | None = None, rivals: Any = ()) -> Any:
        assert method == "ClusterSummary"
        if address == M1:  # the first to end, in silence
            raise DeadlineExceeded(f"master {address} did not answer in time")
        raise Unavailable(f"master {address} unavailable: ZooKeeper is unreachable")

    cluster.unary = unary  # type: ignore[method-assign]
    with pytest.raises(Unavailable, match=r"no master at .* named a leader \(master m2:2"
                                          r" unavailable: ZooKeeper is unreachable\)"):
        client._router.discover_leader(retry_mod.Deadline(30.0))


def test_a_deadline_with_nothing_retried_before_is_reported_as_it_is(
    client: Client, cluster: FakeCluster, clock: FakeClock
) -> None:
    client.create("k", b"x")
    real = cluster.unary

    def unary(address: str, method: str, request: Any, timeout: float | None,
              stall: float | None = None, rivals: Any = ()) -> Any:
        if method != "Delete":
            return real(address, method, request, timeout)
        assert timeout is not None
        clock.now += timeout
        raise DeadlineExceeded(f"master {address} did not answer in time (Deadline Exceeded)")

    cluster.unary = unary  # type: ignore[method-assign]
    with pytest.raises(DeadlineExceeded, match="did not answer in time"):
        client.delete("k")


def test_a_deadline_the_master_reported_is_not_called_a_master_that_did_not_answer() -> None:
    from blobha.client.transport import error_from_rpc

    own = error_from_rpc(M1, _Status(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
    assert isinstance(own, DeadlineExceeded) and "did not answer in time" in str(own)
    told = error_from_rpc(M1, _Status(
        grpc.StatusCode.DEADLINE_EXCEEDED, "'k' v2 is committed but only 1 of the 2 required"))
    assert isinstance(told, DeadlineExceeded)
    assert "did not answer" not in str(told) and "only 1 of the 2" in str(told)


def test_a_stale_refusal_keeps_its_class_through_the_transport() -> None:
    # A read with no minimum refused as stale makes the client look for a master in touch
    # with ZooKeeper; as a plain refusal it would only try the next one.
    from blobha.client.transport import error_from_rpc
    from blobha.core.errors import REFUSED_METADATA_KEY, STALE_METADATA_KEY, Refused, Stale

    stale = error_from_rpc(M1, _Status(grpc.StatusCode.UNAVAILABLE, "cut off for 9 s",
                                       ((REFUSED_METADATA_KEY, "1"), (STALE_METADATA_KEY, "1"))))
    assert type(stale) is Stale and f"master {M1} unavailable: cut off" in str(stale)
    refused = error_from_rpc(M1, _Status(grpc.StatusCode.UNAVAILABLE, "no ZooKeeper",
                                         ((REFUSED_METADATA_KEY, "1"),)))
    assert type(refused) is Refused


def test_a_master_with_no_free_call_thread_is_busy_not_out_of_resources() -> None:
    # grpcio's own refusal when every call thread is taken: retried like any busy master, and
    # known not to have run (a retry that finds the key gone is not the first try's doing).
    from blobha.client.retry import may_have_run
    from blobha.client.transport import error_from_rpc

    full = error_from_rpc(M1, _Status(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                       "Concurrent RPC limit exceeded!"))
    assert isinstance(full, Unavailable) and "master.rpc.threads" in str(full)
    assert not may_have_run(full)
    disk = error_from_rpc(M1, _Status(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                       "not enough disk space on m1:1"))
    assert isinstance(disk, ResourceExhausted)


def test_giving_up_after_a_lost_commit_answer_says_the_write_may_be_made(
        client: Client, cluster: FakeCluster, clock: FakeClock) -> None:
    real_put = cluster._Put

    def committed_then_lost(address: str, r: pb.PutRequest) -> Any:
        real_put(address, r)  # the commit applies
        cluster.down.update((M1, M2, M3))  # and the cluster is gone before the answer
        raise Unavailable(f"master {address} unavailable: connection reset")

    cluster._Put = committed_then_lost  # type: ignore[method-assign]
    started = clock.now
    with pytest.raises(Unavailable, match="may have been made: check its metadata before"):
        client.create("k", b"data")
    assert clock.now - started <= 30.0 + 2.0 + 1.0  # its timeout, and the outcome check's
    assert "k" in cluster.blobs


@pytest.mark.parametrize("refusal", [
    Refused("master m1:1 unavailable: no leader is ready yet (election in progress)"),
    Unavailable("master m1:1 unavailable: failed to connect to all addresses"),
])
def test_a_commit_refused_before_it_ran_is_retried_without_asking_whether_it_was_made(
        client: Client, cluster: FakeCluster, refusal: Unavailable) -> None:
    # During a failover every extra call waits on a busy cluster: a Put the old leader refused
    # unrun (or never received) cannot have been made, so no metadata read settles it.
    client.create("k", b"v1")
    cluster.faults.append((M1, "Put", refusal))
    before = cluster.count("GetMeta")
    assert client.update("k", b"v2").version == 2
    assert cluster.count("GetMeta") - before == 1  # the update's own read of the version
    assert cluster.blobs["k"][1] == b"v2"


def test_a_commit_whose_answer_may_be_lost_is_still_settled_by_a_metadata_read(
        client: Client, cluster: FakeCluster) -> None:
    client.create("k", b"v1")
    cluster.faults.append((M1, "Put", Unavailable("master m1:1 unavailable: connection reset")))
    before = cluster.count("GetMeta")
    assert client.update("k", b"v2").version == 2
    assert cluster.count("GetMeta") - before == 2  # and one more to learn what became of it


def test_a_refusal_keeps_its_class_across_the_wire() -> None:
    from blobha.client.retry import may_have_run
    from blobha.client.transport import error_from_rpc
    from blobha.core.errors import REFUSED_METADATA_KEY, to_status

    code, details, trailers = to_status(Refused("no leader is ready yet; retry in a moment"))
    assert code == grpc.StatusCode.UNAVAILABLE and trailers == ((REFUSED_METADATA_KEY, "1"),)
    back = error_from_rpc(M1, _Status(code, details, trailers))
    assert isinstance(back, Refused) and "no leader is ready yet" in str(back)
    assert not may_have_run(back)
    plain = error_from_rpc(M1, _Status(code, details))  # a master older than the trailer
    assert type(plain) is Unavailable and may_have_run(plain)
