"""How long a master has been cut off from ZooKeeper, from its connection's states."""

from __future__ import annotations

import time

from kazoo.client import KazooClient, KazooState


class CutOffClock:
    """Since when the connection has been out of touch with ZooKeeper.

    SUSPENDED starts the clock (kazoo says so once a server stopped answering for its read
    timeout, two thirds of the session timeout); CONNECTED stops it. LOST means the session
    has ended: anything may have been committed since it was last in touch, so the clock
    counts from a whole session timeout back."""

    def __init__(self, zk: KazooClient, session_timeout: float) -> None:
        self.session_timeout = session_timeout
        self._since: float | None = (None if zk.state == KazooState.CONNECTED
                                     else time.monotonic())
        zk.add_listener(self._on_state)

    def _on_state(self, state: str) -> None:
        # kazoo's event thread: one assignment, nothing that waits.
        now = time.monotonic()
        if state == KazooState.CONNECTED:
            self._since = None
        elif state == KazooState.LOST:
            self._since = min(self._since or now, now - self.session_timeout)
        elif self._since is None:
            self._since = now

    def seconds(self) -> float:
        """Seconds since the connection was last in touch; 0 while it is."""
        since = self._since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)
