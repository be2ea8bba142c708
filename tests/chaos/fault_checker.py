"""A randomized, Jepsen-style checker: a history of operations from several clients, recorded
while faults are injected one at a time, then checked against the store's guarantees.

Each worker thread is one client (one :class:`~blobha.client.Client`) and records every
operation it makes, in order, with its start, end and outcome:

* writers own a few keys each: they create and update them, read them back, and delete one
  key of their own once (it is never written again);
* readers read any writer's keys.

:func:`check_history` then finds, from the history alone:

* reads returning bytes nobody wrote (a digest no write of that key sent);
* reads older than a version the same client had already written or read (read-your-writes
  and monotonic reads, per client);
* a deleted key read back by its deleter after the delete was acknowledged.

What the cluster holds at the end (every acknowledged write, or a newer one, on every master,
replication back at its target) is checked by :func:`chaos_harness.verify`; the leaders by
:class:`chaos_harness.LeaderSampler`.
"""

from __future__ import annotations

import io
import itertools
import logging
import random
import threading
import time
from dataclasses import dataclass, field

from chaos_harness import Ack, ChaosCluster, Failure, Records, digest, payload

from blobha.client import Client
from blobha.core.errors import BlobError, KeyAlreadyExists, KeyNotFound

#: Outcomes: acknowledged (or, for a read, served), refused or unknown (an error: a write may
#: still have been made), absent (a read or a delete found no such key).
OK, FAILED, ABSENT = "ok", "failed", "absent"


@dataclass
class Op:
    client: str
    kind: str  # write, read, delete
    key: str
    start: float
    end: float
    outcome: str
    version: int = 0
    digest: str = ""
    error: str = ""
    #: The master that served a read (the last one, if it failed over), for placing a problem.
    source: str = ""


@dataclass
class History:
    ops: list[Op] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, op: Op) -> None:
        with self.lock:
            self.ops.append(op)

    def snapshot(self) -> list[Op]:
        with self.lock:
            return list(self.ops)

    def records(self) -> Records:
        """The writes, as :func:`chaos_harness.verify` reads them (deleted keys left out:
        they are checked apart)."""
        ops = self.snapshot()
        deleted = {o.key for o in ops if o.kind == "delete"}
        records = Records()
        for o in ops:
            if o.kind != "write" or o.key in deleted:
                continue
            if o.outcome == OK:
                records.acks.append(Ack(o.key, o.version, o.digest, 0, o.end))
            else:
                records.failures.append(Failure(o.key, o.digest, o.error, o.end))
        return records

    def write_gaps(self, start: float, end: float) -> float:
        """The longest time within [start, end] with no acknowledged write."""
        times = sorted(o.end for o in self.snapshot()
                       if o.kind == "write" and o.outcome == OK and start < o.end < end)
        points = [start, *times, end]
        return max(b - a for a, b in itertools.pairwise(points))

    def acked_writes(self) -> int:
        return sum(1 for o in self.snapshot() if o.kind == "write" and o.outcome == OK)


