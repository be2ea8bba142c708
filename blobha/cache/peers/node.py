"""This process's part in peer serving: its piece server (started once, on the first download
with peers on), the TLS it serves and fetches with, and its announcements to the masters of
the versions it holds whole."""

from __future__ import annotations

import json
import logging
import ssl
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from blobha.cache.peers.fetch import FetchFailed, PeerFetch
from blobha.cache.peers.server import PeerServer, Served, advertised_host
from blobha.cache.peers.settings import PeerSettings
from blobha.core.errors import BlobError, ChecksumMismatch, NotAuthorized

if TYPE_CHECKING:
    from blobha.client import BlobInfo, Client, ProgressCallback

__all__ = ["PeerNode", "distrusted_peers", "node", "serve_installed"]

log = logging.getLogger("blobha.cache.peers")

#: Seconds between a cache's announcements of what it holds (the masters forget after 60).
ANNOUNCE_EVERY = 20.0
#: Seconds a peer that served a piece failing its SHA-256 is asked for nothing at all: no
#: accident makes a piece read from a verified file miss it, so it lied.
DISTRUST_SECS = 3600.0

_lock = threading.Lock()
#: One node per TLS setting (a process talking to two clusters serves each its own way).
_nodes: dict[tuple[str | None, str | None, str | None], PeerNode] = {}


