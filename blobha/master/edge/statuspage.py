"""A master's HTTP side: Prometheus metrics and a status page, on ``metrics.listen``.

Every master serves, like Storm UI's Nimbus summary:

* ``GET /metrics``: the Prometheus text format (:mod:`blobha.master.edge.metrics`);
* ``GET /status.json``: the masters (leader, uptime, version, disk), the blobs (version, size,
  replication current and target, under-replicated first) and the leader changes this master
  has seen;
* ``GET /``: a static HTML page whose script renders ``/status.json`` (no build step: the
  files ship in the package under ``blobha/master/edge/static``).

The page lists every key of the cluster (not ACLs or contents): bind ``metrics.listen`` to an
address only operators reach.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from dataclasses import asdict
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST

from blobha.core.errors import BlobError
from blobha.core.version import __version__

if TYPE_CHECKING:
    from blobha.master.edge.metrics import MasterMetrics
    from blobha.master.status import StatusSource

log = logging.getLogger("blobha.statuspage")

DEFAULT_BLOB_LIMIT = 500
MAX_BLOB_LIMIT = 10000

_STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/status.js": ("status.js", "text/javascript; charset=utf-8"),
    "/status.css": ("status.css", "text/css; charset=utf-8"),
}


def status_document(source: StatusSource, blob_limit: int = DEFAULT_BLOB_LIMIT
                    ) -> dict[str, Any]:
    """What ``/status.json`` answers. Never fails as a whole: a part that cannot be read (the
    other masters while ZooKeeper is unreachable, say) is reported in ``errors``."""
    errors: list[str] = []
    try:
        # It holds this master's own status: asked alone only when it fails (each is a pass
        # over every key).
        view = source.cluster_summary()
        masters, leader, epoch = list(view.masters), view.leader, view.epoch
        if view.zookeeper_unreachable:
            errors.append("cluster summary: ZooKeeper is unreachable from this master; the"
                          " masters shown are those it last saw")
    except Exception as e:  # the page must still show this master
        if isinstance(e, BlobError):
            errors.append(f"cluster summary: {e}")
        else:
            log.debug("status: cluster summary failed", exc_info=True)
            errors.append(f"cluster summary: {type(e).__name__}")
        masters, leader, epoch = [source.node_status()], source.leader_address(), source.epoch()
    urls = source.status_urls([m.address for m in masters])

    known = max(source.known_masters(), 1)
    blobs = []
    under = 0
    for key, v in source.views().items():
        holders = v.holders
        rf = v.state.replication_factor
        is_under = len(holders) < rf
        under += is_under
        blobs.append({
            "key": key, "version": v.state.seq, "size": v.state.size,
            "replication": len(holders), "replication_factor": rf,
            # What placement can reach with the masters there are (rf is capped at that).
            "target": min(rf, known), "under_replicated": is_under,
            "holders": sorted(holders), "updated_at": v.state.updated_at,
            "acknowledged": v.state.acked,
        })
    blobs.sort(key=lambda b: (not b["under_replicated"], b["key"]))
    return {
        "generated_at": time.time(),
        "this_master": source.identity,
        "version": __version__,
        "zookeeper": {"servers": source.zk_servers, "state": source.zk_state()},
        "leader": leader,
        "epoch": epoch,
        "masters": [{**asdict(m), "status_url": urls.get(m.address, "")} for m in masters],
        "blob_count": len(blobs),
        "under_replicated": under,
        "blobs": blobs[:blob_limit],
        "blobs_truncated": len(blobs) > blob_limit,
        "leader_changes": source.leader_changes(),
        "failovers": [asdict(t) for t in source.terms()],
        "scrub": source.scrub(),
        "errors": errors,
    }


class _Handler(BaseHTTPRequestHandler):
    server: StatusServer
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        try:
            if url.path == "/metrics":
                self._send(HTTPStatus.OK, CONTENT_TYPE_LATEST, self.server.render_metrics())
            elif url.path == "/status.json":
                limit = _limit(parse_qs(url.query).get("limit", [""])[0])
                if limit is None:
                    self._send(HTTPStatus.BAD_REQUEST, "text/plain; charset=utf-8",
                               f"limit must be a whole number from 1 to {MAX_BLOB_LIMIT}\n"
                               .encode())
                    return
                body = json.dumps(status_document(self.server.source, limit)).encode()
                self._send(HTTPStatus.OK, "application/json", body)
            elif url.path in _STATIC:
                name, ctype = _STATIC[url.path]
                self._send(HTTPStatus.OK, ctype, _static(name))
            else:
                self._send(HTTPStatus.NOT_FOUND, "text/plain; charset=utf-8",
                           b"not found: try /, /status.json or /metrics\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception:
            log.exception("status page: GET %s failed", url.path)
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, "text/plain; charset=utf-8",
                       b"internal error (logged on the master)\n")

    def _send(self, status: HTTPStatus, ctype: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("status page: " + format, *args)


def _limit(text: str) -> int | None:
    if not text:
        return DEFAULT_BLOB_LIMIT
    if not text.isdigit() or not 1 <= int(text) <= MAX_BLOB_LIMIT:
        return None
    return int(text)


def _static(name: str) -> bytes:
    return resources.files("blobha.master.edge.static").joinpath(name).read_bytes()


class StatusServer(ThreadingHTTPServer):
    """The HTTP server; :meth:`start` runs it on a daemon thread, :meth:`stop` ends it."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, source: StatusSource, listen: str, metrics: MasterMetrics) -> None:
        host, port = listen.rsplit(":", 1)
        host = host.strip("[]")
        if ":" in host:
            self.address_family = socket.AF_INET6
        self.source = source
        self.metrics = metrics
        super().__init__((host, int(port)), _Handler)
        self._thread = threading.Thread(target=self.serve_forever, name="status-http",
                                        daemon=True)

    def render_metrics(self) -> bytes:
        return self.metrics.render()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():  # shutdown() would wait forever for a loop never started
            self.shutdown()
            self._thread.join(timeout=5)
        self.server_close()
