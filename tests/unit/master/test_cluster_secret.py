"""Which cluster secrets a master accepts, as its connection to ZooKeeper comes and goes
(blobha.master.clustersecret), with a fake ZooKeeper client and a fake clock; the security
tier (tests/security/test_secret_rotation.py) cuts a real master from a real ZooKeeper."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kazoo.exceptions import NodeExistsError
from kazoo.protocol.states import KazooState
from support.waiting import wait_until

from blobha.master.clustersecret import ClusterSecret

WINDOW = 8.0


class Answer:
    def __init__(self, value: tuple[bytes, None], gate: threading.Event) -> None:
        self._value = value
        self._gate = gate

    def get(self, timeout: float | None = None) -> tuple[bytes, None]:
        assert self._gate.wait(10), "a read held too long"
        return self._value


class FakeZooKeeper:
    """What ClusterSecret uses of KazooClient: one node, its one-shot watches, the state and
    its listeners. ``gate`` holds reads (cleared) to let a test act while one is under way."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.state = KazooState.CONNECTED
        self.listeners: list[Callable[[str], None]] = []
        self.watches: list[Callable[[Any], None]] = []
        self.reads = 0
        self.gate = threading.Event()
        self.gate.set()

    def create(self, path: str, data: bytes) -> None:
        raise NodeExistsError()

    def add_listener(self, listener: Callable[[str], None]) -> None:
        self.listeners.append(listener)

    def remove_listener(self, listener: Callable[[str], None]) -> None:
        if listener in self.listeners:
            self.listeners.remove(listener)

    def get_async(self, path: str, watch: Callable[[Any], None]) -> Answer:
        self.reads += 1
        self.watches.append(watch)
        return Answer((self.data, None), self.gate)

    def become(self, state: str) -> None:
        self.state = state
        for listener in list(self.listeners):
            listener(state)

    def change(self, data: bytes, notify: bool = True) -> None:
        self.data = data
        if notify:
            watches, self.watches = self.watches, []
            for watch in watches:
                watch(object())


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def zk() -> FakeZooKeeper:
    return FakeZooKeeper(b"s0")


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def secret(zk: FakeZooKeeper, clock: Clock) -> Iterator[ClusterSecret]:
    sent: list[str] = []
    s = ClusterSecret(zk, sent.append, WINDOW, read_timeout=5.0, clock=clock)
    s.load()
    yield s
    s.close()


def test_a_replaced_secret_is_accepted_for_the_window_after_the_rotation(
        secret: ClusterSecret, zk: FakeZooKeeper, clock: Clock) -> None:
    assert secret.accepted() == ("s0", "")
    zk.change(b"s1")
    wait_until(lambda: secret.accepted() == ("s1", "s0"), what="the rotation seen")
    clock.now += WINDOW - 0.1
    assert secret.accepted() == ("s1", "s0")
    clock.now += 0.2
    assert secret.accepted() == ("s1", "")


def test_cut_off_a_master_accepts_no_secret_after_the_window_until_it_reads_it_again(
        secret: ClusterSecret, zk: FakeZooKeeper, clock: Clock) -> None:
    # Cut off, it would not see a rotation: what it holds may have been replaced.
    zk.become(KazooState.SUSPENDED)
    zk.change(b"s1", notify=False)  # the rotation it does not see
    clock.now += WINDOW - 0.1
    assert secret.accepted() == ("s0", "")
    clock.now += 0.2
    assert secret.accepted() == ("", "")
    clock.now += 3600  # however long it stays cut off
    assert secret.accepted() == ("", "")
    reads = zk.reads
    zk.become(KazooState.CONNECTED)  # the session survived: its watch fires on its own time
    wait_until(lambda: secret.accepted()[0] == "s1", what="the secret read again")
    assert zk.reads > reads
    # Learnt late: the rotation may be older than the window, so the old one gets none.
    assert secret.accepted() == ("s1", "")
    assert secret.current == "s1"


def test_a_secret_that_did_not_change_is_trusted_again_once_read_on_the_new_session(
        secret: ClusterSecret, zk: FakeZooKeeper, clock: Clock) -> None:
    # kazoo's DataWatch calls back only when the node changed: an unchanged secret would
    # never be confirmed again.
    zk.become(KazooState.SUSPENDED)
    clock.now += 1
    zk.become(KazooState.LOST)  # the session expired: its watch is gone, at once untrusted
    assert secret.accepted() == ("", "")
    zk.gate.clear()
    zk.become(KazooState.CONNECTED)
    wait_until(lambda: zk.reads >= 2, what="a read on the new session")
    assert secret.accepted() == ("", ""), "trusted before the read answered"
    zk.gate.set()
    wait_until(lambda: secret.accepted() == ("s0", ""), what="the secret confirmed")


def test_a_read_that_began_before_the_connection_was_lost_confirms_nothing(
        secret: ClusterSecret, zk: FakeZooKeeper, clock: Clock) -> None:
    zk.gate.clear()
    zk.change(b"s1")  # the watch fires; the read it starts is held
    wait_until(lambda: zk.reads >= 2, what="the read under way")
    zk.become(KazooState.SUSPENDED)
    zk.gate.set()  # it answers after the loss: the news is taken, but it proves nothing now
    wait_until(lambda: secret.current == "s1", what="the answer applied")
    clock.now += WINDOW + 0.1
    assert secret.accepted() == ("", "")
