"""Live masters, as registered under ``/masters``, with a grace period for departed ones.

Placement uses :meth:`Membership.known`: live masters plus those gone for less than the grace
period, so a master that restarts or blips its session does not make others copy its blobs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable

from kazoo.client import KazooClient
from kazoo.exceptions import NodeExistsError, NoNodeError
from kazoo.protocol.states import WatchedEvent

from blobha.zkstate import MASTERS

log = logging.getLogger(__name__)


class Membership:
    def __init__(
        self, zk: KazooClient, identity: str, grace_secs: float, on_change: Callable[[], None],
        info: dict[str, object],
    ) -> None:
        self.zk = zk
        self.identity = identity
        self.grace_secs = grace_secs
        self._on_change = on_change
        self._info = info
        self._lock = threading.Lock()
        self._live: set[str] = set()
        self._gone: dict[str, float] = {}  # address -> monotonic time it left
        # Every master seen leaving since the last take_departed(), even one already back: its
        # session ended, and its replica nodes with it.
        self._departed: set[str] = set()

    def register(self) -> None:
        """(Re-)create our ephemeral node for the current session (ha-rule 6)."""
        path = f"{MASTERS}/{self.identity}"
        data = json.dumps(self._info).encode()
        session = self.zk.client_id[0] if self.zk.client_id else None
        try:
            self.zk.create(path, data, ephemeral=True, makepath=True)
        except NodeExistsError:
            stat = self.zk.exists(path)
            if stat is not None and stat.ephemeralOwner != session:
                # Left over from our previous session, which ZooKeeper has not expired yet.
                with contextlib.suppress(NoNodeError):
                    self.zk.delete(path)
                self.zk.create(path, data, ephemeral=True, makepath=True)
        self.refresh()

    def refresh(self) -> None:
        children = set(self.zk.get_children(MASTERS, watch=self._on_watch))
        now = time.monotonic()
        with self._lock:
            changed = children != self._live
            for gone in self._live - children:
                self._gone[gone] = now
                self._departed.add(gone)
                log.warning("master %s left the cluster", gone)
            for back in children - self._live:
                self._gone.pop(back, None)
            self._live = children
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
