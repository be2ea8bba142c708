"""Live masters, as registered under ``/masters``, with a grace period for departed ones, and
the masters whose replica nodes count, under ``/holders``.

Placement uses :meth:`Membership.known`: live masters plus those gone for less than the grace
period, so a master that restarts or blips its session does not make others copy its blobs.
Replication counts use :meth:`Membership.holding`: replica nodes are persistent, and a master's
count only while its ``/holders`` node shows that it checked them in its current session.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, KazooException, NodeExistsError, NoNodeError
from kazoo.protocol.states import WatchedEvent

from blobha.core.locks import boot_id
from blobha.store.local import write_json_atomic
from blobha.zk.layout import HOLDERS, MASTERS

# Named, not __name__: operators route it by this name wherever the module sits.
log = logging.getLogger("blobha.sync.membership")


class IdentityInUse(Exception):
    """Another live master is registered under this master's identity (master.advertise)."""


class SessionRecord:
    """The ZooKeeper session of the master using a data directory, recorded in that directory
    (``zk-session``: the session's id and password, readable by the master's user only).

    A master restarted after a crash (SIGKILL, the OOM killer, a lost container) finds its
    predecessor's nodes still there: its membership, its candidacy, its replica nodes, held by
    a session that lives on until its timeout. Nothing may take over the name of a session that
    could still be alive (another master with the same ``master.advertise``). But the process
    that recorded this session used the same data directory, and the directory's lock, which
    the successor now holds, died with it: the recorded session's process is gone for certain.
    The successor then ends that session itself (reconnects with its id and password, and
    closes it), which removes every one of its ephemeral nodes at once. A leader restarted at
    once thus hands over at once instead of after the session timeout, and a follower counts
    as a replica again within a second.

    The lock proves the recorder dead only on the same running kernel and the same directory.
    So the record names both (the kernel's boot id, the directory's device and inode) and is
    the predecessor's only there: a copy of the directory (a restored backup, a cloned machine)
    started as a second master with the same address must not end the running master's
    session, and waits as before; so does a master after a reboot (its session is gone by then,
    or soon). Containers on one host share the kernel, so a re-created container counts.

    The record is written by each registration, which precedes every other ephemeral node of a
    session except, after a session loss, possibly a new candidacy: a crash in that moment costs
    the successor the wait, as before. (Not from a connection listener: it must not block.)"""

    FILE_NAME = "zk-session"

    def __init__(self, directory: Path, end_session: Callable[[int, bytes], bool]) -> None:
        """Made by the holder of the directory's lock, before its first session: what the
        directory names then is the predecessor's session."""
        self.path = directory / self.FILE_NAME
        #: Reconnects to the session with this id and password and closes it: True, or False
        #: if it had expired (raises if it cannot reach ZooKeeper).
        self._end_session = end_session
        # The session recorded last. No lock: registrations run one at a time (at start-up,
        # then on the synchroniser's thread).
        self._saved: int | None = None
        self._place = _place(directory)
        self._predecessor = self.load()

    def save(self, client_id: tuple[int, bytes] | None) -> None:
        """Record the current session, before any ephemeral node of it is created. Best
        effort: without a record, a successor only waits for the session to expire."""
        if not client_id or not client_id[0] or not self._place:
            return
        session, password = client_id
        if self._saved == session:
            return
        record = {"session": session, "password": password.hex(), "place": self._place}
        try:
            # Not synced: a record lost in a machine crash only costs the wait, and the session
            # has expired by the time the machine is back anyway.
            write_json_atomic(self.path, record, sync=False, mode=0o600)
        except OSError as e:
            log.warning("cannot record the ZooKeeper session in %s (%s): a master restarted on"
                        " this directory after a crash will wait for the session to expire",
                        self.path, e)
            return
        self._saved = session

    def load(self) -> tuple[int, bytes] | None:
        """The session recorded on this kernel for this directory, if any (a record that
        cannot be read, or was written elsewhere, is no record)."""
        try:
            data = json.loads(self.path.read_bytes())
            if not self._place or data["place"] != self._place:
                return None
            return int(data["session"]), bytes.fromhex(data["password"])
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None

    def end_predecessor(self) -> None:
        """End the recorded session now, before this process has one: called by the holder of
        the directory's lock before its store loads, which takes longer the more it stores,
        so a leader restarted at once hands over at once whatever its size. If ZooKeeper
        cannot be reached, the record stays for :meth:`end_if_predecessors`."""
        recorded = self._predecessor
        if recorded is not None and self._end(recorded):
            self._predecessor = None

    def end_if_predecessors(self, owner: int) -> bool:
        """End session ``owner`` if it is the one the previous process on this directory
        recorded: whether it is gone now. Tried once: the record is dropped either way."""
        recorded = self._predecessor
        if recorded is None or recorded[0] != owner or owner == self._saved:
            return False
        self._predecessor = None
        return self._end(recorded)

    def _end(self, recorded: tuple[int, bytes]) -> bool:
        """End ``recorded``: whether it is gone now (ended, or expired before)."""
        session = recorded[0]
        try:
            ended = self._end_session(*recorded)
        except Exception as e:
            log.warning("could not end session 0x%x of this data directory's previous master"
                        " (%s): waiting for it to expire", session, e)
            return False
        if ended:
            log.info("ended ZooKeeper session 0x%x of this data directory's previous master,"
                     " which is gone: its nodes went with it", session)
        else:
            log.info("session 0x%x of this data directory's previous master has expired",
                     session)
        return True


