"""Which node caches hold or fetch which version: in memory, each entry with a lifetime.

No ZooKeeper writes per node: a cache announces itself with every plan it asks for (see
blobha.master.peerplans), and one that stops asking is forgotten after the lifetime. Each
master knows only the caches that announced to it; caches choose their master by the key, so
the caches of one key meet at the same master."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

__all__ = ["HOLDER_SECS", "Holders"]

#: Seconds an announcement lasts; caches renew it while they fetch, and after.
HOLDER_SECS = 60.0
#: Caches remembered per version, and versions in all: the newest announcements win, so a
#: flood of addresses costs bounded memory.
MAX_PER_VERSION = 4096
MAX_VERSIONS = 10_000


class Holders:
    def __init__(self, lifetime: float = HOLDER_SECS,
                 clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        self.lifetime = lifetime
        self._clock = clock
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        # (key, version) -> address -> (expires, complete, user who announced it); dicts keep
        # insertion order, so the first entries are the oldest announcements.
        self._by: dict[tuple[str, int], dict[str, tuple[float, bool, str]]] = {}
        # (key, version) -> address -> the order in which it first announced
        self._ordinals: dict[tuple[str, int], dict[str, int]] = {}

    def announce(self, key: str, version: int, address: str, complete: bool,
                 user: str = "") -> int:
        """Record ``address``, announced by ``user``; how many caches announced the version
        before it first did."""
        now = self._clock()
        with self._lock:
            entry = self._by.pop((key, version), None) or {}
            self._by[(key, version)] = entry  # now the newest version
            entry.pop(address, None)
            entry[address] = (now + self.lifetime, complete, user)
            ordinals = self._ordinals.setdefault((key, version), {})
            ordinal = ordinals.setdefault(address, len(ordinals))
            if len(ordinals) > MAX_PER_VERSION:
                ordinals.clear()  # only a spread: starting over costs nothing
            while len(entry) > MAX_PER_VERSION:
                del entry[next(iter(entry))]
            while len(self._by) > MAX_VERSIONS:
                gone = next(iter(self._by))
                del self._by[gone]
                self._ordinals.pop(gone, None)
        return ordinal

    def pick(self, key: str, version: int, exclude: str, n: int) -> list[str]:
        """Up to ``n`` live holders other than ``exclude``: complete ones first, a random
        subset of each kind once there are more (so load spreads over all of them)."""
        now = self._clock()
        with self._lock:
            entry = self._by.get((key, version))
            if not entry:
                return []
            for address in [a for a, (until, _, _) in entry.items() if until <= now]:
                del entry[address]
            if not entry:
                del self._by[(key, version)]
                return []
            complete = [a for a, (_, c, _) in entry.items() if c and a != exclude]
            partial = [a for a, (_, c, _) in entry.items() if not c and a != exclude]
        chosen = self._rng.sample(complete, min(n, len(complete)))
        rest = n - len(chosen)
        return chosen + self._rng.sample(partial, min(rest, len(partial)))

    def announcer(self, key: str, version: int, address: str) -> str | None:
        """The user who last announced ``address`` for the version; None if none did."""
        with self._lock:
            found = self._by.get((key, version), {}).get(address)
        return None if found is None else found[2]

    def count(self) -> int:
        with self._lock:
            return sum(len(e) for e in self._by.values())
