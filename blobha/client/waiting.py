"""Waiting for replication: server-side waits, retried on other masters, within the caller's
time."""

from __future__ import annotations

import builtins
from typing import Any

from blobha.client.retry import Deadline, now
from blobha.client.routing import Router
from blobha.client.values import WaitResult
from blobha.core.errors import DeadlineExceeded, Unavailable
from blobha.v1 import blobha_pb2 as pb
from blobha.wire.convert import wait_result_from_pb

#: A server-side replication wait answers at its deadline (or half a second before the call's
#: own, whichever is first); the call, and a wait with all its retries, may outlive the wait's
#: timeout by this much, for that answer to arrive.
WAIT_GRACE = 2.0
# "Wait forever" is a loop of bounded server calls so a dead master is noticed.
_FOREVER_SLICE = 60.0


def wait_for_replication(router: Router, keys: builtins.list[str], min_replication: int,
                         timeout: float) -> WaitResult:
    """:meth:`blobha.client.Client.wait_for_replication`, its arguments checked."""
    started = now()
    if timeout >= 0:
        return _wait_once(router, keys, min_replication, timeout, WAIT_GRACE)
    while True:
        # No end to keep to: a failover gets the client's usual time, as any call would.
        result = _wait_once(router, keys, min_replication, _FOREVER_SLICE, router.timeout)
        if result.reached:
            return WaitResult(True, result.statuses, now() - started)


def _wait_once(router: Router, keys: builtins.list[str], minimum: int, secs: float,
               overrun: float) -> WaitResult:
    """One server-side wait of ``secs``, retried on other masters; the call and its retries
    end within ``secs + overrun``."""
    started = now()
    end = started + secs
    deadline = Deadline(secs + overrun)

    def attempt() -> Any:
        left = max(0.0, end - now())
        limit = min(left + WAIT_GRACE, deadline.remaining())
        if limit <= 0:
            raise DeadlineExceeded("the replication wait ran out of time between retries")
        request = pb.WaitForReplicationRequest(
            keys=keys, min_replication=minimum, timeout_secs=left
        )
        address = router.preferred()
        try:
            return router.transport.unary(address, "WaitForReplication", request, limit,
                                          stall=router.stall_timeout)
        except Unavailable:
            router.forget_leader(address)
            raise

    response = router.retry("wait for replication", deadline, attempt)
    result = wait_result_from_pb(response)
    return WaitResult(result.reached, result.statuses, now() - started)
