"""The cluster secret as one master holds it, and which secrets it accepts from a caller that
claims to be a master (:class:`blobha.wire.authn.ServerAuthentication`).

A rotation (``blobha admin rotate-secret``, or the lock-down of an open tree) reaches a master
through its watch on ``/master-secret``; a master cut from ZooKeeper does not see it. So what
a master accepts is bounded by what it has confirmed with ZooKeeper, ``window`` seconds (twice
the session timeout) being the bound throughout:

* the secret a rotation replaced: for ``window`` after this master learnt of the rotation,
  then never again, whatever becomes of the connection; not at all when it learnt of it only
  after its connection was lost (the rotation may be older than the window by then);
* the secrets it holds, once its connection is lost: for ``window`` after the loss, since a
  rotation meanwhile would not reach it; then none at all until it has read the secret again
  on a connection (the other masters refuse the replaced secret ``window`` after the
  rotation, so no secret is accepted anywhere longer than that after it was replaced);
* after its session expired (its watch ended with it): none at all until it has read the
  secret again on the new session. kazoo's DataWatch reads again after a reconnect but tells
  nothing when the secret did not change, so the reads here are this module's own.

One thread makes every read, one after another, so a slow read cannot put back a secret that
a later one replaced; it reads at start, at every (re)connection and at every watch event.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import KazooException, NodeExistsError
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.protocol.states import KazooState

from blobha.core.auth import new_cluster_secret
from blobha.zk.layout import MASTER_SECRET

__all__ = ["ClusterSecret"]

log = logging.getLogger("blobha.master")

#: Seconds between tries of a read that failed while the connection was up.
_RETRY_SECS = 1.0


class ClusterSecret:
    """``on_change`` gets each new secret (what this master sends to the others)."""

    def __init__(self, zk: KazooClient, on_change: Callable[[str], None], window: float,
                 read_timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._zk = zk
        self._on_change = on_change
        self.window = window
        self._read_timeout = read_timeout
        self._clock = clock
        self._lock = threading.Lock()
        self._current = ""
        self._previous = ""
        self._previous_until = 0.0
        # None: confirmed (read on the connection that is up, watched since); else when trust
        # in the secrets held ends (clock), which may have passed.
        self._trusted_until: float | None = 0.0
        self._distrust_said = False
        # Bumped at every change of the connection's state: a read that started before one
        # confirms nothing.
        self._generation = 0
        self._pending = False
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None

    # ---- what the master sends and accepts ---------------------------------------------------

    @property
    def current(self) -> str:
        """The newest secret this master read: what it sends, confirmed or not."""
        return self._current

    def accepted(self) -> tuple[str, str]:
        """(the current secret, the one a rotation replaced) as far as a caller may prove
        itself with them now; "" for each that may not be used."""
        with self._lock:
            now = self._clock()
            if self._trusted_until is not None and now >= self._trusted_until:
                if not self._distrust_said:
                    self._distrust_said = True
                    log.error("the cluster secret could not be confirmed with ZooKeeper for"
                              " %.0f s (connection or session lost): no call as the masters"
                              " is accepted until it is read again", self.window)
                return "", ""
            return self._current, self._previous if now < self._previous_until else ""

    # ---- reading ---------------------------------------------------------------------------

    def load(self) -> None:
        """Create the secret if there is none (the first master), read it, and keep it
        current from then on. Raises what ZooKeeper raised for the first read."""
        with contextlib.suppress(NodeExistsError):
            self._zk.create(MASTER_SECRET, new_cluster_secret().encode())
        # Listening first: a change of the connection during the first read is not missed.
        self._zk.add_listener(self._state_changed)
        self._read()
        self._thread = threading.Thread(target=self._run, name="cluster-secret", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stopped = True
        self._zk.remove_listener(self._state_changed)
        self._wake.set()

    def _state_changed(self, state: str) -> None:
        # kazoo's connection thread: note what it means for trust; the reader thread reads.
        with self._lock:
            self._generation += 1
            now = self._clock()
            if state == KazooState.SUSPENDED and self._trusted_until is None:
                self._trusted_until = now + self.window
            elif state == KazooState.LOST:
                # The watch is gone with the session: nothing held is trusted until read again.
                self._trusted_until = (now if self._trusted_until is None
                                       else min(self._trusted_until, now))
        if state == KazooState.CONNECTED:
            self._request()

    def _watched(self, event: Any) -> None:
        self._request()

    def _request(self) -> None:
        self._pending = True
        self._wake.set()

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait(timeout=_RETRY_SECS if self._pending else None)
            self._wake.clear()
            if self._stopped:
                return
            if not self._pending or self._zk.state != KazooState.CONNECTED:
                continue  # a (re)connection wakes this thread again
            self._pending = False
            try:
                self._read()
            except (KazooException, KazooTimeoutError) as e:
                self._pending = True
                log.info("could not read the cluster secret (%s); trying again", e)
            except Exception:
                self._pending = True
                log.exception("could not read the cluster secret; trying again")

    def _read(self) -> None:
        with self._lock:
            generation = self._generation
        data, _ = self._zk.get_async(MASTER_SECRET, watch=self._watched).get(
            timeout=self._read_timeout)
        self._apply(data.decode() if data else "", generation)

    def _apply(self, secret: str, generation: int) -> None:
        changed = False
        with self._lock:
            if secret and secret != self._current:
                changed = True
                if self._current and self._trusted_until is None:
                    self._previous = self._current
                    self._previous_until = self._clock() + self.window
                    log.warning("the cluster secret was rotated; the old one is accepted for"
                                " %.0f s more", self.window)
                elif self._current:
                    # Learnt after a loss of the connection: the rotation may be older than
                    # the window already, so the old secret gets none here.
                    self._previous, self._previous_until = "", 0.0
                    log.warning("the cluster secret was rotated while this master was cut from"
                                " ZooKeeper; the old one is refused from now on")
                self._current = secret
            if (secret and generation == self._generation
                    and self._zk.state == KazooState.CONNECTED):
                if self._trusted_until is not None and self._distrust_said:
                    log.warning("the cluster secret was read again: calls as the masters are"
                                " accepted again")
                self._trusted_until = None
                self._distrust_said = False
            elif secret:
                self._pending = True  # the connection changed meanwhile: read again
                self._wake.set()
        if changed:
            self._on_change(secret)
