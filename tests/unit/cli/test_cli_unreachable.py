"""Failing fast when no master answers at all (issue 46 §3, item 4): the router tells "nobody
answered" (no connection to any master) from "answered without a leader", names every
master's error, and gives up after ``unreachable_after`` where the command line sets it.
A fake transport and a fake clock: no network, no sleeping."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import pytest

from blobha import cli
from blobha.cli import connect
from blobha.client import Client
from blobha.client import retry as retry_mod
from blobha.client.transport import NoConnection, no_connection
from blobha.core.errors import Unavailable
from blobha.v1 import blobha_pb2 as pb

MASTERS = ("m1:1", "m2:2", "m3:3")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, secs: float) -> None:
        self.now += secs


class Silent:
    """A cluster no connection reaches; with ``answers``, its masters answer, with no leader."""

    def __init__(self, clock: Clock, answers: bool = False) -> None:
        self.clock = clock
        self.answers = answers
        self.calls = 0

    def _fail(self, address: str) -> Exception:
        self.calls += 1
        self.clock.now += 0.01
        if self.answers:
            return Unavailable(f"master {address} unavailable: no leader is elected yet")
        return NoConnection(f"master {address} unavailable: Connection refused",
                            {address: f"refused by {address}"})

    def unary(self, address: str, method: str, request: Any, timeout: float | None,
              stall: float | None = None, rivals: Sequence[str] = ()) -> Any:
        raise self._fail(address)

    def probe(self, addresses: Sequence[str], method: str, request: Any,
              timeout: float) -> Generator[tuple[str, Any], None, None]:
        for address in addresses:
            if self.answers:
                yield address, pb.ClusterSummaryResponse()  # no leader named
            else:
                yield address, self._fail(address)

    def data_host(self, address: str) -> str | None:
        return None

    def data_tls(self) -> None:
        return None

    def close(self) -> None:
        pass


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(retry_mod, "_monotonic", fake)
    return fake


def client(clock: Clock, transport: Silent, unreachable_after: float | None) -> Client:
    c = Client(list(MASTERS), user="alice", timeout=60.0, transport=transport)
    c._router.sleep = clock.sleep
    c._router.unreachable_after = unreachable_after
    return c


@pytest.mark.parametrize("call", ["read", "write"])
def test_nobody_answering_fails_after_unreachable_after_naming_every_master(
        clock: Clock, call: str) -> None:
    c = client(clock, Silent(clock), unreachable_after=3.0)
    start = clock.now
    with pytest.raises(NoConnection) as raised:
        if call == "read":
            c.get_meta("k")
        else:
            c.delete("k")
    assert 3.0 <= clock.now - start < 5.0
    message = str(raised.value)
    assert "none of the 3 masters answered" in message
    assert all(f"refused by {m}" in message for m in MASTERS)
    assert raised.value.exit_code == 11


def test_the_library_keeps_its_timeout_and_names_every_master(clock: Clock) -> None:
    c = client(clock, Silent(clock), unreachable_after=None)
    start = clock.now
    with pytest.raises(Unavailable) as raised:
        c.get_meta("k")
    assert clock.now - start >= 59.0
    assert "none of the 3 masters answered" in str(raised.value)
    assert all(f"refused by {m}" in str(raised.value) for m in MASTERS)


def test_masters_that_answer_without_a_leader_are_waited_for_to_the_timeout(
        clock: Clock) -> None:
    c = client(clock, Silent(clock, answers=True), unreachable_after=3.0)
    start = clock.now
    with pytest.raises(Unavailable) as raised:
        c.delete("k")
    assert clock.now - start >= 59.0
    assert "none of the" not in str(raised.value)


def test_grpc_words_for_no_connection() -> None:
    refused = no_connection("h:1", "failed to connect to all addresses; last error: UNKNOWN:"
                                   " ipv4:127.0.0.1:1: Failed to connect to remote host:"
                                   " Connection refused")
    assert isinstance(refused, NoConnection) and refused.errors.keys() == {"h:1"}
    unresolved = no_connection("x:1", "errors resolving x:1: Domain name not found")
    assert isinstance(unresolved, NoConnection)
    assert no_connection("h:1", "no leader is elected yet") is None


def test_the_command_line_sets_its_timeout_and_fails_fast(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    made: list[Client] = []

    def factory(cluster: str, user: str | None) -> Client:
        c = connect.make_client(cluster, user)
        made.append(c)
        return c

    monkeypatch.setattr(connect, "client_factory", factory)
    monkeypatch.delenv("BLOBHA_TIMEOUT", raising=False)
    assert cli.main(["--cluster", "127.0.0.1:1", "cluster", "--timeout", "7"]) == 11
    assert made[-1].timeout == 7.0
    assert made[-1]._router.unreachable_after == connect.UNREACHABLE_SECS
    assert "none of the 1 masters answered (127.0.0.1:1: " in capsys.readouterr().err
    monkeypatch.setenv("BLOBHA_TIMEOUT", "2")
    assert cli.main(["--cluster", "127.0.0.1:1", "cluster"]) == 11
    assert made[-1].timeout == 2.0 and made[-1]._router.unreachable_after == 2.0
    monkeypatch.setenv("BLOBHA_TIMEOUT", "soon")
    assert cli.main(["--cluster", "127.0.0.1:1", "cluster"]) == 2
    assert "BLOBHA_TIMEOUT" in capsys.readouterr().err
