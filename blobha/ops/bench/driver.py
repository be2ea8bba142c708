"""Load generation: timed operations from many threads, each with its own connection.

A connection is a blobha client or a raw ZooKeeper client; the raw ZooKeeper rates are the
baselines the blobha ones are set against.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from kazoo.client import KazooClient

from blobha.client import Client
from blobha.ops.bench.options import USER, ZK_NODE_BYTES
from blobha.ops.zkserver import tls_client_args
from blobha.wire.credentials import Credentials

C = TypeVar("C")


@dataclass
class DriveResult:
    ops: int
    secs: float
    latencies_ms: list[float] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.ops / self.secs if self.secs > 0 else 0.0


class Driver(Generic[C]):
    """Runs ``op(conn, i)`` from ``threads`` threads, each with its own connection, for a time
    or a total count; ``i`` is a run-wide sequence number (unique keys without coordination).

    Connections are opened and warmed (``warm``) before the clock starts, so the rate measures
    steady-state operations, not connection set-up or leader discovery.
    """

    def __init__(
        self,
        open_conn: Callable[[], C],
        close_conn: Callable[[C], None],
        op: Callable[[C, int], object],
        warm: Callable[[C], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.open_conn = open_conn
        self.close_conn = close_conn
        self.op = op
        self.warm = warm
        self.clock = clock

    def run(
        self, threads: int, seconds: float | None = None, total: int | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> DriveResult:
        """``progress(ops done)`` is called about every second from the calling thread."""
        if seconds is None and total is None:
            raise ValueError("give seconds or total")
        lock = threading.Lock()
        issued = [0]  # sequence numbers handed out
        completed = [0]
        stop = threading.Event()
        result = DriveResult(0, 0.0)
        started = [0.0]
        deadline = [math.inf]

        def start_clock() -> None:
            # Run by the barrier before it lets any thread go: no operation starts before the
            # clock does (the workers' first ones used to, while the caller had yet to read it).
            started[0] = self.clock()
            if seconds is not None:
                deadline[0] = started[0] + seconds

        barrier = threading.Barrier(threads + 1, action=start_clock)

        def worker() -> None:
            conn: C | None = None
            latencies: list[float] = []
            try:
                conn = self.open_conn()
                if self.warm is not None:
                    self.warm(conn)
                barrier.wait()
                while not stop.is_set() and self.clock() < deadline[0]:
                    with lock:
                        i = issued[0]
                        issued[0] += 1
                    if total is not None and i >= total:
                        break
                    t0 = time.perf_counter()
                    self.op(conn, i)
                    latencies.append((time.perf_counter() - t0) * 1000)
                    with lock:
                        completed[0] += 1
            except threading.BrokenBarrierError:
                pass
            except BaseException as e:
                with lock:
                    result.errors.append(e)
                stop.set()
                barrier.abort()
            finally:
                with lock:
                    result.latencies_ms.extend(latencies)
                if conn is not None:
                    with contextlib.suppress(Exception):
                        self.close_conn(conn)

        pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
        for t in pool:
            t.start()
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            for t in pool:
                t.join()
            raise result.errors[0] from None
        for t in pool:
            while t.is_alive():
                t.join(timeout=1.0 if progress is not None else None)
                if progress is not None:
                    progress(completed[0])
        result.secs = self.clock() - started[0]
        result.ops = completed[0]
        if result.errors and result.ops == 0:
            raise result.errors[0]
        return result


def timed_ms(op: Callable[[int], object], rounds: int, seconds: float) -> float:
    """Median milliseconds of ``op(i)`` over at most ``rounds`` calls and about ``seconds``,
    one after the other; the first failure is raised."""
    res = Driver(lambda: None, lambda _: None, lambda _, i: op(i)).run(
        1, seconds=seconds, total=rounds)
    if res.errors:
        raise res.errors[0]
    return statistics.median(res.latencies_ms)


def bench_user(credentials: Credentials | None = None) -> str | None:
    """The user the bench acts as: on a secure cluster whoever the credentials (token or client
    certificate, given, else from the command line or ``BLOBHA_*``) say; otherwise a user of
    its own."""
    creds = credentials or Credentials.from_env()
    return None if creds.token_file or creds.cert else USER


def bench_client(cluster: str, credentials: Credentials | None = None) -> Client:
    return Client(cluster, user=bench_user(credentials), timeout=120, credentials=credentials)


def client_driver(cluster: str, op: Callable[[Client, int], object],
                  credentials: Credentials | None = None) -> Driver[Client]:
    # Leader discovery and channel set-up happen in warm-up, outside the clock.
    return Driver(lambda: bench_client(cluster, credentials), Client.close, op,
                  warm=lambda c: c.cluster_summary())


def zk_open(connect: str) -> KazooClient:
    # A local TLS cluster's ZooKeeper serves TLS only: its baselines go over TLS, as the
    # masters' requests do.
    zk = KazooClient(hosts=connect, **tls_client_args(connect))
    zk.start(timeout=15)
    return zk


def zk_close(zk: KazooClient) -> None:
    zk.stop()
    zk.close()


def zk_delete_tree(zk: KazooClient, base: str) -> None:
    """Delete ``base`` and its children, pipelined: kazoo's recursive delete does one
    synchronous round trip per child, far too slow for the tens of thousands a baseline makes."""
    with contextlib.suppress(Exception):
        names = zk.get_children(base)
        for start in range(0, len(names), 2000):
            asyncs = [zk.delete_async(f"{base}/{n}") for n in names[start:start + 2000]]
            for a in asyncs:
                with contextlib.suppress(Exception):
                    a.get(timeout=30)
        zk.delete(base)


def zk_create_rate(connect: str, threads: int, seconds: float) -> DriveResult:
    """Raw synchronous ZooKeeper creates per second with ``threads`` kazoo clients."""
    admin = zk_open(connect)
    base = f"/blobha-bench-{os.getpid()}-{time.monotonic_ns()}"
    admin.create(base)
    payload = b"x" * ZK_NODE_BYTES
    try:
        return Driver(lambda: zk_open(connect), zk_close,
                      lambda zk, i: zk.create(f"{base}/n{i}", payload)).run(threads, seconds)
    finally:
        zk_delete_tree(admin, base)
        zk_close(admin)


def zk_get_rate(connect: str, threads: int, seconds: float, nodes: int = 1000) -> DriveResult:
    """Raw synchronous ZooKeeper gets per second with ``threads`` kazoo clients."""
    admin = zk_open(connect)
    base = f"/blobha-bench-{os.getpid()}-{time.monotonic_ns()}"
    admin.create(base)
    payload = b"x" * ZK_NODE_BYTES
    try:
        for a in [admin.create_async(f"{base}/n{i}", payload) for i in range(nodes)]:
            a.get(timeout=30)
        return Driver(lambda: zk_open(connect), zk_close,
                      lambda zk, i: zk.get(f"{base}/n{i % nodes}")).run(threads, seconds)
    finally:
        zk_delete_tree(admin, base)
        zk_close(admin)
