"""EmbeddedZooKeeper against a real ZooKeeper server (needs Java and ZooKeeper jars)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient

from blobha.ops.zkserver import (
    EmbeddedZooKeeper,
    JavaNotFound,
    ZooKeeperNotFound,
    ZooKeeperStartError,
    find_java,
    find_zookeeper_classpath,
    four_letter_word,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture(scope="module", autouse=True)
def _needs_zookeeper() -> None:
    try:
        find_java()
        find_zookeeper_classpath()
    except (JavaNotFound, ZooKeeperNotFound) as e:
        pytest.skip(str(e))


def _process_gone(pid: int) -> bool:
    # The server is our child and stop() reaps it, so the pid must no longer exist at all.
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_start_use_stop(tmp_path: Path) -> None:
    zk = EmbeddedZooKeeper(tmp_path / "zk", tick_ms=500)
    with zk:
        assert zk.is_running()
        pid = zk.pid
        assert pid is not None
        host, port = zk.connect_string.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) == zk.port > 0
        assert four_letter_word(host, zk.port, "ruok") == "imok"

        client = KazooClient(hosts=zk.connect_string, timeout=2.0)
        client.start(timeout=15)
        try:
            client.create("/blobha/test", b"payload", makepath=True)
            data, stat = client.get("/blobha/test")
            assert data == b"payload"
            assert stat.version == 0
            # tick 500 ms allows 2 s sessions (minSessionTimeout = 2 ticks).
            assert client._session_timeout == 2000
        finally:
            client.stop()
            client.close()
    assert not zk.is_running()
    assert _process_gone(pid)
    zk.stop()  # idempotent
    assert (tmp_path / "zk" / "zoo.cfg").read_text().startswith("tickTime=500\n")
    assert (tmp_path / "zk" / "zookeeper.log").stat().st_size > 0


def test_restart_keeps_port_and_data_and_kill_is_a_crash(tmp_path: Path) -> None:
    zk = EmbeddedZooKeeper(tmp_path / "zk", tick_ms=500)
    zk.start()
    try:
        first_port = zk.port
        client = KazooClient(hosts=zk.connect_string, timeout=2.0)
        client.start(timeout=15)
        client.create("/kept", b"1")
        client.stop()
        client.close()

        zk.kill()
        assert not zk.is_running()
        zk.start()
        assert zk.port == first_port
        client = KazooClient(hosts=zk.connect_string, timeout=2.0)
        client.start(timeout=15)
        try:
            assert client.get("/kept")[0] == b"1"
        finally:
            client.stop()
            client.close()
    finally:
        zk.stop()


def test_a_taken_fixed_port_fails_with_the_log(tmp_path: Path) -> None:
    with EmbeddedZooKeeper(tmp_path / "a", tick_ms=500) as first:
        second = EmbeddedZooKeeper(tmp_path / "b", port=first.port, tick_ms=500)
        with pytest.raises(ZooKeeperStartError, match="exited") as info:
            second.start(timeout=30)
        assert info.value.port_in_use
        assert not second.is_running()
        # The first server is untouched.
        assert four_letter_word("127.0.0.1", first.port, "ruok") == "imok"


def test_the_masters_handler_talks_to_a_real_server_and_survives_its_restart(
        tmp_path: Path) -> None:
    from kazoo.protocol.states import KazooState
    from support.waiting import wait_until

    from blobha.zk.connection import PollHandler

    zk = EmbeddedZooKeeper(tmp_path / "zk", tick_ms=500)
    zk.start()
    client = KazooClient(hosts=zk.connect_string, timeout=4.0, handler=PollHandler())
    try:
        client.start(timeout=15)
        events: list[str] = []
        client.create("/w", b"0")
        client.get("/w", watch=lambda e: events.append(e.type))
        # Pipelined requests and their replies, then a watch event, all through poll().
        results = [client.create_async(f"/w/n{i}", b"x" * 100) for i in range(200)]
        assert [r.get(timeout=10) for r in results] == [f"/w/n{i}" for i in range(200)]
        client.set("/w", b"1")
        wait_until(lambda: events == ["CHANGED"], 10, "the watch event")
        # A lost connection is noticed (the peer's hang-up reads as readable) and recovered.
        zk.kill()
        wait_until(lambda: client.state != KazooState.CONNECTED, 10, "the client to notice")
        zk.start()
        wait_until(lambda: client.state == KazooState.CONNECTED, 20, "the reconnect")
        assert client.get("/w")[0] == b"1"
    finally:
        client.stop()
        client.close()
        zk.stop()


@contextlib.contextmanager
def _root_and_chrooted(tmp_path: Path) -> Iterator[tuple[EmbeddedZooKeeper, KazooClient,
                                                           KazooClient]]:
    """A server, a client at its root, and one chrooted at /app as the masters are (paths go
    out with the root and come back without it), on the masters' connection handler."""
    from blobha.zk.connection import PollHandler

    zk = EmbeddedZooKeeper(tmp_path / "zk", tick_ms=500)
    zk.start()
    # The longest session the server grants (20 ticks): a test that restarts the server must
    # not lose its sessions to a JVM start slowed by a busy machine (one took over 4 s).
    root = KazooClient(hosts=zk.connect_string, timeout=10.0)
    client = KazooClient(hosts=zk.connect_string + "/app", timeout=10.0, handler=PollHandler())
    try:
        root.start(timeout=15)
        root.ensure_path("/app")
        client.start(timeout=15)
        yield zk, root, client
    finally:
        for c in (client, root):
            c.stop()
            c.close()
        zk.stop()