class PeerNode:
    def __init__(self, settings: PeerSettings, server: PeerServer | None,
                 peer_tls: ssl.SSLContext | None, use_peers: bool) -> None:
        self.settings = settings
        self.server = server
        self.peer_tls = peer_tls
        self.use_peers = use_peers
        # (key, version) -> (last use, client to announce with)
        self._held: dict[tuple[str, int], tuple[float, Client]] = {}
        # peer address -> until when it is distrusted (monotonic)
        self._liars: dict[str, float] = {}
        self._wake = threading.Event()
        threading.Thread(target=self._announce, name="blobha-peer-announce",
                         daemon=True).start()

    @property
    def address(self) -> str:
        return self.server.address if self.server is not None else ""

    def fetch(self, client: Client, key: str, target: Path,
              progress: ProgressCallback | None = None
              ) -> tuple[BlobInfo, Served | None, int] | None:
        """Download the key's current version into ``target`` through peers and the
        replicas, with the bytes peers served; None when plans cannot be had (an older
        master, say): the caller then downloads as before."""
        try:
            plan = client.peer_plan(key, 0, self.address, False)
        except NotAuthorized:
            raise
        except BlobError as e:
            log.info("no peer plan for %r (%s): downloading from the masters", key, e)
            return None
        pieces = max(1, -(-plan.size // plan.chunk_size)) if plan.chunk_size > 0 else 0
        if plan.chunk_size <= 0 or (plan.size and (
                len(plan.chunk_digests) != pieces or len(plan.chunk_sha256) != pieces)):
            # No SHA-256 of the chunks (an older master): nothing to check a peer's piece
            # against that a peer cannot forge, so none is taken.
            return None
        log.info("plan for %r: peers %s replicas %s", key, plan.peers, plan.replicas)
        job = PeerFetch(client, key, target, plan, self.server, self.use_peers,
                        self.settings.parallel, self.peer_tls, self.address,
                        progress=progress, distrust=self.distrusted())
        try:
            info = job.run()
        except (FetchFailed, ChecksumMismatch) as e:
            log.warning("fetching %r through peers failed (%s): downloading from the masters",
                        key, e)
            if job.served is not None and self.server is not None:
                self.server.withdraw(key, plan.version)
            return None
        finally:
            self._distrust(job.liars, key)
        return info, job.served, job.peer_bytes

    def distrusted(self) -> set[str]:
        """Peers caught serving forged pieces, asked for nothing until their time is up."""
        now = time.monotonic()
        with _lock:
            for peer in [p for p, until in self._liars.items() if until <= now]:
                del self._liars[peer]
            return set(self._liars)

    def _distrust(self, liars: set[str], key: str) -> None:
        for peer in liars:
            log.warning("peer %s served a forged piece of %r (its SHA-256 differs from the"
                        " masters'): none of its pieces is taken for %d s", peer, key,
                        DISTRUST_SECS)
        with _lock:
            for peer in liars:
                self._liars[peer] = time.monotonic() + DISTRUST_SECS

    def installed(self, served: Served | None, path: Path, client: Client) -> None:
        """The version ``served`` is now whole at ``path``: serve it from there, and keep
        telling the masters so."""
        if served is None or self.server is None:
            return
        self.server.offer(Served(served.key, served.version, served.size, served.chunk_size,
                                 served.serve_key, path, None))
        self.used(served.key, served.version, client)
        self._wake.set()

    def used(self, key: str, version: int, client: Client) -> None:
        with _lock:
            self._held[(key, version)] = (time.monotonic(), client)

    def _announce(self) -> None:
        while True:
            self._wake.wait(ANNOUNCE_EVERY)
            self._wake.clear()
            now = time.monotonic()
            with _lock:
                held = list(self._held.items())
            for (key, version), (last, client) in held:
                if now - last > self.settings.announce_secs or self.server is None or not any(
                        s.key == key and s.version == version and s.path.exists()
                        for s in self.server.served()):
                    with _lock:
                        self._held.pop((key, version), None)
                    continue
                try:
                    plan = client.peer_plan(key, version, self.address, True)
                except (BlobError, ValueError) as e:  # ValueError: a closed client
                    log.debug("announcing %r v%d failed: %s", key, version, e)
                    continue
                # The key for this process's address: the first for a version found
                # installed (none before), a new one after the cluster secret was rotated.
                self.server.rekey(key, version, plan.serve_key)


def distrusted_peers() -> set[str]:
    """Peers this process caught serving forged pieces, still distrusted."""
    with _lock:
        nodes = list(_nodes.values())
    return set().union(*(n.distrusted() for n in nodes))


def serve_installed(settings: PeerSettings, client: Client, key: str, version: int,
                    version_dir: Path, path: Path) -> None:
    """A version this process found installed (a cache hit): served to peers too when it
    came through peers (its meta.json says so), and announced: the announcement brings the
    key grants are checked under, for this process's address; until then all are refused."""
    made = node(settings, client)
    if made is None or made.server is None:
        return
    if any(s.key == key and s.version == version and s.have is None and s.path == path
           for s in made.server.served()):
        made.used(key, version, client)
        return
    try:
        record = json.loads((version_dir / "meta.json").read_bytes())
        peer = record["peer"]
        served = Served(key, version, int(record["size"]), int(peer["chunk_size"]), b"",
                        path, None)
    except (OSError, ValueError, KeyError, TypeError):
        return  # installed by a plain download, or by an older release: nothing to serve
    made.installed(served, path, client)


def node(settings: PeerSettings, client: Client) -> PeerNode | None:
    """This process's peer node, made on first use; None when peers are off."""
    creds = getattr(client, "credentials", None)
    if not settings.enabled or creds is None:
        # Off, or a client that dials no masters of its own (a test's fake): nothing to
        # plan with, nor certificates to serve with.
        return None
    which = (creds.ca, creds.cert, creds.key) if creds.tls else (None, None, None)
    with _lock:
        made = _nodes.get(which)
        if made is None:
            made = _nodes[which] = _make(settings, client)
        return made


def _make(settings: PeerSettings, client: Client) -> PeerNode:
    creds = client.credentials
    server_tls: ssl.SSLContext | None = None
    peer_tls: ssl.SSLContext | None = None
    serve = use = creds is not None
    if creds is not None and creds.tls:
        if creds.ca and creds.cert and creds.key:
            from blobha.wire.datatls import server_context

            server_tls = server_context(creds.cert, creds.key, creds.ca,
                                        require_client_cert=False)
            peer_tls = ssl.create_default_context(cafile=creds.ca)
            # Peers are named by address, not by a certificate's name: the cluster CA's
            # signature is what is checked; the grant is what authorises.
            peer_tls.check_hostname = False
        else:
            # A TLS cluster, and no certificate to serve with: no pieces in plaintext.
            serve = use = False
    server = None
    if serve:
        masters = client.addresses()
        host = advertised_host(masters[0]) if masters else "127.0.0.1"
        try:
            server = PeerServer(settings, host, server_tls)
        except OSError as e:
            log.warning("cannot serve pieces to peers (%s): fetching only", e)
    return PeerNode(settings, server, peer_tls, use)
