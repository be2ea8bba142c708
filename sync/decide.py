"""The pure decision: what one key needs on this master, from values alone (no ZooKeeper, no disk).

The executor (:mod:`blobha.sync.apply`) gathers the facts (the committed state read, its
holders, this master's replica nodes, what the local store holds) and carries out the plan.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Set
from dataclasses import dataclass
from typing import Protocol

from blobha.core import placement


def chosen(me: str, key: str, rf: int, known: Collection[str]) -> bool:
    """Whether ``me`` is among the holders the placement chooses for ``key`` with replication
    factor ``rf`` (capped at the masters known)."""
    rf = min(rf, max(len(known), 1))
    # With rf >= the masters known, every one of them is chosen: skip the hashing.
    return me in known if rf >= len(known) else me in placement.choose(key, known, rf)


def counted(holders: tuple[str, ...], holding: Set[str]) -> tuple[str, ...]:
    """The ``holders`` whose replica nodes count: masters under ``/holders``, each of which
    checked its nodes in its current session (ha-rule 9). A dead master's nodes stay in
    ZooKeeper and stop counting at once."""
    if all(h in holding for h in holders):
        return holders
    return tuple(h for h in holders if h in holding)


class Held(Protocol):
    """What the view keeps of a key that these decisions look at (view.Entry)."""

    @property
    def rf(self) -> int: ...
    @property
    def acked(self) -> bool: ...
    @property
    def holders(self) -> tuple[str, ...]: ...
    @property
    def registered(self) -> int: ...


def has_work(me: str, key: str, entry: Held, known: Collection[str], leader: bool,
             session: int) -> bool:
    """Whether a change of ``key``'s replica list may leave this master something to do
    beyond following it: acknowledge or roll back (the leader, for an unacknowledged
    version), fetch, register, drop a copy held beyond the placement, or find out why its
    registered copy left the list. ``session``: the current ZooKeeper session (0: none)."""
    if leader and not entry.acked:
        return True
    target = chosen(me, key, entry.rf, known)
    if me in entry.holders:
        return not target or entry.registered != session or not session
    return target or entry.registered != 0


def in_motion(me: str, key: str, entry: Held, known: Collection[str], leader: bool,
              holding: Set[str] | None = None) -> bool:
    """Whether ``key``'s replica list is due to move in a way this master acts on or reports:
    under-replicated (counting only ``holding``'s nodes, when given), unacknowledged (the
    leader), or held here beyond its placement."""
    holders = entry.holders if holding is None else counted(entry.holders, holding)
    if len(holders) < entry.rf or (leader and not entry.acked):
        return True
    if me in entry.holders:
        return not chosen(me, key, entry.rf, known)
    return False


class Local(enum.Enum):
    """What the local store holds of the committed version."""

    #: Nothing.
    ABSENT = "absent"
    #: A copy whose size and digest match the record.
    PRESENT = "present"
    #: A copy verified and registered in this session, its record unchanged since: not
    #: looked at again beyond being on disk.
    TRUSTED = "trusted"
    #: A copy whose size or digest differ from the record: of an earlier incarnation of the
    #: key, or of a commit that never was.
    DIFFERS = "differs"


class Action(enum.Enum):
    NOTHING = "nothing"
    #: Fetch the committed version from a holder, then register it.
    FETCH = "fetch"
    #: Make our replica node of the committed version exist in this session.
    REGISTER = "register"
    #: Drop our copy (held beyond the placement, every chosen holder has it).
    DROP = "drop"


@dataclass(frozen=True)
class Facts:
    """One key as this master sees it now."""

    key: str
    #: The committed version and its replication factor (asked for, not capped).
    seq: int
    rf: int
    #: The masters holding ``seq`` whose replica nodes count (see counted).
    holders: tuple[str, ...]
    #: This master's replica nodes listed, as (node name, version).
    own_nodes: tuple[tuple[str, int], ...]
    local: Local
    #: The session in which our replica node of ``seq`` was verified (0: not), and the current
    #: one (0: none).
    registered: int
    session: int
    identity: str
    known: frozenset[str]
    leader: bool


@dataclass(frozen=True)
class Plan:
    """What to do about one key, in this order."""

    #: Delete the local copy that differs from the record, but only where ZooKeeper holds
    #: this store's cluster; otherwise do nothing at all (ha-rule 10).
    discard_local: bool = False
    #: Our replica nodes to remove (name, version): of other versions, or of one not held.
    drop_nodes: tuple[tuple[str, int], ...] = ()
    #: Ask the leader's duty first (acknowledge or roll back); if it changed the key's state,
    #: stop there (its watch brings the key back).
    leader_duty: bool = False
    action: Action = Action.NOTHING
    #: Remove versions older than the retained window, and debris above the committed one.
    prune: bool = False
    #: The holders the placement chooses, best first (for the log line of a drop).
    targets: tuple[str, ...] = ()


def decide(f: Facts) -> Plan:
    """Turn (committed state, holders, local copy, placement) into a plan."""
    discard = f.local is Local.DIFFERS
    has_local = f.local in (Local.PRESENT, Local.TRUSTED)
    drop_nodes = tuple((name, seq) for name, seq in f.own_nodes if not has_local or seq != f.seq)
    registered = 0 if any(seq == f.seq for _, seq in drop_nodes) else f.registered
    rf = min(f.rf, max(len(f.known), 1))
    targets = placement.choose(f.key, f.known, rf)
    me = f.identity
    prune = False
    if has_local:
        others = [h for h in f.holders if h != me]
        if me not in targets and set(targets) <= set(f.holders) and len(others) >= rf:
            # Lowering R or a membership change: drop extras only once the set is complete.
            action = Action.DROP
        else:
            prune = f.local is not Local.TRUSTED
            done = registered == f.session and f.session
            action = Action.NOTHING if done else Action.REGISTER
    elif me in targets:
        action = Action.FETCH
    else:
        action, prune = Action.NOTHING, True
    return Plan(discard_local=discard, drop_nodes=drop_nodes, leader_duty=f.leader,
                action=action, prune=prune, targets=tuple(targets))


__all__ = ["Action", "Facts", "Held", "Local", "Plan", "chosen", "counted", "decide", "has_work",
           "in_motion"]