def test_a_recursive_watch_brings_every_change_below_its_path_until_the_connection_ends(
        tmp_path: Path) -> None:
    from kazoo.protocol.states import KazooState
    from support.waiting import wait_until

    from blobha.zk.connection import add_recursive_watch

    with _root_and_chrooted(tmp_path) as (zk, root, client):
        root.create("/app/tree", b"")
        events: list[tuple[str, str]] = []
        add_recursive_watch(client, "/tree", lambda e: events.append((e.type, e.path)),
                            timeout=10)
        # A one-shot watch on the same path still works, and its child event is its own; so
        # does one on a node below it (the leader's wait for a write quorum sets those).
        one_shot: list[str] = []
        client.get_children("/tree", watch=lambda e: one_shot.append(e.type))
        client.exists("/tree/k", watch=lambda e: one_shot.append(e.type))
        root.create("/app/tree/k", b"1")
        root.create("/app/tree/k/m1-1", b"", ephemeral=True)
        root.set("/app/tree/k", b"2")
        root.delete("/app/tree/k/m1-1")
        root.delete("/app/tree/k")
        root.create("/app/elsewhere", b"")
        expected = [("CREATED", "/tree/k"), ("CREATED", "/tree/k/m1-1"),
                    ("CHANGED", "/tree/k"), ("DELETED", "/tree/k/m1-1"),
                    ("DELETED", "/tree/k")]
        wait_until(lambda: len(events) >= len(expected), 10, "the recursive watch's events")
        client.sync("/")  # anything further (there must be nothing) has arrived by now
        assert events == expected
        assert sorted(one_shot) == ["CHILD", "CREATED"]
        # The watch lasts for the connection: a server restart ends it, and a new one must
        # be added (what the synchroniser does before the reconcile that follows). This one
        # runs its callback on the connection thread, as the synchroniser's does; one that
        # fails is logged and the connection carries on.
        zk.kill()
        wait_until(lambda: client.state != KazooState.CONNECTED, 10, "the client to notice")
        zk.start()
        wait_until(lambda: client.state == KazooState.CONNECTED, 20, "the reconnect")
        events.clear()

        def inline(e: Any) -> None:
            events.append((e.type, e.path))
            if e.path == "/tree/bad":
                raise RuntimeError("a failing callback")

        add_recursive_watch(client, "/tree", inline, timeout=10, inline=True)
        root.create("/app/tree/bad", b"")
        root.create("/app/tree/again", b"")
        wait_until(lambda: len(events) >= 2, 10, "the new watch's events")
        assert events == [("CREATED", "/tree/bad"), ("CREATED", "/tree/again")]
        assert client.get("/tree/again")[0] == b""  # the connection is still serving


def test_a_multi_read_answers_each_read_on_its_own(tmp_path: Path) -> None:
    from kazoo.exceptions import NoAuthError, NoNodeError
    from kazoo.security import make_digest_acl

    from blobha.zk.connection import read_many_async

    with _root_and_chrooted(tmp_path) as (_, root, client):
        root.create("/app/k1", b"one")
        root.create("/app/k1/m1-1", b"")
        root.create("/app/k1/m2-1", b"")
        root.create("/app/empty", b"")
        root.set("/app/empty", b"")  # a node's version moves: the stat comes with the data
        root.create("/app/big", os.urandom(200_000))
        root.create("/app/locked", b"secret", acl=[make_digest_acl("other", "pw", all=True)])
        reads = [("/k1", False), ("/k1", True), ("/gone", False), ("/empty", False),
                 ("/big", False), ("/locked", False), ("/gone", True)]
        results = read_many_async(client, reads).get(timeout=10)
        assert len(results) == len(reads)
        data, stat = results[0]  # type: ignore[misc]
        assert data == b"one" and stat.numChildren == 2
        assert sorted(results[1]) == ["m1-1", "m2-1"]  # type: ignore[arg-type]
        assert isinstance(results[2], NoNodeError) and isinstance(results[6], NoNodeError)
        data, stat = results[3]  # type: ignore[misc]
        assert data == b"" and stat.version == 1
        assert results[4][0] == root.get("/app/big")[0]  # type: ignore[index]
        assert isinstance(results[5], NoAuthError)  # refused alone; the others answered
        assert read_many_async(client, []).get(timeout=10) == []
        # The connection goes on serving as before.
        assert client.get("/k1")[0] == b"one"


def test_the_session_timeout_zookeeper_grants_is_reported(tmp_path: Path) -> None:
    from blobha.zk.connection import on_session_timeout

    # tick 500 ms: ZooKeeper grants 1 s (2 ticks) to 60 s (its maxSessionTimeout here).
    with EmbeddedZooKeeper(tmp_path / "zk", tick_ms=500) as zk:
        for asked, granted in ((0.3, 1.0), (120.0, 60.0), (4.0, 4.0)):
            got: list[float] = []
            client = KazooClient(hosts=zk.connect_string, timeout=asked)
            on_session_timeout(client, got.append)
            client.start(timeout=15)
            try:
                assert got == [granted]
            finally:
                client.stop()
                client.close()
