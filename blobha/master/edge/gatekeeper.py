"""The gRPC server interceptor in front of every call: authenticates the caller, keeps a job token
to its scope (:func:`scope_refusal`), and caps how many calls one user, and all users together,
may have running at once, before any handler runs.

It does so from the call's headers, before its request message is read: every method is served
as one with a stream of requests, so that the handler runs as the headers arrive, refuses an
unknown caller at once, and reads the message only for one admitted, within
``master.request.receive.secs`` (:mod:`blobha.master.edge.receiving`). Otherwise a call whose
message never comes would hold a call thread with no credential at all. The services that take
no credential (health, reflection) get a few threads of their own, capped per connection and
host.

Handlers learn the authenticated user from :func:`authenticated_user`; they never read the user
from metadata themselves, so no call can skip authentication.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import grpc

from blobha.core.admission import CALLER_PEER, PeerCaps
from blobha.core.errors import BUSY_METADATA_KEY, BlobError, Busy, Unauthenticated, to_status
from blobha.master.edge import audit
from blobha.master.edge.metrics import RpcMetrics
from blobha.master.edge.receiving import CancelTimer, receive_one
from blobha.wire.authn import Caller, ServerAuthentication

#: Calls of this service are authenticated; others (health checks, reflection) are not ours.
SERVICE_PREFIX = "/blobha.v1.BlobStore/"


class AuthenticatedContext:
    """The handler's view of the call context: the real one plus the authenticated user."""

    __slots__ = ("_context", "blobha_user")

    def __init__(self, context: grpc.ServicerContext, user: str) -> None:
        self._context = context
        self.blobha_user = user

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def authenticated_user(context: Any) -> str:
    user = getattr(context, "blobha_user", None)
    if not isinstance(user, str):
        # Only reachable if a server was built without the gatekeeper: fail closed.
        raise Unauthenticated("this call was not authenticated; the master is misconfigured")
    return user


def _peer_names(context: grpc.ServicerContext) -> Mapping[str, Sequence[str]]:
    out: dict[str, list[str]] = {}
    for k, values in (context.auth_context() or {}).items():
        out[k] = [v.decode(errors="replace") if isinstance(v, bytes) else str(v)
                  for v in values]
    return out


#: What a job token may call: reads of keys in its scope (the request's ``key``, or all its
#: ``keys``), and the cluster's status, which names no key. Anything else (every write, List,
#: the masters' FetchVersions, issuing or revoking tokens) is refused.
_SCOPED_KEY_READS = frozenset({"GetMeta", "Download", "GetReplication", "PeerPlan"})
_SCOPED_MANY_KEY_READS = frozenset({"WaitForReplication"})
_SCOPED_STATUS = frozenset({"ClusterSummary", "NodeStatus"})


def scope_refusal(method: str, request: Any, scope: frozenset[str]) -> str:
    """Why a call made with a job token of ``scope`` is refused; "" if it may go on."""
    if method in _SCOPED_STATUS:
        return ""
    if method in _SCOPED_KEY_READS:
        keys = [str(request.key)]
    elif method in _SCOPED_MANY_KEY_READS:
        keys = [str(k) for k in request.keys]
    elif method == "List":
        # A listing would name keys outside the scope; the job knows its keys already.
        return "a job token cannot list keys; it reads only the keys it was issued for"
    else:
        return f"a job token only reads the keys it was issued for; {method} is refused"
    outside = [k for k in keys if k not in scope]
    if outside:
        return (f"this job token does not grant access to {outside[0]!r}; it reads only the"
                f" {len(scope)} keys it was issued for")
    return ""


#: Calls admitted past the cap on all users' calls, up to a small cap of their own: a status
#: check is how a client tells a busy master from a paused one.
_PAST_THE_CAP = frozenset({"NodeStatus"})
#: Calls that may last as long as their caller likes: a wait without a deadline (until the
#: replicas come), an upload stream whose next chunk may come when its source has it. They
#: count against the caps on all calls, and against tighter ones of their own, so that one
#: user's, or all users' together, leave call threads for everything else.
_LONG_WAITS = frozenset({"WaitForReplication", "AppendUpload"})