def _place(directory: Path) -> str:
    """This kernel and directory: where a record is valid ('' if either is unknown)."""
    boot = boot_id()
    try:
        st = os.stat(directory)
    except OSError:
        return ""
    return f"{boot}:{st.st_dev}:{st.st_ino}" if boot else ""


class Membership:
    def __init__(
        self, zk: KazooClient, identity: str, grace_secs: float, on_change: Callable[[], None],
        info: dict[str, object], claim_secs: float = 0.0,
        record: SessionRecord | None = None, on_leave: Callable[[str], None] | None = None,
    ) -> None:
        self.zk = zk
        #: Where this process records its sessions, and finds its predecessor's.
        self.record = record
        self.identity = identity
        self.grace_secs = grace_secs
        self._on_change = on_change
        #: Called with each master seen leaving (before on_change), outside the lock.
        self._on_leave = on_leave
        self._info = info
        #: How long a first registration waits for a node of our name held by a session not
        #: of this process to go away (see register).
        self.claim_secs = claim_secs
        # The sessions in which this process registered: a node of our name under one of
        # them is ours to replace.
        self._sessions: set[int] = set()
        self._lock = threading.Lock()
        self._live: set[str] = set()
        #: The masters under /holders (see holding).
        self._holding: frozenset[str] = frozenset()
        self._gone: dict[str, float] = {}  # address -> monotonic time it left
        # Every master seen leaving since the last take_departed(), even one already back: its
        # session ended, and its replica nodes with it.
        self._departed: set[str] = set()

    def register(self, wait: bool = False) -> None:
        """(Re-)create our ephemeral node for the current session (ha-rule 6).

        A node of our name may already be there. Under an earlier session of this process it
        is ours: it is replaced at once. Under any other session it is either a predecessor's
        (a master that ran with this identity and died, its session not expired yet) or a
        live master's with the same ``master.advertise``. The first goes within its session
        timeout, or at once when this data directory's record names it (see SessionRecord);
        the second never does, and two masters under one identity would take each other's
        replica nodes away in turn. So it is never deleted: with ``wait``, up to
        ``claim_secs`` pass for it to go; then, or at once without ``wait``, IdentityInUse."""
        path = f"{MASTERS}/{self.identity}"
        data = json.dumps(self._info).encode()
        client_id = self.zk.client_id
        session = client_id[0] if client_id else None
        if self.record is not None:
            self.record.save(client_id)
        deadline = time.monotonic() + (self.claim_secs if wait else 0.0)
        announced = False
        gone = threading.Event()  # set by a watch on the node: it went (or changed)
        while True:
            try:
                self.zk.create(path, data, ephemeral=True, makepath=True)
                break
            except NodeExistsError:
                pass
            gone.clear()
            try:
                held, stat = self.zk.get(path, watch=lambda event: gone.set())
            except NoNodeError:
                continue  # went meanwhile
            owner = stat.ephemeralOwner
            if owner == session:
                break
            if owner in self._sessions:
                with contextlib.suppress(NoNodeError, BadVersionError):
                    self.zk.delete(path, version=stat.version)
                continue
            if self.record is not None and self.record.end_if_predecessors(owner):
                # Our server may not have applied the close yet: catch up, then look again.
                with contextlib.suppress(KazooException):
                    self.zk.sync(path)
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise IdentityInUse(self._claim_error(held, owner, wait))
            if not announced:
                log.info("%s is registered under ZooKeeper session 0x%x, not one of ours:"
                         " waiting up to %.0f s for it to expire", self.identity, owner, left)
                announced = True
            gone.wait(left)
        if session:
            self._sessions.add(session)
        self.refresh()

    def _claim_error(self, held: bytes, owner: int, waited: bool) -> str:
        holder = ""
        with contextlib.suppress(ValueError, AttributeError):
            info = json.loads(held)  # the other master's registration (see __init__'s info)
            holder = f" (pid {info.get('pid')} on {info.get('host')})"
        after = f" and did not go away within {self.claim_secs:.0f} s" if waited else ""
        return (f"another master{holder} is registered as {self.identity} under ZooKeeper"
                f" session 0x{owner:x}{after}: each master needs a master.advertise address"
                " of its own; stop the other master or change this one's")

    def refresh(self, timeout: float | None = None) -> None:
        """Read the masters' list again. ``timeout``: seconds to wait for ZooKeeper's answer
        (KazooTimeoutError after it) where the caller holds a lock others need; kazoo holds a
        call made while it reconnects until the connection is back."""
        masters = self.zk.get_children_async(MASTERS, watch=self._on_watch)
        holders = self.zk.get_children_async(HOLDERS, watch=self._on_watch)
        children = set(masters.get(timeout=timeout))
        try:
            holding = frozenset(holders.get(timeout=timeout))
        except NoNodeError:
            holding = frozenset()  # made by the first master of this version to start
        now = time.monotonic()
        with self._lock:
            changed = children != self._live or holding != self._holding
            for gone in self._holding - holding:
                log.info("the replicas of master %s no longer count (its session ended)", gone)
            self._holding = holding
            left = self._live - children
            for gone in left:
                self._gone[gone] = now
                self._departed.add(gone)
                log.warning("master %s left the cluster", gone)
            for back in children - self._live:
                self._gone.pop(back, None)
            self._live = children
        if self._on_leave is not None:
            for gone in sorted(left):
                self._on_leave(gone)
        if changed:
            self._on_change()

    def _on_watch(self, event: WatchedEvent) -> None:
        # Event thread: only hand off.
        threading.Thread(target=self._safe_refresh, name="membership", daemon=True).start()

    def _safe_refresh(self) -> None:
        try:
            self.refresh()
        except Exception:
            log.exception("membership refresh failed; the periodic reconcile retries")

    def live(self) -> set[str]:
        with self._lock:
            return set(self._live)

    def holding(self) -> frozenset[str]:
        """The masters whose replica nodes count: each checked its nodes against its disk in
        its current session (see :meth:`hold`). A dead master's nodes stay in ZooKeeper and
        count again once it has checked them after its return."""
        with self._lock:
            return self._holding

    def hold(self) -> None:
        """Announce that this master's replica nodes count (the ephemeral ``/holders`` node),
        once it has checked them in this session (:func:`blobha.sync.verify.check_own_nodes`).
        Called after :meth:`register`, which claimed the identity: a node of our name under
        another session is then an earlier session's of this master (or its predecessor's,
        which register ended), and is replaced."""
        path = f"{HOLDERS}/{self.identity}"
        client_id = self.zk.client_id
        session = client_id[0] if client_id else None
        for _ in range(5):
            try:
                self.zk.create(path, b"", ephemeral=True, makepath=True)
                break
            except NodeExistsError:
                pass
            try:
                stat = self.zk.exists(path)
            except NoNodeError:
                continue
            if stat is None:
                continue
            if stat.ephemeralOwner == session:
                break
            with contextlib.suppress(NoNodeError, BadVersionError):
                self.zk.delete(path, version=stat.version)
        else:
            raise KazooException(f"{path} kept being re-created by another session")
        self.refresh()

    def take_departed(self) -> set[str]:
        """The masters seen leaving since the last call."""
        with self._lock:
            departed, self._departed = self._departed, set()
        return departed

    def known(self) -> set[str]:
        """Live masters plus those gone for less than the grace period."""
        now = time.monotonic()
        with self._lock:
            for addr, left in list(self._gone.items()):
                if now - left >= self.grace_secs:
                    del self._gone[addr]
            return self._live | set(self._gone)

    def next_grace_expiry(self) -> float | None:
        """Seconds until a departed master stops counting, if any."""
        now = time.monotonic()
        with self._lock:
            if not self._gone:
                return None
            return max(0.0, min(left + self.grace_secs - now for left in self._gone.values()))
