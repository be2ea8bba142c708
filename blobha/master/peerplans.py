"""Plans for node caches fetching from each other: the version, its chunk digests (SHA-256,
which pieces from peers are checked against), the replicas, some peers, a grant for each
peer bound to the caller's host, and the key the caller's own cache checks grants under (see
blobha.core.grants)."""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Callable

from blobha.core.consistency import MinVersion, View
from blobha.core.errors import InvalidArgument
from blobha.core.grants import (
    GRANT_SECS,
    MAX_GRANT_SECS,
    host_key,
    make_grant,
    peer_root,
    serve_key,
)
from blobha.master.chunkhashes import ChunkHashes
from blobha.master.holders import Holders
from blobha.master.reads import Reads
from blobha.wire.status import PeerPlan

__all__ = ["LONGEST_GRANT_SECS", "MAX_PEERS", "PeerPlans", "caller_host"]

#: Peers one plan names at most: enough sources to fill a link, few enough that every peer
#: of a large fleet is named about as often as the others.
MAX_PEERS = 8
_MAX_ADDRESS = 300
#: The longest grant a master makes, whatever blobstore.peer.grant.secs says: peers refuse
#: one ending more than MAX_GRANT_SECS ahead of their clock, and this leaves a peer's clock
#: GRANT_SECS of room behind the master's.
LONGEST_GRANT_SECS = MAX_GRANT_SECS - GRANT_SECS

def caller_host(peer: str) -> str:
    """The host of a gRPC peer string as grants name it (blobha.core.grants.host_key); ""
    for one that names no IP address (a Unix socket, nothing known)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return ""
    # gRPC writes an IPv6 peer's brackets percent-encoded: ipv6:%5B::1%5D:5000.
    return host_key(urllib.parse.unquote(rest).rpartition(":")[0])


class PeerPlans:
    def __init__(self, identity: str, reads: Reads, secret: Callable[[], str],
                 grant_secs: float = GRANT_SECS, holders: Holders | None = None) -> None:
        self.identity = identity
        self.reads = reads
        self._secret = secret  # asked per plan: loaded from ZooKeeper after start
        self.grant_secs = min(grant_secs, LONGEST_GRANT_SECS)
        self.holders = holders or Holders()
        self.hashes = ChunkHashes(reads.store.read)

    def plan(self, user: str, key: str, version: int, address: str, complete: bool,
             minimum: MinVersion | None = None, view: View = View.SESSION,
             caller: str = "") -> PeerPlan:
        """``caller``: the gRPC peer the call came from (``ipv4:10.0.0.1:5000``); grants are
        bound to the host it names ("": none are made)."""
        if len(address) > _MAX_ADDRESS or (address and ":" not in address):
            raise InvalidArgument(f"peer_address must be host:port, not {address[:80]!r}")
        # READ is checked here, as for Download; the version must be held by this master
        # (its chunk digests come from its store), else "not held here".
        info, created_at = self.reads.version_for_read(user, key, version, minimum, view)
        status = self.reads.get_replication(user, key, minimum, view)
        replicas = status.holders if status.version == info.seq else (self.identity,)
        peers = self.holders.pick(key, info.seq, address, MAX_PEERS)
        ordinal = (self.holders.announce(key, info.seq, address, complete, user)
                   if address else 0)
        root = peer_root(self._secret())
        # The caller's key opens its own cache only (the address it announced, run as its
        # user): a reader cannot make grants that another cache accepts, not even by
        # announcing that cache's address (nothing verifies it) to be given a key for it.
        own = serve_key(root, key, info.seq, info.digest, address, user) if address else b""
        # Bound to the host this master saw the call come from, not to one the caller names:
        # a grant taken elsewhere (a sniffed request, say) is refused by every peer. None
        # when the host is unknown: the caller then fetches from the replicas only.
        requester = caller_host(caller)
        expires = float(int(time.time() + self.grant_secs))
        grants: list[tuple[str, str]] = []
        for p in peers if requester else ():
            # Under the key of the user who announced the peer: the key its cache holds.
            owner = self.holders.announcer(key, info.seq, p)
            if owner is not None:
                grants.append((p, make_grant(serve_key(root, key, info.seq, info.digest, p,
                                                       owner),
                                             user, key, info.seq, expires, requester).mac))
        # From this master's own bytes: a cache trusts the masters, never another cache.
        sha256 = self.hashes.get(key, info.seq, info.digest)
        return PeerPlan(key, info.seq, info.size, info.digest, created_at, info.chunk_size,
                        info.chunks, tuple(replicas), tuple(peers), own, user, expires,
                        ordinal, sha256, requester, tuple(grants))