def wait_calls_per_user(max_calls_per_client: int) -> int:
    """Long calls one user may hold at once: a quarter of the calls a user may hold, and at
    least three (a launcher waits for its blobs while it uploads its code), within the cap."""
    return max(min(max_calls_per_client, 3), max_calls_per_client // 4)


def wait_call_threads(threads: int) -> int:
    """Long waits all users may hold at once: half of the call threads open to users."""
    return max(1, client_call_threads(threads) // 2)


def client_call_threads(threads: int) -> int:
    """Of a master's ``threads`` call threads, those users' calls may take together; the rest
    stay for the other masters (replication) and for status checks, so that users keeping their
    share busy neither stop replication nor make the master look dead."""
    return threads - max(2, threads // 4)


def status_call_threads(threads: int) -> int:
    """Of the threads users' other calls may not take, those their status checks may: half, so
    that status checks (not free: a master's figures are read over every key) cannot take the
    other masters' share either."""
    return max(1, (threads - client_call_threads(threads)) // 2)


def service_call_threads(threads: int) -> int:
    """Of a master's ``threads``, those the health service may hold at once (it takes no
    credential, so anyone may call it): enough for probes, within the masters' share."""
    return max(1, status_call_threads(threads) // 2)


#: How long a master waits for a call's request message after its headers, by default.
RECEIVE_SECS = 10.0
_HEALTH = "/grpc.health.v1.Health/"


def _abort(context: grpc.ServicerContext, error: BlobError) -> None:
    code, details, trailers = to_status(error)
    if trailers:
        context.set_trailing_metadata(trailers)
    context.abort(code, details)
    raise AssertionError("unreachable")  # abort raises


def _less(counts: dict[str, int], user: str) -> None:
    left = counts.get(user, 1) - 1
    if left > 0:
        counts[user] = left
    else:
        counts.pop(user, None)


class Gatekeeper(grpc.ServerInterceptor):  # type: ignore[type-arg]
    def __init__(self, auth: ServerAuthentication, max_calls_per_client: int,
                 threads: int, receive_secs: float = RECEIVE_SECS,
                 metrics: RpcMetrics | None = None) -> None:
        self.auth = auth
        self.max_calls = max_calls_per_client
        #: Calls of all users together (masters apart) on a server of ``threads`` call
        #: threads. Status checks may go ``max_status_calls`` past it.
        self.max_client_calls = client_call_threads(threads)
        self.max_status_calls = status_call_threads(threads)
        self.receive_secs = receive_secs
        self._metrics = metrics
        self._timer = CancelTimer()
        # The services without credentials: health checks, and the rest (reflection, whose
        # stream holds its thread while open) fewer still.
        health = service_call_threads(threads)
        self._health = PeerCaps("health checks", health, per_connection=max(1, health // 2),
                                per_host=max(1, health - 1))
        self._other = PeerCaps("calls of its other services", 2, per_connection=1, per_host=1)
        self._running: dict[str, int] = {}
        self._all_running = 0
        self.max_waits = wait_calls_per_user(max_calls_per_client)
        self.max_all_waits = wait_call_threads(threads)
        self._waiting: dict[str, int] = {}
        self._all_waiting = 0
        self._lock = threading.Lock()

    # ---- admission ---------------------------------------------------------------------------

    def _identify(self, method: str, context: grpc.ServicerContext) -> Caller:
        """Who calls, from the headers alone; refused (aborted) if unknown."""
        metadata = {
            str(k).lower(): v for k, v in (context.invocation_metadata() or ())
            if isinstance(v, str)
        }
        token = CALLER_PEER.set(context.peer())
        try:
            return self.auth.identify(metadata, _peer_names(context))
        except BlobError as e:  # Unauthenticated; Unavailable if a job token cannot be checked
            if isinstance(e, Unauthenticated):
                audit.refused(method, context.peer(), str(e))
            _abort(context, e)
            raise AssertionError("unreachable") from None
        finally:
            CALLER_PEER.reset(token)

    def _check_scope(self, method: str, caller: Caller, request: Any,
                     context: grpc.ServicerContext) -> None:
        if caller.scope is None:
            return
        why = scope_refusal(method, request, caller.scope)
        if why:
            audit.record(audit.AuditRecord(
                caller.user, method, "", result="PERMISSION_DENIED",
                detail=f"job token {caller.token_id}: {why}"[:200]))
            context.abort(grpc.StatusCode.PERMISSION_DENIED, why)

    def _take(self, user: str, method: str, context: grpc.ServicerContext) -> str:
        if user == self.auth.principal:
            # Masters are trusted and their sync fans out over many keys at once.
            return user
        refusal = ""
        with self._lock:
            running = self._running.get(user, 0)
            if running >= self.max_calls:
                refusal = (f"user {user!r} already has {self.max_calls} calls in progress on"
                           " this master (master.max.calls.per.client); wait for some to finish")
            elif self._all_running >= self.max_client_calls + (
                    self.max_status_calls if method in _PAST_THE_CAP else 0):
                refusal = (f"this master is busy: users' calls hold all {self.max_client_calls}"
                           " of its call threads open to them (master.rpc.threads); retry")
            elif method in _LONG_WAITS and self._waiting.get(user, 0) >= self.max_waits:
                refusal = (f"user {user!r} already has {self.max_waits} waits for replication"
                           " or upload streams in progress on this master (a quarter of"
                           " master.max.calls.per.client, at least 3); wait for some to finish,"
                           " or wait for several keys in one call")
            elif method in _LONG_WAITS and self._all_waiting >= self.max_all_waits:
                refusal = (f"this master is busy: users' waits and upload streams hold all"
                           f" {self.max_all_waits} of the call threads open to them; retry")
            else:
                self._running[user] = running + 1
                self._all_running += 1
                if method in _LONG_WAITS:
                    self._waiting[user] = self._waiting.get(user, 0) + 1
                    self._all_waiting += 1
        if refusal:
            context.set_trailing_metadata(((BUSY_METADATA_KEY, "1"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        return user

    def _admit(self, method: str, context: grpc.ServicerContext, request: Any = None) -> str:
        """The caller's user, once authenticated, within its job token's scope if it used one,
        and admitted; ``request``: the call's request (None for a stream of them)."""
        caller = self._identify(method, context)
        self._check_scope(method, caller, request, context)
        return self._take(caller.user, method, context)

    def _release(self, user: str, method: str) -> None:
        if user == self.auth.principal:
            return
        with self._lock:
            self._all_running -= 1
            _less(self._running, user)
            if method in _LONG_WAITS:
                self._all_waiting -= 1
                _less(self._waiting, user)

    def running(self, user: str) -> int:
        with self._lock:
            return self._running.get(user, 0)

    def _receive(self, requests: Iterator[Any], context: grpc.ServicerContext,
                 method: str) -> Any:
        awaiting = self._metrics.awaiting_request if self._metrics is not None else None
        if awaiting is not None:
            awaiting.inc()
        try:
            return receive_one(requests, context, self._timer, self.receive_secs, method)
        except BlobError as e:
            _abort(context, e)
        finally:
            if awaiting is not None:
                awaiting.dec()

    def _admitted(self, method: str, requests: Iterator[Any], context: grpc.ServicerContext
                  ) -> tuple[str, Any]:
        """Admit the caller from the headers, then read the request: (user, request)."""
        caller = self._identify(method, context)
        user = self._take(caller.user, method, context)
        try:
            request = self._receive(requests, context, method)
            self._check_scope(method, caller, request, context)
        except BaseException:
            self._release(user, method)
            raise
        return user, request

    # ---- wrapping handlers -------------------------------------------------------------------

    def _unary_response(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        """For a method with a stream of requests: they are read by the handler."""
        def wrapped(request: Any, context: grpc.ServicerContext) -> Any:
            user = self._admit(method, context, request)
            try:
                return behavior(request, AuthenticatedContext(context, user))
            finally:
                self._release(user, method)
        return wrapped

    def _stream_response(self, method: str, behavior: Callable[..., Iterator[Any]]
                         ) -> Callable[..., Iterator[Any]]:
        def wrapped(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            # Admission runs on the first next(), so the slot is released by this finally
            # whether the stream ends, fails or is dropped by a cancelled client.
            user = self._admit(method, context, request)
            try:
                yield from behavior(request, AuthenticatedContext(context, user))
            finally:
                self._release(user, method)
        return wrapped

    def _one_then_unary(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        """For a method of one request: served with a stream of them, read once admitted."""
        def wrapped(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            user, request = self._admitted(method, requests, context)
            try:
                return behavior(request, AuthenticatedContext(context, user))
            finally:
                self._release(user, method)
        return wrapped

    def _one_then_stream(self, method: str, behavior: Callable[..., Iterator[Any]]
                         ) -> Callable[..., Iterator[Any]]:
        def wrapped(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            user, request = self._admitted(method, requests, context)
            try:
                yield from behavior(request, AuthenticatedContext(context, user))
            finally:
                self._release(user, method)
        return wrapped

    def _open(self, caps: PeerCaps, context: grpc.ServicerContext) -> str:
        try:
            return caps.take(context.peer())
        except Busy as e:
            _abort(context, e)
            raise AssertionError("unreachable") from None

    def _open_service(self, caps: PeerCaps, method: str, handler: Any) -> Any:
        """A handler of a service without credentials, holding a place of ``caps`` while it
        runs; one of a single request reads it within the time limit."""
        kw = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
        behavior = (handler.unary_unary or handler.unary_stream or handler.stream_unary
                    or handler.stream_stream)
        one = handler.unary_unary is not None or handler.unary_stream is not None
        non_blocking = bool(getattr(behavior, "experimental_non_blocking", False))

        def run(requests: Any, context: grpc.ServicerContext, *more: Any) -> Any:
            place = self._open(caps, context)
            try:
                request = self._receive(requests, context, method) if one else requests
                return behavior(request, context, *more)
            finally:
                caps.give(place)

        def run_stream(requests: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            place = self._open(caps, context)
            try:
                request = self._receive(requests, context, method) if one else requests
                yield from behavior(request, context)
            finally:
                caps.give(place)

        if handler.unary_unary is not None or handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(run, **kw)
        if non_blocking:
            # grpcio hands these (the health service's Watch) a send-callback and lets them
            # return at once: the place is held while the request is awaited, not the watch.
            run.experimental_non_blocking = True  # type: ignore[attr-defined]
            return grpc.stream_stream_rpc_method_handler(run, **kw)
        return grpc.stream_stream_rpc_method_handler(run_stream, **kw)

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        method = str(details.method)
        if handler is None:
            return handler
        if not method.startswith(SERVICE_PREFIX):
            caps = self._health if method.startswith(_HEALTH) else self._other
            return self._open_service(caps, method, handler)
        name = method[len(SERVICE_PREFIX):]
        kw = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
        if handler.unary_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._one_then_unary(name, handler.unary_unary), **kw)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._unary_response(name, handler.stream_unary), **kw)
        if handler.unary_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                self._one_then_stream(name, handler.unary_stream), **kw)
        return grpc.stream_stream_rpc_method_handler(
            self._stream_response(name, handler.stream_stream), **kw)