class _Sources(logging.Handler):
    """The master each worker thread's latest download came from, as the client logs it."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.latest: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        master = getattr(record, "master", None)
        if master is not None:
            self.latest[threading.current_thread().name] = str(master)


class RandomWorkload:
    """``writers`` writer and ``readers`` reader threads, each its own client, until stopped
    (bounded by ``max_secs``)."""

    def __init__(self, cluster: ChaosCluster, seed: int, writers: int = 3, readers: int = 2,
                 keys_per_writer: int = 3, max_secs: float = 600.0,
                 op_timeout: float = 20.0) -> None:
        self.cluster = cluster
        self.seed = seed
        self.writers = writers
        self.readers = readers
        self.keys_per_writer = keys_per_writer
        self.max_secs = max_secs
        self.op_timeout = op_timeout
        self.history = History()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.errors: list[str] = []
        self._sources = _Sources()
        self._logger = logging.getLogger("blobha.client")
        self._logger_was = (self._logger.level, self._logger.propagate)

    def keys(self, writer: int) -> list[str]:
        return [f"rf-{writer}-{k}" for k in range(self.keys_per_writer)]

    def gone_key(self, writer: int) -> str:
        return f"rf-{writer}-gone"

    def __enter__(self) -> RandomWorkload:
        # Which master served each read; kept out of the test's own log capture.
        self._logger.addHandler(self._sources)
        self._logger.setLevel(logging.DEBUG)
        self._logger.propagate = False
        started = time.monotonic()
        for i in range(self.writers):
            self._spawn(f"writer-{i}", self._writer, i, started)
        for i in range(self.readers):
            self._spawn(f"reader-{i}", self._reader, i, started)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.op_timeout + 30)
        self._logger.removeHandler(self._sources)
        self._logger.setLevel(self._logger_was[0])
        self._logger.propagate = self._logger_was[1]
        assert not any(t.is_alive() for t in self._threads), "workload threads did not stop"

    def _spawn(self, name: str, target: object, index: int, started: float) -> None:
        def run() -> None:
            try:
                target(name, index, started)  # type: ignore[operator]
            except Exception as e:  # a bug of the workload itself: reported by the test
                self.errors.append(f"{name}: {type(e).__name__}: {e}")

        t = threading.Thread(target=run, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _running(self, started: float) -> bool:
        return not self._stop.is_set() and time.monotonic() - started < self.max_secs

    def _read(self, client: Client, name: str, key: str) -> None:
        out = io.BytesIO()
        self._sources.latest.pop(name, None)
        t0 = time.monotonic()
        try:
            info = client.download(key, out)  # the client checks the digest end to end
        except KeyNotFound:
            self.history.add(Op(name, "read", key, t0, time.monotonic(), ABSENT))
            return
        except BlobError as e:
            self.history.add(Op(name, "read", key, t0, time.monotonic(), FAILED,
                                error=f"{type(e).__name__}: {e}"))
            return
        self.history.add(Op(name, "read", key, t0, time.monotonic(), OK, info.version,
                            digest(out.getvalue()),
                            source=self._sources.latest.pop(name, "")))

    def _write(self, client: Client, name: str, key: str, data: bytes, create: bool) -> bool:
        d = digest(data)
        t0 = time.monotonic()
        try:
            if create:
                meta = client.create(key, data, replication_factor=3)
            else:
                meta = client.update(key, data)
        except KeyAlreadyExists:
            # An earlier create of ours landed though it reported failure.
            self.history.add(Op(name, "write", key, t0, time.monotonic(), FAILED, digest=d,
                                error="already exists"))
            return True
        except BlobError as e:
            self.history.add(Op(name, "write", key, t0, time.monotonic(), FAILED, digest=d,
                                error=f"{type(e).__name__}: {e}"))
            return False
        self.history.add(Op(name, "write", key, t0, time.monotonic(), OK, meta.version,
                            meta.digest))
        return True

    def _writer(self, name: str, index: int, started: float) -> None:
        rng = random.Random(self.seed * 1000 + index)
        client = self.cluster.client(timeout=self.op_timeout)
        mine = self.keys(index)
        gone = self.gone_key(index)
        created: set[str] = set()
        deleted = False
        n = 0
        while self._running(started):
            n += 1
            if not deleted and n == 8:
                self._write(client, name, gone, payload(2048, rng, gone), create=True)
            elif not deleted and n >= 16 and rng.random() < 0.2:
                t0 = time.monotonic()
                try:
                    client.delete(gone)
                    outcome, error = OK, ""
                except KeyNotFound:
                    outcome, error = ABSENT, ""
                except BlobError as e:
                    outcome, error = FAILED, f"{type(e).__name__}: {e}"
                self.history.add(Op(name, "delete", gone, t0, time.monotonic(), outcome,
                                    error=error))
                deleted = outcome in (OK, ABSENT)
            elif rng.random() < 0.3:
                self._read(client, name, rng.choice([*mine, *([gone] if deleted else [])]))
            else:
                key = rng.choice(mine)
                data = payload(rng.randint(1024, 256 * 1024), rng, key)
                if self._write(client, name, key, data, create=key not in created):
                    created.add(key)

    def _reader(self, name: str, index: int, started: float) -> None:
        rng = random.Random(self.seed * 1000 + 500 + index)
        client = self.cluster.client(timeout=self.op_timeout)
        every = [k for w in range(self.writers) for k in self.keys(w)]
        while self._running(started):
            self._read(client, name, rng.choice(every))
            # Readers pace themselves: the writers' load is what the faults are measured by.
            self._stop.wait(rng.uniform(0.01, 0.05))


def check_history(ops: list[Op]) -> list[str]:
    """The violations a history shows by itself (see the module docstring)."""
    problems: list[str] = []
    written: dict[str, set[str]] = {}
    for o in ops:
        if o.kind == "write":
            written.setdefault(o.key, set()).add(o.digest)
    by_client: dict[str, list[Op]] = {}
    for o in ops:
        by_client.setdefault(o.client, []).append(o)
    for name, mine in sorted(by_client.items()):
        newest: dict[str, int] = {}  # per key, the newest version this client wrote or read
        deleted_at: dict[str, float] = {}
        for o in sorted(mine, key=lambda o: o.start):  # one thread: one op at a time
            if o.kind == "delete" and o.outcome in (OK, ABSENT):
                deleted_at[o.key] = o.end
            if o.outcome != OK or o.kind == "delete":
                continue
            if o.kind == "read":
                if o.digest not in written.get(o.key, set()):
                    problems.append(f"{name} read {o.key} v{o.version} with bytes no write sent"
                                    f" ({o.digest[:8]})")
                if o.key in deleted_at:
                    problems.append(f"{name} read {o.key} v{o.version} after deleting it")
                if o.version < newest.get(o.key, 0):
                    problems.append(f"{name} read {o.key} v{o.version} after it had written or"
                                    f" read v{newest[o.key]} (at {o.start:.2f}"
                                    f"{f', from {o.source}' if o.source else ''})")
            newest[o.key] = max(newest.get(o.key, 0), o.version)
    return problems
