"""Callers who have not (yet) proved who they are cannot exhaust a master or a node cache
(issue 56, item 3): calls that send their headers and never their message, floods of wrong
tokens, and idle connections to the peer piece server. Real masters (LocalCluster) and a real
piece server; the attacker and the good clients all on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, closing, suppress
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from support.clusters import FAST, running_cluster
from support.waiting import wait_until

from blobha.cache.peers import wire
from blobha.cache.peers.server import PeerServer, Served
from blobha.cache.peers.settings import PeerSettings
from blobha.client import Client
from blobha.core.auth import AUTHORIZATION_METADATA_KEY, new_job_token
from blobha.core.grants import Grant, make_grant
from blobha.ops.localcluster import LocalCluster, MasterProcess
from blobha.v1 import blobha_pb2 as pb

pytestmark = pytest.mark.integration

#: The issue's attack: this many calls over one connection, headers only, no deadline.
ATTACK_CALLS = 64
#: How long a master waits for a call's request message in these tests (default 10 s).
RECEIVE_SECS = 2.0
#: What "within a few seconds" means for the good client's calls under attack.
PROMPT = 5.0


class HeadersOnly:
    """``n`` calls of ``method`` on a connection of their own (not shared with the test's
    other channels) that send their headers and never a message; no deadline."""

    def __init__(self, address: str, method: str, n: int,
                 metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self._release = threading.Event()
        self.channel = grpc.insecure_channel(
            address, options=[("grpc.use_local_subchannel_pool", 1)])
        grpc.channel_ready_future(self.channel).result(timeout=10)
        # A unary method called as client-streaming: gRPC does not check the cardinality on
        # the wire, and a request iterator that yields nothing sends the headers alone.
        call = self.channel.stream_unary(method)
        self.futures = [call.future(self._nothing(), metadata=metadata or None)
                        for _ in range(n)]
        self._settle()

    def _settle(self) -> None:
        """Return once the master has seen the calls' headers: a later call on the same
        connection has its answer (streams of a connection are taken in order), or, if the
        master answers nothing, a moment has passed."""
        check = self.channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString)
        # Refused (busy) or not answered in time: the headers are there either way.
        with suppress(grpc.RpcError):
            check(health_pb2.HealthCheckRequest(service=""), timeout=3)

    def _nothing(self) -> Iterator[bytes]:
        self._release.wait(120)  # bounded, in case close() is never reached
        return
        yield b""  # a generator that yields nothing

    def codes(self) -> list[grpc.StatusCode | None]:
        return [f.exception().code() if f.done() and f.exception() is not None  # type: ignore[union-attr]
                else None for f in self.futures]

    def close(self) -> None:
        self.channel.close()  # cancels every call still open
        self._release.set()


def _metric(m: MasterProcess, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"http://{m.metrics_address}/metrics", timeout=5) as r:
        text = r.read().decode()
    total = 0.0
    found = False
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and labels.items() <= s.labels.items():
                total += s.value
                found = True
    if not found:
        raise LookupError(f"no {name} {labels} in the metrics of {m.address}")
    return total


def _health(address: str) -> int:
    with grpc.insecure_channel(address,
                               options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(  # type: ignore[no-untyped-call]
            health_pb2.HealthCheckRequest(service=""), timeout=3)
        return int(reply.status)


def _prompt_calls(cluster: LocalCluster, leader: MasterProcess, key: str) -> None:
    """What must keep working while a master is attacked: a second client's status check, a
    create with a write quorum of 2 (the other masters' replication of it too), the health
    check, each within a few seconds."""
    with Client(leader.address, user="alice", timeout=PROMPT) as c:
        started = time.monotonic()
        status = c.node_status(leader.address)
        assert status.is_leader
        meta = c.create(key, os.urandom(4096), replication_factor=3, write_quorum=2)
        assert meta.acknowledged and meta.replication >= 2
        assert time.monotonic() - started < 2 * PROMPT
    assert _health(leader.address) == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def simple(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with running_cluster(tmp_path_factory.mktemp("preauth"),
                         **{"master.request.receive.secs": RECEIVE_SECS}) as c:
        yield c


def test_headers_only_calls_without_a_credential_do_not_exhaust_a_master(
        simple: LocalCluster) -> None:
    leader = simple.leader()
    with ExitStack() as stack:
        attack = HeadersOnly(leader.address, "/blobha.v1.BlobStore/GetMeta", ATTACK_CALLS)
        stack.callback(attack.close)
        # The health service needs no credential at all: its calls are held only so long.
        probes = HeadersOnly(leader.address, "/grpc.health.v1.Health/Check", 16)
        stack.callback(probes.close)
        _prompt_calls(simple, leader, f"preauth-create-{os.getpid()}")
        # Without a credential a call is refused from its headers, before its message.
        wait_until(lambda: all(f.done() for f in attack.futures), timeout=PROMPT,
                   what="the attacker's calls refused")
        assert set(attack.codes()) == {grpc.StatusCode.UNAUTHENTICATED}
    # The attacker has gone: nothing of it is held.
    wait_until(lambda: _metric(leader, "blobha_rpc_awaiting_request") == 0, timeout=PROMPT,
               what="no call waiting for its message")
    for method in ("GetMeta", "Check"):
        wait_until(lambda m=method: _metric(leader, "blobha_rpc_in_progress",  # type: ignore[misc]
                                            grpc_method=m) == 0,
                   timeout=PROMPT, what=f"no {method} call in progress")


def test_an_authenticated_caller_holds_no_more_than_its_share_and_not_for_long(
        simple: LocalCluster) -> None:
    leader = simple.leader()
    with ExitStack() as stack:
        # A user whose calls never send their message: capped per user, and cancelled by the
        # master when their message has not come within master.request.receive.secs.
        attack = HeadersOnly(leader.address, "/blobha.v1.BlobStore/GetMeta", ATTACK_CALLS,
                             metadata=(("x-blobha-user", "mallory"),))
        stack.callback(attack.close)
        wait_until(lambda: _metric(leader, "blobha_rpc_awaiting_request") > 0, timeout=PROMPT,
                   what="mallory's calls waiting for their message")
        _prompt_calls(simple, leader, f"preauth-held-{os.getpid()}")
        # Still connected, yet every call has ended: refused past its share, or cancelled.
        wait_until(lambda: all(f.done() for f in attack.futures), timeout=RECEIVE_SECS + PROMPT,
                   what="mallory's calls ended by the master")
        codes = set(attack.codes())
        assert codes <= {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED,
                         grpc.StatusCode.CANCELLED}, codes
        assert _metric(leader, "blobha_rpc_awaiting_request") == 0


# ---- wrong tokens ------------------------------------------------------------------------------


def _flood(address: str, tokens: list[str], stop: threading.Event,
           codes: list[grpc.StatusCode], in_flight: int = 64, limit: int = 3000) -> None:
    """Keep ``in_flight`` GetMeta calls with the wrong ``tokens`` going over one connection
    until ``stop`` (at most ``limit`` calls); the codes they end with go to ``codes``."""
    with grpc.insecure_channel(address,
                               options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        get_meta = ch.unary_unary("/blobha.v1.BlobStore/GetMeta",
                                  request_serializer=pb.GetMetaRequest.SerializeToString,
                                  response_deserializer=pb.BlobMeta.FromString)
        running: list[Any] = []
        sent = 0
        while not stop.is_set() and sent < limit:
            while len(running) < in_flight and sent < limit:
                token = tokens[sent % len(tokens)]
                running.append(get_meta.future(
                    pb.GetMetaRequest(key="k"), timeout=10,
                    metadata=((AUTHORIZATION_METADATA_KEY, f"Bearer {token}"),)))
                sent += 1
            done = next((f for f in running if f.done()), None)
            if done is None:
                running[0].exception(timeout=1)  # waits for the oldest, bounded
                continue
            running.remove(done)
            error = done.exception()
            codes.append(error.code() if error is not None else grpc.StatusCode.OK)
        for f in running:
            f.cancel()


def test_a_flood_of_wrong_tokens_does_not_stop_good_clients(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "tokens", nodes=3, base_port=0, overrides=FAST,
                           auth="token")
    with ExitStack() as stack:
        stack.callback(cluster.stop)
        cluster.start()
        leader = cluster.leader()
        wrong = ["alice:" + "A" * 43, "admin:" + "B" * 43,  # real users: scrypt checks
                 new_job_token()[0], new_job_token()[0]]  # unknown job tokens: ZooKeeper reads
        stop = threading.Event()
        codes: list[grpc.StatusCode] = []
        flood = threading.Thread(target=_flood, args=(leader.address, wrong, stop, codes))
        flood.start()
        try:
            wait_until(lambda: len(codes) > 100, timeout=30, what="the flood under way")
            # Users whose tokens this master has not checked yet: each needs a scrypt check.
            for user in ("bob", "alice", "admin"):
                started = time.monotonic()
                with Client(leader.address, user=user, timeout=PROMPT,
                            credentials=cluster.credentials(user)) as c:
                    c.create(f"token-flood-{user}-{os.getpid()}", b"x" * 100,
                             replication_factor=3, write_quorum=2)
                    assert c.node_status(leader.address).is_leader
                assert time.monotonic() - started < PROMPT, user
        finally:
            stop.set()
            flood.join(timeout=30)
        # Refused, as busy, or (UNAVAILABLE) a stream past the connection's cap of streams.
        assert set(codes) <= {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED,
                              grpc.StatusCode.UNAVAILABLE}, set(codes)


# ---- the peer piece server ---------------------------------------------------------------------

KEY, VERSION, CHUNK = "peer-key", 3, 1024


def _served(tmp_path: Path, vkey: bytes) -> Served:
    path = tmp_path / "held.blob"
    path.write_bytes(os.urandom(4 * CHUNK))
    return Served(KEY, VERSION, 4 * CHUNK, CHUNK, vkey, path, have=None)


def _ask(address: str, key: str, version: int, piece: int, grant: Grant) -> wire.Answer:
    host, port = address.rsplit(":", 1)
    with closing(socket.create_connection((host, int(port)), timeout=5)) as conn:
        conn.sendall(wire.Request(key, version, piece, grant).encode())
        answer = wire.read_answer(conn)
        if answer.status == wire.OK:
            assert wire.recv_buffer(conn, answer.size) is not None
        return answer


def test_idle_connections_do_not_stop_a_requester_of_the_peer_server(tmp_path: Path) -> None:
    vkey = os.urandom(32)
    server = PeerServer(PeerSettings(connections=4), "127.0.0.1")
    idle: list[socket.socket] = []
    try:
        server.offer(_served(tmp_path, vkey))
        host, port = server.address.rsplit(":", 1)
        # More idle connections than the server serves at once, and more than it keeps
        # threads for: none sends a request.
        for _ in range(64):
            idle.append(socket.create_connection((host, int(port)), timeout=5))
        grant = make_grant(vkey, "alice", KEY, VERSION, time.time() + 60, "127.0.0.1")

        def served_now() -> bool:
            return _ask(server.address, KEY, VERSION, 1, grant).status == wire.OK
        wait_until(served_now, timeout=PROMPT, what="a piece served beside idle connections")
    finally:
        for s in idle:
            s.close()
        server.stop()


def test_the_peer_server_tells_nothing_to_a_request_without_a_valid_grant(
        tmp_path: Path) -> None:
    vkey = os.urandom(32)
    server = PeerServer(PeerSettings(), "127.0.0.1")
    try:
        server.offer(_served(tmp_path, vkey))
        forged = make_grant(os.urandom(32), "mallory", KEY, VERSION, time.time() + 60,
                            "127.0.0.1")
        guesses = [(KEY, VERSION), (KEY, VERSION + 1), ("another-key", 1)]
        for key, version in guesses:
            grant = make_grant(os.urandom(32), "mallory", key, version, time.time() + 60,
                               "127.0.0.1")
            answer = _ask(server.address, key, version, 0, grant)
            # Held or not, the same answer: no grant, nothing learnt.
            assert (answer.status, answer.have) == (wire.REFUSED, ""), (key, version, answer)
        answer = _ask(server.address, KEY, VERSION, 0, forged)
        assert answer.status == wire.REFUSED
        good = make_grant(vkey, "alice", KEY, VERSION, time.time() + 60, "127.0.0.1")
        assert _ask(server.address, KEY, VERSION, 0, good).status == wire.OK
    finally:
        server.stop()
