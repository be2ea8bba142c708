"""Node caches serving each other: a blob reaches N nodes in about the time it reaches one.

A cache that downloads asks a master for a plan (blobha.client.peering), fetches 1 MiB pieces
from the peers it names and from the replicas (:mod:`.fetch`, choosing with :mod:`.schedule`),
checks every piece against the version's chunk digest, and serves the pieces it holds to
other caches that present a grant (:mod:`.server`, wire format in :mod:`.wire`). See
docs/cache.md, "Peer serving"."""

from __future__ import annotations

from blobha.cache.peers.settings import PeerSettings

__all__ = ["PeerSettings"]
