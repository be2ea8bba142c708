"""Which piece to fetch next, and from where: pure bookkeeping, no I/O (unit-tested alone).

- A piece some usable peer holds comes from a peer (the rarest such piece first, from the
  least busy holder): peers' links add up, the masters' do not.
- A peer whose holdings are unknown or old is asked for a missing piece (its answer, even
  "not held", tells what it holds).
- The rest comes from the replicas, striped over them (the least busy first), a few pieces
  per request. Once peers are known, a cache takes from the masters only its own stripe of
  blocks (by its ordinal among the caches it knows of) and waits for the others' stripes to
  reach it through their caches; idle, it takes any block, so a dead peer never stalls it.
- A piece that fails its digest marks that peer bad for this download; a peer that fails
  otherwise (dead, refused) is dropped after a few failures; the piece is simply fetched again.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["Assignment", "Scheduler"]

#: Seconds a peer's holdings are trusted before it is asked again.
HAVE_TTL = 0.25
#: Seconds a peer that said "busy" is left alone.
BUSY_SECS = 0.5
#: Failures (not bad pieces: those count at once) after which a peer is dropped.
MAX_FAILURES = 2
#: Pieces one fetch from a replica covers at most.
MASTER_RUN = 2
#: Requests in flight to one peer at most.
PER_PEER = 2


@dataclass(frozen=True)
class Assignment:
    source: str
    pieces: tuple[int, ...]
    from_master: bool


class Scheduler:
    def __init__(self, pieces: int, masters: list[str], rng: random.Random | None = None,
                 master_run: int = MASTER_RUN, ordinal: int | None = None) -> None:
        self.rng = rng or random.Random()
        self.pieces = pieces
        self.missing = set(range(pieces))
        self.inflight: dict[int, str] = {}
        if ordinal is None:
            start = self.rng.randrange(pieces) if pieces else 0
        else:
            # The golden ratio's sequence: the k-th cache starts as far as can be from the
            # starts of those before it, however many there are.
            start = int((ordinal * 0.6180339887498949) % 1 * pieces)
        self.order = [(start + i) % pieces for i in range(pieces)]
        self.ordinal = ordinal
        self.masters = list(masters)
        self.master_load = {m: 0 for m in masters}
        self.master_run = master_run
        self.peer_have: dict[str, set[int]] = {}
        self.peer_seen: dict[str, float] = {}
        self.peer_load: dict[str, int] = {}
        self.busy_until: dict[str, float] = {}
        self.failures: dict[str, int] = {}
        self.bad: set[str] = set()

    # -- what we learn ---------------------------------------------------------------------

    def add_peers(self, peers: list[str]) -> None:
        for p in peers:
            if p not in self.peer_load and p not in self.bad:
                self.peer_load[p] = 0

    def set_masters(self, masters: list[str]) -> None:
        for m in masters:
            self.master_load.setdefault(m, 0)
        if masters:
            self.masters = list(masters)

    def learned(self, peer: str, have: set[int], now: float) -> None:
        self.peer_have[peer] = have
        self.peer_seen[peer] = now

    def done(self, a: Assignment, piece: int) -> None:
        self.missing.discard(piece)
        self.inflight.pop(piece, None)

    def finished(self, a: Assignment) -> None:
        """The assignment ended (each piece reported done, or not)."""
        for p in a.pieces:
            if self.inflight.get(p) == a.source:
                del self.inflight[p]
        if a.from_master:
            self.master_load[a.source] = max(0, self.master_load.get(a.source, 1) - 1)
        elif a.source in self.peer_load:
            self.peer_load[a.source] = max(0, self.peer_load[a.source] - 1)

    def not_held(self, peer: str, piece: int) -> None:
        self.peer_have.get(peer, set()).discard(piece)

    def busy(self, peer: str, now: float) -> None:
        self.busy_until[peer] = now + BUSY_SECS

    def failed(self, source: str, bad_piece: bool) -> None:
        if source in self.master_load:
            return  # the client already failed over between replicas
        n = self.failures[source] = self.failures.get(source, 0) + 1
        if bad_piece or n >= MAX_FAILURES:
            self.drop(source)

    def drop(self, peer: str) -> None:
        self.bad.add(peer)
        self.peer_load.pop(peer, None)
        self.peer_have.pop(peer, None)

    # -- what to do next -------------------------------------------------------------------

    def complete(self) -> bool:
        return not self.missing

    def usable_peers(self, now: float) -> list[str]:
        return [p for p, load in self.peer_load.items()
                if load < PER_PEER and self.busy_until.get(p, 0) <= now]

    def next(self, now: float, master_cap: int) -> Assignment | None:
        free = [p for p in self.missing if p not in self.inflight]
        if not free:
            return None
        peers = self.usable_peers(now)
        if peers:
            free_set = set(free)
            holders: dict[int, list[str]] = {}
            for p in peers:
                for piece in self.peer_have.get(p, set()) & free_set:
                    holders.setdefault(piece, []).append(p)
            if holders:
                fewest = min(len(h) for h in holders.values())
                piece = self.rng.choice([i for i, h in holders.items() if len(h) == fewest])
                peer = min(holders[piece], key=lambda p: (self.peer_load[p], self.rng.random()))
                return self._give(peer, (piece,), False)
            stale = [p for p in peers if now - self.peer_seen.get(p, -1e9) > HAVE_TTL
                     and self.peer_load[p] == 0]
            if stale:
                return self._give(self.rng.choice(stale), (self.rng.choice(free),), False)
        if not self.masters or sum(self.master_load.values()) >= master_cap:
            return None
        held = set().union(*(self.peer_have.get(p, set()) for p in self.peer_load))
        wanted = [p for p in self.order
                  if p in self.missing and p not in self.inflight and p not in held]
        if self.ordinal is not None and self.peer_load:
            # Each cache takes its own stripe of blocks from the masters (by its ordinal
            # among the caches it knows of) and the rest from the caches whose stripes
            # they are: each piece leaves the masters about once, however many fetch it.
            stripes = len(self.peer_load) + 1
            mine = [p for p in wanted
                    if (p // self.master_run) % stripes == self.ordinal % stripes]
            if not mine and self.inflight:
                return None  # the others' stripes will reach us through them
            wanted = mine or wanted
        run: list[int] = []
        for piece in wanted:
            if run and piece != run[-1] + 1:
                break
            run.append(piece)
            if len(run) == self.master_run:
                break
        if not run:
            if peers:
                return None  # the peers holding the rest will be free again soon
            # Every free piece is held by peers that are all busy: a master serves one rather
            # than leave the download idle.
            run = [free[0]]
        master = min(self.masters, key=lambda m: (self.master_load.get(m, 0), self.rng.random()))
        return self._give(master, tuple(run), True)

    def _give(self, source: str, pieces: tuple[int, ...], from_master: bool) -> Assignment:
        for p in pieces:
            self.inflight[p] = source
        if from_master:
            self.master_load[source] = self.master_load.get(source, 0) + 1
        else:
            self.peer_load[source] += 1
        return Assignment(source, pieces, from_master)
