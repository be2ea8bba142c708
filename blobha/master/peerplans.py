"""Plans for node caches fetching from each other: the version, its chunk digests (SHA-256,
which pieces from peers are checked against), the replicas, some peers, and a grant the peers
accept (see blobha.core.grants)."""

from __future__ import annotations

import time
from collections.abc import Callable

from blobha.core.consistency import MinVersion, View
from blobha.core.errors import InvalidArgument
from blobha.core.grants import GRANT_SECS, make_grant, peer_root, version_key
from blobha.master.chunkhashes import ChunkHashes
from blobha.master.holders import Holders
from blobha.master.reads import Reads
from blobha.wire.status import PeerPlan

__all__ = ["MAX_PEERS", "PeerPlans"]

#: Peers one plan names at most: enough sources to fill a link, few enough that every peer
#: of a large fleet is named about as often as the others.
MAX_PEERS = 8
_MAX_ADDRESS = 300


class PeerPlans:
    def __init__(self, identity: str, reads: Reads, secret: Callable[[], str],
                 grant_secs: float = GRANT_SECS, holders: Holders | None = None) -> None:
        self.identity = identity
        self.reads = reads
        self._secret = secret  # asked per plan: loaded from ZooKeeper after start
        self.grant_secs = grant_secs
        self.holders = holders or Holders()
        self.hashes = ChunkHashes(reads.store.read)

    def plan(self, user: str, key: str, version: int, address: str, complete: bool,
             minimum: MinVersion | None = None, view: View = View.SESSION) -> PeerPlan:
        if len(address) > _MAX_ADDRESS or (address and ":" not in address):
            raise InvalidArgument(f"peer_address must be host:port, not {address[:80]!r}")
        # READ is checked here, as for Download; the version must be held by this master
        # (its chunk digests come from its store), else "not held here".
        info, created_at = self.reads.version_for_read(user, key, version, minimum, view)
        status = self.reads.get_replication(user, key, minimum, view)
        replicas = status.holders if status.version == info.seq else (self.identity,)
        peers = self.holders.pick(key, info.seq, address, MAX_PEERS)
        ordinal = self.holders.announce(key, info.seq, address, complete) if address else 0
        vkey = version_key(peer_root(self._secret()), key, info.seq, info.digest)
        grant = make_grant(vkey, user, key, info.seq, time.time() + self.grant_secs)
        # From this master's own bytes: a cache trusts the masters, never another cache.
        sha256 = self.hashes.get(key, info.seq, info.digest)
        return PeerPlan(key, info.seq, info.size, info.digest, created_at, info.chunk_size,
                        info.chunks, tuple(replicas), tuple(peers), vkey, grant.user,
                        grant.expires, grant.mac, ordinal, sha256)
