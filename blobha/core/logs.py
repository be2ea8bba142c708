"""A master's log lines: plain text or JSON, each with the id of the request being served.

The gRPC interceptor (:mod:`blobha.master.edge.interceptor`) sets the request id for the
duration of a call; every line logged meanwhile on that thread carries it (``-`` outside
calls), so one request can be followed through the log, and a client that sent ``x-request-id``
can find its call.

Text: ``2025-01-01 12:00:00,000 INFO [127.0.0.1:6627] req=3f2a... blobha.master.facade: message``
JSON: ``{"ts": "...", "level": "INFO", "master": "127.0.0.1:6627", "request_id": "3f2a...",
"logger": "blobha.master", "message": "...", "exception": "..."}``
"""

from __future__ import annotations

import contextvars
import datetime
import json
import logging

NO_REQUEST = "-"

_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id",
                                                                  default=NO_REQUEST)


def current_request_id() -> str:
    return _request_id.get()


def set_request_id(request_id: str) -> str:
    """Make ``request_id`` current on this thread; returns the previous one to restore."""
    previous = _request_id.get()
    _request_id.set(request_id)
    return previous


class RequestIdFilter(logging.Filter):
    """Adds ``record.request_id`` (a filter on the handler, so records of every logger get it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = _request_id.get()
        return True


class JsonFormatter(logging.Formatter):
    def __init__(self, master: str) -> None:
        super().__init__()
        self.master = master

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC)
            .isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "master": self.master,
            "request_id": getattr(record, "request_id", NO_REQUEST),
            "logger": record.name,
            "thread": record.threadName,
            "message": record.getMessage(),
        }
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False)


def configure(level: str, fmt: str, master: str) -> None:
    """Set up the root logger of a master process (``log.level``, ``log.format``)."""
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter(master))
    else:
        handler.setFormatter(logging.Formatter(
            f"%(asctime)s %(levelname)s [{master}] req=%(request_id)s %(name)s: %(message)s"
        ))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level)
    # kazoo logs every reconnect attempt at WARNING; its state changes are logged by us.
    logging.getLogger("kazoo.client").setLevel(logging.ERROR)
