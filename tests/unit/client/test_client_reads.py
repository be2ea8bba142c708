"""Reads through the fake transport: masters first and replicas on a miss, listing, waiting
for replication, and the address map."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
from support.client_fakes import (
    M1,
    M2,
    M3,
    FakeClock,
    FakeCluster,
    KiB,
    payload,
)

from blobha.client import (
    BlobInfo,
    Client,
)
from blobha.client import routing as routing_mod
from blobha.client import waiting as waiting_mod
from blobha.core.digest import digest_bytes
from blobha.core.errors import (
    BlobError,
    ChecksumMismatch,
    DeadlineExceeded,
    InternalError,
    InvalidArgument,
    Unavailable,
)
from blobha.v1 import blobha_pb2 as pb


def test_a_read_goes_straight_to_a_master_and_asks_for_replicas_only_on_a_miss(
    client: Client, cluster: FakeCluster
) -> None:
    client.create("k", b"abc")
    cluster.holders["k"] = [M1, M2, M3]
    cluster.calls.clear()
    assert client.read("k") == b"abc"
    assert [m for _, m in cluster.calls] == ["Download"]
    cluster.holders["k"] = [M3]
    for _ in range(10):
        cluster.calls.clear()
        assert client.read("k") == b"abc"
        methods = [m for _, m in cluster.calls]
        assert methods in (["Download"], ["Download", "GetReplication", "Download"])
        assert cluster.calls[-1] == (M3, "Download")


def test_not_held_here_tries_another_master(client: Client, cluster: FakeCluster) -> None:
    client.create("k", b"abc")
    cluster.holders["k"] = [M3]  # but GetReplication reports none: every master is tried
    original = cluster._GetReplication

    def no_holders(address: str, r: pb.GetReplicationRequest) -> pb.ReplicationStatus:
        status = original(address, r)
        del status.holders[:]
        return status

    cluster._GetReplication = no_holders  # type: ignore[method-assign]
    assert client.read("k") == b"abc"


def test_a_read_whose_deadline_ends_in_a_replica_lookup_says_why_it_was_retrying(
    client: Client, cluster: FakeCluster, clock: FakeClock
) -> None:
    # Before: the last back-off left a sliver of the deadline, the replica lookup after it ran
    # into the deadline's end, and the read failed "did not answer in time" (a master that
    # answered every call) instead of saying that no reachable master holds the key's bytes.
    client.create("k", b"abc")
    cluster.holders["k"] = []  # its one holder is down: its replica node is gone
    original = cluster._GetReplication
    start = clock.now

    def into_the_end(address: str, r: pb.GetReplicationRequest) -> pb.ReplicationStatus:
        if 30.0 - (clock.now - start) <= routing_mod._CONTROL_TIMEOUT:
            clock.now = start + 30.0  # the call takes what is left of the read's deadline
            raise DeadlineExceeded(f"master {address} did not answer in time")
        return original(address, r)

    cluster._GetReplication = into_the_end  # type: ignore[method-assign]
    with pytest.raises(Unavailable) as e:
        client.read("k")
    assert str(e.value).startswith("could not download 'k' within 30 s: no reachable master")
    assert clock.now - start == 30.0


@pytest.mark.parametrize("failure", [
    ChecksumMismatch("chunk 0 corrupt on disk"),
    # INTERNAL (a disk error there) failed the whole read, two others holding the version.
    InternalError("internal error on that master"),
], ids=["corrupt", "internal"])
def test_a_failing_replica_is_skipped(client: Client, cluster: FakeCluster,
                                      failure: BlobError) -> None:
    client.create("k", b"abc")
    cluster.holders["k"] = [M1, M2, M3]
    cluster.faults.append((M1, "Download", failure))
    cluster.faults.append((M2, "Download", failure))
    assert client.read("k") == b"abc"


def test_digest_mismatch_keeps_no_file(
    client: Client, cluster: FakeCluster, tmp_path: Path
) -> None:
    client.create("k", b"abc")
    cluster.holders["k"] = [M2]
    cluster.corrupt = {M2}
    dest = tmp_path / "out"
    dest.write_bytes(b"previous")
    with pytest.raises(ChecksumMismatch):
        client.download("k", dest)
    assert dest.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_download_to_path_and_range(client: Client, cluster: FakeCluster, tmp_path: Path) -> None:
    data = payload(300 * KiB)
    client.create("k", data)
    dest = tmp_path / "out"
    seen: list[tuple[int, int]] = []
    info = client.download("k", dest, progress=lambda d, t: seen.append((d, t)))
    assert dest.read_bytes() == data and info == BlobInfo(1, len(data), digest_bytes(data))
    assert seen[-1] == (len(data), len(data))
    buf = io.BytesIO()
    client.download("k", buf, offset=10, length=5)
    assert buf.getvalue() == data[10:15]


def test_list_follows_pages(client: Client, cluster: FakeCluster) -> None:
    for k in ["a1", "a2", "a3", "b1", "a4"]:
        cluster.blobs[k] = (1, b"")
    assert list(client.list("a")) == ["a1", "a2", "a3", "a4"]
    assert list(client.list()) == ["a1", "a2", "a3", "a4", "b1"]
    # A caller wanting the first key only asks for one (`blobha list KEY`).
    assert list(client.list("a", page_size=1)) == ["a1", "a2", "a3", "a4"]
    with pytest.raises(InvalidArgument, match="page_size"):
        list(client.list(page_size=0))


def test_reads_move_to_another_master(client: Client, cluster: FakeCluster) -> None:
    cluster.blobs["k"] = (4, b"zz")
    cluster.down = {M1, M2}
    assert client.get_meta("k").version == 4


def test_wait_for_replication(client: Client, cluster: FakeCluster) -> None:
    client.create("k", b"x")
    assert client.wait_for_replication(["k"], 1, 5).reached
    result = client.wait_for_replication("k", 2, 5)
    assert not result.reached and result.statuses[0].replication == 1
    with pytest.raises(InvalidArgument):
        client.wait_for_replication([], 1, 5)


@pytest.mark.parametrize("secs", [0.0, 5.0, 45.0])
def test_a_wait_on_unreachable_masters_gives_up_at_its_own_timeout(
    client: Client, cluster: FakeCluster, clock: FakeClock, secs: float
) -> None:
    # "Give up after this long": not after the wait plus the client's own 30 s.
    cluster.down = {M1, M2, M3}
    with pytest.raises(Unavailable, match="unavailable"):
        client.wait_for_replication(["k"], 1, secs)
    assert clock.now - 1000.0 <= secs + waiting_mod.WAIT_GRACE
    assert cluster.count("WaitForReplication") > 1  # other masters were tried


def test_a_wait_on_a_silent_master_ends_within_its_grace(
    client: Client, cluster: FakeCluster, clock: FakeClock
) -> None:
    # A paused master holds each call until its deadline; the last call's deadline is the
    # wait's own end plus the grace, not the server-side wait plus a longer allowance.
    calls: list[tuple[float, float]] = []

    def unary(address: str, method: str, request: Any, timeout: float | None,
              stall: float | None = None, rivals: Any = ()) -> Any:
        assert method == "WaitForReplication" and timeout is not None
        calls.append((request.timeout_secs, timeout))
        clock.now += timeout
        raise DeadlineExceeded(f"master {address} did not answer in time")

    cluster.unary = unary  # type: ignore[method-assign]
    with pytest.raises(DeadlineExceeded):
        client.wait_for_replication(["k"], 1, 5)
    assert clock.now - 1000.0 <= 5 + waiting_mod.WAIT_GRACE
    # The call outlives the server-side wait by more than the half second the server keeps
    # for its answer, so a live master still reports its counts.
    assert calls[0] == (5.0, 5.0 + waiting_mod.WAIT_GRACE) and waiting_mod.WAIT_GRACE > 0.5


def test_wait_forever_loops_bounded_calls(
    client: Client, cluster: FakeCluster, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    client.create("k", b"x")
    timeouts: list[float] = []
    original = cluster._WaitForReplication

    def slow(address: str, r: pb.WaitForReplicationRequest) -> pb.WaitForReplicationResponse:
        timeouts.append(r.timeout_secs)
        if len(timeouts) == 3:
            cluster.holders["k"] = [M1, M2]
        clock.now += r.timeout_secs
        return original(address, r)

    cluster._WaitForReplication = slow  # type: ignore[method-assign]
    result = client.wait_for_replication(["k"], 2, -1)
    assert result.reached and timeouts == [60.0, 60.0, 60.0]
    assert result.waited_secs == pytest.approx(180.0)


def test_invalid_key_fails_before_any_call(client: Client, cluster: FakeCluster) -> None:
    with pytest.raises(InvalidArgument):
        client.get_meta("a/b")
    assert cluster.calls == []


def test_address_map_parses_and_rejects_bad_entries() -> None:
    from blobha.client import parse_address_map

    assert parse_address_map("m1:6627=127.0.0.1:16627, m2=127.0.0.1:16628,") == {
        "m1:6627": "127.0.0.1:16627", "m2:6627": "127.0.0.1:16628",
    }
    assert parse_address_map("") == {}
    for bad in ("m1:6627", "m1:6627=", "=127.0.0.1:1", "m1:99999=h:1"):
        with pytest.raises(InvalidArgument):
            parse_address_map(bad)


def test_address_map_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from blobha.client import GrpcTransport

    monkeypatch.setenv("BLOBHA_ADDRESS_MAP", "m1:6627=127.0.0.1:1")
    c = Client("m1:6627", user="alice")
    try:
        assert isinstance(c._transport, GrpcTransport)
        assert c._transport._address_map == {"m1:6627": "127.0.0.1:1"}
    finally:
        c.close()
