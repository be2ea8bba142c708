"""The replica view's passes over every key: its figures (keys, keys under-replicated, keys
this master lacks) and the keys a change of masters, a departure or a new leadership concerns."""

from __future__ import annotations

import threading
import time
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING

from blobha.sync.decide import chosen, counted

if TYPE_CHECKING:
    from blobha.sync.view import Entry, ReplicaView

#: (the view's generation, the masters known, the masters holding), the monotonic time the
#: entries behind it were taken, and the figures.
_Last = tuple[tuple[int, frozenset[str], frozenset[str]], float, tuple[int, int, int]]


class Tally:
    """The passes over every key of one :class:`ReplicaView`: the figures, one pass at a
    time, and the keys that moving masters or a new leader concern."""

    def __init__(self, view: ReplicaView) -> None:
        self.view = view
        #: One pass at a time; guards what follows.
        self.lock = threading.Lock()
        self._last: _Last | None = None
        # For the keys this master lacks, whether the placement chooses it, with the factor it
        # was decided for; valid for the masters in _placed_for. The hashing was most of a
        # pass's cost, and a pass runs at every status check under writes; only a new key,
        # or a new membership, costs a hash.
        self._placed: dict[str, tuple[int, bool]] = {}
        self._placed_for: frozenset[str] = frozenset()

    def figures(self) -> tuple[int, int, int]:
        """(keys, keys with fewer holders than their replication factor, keys this master
        should hold but lacks), as of a moment during the call.

        A pass over every key (with the placement hash of each key this master lacks: costly at
        100,000s of keys) whenever the view has moved, which under writes is at every call. So
        one pass runs at a time, and callers that waited for it take its answer when it began
        after they asked: concurrent status checks cost one pass, not one each."""
        asked = time.monotonic()
        with self.lock:
            return self._since(asked)

    def _since(self, asked: float) -> tuple[int, int, int]:
        view = self.view
        known = frozenset(view.membership.known())
        holding = view.holding()
        last = self._last
        with view.lock:
            stamp = (view.generation, known, holding)
            if last is not None and (last[0] == stamp or last[1] > asked):
                return last[2]
            taken = time.monotonic()
            entries = list(view.entries.items())
        result = (len(entries), *self.count(entries, known, holding))
        self._last = (stamp, taken, result)
        return result

    def count(self, entries: list[tuple[str, Entry]], known: frozenset[str],
              holding: AbstractSet[str] | None = None) -> tuple[int, int]:
        """One pass of :meth:`figures` (its lock held): the under-replicated keys (counting
        the nodes of ``holding`` only, when given), and the keys this master should hold but
        lacks."""
        me = self.view.identity
        under = lag = 0
        before = self._placed if self._placed_for == known else {}
        placed: dict[str, tuple[int, bool]] = {}  # only keys still lacking: none left behind
        # Holder tuples are shared (canonical): a handful of distinct ones among 100,000s of
        # keys, each counted once per pass (by identity: `entries` keeps them alive).
        counts: dict[int, int] = {}
        for key, e in entries:
            holders = e.holders
            n = counts.get(id(holders))
            if n is None:
                n = counts[id(holders)] = len(
                    holders if holding is None else counted(holders, holding))
            # Against the factor asked for, not the capped one: a blob that wants 3 copies in a
            # cluster with a dead master is under-replicated, and operators should see it.
            if n < e.rf:
                under += 1
            if me not in holders:
                decided = before.get(key)
                if decided is None or decided[0] != e.rf:
                    decided = (e.rf, chosen(me, key, e.rf, known))
                placed[key] = decided
                lag += decided[1]
        self._placed, self._placed_for = placed, known
        return under, lag

    def placed(self) -> dict[str, tuple[int, bool]]:
        """The placement decisions the last pass kept (keys lacking here)."""
        with self.lock:
            return dict(self._placed)

    def placement_moved(self, before: frozenset[str], after: frozenset[str]) -> list[str]:
        """The keys for which placement chooses this master under one set of masters and not
        under the other (a key held by all of them either way, the common case when the
        replication factor is at least the number of masters, is not among them)."""
        me = self.view.identity
        with self.view.lock:
            entries = [(key, e.rf) for key, e in self.view.entries.items()]
        return [key for key, rf in entries
                if chosen(me, key, rf, before) != chosen(me, key, rf, after)]

    def unsettled(self) -> list[str]:
        """The keys that may call for a leader's duty: an unacknowledged version, or a
        change announced and not read yet (a key created, with no entry yet, among them)."""
        view = self.view
        with view.lock:
            entries, unread = view.entries, view.unread
            return [*(key for key, e in entries.items() if not e.acked or key in unread),
                    *(key for key in unread if key not in entries)]

    def held_by(self, masters: set[str]) -> list[str]:
        """The keys with a replica node of one of ``masters``."""
        with self.view.lock:
            return [key for key, e in self.view.entries.items()
                    if not masters.isdisjoint(e.holders)]


__all__ = ["Tally"]
