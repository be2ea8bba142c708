"""Stalled streams, slow and silent masters: what the client waits for and what it gives up
on."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
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

from blobha.client import Client
from blobha.client import routing as routing_mod
from blobha.client import transport as transport_mod
from blobha.core.errors import (
    DeadlineExceeded,
    KeyNotFound,
    Unavailable,
)
from blobha.v1 import blobha_pb2 as pb


class _StallingCall:
    """A server stream that sends ``first`` messages and then nothing until cancelled (or,
    with ``end``, ends there)."""

    def __init__(self, first: int, end: bool = False) -> None:
        self.first = first
        self.end = end
        self.cancelled = threading.Event()

    def __iter__(self) -> Iterator[pb.DownloadChunk]:
        for _ in range(self.first):
            if self.cancelled.is_set():  # as gRPC does: a cancelled call ends at the next read
                raise _Status(grpc.StatusCode.CANCELLED, "Locally cancelled by application!")
            yield pb.DownloadChunk(data=b"x")
        if self.end:
            return
        if not self.cancelled.wait(30):
            raise AssertionError("the stalled stream was never cancelled")
        raise _Status(grpc.StatusCode.CANCELLED, "Locally cancelled by application!")

    def cancel(self) -> None:
        self.cancelled.set()


def _transport_with(calls: list[Any]) -> Any:
    from blobha.client import GrpcTransport

    transport = GrpcTransport("alice")

    class Stub:
        def Download(self, request: Any, timeout: float | None, metadata: Any) -> Any:
            return calls.pop(0)

    transport._stub = lambda address: Stub()  # type: ignore[method-assign]
    return transport


def test_a_stream_that_stalls_is_abandoned_after_the_stall_limit() -> None:
    # A paused master takes the call and sends nothing more: without the watch, only the
    # call's whole deadline (60 s by default) ended it.
    stalled = _StallingCall(first=2)
    transport = _transport_with([stalled])
    got = []
    started = time.monotonic()
    with pytest.raises(Unavailable, match=r"sent nothing for 0\.3 s"):
        for m in transport.server_stream(M1, "Download", pb.DownloadRequest(), 60.0, stall=0.3):
            got.append(m)
    assert len(got) == 2 and stalled.cancelled.is_set()
    assert time.monotonic() - started < 10
    transport.close()


def test_a_slow_consumer_is_not_a_stalled_master() -> None:
    # Time the caller spends on each message (a slow disk) is not the master's silence.
    transport = _transport_with([_StallingCall(first=3, end=True)])
    got = 0
    for _ in transport.server_stream(M1, "Download", pb.DownloadRequest(), 60.0, stall=0.1):
        threading.Event().wait(0.3)  # the consumer's own work, three times the stall limit
        got += 1
    assert got == 3
    transport.close()
    assert transport._stalls._thread is not None
    transport._stalls._thread.join(5)
    assert not transport._stalls._thread.is_alive()  # closing the transport ends the watch


class _Silent:
    """A status call that never answers (a paused master's), as a gRPC future."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def result(self, timeout: float | None = None) -> Any:
        if self.cancelled.wait(timeout):
            raise _Status(grpc.StatusCode.CANCELLED, "Cancelled")
        raise grpc.FutureTimeoutError()

    def cancel(self) -> bool:
        self.cancelled.set()
        return True


class _Answered:
    def __init__(self, reply: Any) -> None:
        self.reply = reply

    def result(self, timeout: float | None = None) -> Any:
        return self.reply

    def cancel(self) -> bool:
        return False


class _Failed:
    def __init__(self, error: Exception) -> None:
        self.error = error

    def result(self, timeout: float | None = None) -> Any:
        raise self.error

    def cancel(self) -> bool:
        return False


class _StatusCall:
    """``stub.NodeStatus``: callable, with ``.future`` giving ``make()``."""

    def __init__(self, make: Callable[[], Any], calls: list[str], name: str) -> None:
        self.make, self.calls, self.name = make, calls, name

    def future(self, request: Any, timeout: float | None, metadata: Any) -> Any:
        self.calls.append(self.name)
        return self.make()


class _SlowMaster:
    """A master whose Put answers once ``checks`` status checks have been made (None: never),
    over a channel whose close ends the call as gRPC does."""

    def __init__(self, checks: int | None, status_answers: bool) -> None:
        self.answer_after = checks
        self.status_answers = status_answers
        self.checks: list[str] = []
        self.closed = threading.Event()
        #: What a status check gives instead, as a gRPC future.
        self.status_future: Callable[[], Any] | None = None

    def Put(self, request: Any, timeout: float | None, metadata: Any) -> str:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.closed.wait(0.01):
                raise _Status(grpc.StatusCode.CANCELLED, "Channel closed!")
            if self.answer_after is not None and len(self.checks) >= self.answer_after:
                return "answer"
        raise AssertionError("the call was neither answered nor ended in 10 s")

    @property
    def NodeStatus(self) -> Any:
        def check() -> Any:
            if not self.status_answers:
                return _Failed(_Status(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
            return _Answered(pb.MasterSummary())

        return _StatusCall(self.status_future or check, self.checks, "NodeStatus")

    def close(self) -> None:
        self.closed.set()


def _unary_transport(master: _SlowMaster) -> Any:
    from blobha.client import GrpcTransport

    transport = GrpcTransport("alice")
    transport._stubs[M1] = master
    transport._channels[M1] = master
    return transport


def test_a_long_call_to_a_master_that_answers_status_checks_is_waited_for() -> None:
    # A write waiting for its quorum takes long; its master is working on it.
    master = _SlowMaster(checks=3, status_answers=True)
    transport = _unary_transport(master)
    try:
        assert transport.unary(M1, "Put", pb.PutRequest(), 60.0, stall=0.4) == "answer"
        assert master.checks == ["NodeStatus"] * 3 and not master.closed.is_set()
    finally:
        transport.close()


def test_a_call_to_a_master_that_answers_nothing_is_given_up() -> None:
    master = _SlowMaster(checks=None, status_answers=False)
    transport = _unary_transport(master)
    try:
        with pytest.raises(Unavailable,
                           match=r"stopped answering: Put got no answer for 0\.4 s, or until"):
            transport.unary(M1, "Put", pb.PutRequest(), 60.0, stall=0.4)
        assert master.checks == ["NodeStatus"] and master.closed.is_set()
        assert M1 not in transport._channels  # the next call dials the master afresh
    finally:
        transport.close()


def test_a_write_to_a_silent_leader_ends_once_a_rival_leads() -> None:
    # The leader paused past its session: a successor is elected long before the stall limit
    # (60 s here) ends the call, and the write must go there.
    leader = _SlowMaster(checks=None, status_answers=False)
    asked: list[str] = []
    leader.status_future = _Silent

    class _Rival:
        # Elected once asked a second time: the first look finds no successor yet.
        NodeStatus = _StatusCall(
            lambda: _Answered(pb.MasterSummary(is_leader=asked.count(M2) >= 2)), asked, M2)

    transport = _unary_transport(leader)
    transport._stubs[M2] = _Rival()
    try:
        started = time.monotonic()
        with pytest.raises(transport_mod.LeaderMoved, match=f"and {M2} leads now") as moved:
            transport.unary(M1, "Put", pb.PutRequest(), 120.0, stall=60.0, rivals=[M1, M2])
        took = time.monotonic() - started
        assert moved.value.leader == M2  # where the retry goes at once
        assert took < 10, f"left the silent leader after {took:.1f} s"
        assert leader.closed.is_set() and asked.count(M2) == 2
    finally:
        transport.close()


def test_a_download_no_master_holds_gives_up_unavailable_not_key_not_found() -> None:
    # Every master answered "not held here" for a key whose replica list was read: the key
    # exists, so the read gives up with UNAVAILABLE (exit 11), never "key not found" (exit 3).
    from blobha.client.download import DownloadJob

    job: Any = DownloadJob.__new__(DownloadJob)
    job.key, job.version, job.info = "k", 0, None
    not_held = KeyNotFound("not held here: m3:6627 does not hold v1 of 'k'")
    why = job._why(not_held, None)
    assert isinstance(why, Unavailable) and not isinstance(why, KeyNotFound)
    assert "no reachable master holds the latest version of 'k'" in str(why)
    assert "GetReplication" not in str(why)
    job.version = 4
    assert "holds v4 of 'k'" in str(job._why(not_held, None))
    down = Unavailable("master m1:6627 unavailable: connection refused")
    assert job._why(not_held, down) is down  # a holder's own failure says more


def test_masters_cut_off_from_zookeeper_say_so_when_no_leader_is_found(
    client: Client, cluster: FakeCluster
) -> None:
    # They answer the leader search from what they last saw (so 'blobha cluster' has a view);
    # with no leader among them, the failure names ZooKeeper, not "no leader elected yet".
    cluster.leader = ""
    original = cluster._ClusterSummary

    def cut_off(address: str, request: Any) -> pb.ClusterSummaryResponse:
        reply = original(address, request)
        reply.zookeeper_unreachable = True
        return reply

    cluster._ClusterSummary = cut_off  # type: ignore[method-assign]
    with pytest.raises(Unavailable, match="ZooKeeper is unreachable from master") as info:
        client.create("k", b"x")
    assert "retry when ZooKeeper is back" in str(info.value)
    # A leader one of them still sees (a live session of its own) is used as usual.
    cluster.leader = M2
    client.create("k", b"x")
    assert cluster.count("BeginUpload", M2) + cluster.count("Put", M2) >= 1


def test_a_call_retrying_for_a_while_is_told_once_and_a_short_blip_not_at_all(
    client: Client, cluster: FakeCluster, clock: FakeClock
) -> None:
    told: list[tuple[str, str, float]] = []
    client.on_retry = lambda what, why, left: told.append((what, str(why), left))
    # A blip (one refusal, then a leader): retried quietly.
    cluster.faults.append(("*", "ClusterSummary", Unavailable("starting")))
    client.create("a", b"x")
    assert told == []
    # No leader for the whole timeout: one word once it has retried for a while, then the
    # failure at the deadline as before.
    cluster.leader = ""
    started = clock.now
    with pytest.raises(Unavailable, match="could not create 'b' within 30 s"):
        client.create("b", b"x")
    assert len(told) == 1, told
    what, why, left = told[0]
    assert what == "create 'b'" and "no leader is elected yet" in why
    assert 0 < left <= 30.0 - routing_mod._RETRY_NOTICE_AFTER
    assert clock.now - started > 30.0 - left >= routing_mod._RETRY_NOTICE_AFTER


def test_a_master_that_does_not_answer_a_control_call_is_passed_over_late_in_the_deadline(
    client: Client, cluster: FakeCluster, clock: FakeClock
) -> None:
    # Each stalled GetReplication takes the control call's whole limit (8 s). The third one
    # starts with 14 s of the 30 left: it must still count as that master's silence (try
    # another), not as the end of the caller's deadline, which has 6 s left.
    client.create("k", b"data")
    cluster.holders["k"] = [M1, M2, M3]
    real = cluster.unary
    stalls = [3]

    def unary(address: str, method: str, request: Any, timeout: float | None,
              stall: float | None = None, rivals: Any = ()) -> Any:
        if method == "GetReplication" and stalls[0] > 0:
            stalls[0] -= 1
            assert timeout is not None
            clock.now += timeout
            raise DeadlineExceeded(f"master {address} did not answer in time")
        return real(address, method, request, timeout, stall)

    cluster.unary = unary  # type: ignore[method-assign]
    assert client.get_replication("k").replication == 3
    assert stalls == [0]


@pytest.mark.parametrize("write", ["create", "update", "put"])
def test_a_str_body_is_refused_before_any_call(
        client: Client, cluster: FakeCluster, tmp_path: Path, write: str) -> None:
    # Content or a file's name? Either guess writes the wrong blob without a word.
    (tmp_path / "data").write_bytes(b"in the file")
    with pytest.raises(TypeError, match=r"a str body is ambiguous: pass data.encode\(\) for"
                                        r" content or Path\(...\) for a file"):
        getattr(client, write)("k", str(tmp_path / "data"))
    assert cluster.calls == []
