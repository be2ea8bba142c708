"""A node cache's calls for fetching from its peers: the plan, from the master the key hashes
to, and ranged reads of one version from a chosen replica."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from blobha.client.download import DownloadJob
from blobha.client.retry import Deadline
from blobha.client.routing import Router
from blobha.client.sources import Sink
from blobha.core.errors import KeyNotFound, Unavailable
from blobha.v1 import blobha_pb2 as pb
from blobha.wire.convert import peer_plan_from_pb
from blobha.wire.status import PeerPlan

__all__ = ["peer_plan", "planning_order", "read_range"]


def planning_order(key: str, addresses: list[str]) -> list[str]:
    """The masters in the order a cache asks them for plans of ``key``: by rendezvous hash,
    so every cache of one key announces to the same master (each master knows only the
    caches that announced to it), and a key's caches move to the same next one when it is
    down."""
    def rank(address: str) -> bytes:
        return hashlib.sha256(f"{key}\0{address}".encode()).digest()

    return sorted(set(addresses), key=rank)


def peer_plan(router: Router, key: str, version: int, address: str, complete: bool
              ) -> PeerPlan:
    request = pb.PeerPlanRequest(key=key, version=version, peer_address=address,
                                 complete=complete)
    deadline = Deadline(router.timeout)
    order: list[str] = []

    def attempt() -> PeerPlan:
        if not order:
            order.extend(planning_order(key, router.known_addresses()))
        target = order[0]
        router.with_minimum(key, request)
        try:
            answer = router.control_call(target, "PeerPlan", request, deadline)
        except Unavailable:
            order.pop(0)  # the next master in the key's order
            raise
        except KeyNotFound as exc:
            # This master does not hold the version (yet): the next one in the key's order
            # answers; caches meet there until the first has its copy.
            if not str(exc).startswith("not held here") or len(order) <= 1:
                raise
            order.pop(0)
            raise Unavailable(str(exc)) from None
        return peer_plan_from_pb(key, answer)

    return router.retry(f"plan a peer fetch of {key!r}", deadline, attempt)


class _CallbackSink(Sink):
    def __init__(self, on_data: Callable[[memoryview], object]) -> None:
        self._on_data = on_data

    def write(self, data: bytes | memoryview) -> None:
        self._on_data(memoryview(data))


def read_range(router: Router, key: str, version: int, offset: int, length: int,
               prefer: str, on_data: Callable[[memoryview], object]) -> None:
    """``length`` bytes of ``key`` v``version`` from ``offset``, from ``prefer`` first (then
    the other replicas, resuming where it stopped). The caller checks them (chunk digests):
    a ranged download is verified chunk by chunk by the master, not whole."""
    job = DownloadJob(router, key, _CallbackSink(on_data), version, offset, length, None)
    job.candidates = [prefer]
    job.run()
