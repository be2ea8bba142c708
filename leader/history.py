"""The leadership terms a master has seen, for the status page and metrics.

Every election win bumps ``/epoch`` (see :mod:`blobha.leader.election`), so watching that one
znode sees every leader change, including those between two other masters. The history is kept
in memory and bounded: it answers "what failovers happened recently", not an audit trail.
Terms that came and went while this master was disconnected from ZooKeeper are not seen.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from kazoo.client import KazooClient
from kazoo.protocol.states import ZnodeStat

from blobha.zk.layout import EPOCH, EpochRecord

#: Terms kept; older ones are forgotten.
MAX_TERMS = 50


@dataclass(frozen=True)
class Term:
    epoch: int
    leader: str
    #: Wall-clock time this master saw the term begin (or first saw it, at start-up).
    observed_at: float
    #: True for the term that was already running when this master started watching.
    at_start: bool


class LeaderHistory:
    def __init__(self, max_terms: int = MAX_TERMS) -> None:
        self._terms: deque[Term] = deque(maxlen=max_terms)
        self._changes = 0
        self._lock = threading.Lock()

    def watch(self, zk: KazooClient) -> None:
        """Follow ``/epoch``. kazoo's DataWatch re-arms itself after reconnects; its callback
        runs on the event thread and only appends to memory (ha-rule 14)."""
        zk.DataWatch(EPOCH, self._on_epoch)

    def _on_epoch(self, data: bytes | None, stat: ZnodeStat | None) -> None:
        if not data:
            return
        try:
            record = EpochRecord.decode(data)
        except (ValueError, KeyError, TypeError):
            return  # not ours to judge here; the election reports a broken /epoch
        self.observe(record.epoch, record.leader)

    def observe(self, epoch: int, leader: str, at: float | None = None) -> None:
        """Record that term ``epoch`` led by ``leader`` is current (repeats are ignored)."""
        if epoch <= 0:
            return
        with self._lock:
            last = self._terms[-1] if self._terms else None
            if last is not None and epoch <= last.epoch:
                return
            first = last is None
            if not first:
                self._changes += 1
            self._terms.append(Term(epoch, leader, time.time() if at is None else at, first))

    def terms(self) -> list[Term]:
        """Newest first."""
        with self._lock:
            return list(reversed(self._terms))

    @property
    def changes(self) -> int:
        """Leader changes seen since this master started (the first term seen is not one)."""
        with self._lock:
            return self._changes

    @property
    def current(self) -> Term | None:
        with self._lock:
            return self._terms[-1] if self._terms else None
