"""Caps on what one caller's connection, its host, and all callers together may hold at once,
refusing the one beyond at once: for work done before a caller is known (checking a
credential), which no per-user cap can bound."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from blobha.core.errors import Busy

#: The connection the call being authenticated came over (gRPC's peer string), set by the
#: master's gatekeeper around the check: the costly checks are capped per connection and host.
CALLER_PEER: ContextVar[str] = ContextVar("blobha_caller_peer", default="")


def host_of_peer(peer: str) -> str:
    """The host a cap counts a connection against: ``ipv4:10.0.0.1:5000`` -> ``10.0.0.1``;
    an IPv4 address in IPv6 form as that IPv4 address; any other IPv6 address as its /64,
    which one machine or customer usually holds whole (so it cannot take a place per address
    of its own)."""
    host = peer.partition(":")[2].rpartition(":")[0] or peer
    if not peer.startswith("ipv6:"):
        return host
    import ipaddress

    try:
        address = ipaddress.IPv6Address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return host
    if address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(ipaddress.IPv6Network((address, 64), strict=False))


class PeerCaps:
    """At most ``per_connection`` of something per connection (gRPC's peer string, which
    holds the port), ``per_host`` per host and ``total`` in all; :meth:`take` refuses the one
    beyond at once (:class:`Busy`, which clients retry) instead of making it wait."""

    def __init__(self, what: str, total: int, per_connection: int, per_host: int) -> None:
        self.what = what
        self.total = max(1, total)
        self.per_connection = max(1, per_connection)
        self.per_host = max(1, per_host)
        self._lock = threading.Lock()
        self._all = 0
        self._by_peer: dict[str, int] = {}
        self._by_host: dict[str, int] = {}

    def take(self, peer: str) -> str:
        """A place for ``peer``; give it back with :meth:`give`."""
        host = host_of_peer(peer)
        with self._lock:
            if (self._all >= self.total or self._by_peer.get(peer, 0) >= self.per_connection
                    or self._by_host.get(host, 0) >= self.per_host):
                raise Busy(f"this master is busy with {self.what} at the moment; retry shortly")
            self._all += 1
            self._by_peer[peer] = self._by_peer.get(peer, 0) + 1
            self._by_host[host] = self._by_host.get(host, 0) + 1
        return peer

    def give(self, peer: str) -> None:
        host = host_of_peer(peer)
        with self._lock:
            self._all -= 1
            for table, name in ((self._by_peer, peer), (self._by_host, host)):
                left = table.get(name, 1) - 1
                if left > 0:
                    table[name] = left
                else:
                    table.pop(name, None)

    def held(self) -> int:
        with self._lock:
            return self._all




@contextmanager
def costly(caps: PeerCaps) -> Iterator[None]:
    """Hold a place of ``caps`` for the current caller (:data:`CALLER_PEER`) while the block
    runs; :class:`Busy` at once if there is none."""
    peer = caps.take(CALLER_PEER.get() or "unknown")
    try:
        yield
    finally:
        caps.give(peer)
