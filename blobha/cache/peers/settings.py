"""Peer serving's settings: constructor arguments, else environment variables, else defaults."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from blobha.core.errors import InvalidArgument

__all__ = ["PeerSettings"]

MiB = 1024 * 1024


@dataclass(frozen=True)
class PeerSettings:
    #: Serve pieces to other caches and fetch from them (``BLOBHA_CACHE_PEERS``, 1/0).
    enabled: bool = True
    #: Port the piece server listens on (``BLOBHA_CACHE_PEER_PORT``; 0: any free one).
    port: int = 0
    #: Bytes per second the node uploads to peers at most (``BLOBHA_CACHE_PEER_UPLOAD_BPS``):
    #: link-agnostic; lower it where a node's uplink is needed for other work.
    upload_bytes_per_sec: int = 100 * MiB
    #: Connections served at once (``BLOBHA_CACHE_PEER_CONNECTIONS``); others are told
    #: "busy". A requester keeps up to two open to each peer, so 8 serves four at full pace;
    #: at 4, most requests were refused and went to the masters (docs/perf-log/).
    connections: int = 8
    #: Pieces one download fetches at once, from peers and replicas together.
    parallel: int = 4
    #: Seconds the cache keeps telling the masters it holds a version after it last used it.
    announce_secs: float = 600.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, enabled: bool | None = None
                 ) -> PeerSettings:
        env = os.environ if env is None else env

        def number(name: str, default: int) -> int:
            raw = env.get(name, "").strip()
            if not raw:
                return default
            try:
                value = int(raw)
            except ValueError:
                raise InvalidArgument(f"{name} must be a whole number, not {raw!r}") from None
            if value < 0:
                raise InvalidArgument(f"{name} must be 0 or more, not {value}")
            return value

        if enabled is None:
            raw = env.get("BLOBHA_CACHE_PEERS", "1").strip().lower()
            if raw not in ("1", "0", "true", "false", "yes", "no", "on", "off", ""):
                raise InvalidArgument(f"BLOBHA_CACHE_PEERS must be 1 or 0, not {raw!r}")
            enabled = raw in ("1", "true", "yes", "on", "")
        d = cls()
        return cls(
            enabled=enabled,
            port=number("BLOBHA_CACHE_PEER_PORT", d.port),
            upload_bytes_per_sec=max(1, number("BLOBHA_CACHE_PEER_UPLOAD_BPS",
                                               d.upload_bytes_per_sec)),
            connections=max(1, number("BLOBHA_CACHE_PEER_CONNECTIONS", d.connections)),
        )
