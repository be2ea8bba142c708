"""The stage link's two ends over a socket pair, and the leader's choice between links and
StageVersions calls (blobha.wire.stagelink, blobha.wire.stagelinks)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator, Sequence

import pytest
from support.waiting import wait_until

from blobha.core.errors import BlobError, InvalidArgument, NotLeader, Unavailable
from blobha.wire.datachannel import DataChannels, DataOffer
from blobha.wire.stagelink import StageLink, Version, serve_stage_link
from blobha.wire.stagelinks import StageLinks


class Holder:
    """A holder's staging as the link sees it: fenced by epoch, each version's size checked."""

    def __init__(self, newest_epoch: int = 5) -> None:
        self.newest = newest_epoch
        self.staged: list[tuple[str, bytes]] = []

    def __call__(self, user: str, epoch: int, versions: list[Version]) -> list[bool]:
        if epoch < self.newest:
            raise NotLeader(f"a forward from epoch {epoch}, but epoch {self.newest} has begun")
        self.staged += [(key, data) for key, _, _, data in versions]
        return [len(data) == size for _, size, _, data in versions]


@pytest.fixture
def link() -> Iterator[tuple[StageLink, Holder, list[object]]]:
    ours, theirs = socket.socketpair()
    holder = Holder()
    ended: list[object] = []

    def serve() -> None:
        try:
            ended.append(serve_stage_link(theirs, "master", holder, lambda e: e
                                          if isinstance(e, BlobError) else Unavailable(str(e))))
        except Exception as e:
            ended.append(e)
        finally:
            theirs.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    end = StageLink(ours, "holder:1")
    try:
        yield end, holder, ended
    finally:
        end.close()
        thread.join(10)
        assert not thread.is_alive()


def test_batches_go_one_after_another_on_one_connection(
        link: tuple[StageLink, Holder, list[object]]) -> None:
    end, holder, ended = link
    assert end.stage(5, [("a", 3, "d1", b"abc"), ("b", 0, "d2", b"")], 5.0) == [True, True]
    assert end.stage(6, [("c", 2, "d3", b"xy")], 5.0) == [True]
    assert holder.staged == [("a", b"abc"), ("b", b""), ("c", b"xy")]
    assert end.fresh()
    end.close()
    # The leader's end of the link (a length of 0) ends the holder's loop cleanly.
    wait_until(lambda: ended == [2], 5, "the holder to end the link")


def test_a_deposed_epoch_is_refused_per_batch_and_the_link_stays_usable(
        link: tuple[StageLink, Holder, list[object]]) -> None:
    end, holder, _ = link
    with pytest.raises(NotLeader, match="epoch 5 has begun"):
        end.stage(4, [("old", 1, "d", b"x")], 5.0)
    assert holder.staged == []  # nothing of a deposed leader's batch is kept
    assert not end.closed
    assert end.stage(5, [("new", 1, "d", b"y")], 5.0) == [True]


def test_a_malformed_header_ends_the_link_with_nothing_staged() -> None:
    ours, theirs = socket.socketpair()
    holder = Holder()
    header = b'{"epoch": 5, "versions": [["k", -1, "d"]]}'
    ours.sendall(len(header).to_bytes(4, "big") + header)
    with pytest.raises(InvalidArgument, match="malformed"):
        serve_stage_link(theirs, "master", holder, lambda e: Unavailable(str(e)))
    assert holder.staged == []
    ours.close()
    theirs.close()


def test_a_link_that_broke_fails_as_unavailable_and_is_closed() -> None:
    ours, theirs = socket.socketpair()
    theirs.close()
    end = StageLink(ours, "holder:1")
    with pytest.raises(Unavailable, match="stage link to holder:1 failed"):
        end.stage(5, [("k", 1, "d", b"x")], 2.0)
    assert end.closed


class Calls:
    def __init__(self) -> None:
        self.grpc: list[str] = []

    def __call__(self, address: str, epoch: int, versions: Sequence[Version],
                 timeout: float) -> list[bool]:
        self.grpc.append(address)
        return [True] * len(versions)


def test_a_master_without_links_gets_stageversions_calls_and_is_not_asked_again() -> None:
    asked: list[str] = []

    def begin(address: str, epoch: int, timeout: float) -> DataOffer | None:
        asked.append(address)
        if address == "old:1":
            raise InvalidArgument("key '' is not a valid key")  # an older release
        return None  # no data channel

    calls = Calls()
    links = StageLinks(begin, calls, DataChannels())
    for _ in range(3):
        assert links.stage("old:1", 5, [("k", 1, "d", b"x")], 5.0) == [True]
        assert links.stage("plain:1", 5, [("k", 1, "d", b"x")], 5.0) == [True]
    assert calls.grpc == ["old:1", "plain:1"] * 3
    assert asked == ["old:1", "plain:1"]  # each asked once, then remembered
    assert (links.over_grpc, links.over_links) == (6, 0)


def test_a_refused_link_is_the_forwards_failure_not_a_fallback() -> None:
    def begin(address: str, epoch: int, timeout: float) -> DataOffer | None:
        raise NotLeader("epoch 6 has begun")

    calls = Calls()
    links = StageLinks(begin, calls, DataChannels())
    with pytest.raises(NotLeader):
        links.stage("b:1", 5, [("k", 1, "d", b"x")], 5.0)
    assert calls.grpc == []
