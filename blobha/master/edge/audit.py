"""The audit log: one line per mutation (who, what, key, version, result) on the logger
``blobha.audit``, so operators can route it to its own file (``audit.file``) or system.

Lines are ``key=value`` pairs with JSON-quoted strings, so keys with spaces stay parseable::

    audit user="alice" op=create key="geo table" version=3 result=OK
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import grpc

from blobha.core.errors import BlobError

log = logging.getLogger("blobha.audit")


@dataclass
class AuditRecord:
    user: str
    op: str
    key: str
    version: int = 0
    result: str = "OK"
    detail: str = ""

    def line(self) -> str:
        text = (f"audit user={json.dumps(self.user)} op={self.op} key={json.dumps(self.key)}"
                f" version={self.version} result={self.result}")
        if self.detail:
            text += f" detail={json.dumps(self.detail)}"
        return text


def record(rec: AuditRecord) -> None:
    log.info("%s", rec.line())


@contextmanager
def audited(user: str, op: str, key: str, version: int = 0) -> Iterator[AuditRecord]:
    """Log one audit line when the block ends; the block may fill in ``key`` and ``version``.
    An exception is logged with its gRPC status name and re-raised."""
    rec = AuditRecord(user, op, key, version)
    try:
        yield rec
    except BlobError as e:
        rec.result = e.code.name
        rec.detail = str(e)[:200]
        record(rec)
        raise
    except BaseException as e:
        rec.result = grpc.StatusCode.INTERNAL.name
        rec.detail = type(e).__name__
        record(rec)
        raise
    record(rec)


def refused(method: str, peer: str, reason: str) -> None:
    """A call refused before it ran (no or wrong credential): who tried, from where."""
    log.warning("audit user=null op=%s key=null version=0 result=UNAUTHENTICATED peer=%s"
                " detail=%s", method, json.dumps(peer), json.dumps(reason[:200]))
