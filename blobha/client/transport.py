"""How the client reaches one master: the :class:`Transport` protocol and its gRPC form.

Also the translation of gRPC failures into BlobErrors, a TLS disagreement among them."""

from __future__ import annotations

import functools
import queue
import ssl
import threading
from collections.abc import Generator, Iterator, Mapping, Sequence
from typing import Any, Protocol

import grpc

from blobha.client.arguments import MiB
from blobha.core import errors
from blobha.core.addresses import host_of, split_host_port
from blobha.core.errors import (
    BlobError,
    Busy,
    DeadlineExceeded,
    InvalidArgument,
    Refused,
    Unavailable,
)
from blobha.v1 import blobha_pb2 as pb
from blobha.wire import chunks
from blobha.wire.credentials import Credentials
from blobha.wire.stallwatch import CallWatch, Pending, Stalled, StallWatch

#: While a leader a call waits for is silent, how often its rivals are asked who leads.
_RIVAL_POLL_SECS = 0.5

#: Bounded on both ends so one message can never exhaust memory; a chunk is at most 1 MiB.
MAX_MESSAGE_BYTES = 8 * MiB

_CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Masters are reached directly; an http_proxy variable meant for web traffic must not
    # silently reroute (or break) cluster traffic.
    ("grpc.enable_http_proxy", 0),
    # A paused or partitioned master still has a kernel that accepts TCP, so a call to it
    # would hang until its deadline. HTTP/2 pings need the process itself: an unanswered ping
    # closes the connection and fails the call with UNAVAILABLE, and the client moves on.
    ("grpc.keepalive_time_ms", 4000),
    ("grpc.keepalive_timeout_ms", 4000),
    # Likewise a reconnection to such a master gives up after this long instead of 20 s.
    ("grpc.min_reconnect_backoff_ms", 3000),
    ("grpc.http2.max_pings_without_data", 0),
    chunks.CALLER_THREAD_STREAMS,
)


class Transport(Protocol):
    """How the client reaches one master. Implementations raise only :class:`BlobError`."""

    def unary(self, address: str, method: str, request: Any, timeout: float | None,
              stall: float | None = None, rivals: Sequence[str] = ()) -> Any:
        """The call's answer; ``stall``: after this many seconds without one, the master is
        asked whether it is there at all, and a master that does not answer that either
        fails the call with :class:`Unavailable` (the call itself may still have run).
        ``rivals``: for a call to the leader, the other masters: once the call has waited
        about a second, a silent leader is left as soon as one of them leads instead."""
        ...

    def client_stream(
        self, address: str, method: str, requests: Iterator[Any], timeout: float | None,
        stall: float | None = None, rivals: Sequence[str] = (),
    ) -> Any:
        """The call's answer; ``stall`` and ``rivals`` as for :meth:`unary`."""
        ...

    def server_stream(
        self, address: str, method: str, request: Any, timeout: float | None,
        stall: float | None = None,
    ) -> Iterator[Any]:
        """The call's messages; ``stall``: seconds the master may send nothing before the
        call is abandoned with :class:`Unavailable` (time the consumer spends on a message
        does not count)."""
        ...

    def probe(
        self, addresses: Sequence[str], method: str, request: Any, timeout: float
    ) -> Generator[tuple[str, Any], None, None]:
        """Call every address at once; yield ``(address, response or BlobError)`` as they end."""
        ...

    def data_host(self, address: str) -> str | None:
        """The host to dial for the data channel of ``address`` (blobha.wire.datachannel), or None
        when transfers must stay in gRPC."""
        ...

    def data_tls(self) -> ssl.SSLContext | None:
        """The TLS the data channel takes (None: plaintext, as the gRPC channel)."""
        ...

    def close(self) -> None: ...


class LeaderMoved(Unavailable):
    """A call to the leader was left while that leader was silent, because ``leader`` leads
    now (a newer term). The call may have run (a commit whose answer was lost): it is settled
    or made again with the new leader, which the client goes to at once."""

    def __init__(self, message: str, leader: str = "") -> None:
        super().__init__(message)
        self.leader = leader


class HandshakeFailed(Unavailable):
    """The TLS handshake with ``addresses`` failed in a way only a TLS peer that disagrees
    can cause: its certificate did not verify against the client's CA, or it answered in plain
    text. Transient at most while certificates are being replaced (masters reload theirs), so
    the client gives up early once every master says so (see
    :meth:`blobha.client.routing.Router.give_up_on_tls`)."""

    def __init__(self, message: str, addresses: frozenset[str] = frozenset(),
                 lasting: bool = False) -> None:
        super().__init__(message)
        self.addresses = addresses
        #: Not a certificate that a reload may replace: the master speaks TLS and the client
        #: does not, which nothing short of a restart with other settings changes.
        self.lasting = lasting


#: How long the check that a master speaks TLS may take (see speaks_tls).
_TLS_CHECK_SECS = 1.0


def speaks_tls(target: str, timeout: float = _TLS_CHECK_SECS) -> bool:
    """Whether ``target`` (host:port) completes a TLS handshake, its certificate unchecked:
    the proof that a master closed a plain-text client's connection for want of TLS, and not a
    proxy with no master behind it, which closes a TLS client's connection just the same."""
    import socket

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])  # as gRPC asks: a server may insist on it
    try:
        host, port = split_host_port(target)
        with socket.create_connection((host, port), timeout=timeout) as raw, \
                context.wrap_socket(raw, server_hostname=host):
            return True
    except (OSError, InvalidArgument):  # ssl.SSLError is an OSError
        return False


#: What gRPC says of a connection the far side closed before any HTTP/2 frame.
_CLOSED_AT_ONCE = ("socket closed", "connection reset by peer")


def handshake_failure(address: str, details: str, tls: bool,
                      dial: str | None = None) -> Unavailable | None:
    """What to say of a connection that failed, perhaps for want of TLS agreement, with what
    to change; None for any other unavailability. Only a :class:`HandshakeFailed` is proof of
    a mismatch: a connection closed at once is also what a proxy or load balancer with no
    master behind it does, so that is only a hint, unless (plain text, ``dial`` given: the
    address dialled) the master is found to speak TLS."""
    lowered = details.lower()
    if "hostname verification check failed" in lowered:
        return HandshakeFailed(
            f"no TLS connection to master {address}: its certificate does not name the address"
            " dialled; reach the masters by an address their certificates name (see"
            f" BLOBHA_ADDRESS_MAP), or give them certificates that name it ({details})",
            frozenset({address}))
    if "handshake failed" in lowered:
        if "wrong_version_number" in lowered:
            advice = ("it does not use TLS; drop --ca / BLOBHA_CA and any client certificate, or"
                      " enable TLS on the masters")
        else:
            advice = ("its certificate did not verify against the CA given in --ca / BLOBHA_CA;"
                      " pass the CA that signed the masters' certificates")
        return HandshakeFailed(f"no TLS connection to master {address}: {advice} ({details})",
                                frozenset({address}))
    if ("failed to connect" in lowered
            and any(words in lowered for words in _CLOSED_AT_ONCE)
            and "handshake read failed" not in lowered):
        # Closed before any HTTP/2 frame (a reset when the client's first bytes were there
        # before the close): what a TLS master does to a plain-text client, and
        # (TLS 1.3 ends the handshake before the server judges the client) a master that wants
        # a client certificate to one with none or a foreign one; but also a proxy whose
        # master is down. So it is retried like any unavailability, with the likely fix. (A
        # TLS client that a proxy cuts off sees its handshake's read fail: no hint there.)
        if tls:
            hint = ("if the masters ask for client certificates, pass --cert/--tls-key"
                    " (BLOBHA_CERT/BLOBHA_KEY) with one that their CA signed")
        elif dial is not None and speaks_tls(dial):
            # Told at the first attempt, not after the whole timeout of retries.
            return HandshakeFailed(
                f"no connection to master {address}: it uses TLS and this client does not;"
                " pass --ca / BLOBHA_CA with the CA that signed the masters' certificates"
                f" ({details})", frozenset({address}), lasting=True)
        else:
            hint = ("if the masters use TLS, pass --ca / BLOBHA_CA with the CA that signed their"
                    " certificates")
        return Unavailable(f"master {address} unavailable: {details} ({hint})")
    return None


class NoConnection(Unavailable):
    """No connection could be made to a master (refused, no such host): it did not answer at
    all, unlike one that answered "unavailable" (no leader yet, ZooKeeper out). ``errors``:
    why, by master address."""

    def __init__(self, message: str, errors: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.errors: dict[str, str] = dict(errors or {})


#: What gRPC says when it could not connect at all (words of its UNAVAILABLE details).
_NO_CONNECTION_WORDS = ("failed to connect to all addresses", "connection refused",
                        "errors resolving", "dns resolution failed")


def no_connection(address: str, details: str) -> NoConnection | None:
    """The error for an UNAVAILABLE that says no connection was made, else None."""
    lowered = details.lower()
    if not any(words in lowered for words in _NO_CONNECTION_WORDS):
        return None
    return NoConnection(f"master {address} unavailable: {details}", {address: details})


def error_from_rpc(address: str, exc: grpc.RpcError, tls: bool = False,
                   dial: str | None = None) -> BlobError:
    """The BlobError for a failed call to ``address``; ``dial``: the address dialled for it,
    where a connection closed at once may be checked for TLS (see handshake_failure)."""
    if not isinstance(exc, grpc.Call):
        return Unavailable(f"master {address}: {exc}")
    code = exc.code()
    details = exc.details() or ""
    trailers = tuple((str(k), v) for k, v in (exc.trailing_metadata() or ()))
    if code == grpc.StatusCode.CANCELLED:
        # Our own cancellations never get here; a cancel from the far side means the master
        # is going away, which is worth a retry elsewhere.
        return Unavailable(f"master {address} cancelled the call: {details or 'no reason'}")
    error = errors.from_status(code, details, trailers)
    if isinstance(error, Busy):
        # Transient: back off and retry.
        return Busy(f"master {address} is busy: {error}")
    if isinstance(error, Refused):
        # Its own class kept (a Stale refusal makes a read look for a master in touch with
        # ZooKeeper: Router.refused_as_stale).
        return type(error)(f"master {address} unavailable: {error}")
    if isinstance(error, Unavailable):
        return (handshake_failure(address, details, tls, dial)
                or no_connection(address, details)
                or Unavailable(f"master {address} unavailable: {error}"))
    if isinstance(error, DeadlineExceeded):
        if details.strip().lower() != "deadline exceeded":
            # The master's own answer (a write quorum not reached in its time), not gRPC's:
            # it did answer, and its message says what happened.
            return DeadlineExceeded(f"master {address}: {details}")
        return DeadlineExceeded(f"master {address} did not answer in time ({error})")
    return error


class GrpcTransport:
    """The gRPC transport: one cached channel per address, over TLS when ``credentials`` name
    a CA or a client certificate, with the token (if any) on every call.

    ``address_map`` translates a master's advertised address to the one this client dials
    (see :func:`parse_address_map`); unlisted addresses are dialled as they are."""

    def __init__(self, user: str, credentials: Credentials | None = None,
                 address_map: Mapping[str, str] | None = None) -> None:
        self._credentials = credentials or Credentials()
        self._metadata: tuple[tuple[str, str], ...] = self._credentials.metadata(user)
        self._address_map = dict(address_map or {})
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, Any] = {}
        self._stalls = StallWatch()
        self._calls = CallWatch(self._answers, self._cut)
        #: A silent master -> the rival found leading instead (see _answers); kept until that
        #: master answers again.
        self._successors: dict[str, str] = {}
        self._closed = False

    def _stub(self, address: str) -> Any:
        with self._lock:
            if self._closed:
                raise InvalidArgument("this Client is closed; create a new one")
            stub = self._stubs.get(address)
            if stub is None:
                target = self._address_map.get(address, address)
                options: list[tuple[str, object]] = list(_CHANNEL_OPTIONS)
                if target != address:
                    # TLS still checks the certificate against the advertised name.
                    options.append(("grpc.ssl_target_name_override", host_of(address)))
                channel = self._credentials.channel(target, options)
                self._channels[address] = channel
                stub = self._stubs[address] = chunks.stub(channel)
            return stub

    def unary(self, address: str, method: str, request: Any, timeout: float | None,
              stall: float | None = None, rivals: Sequence[str] = ()) -> Any:
        return self._call(address, method, request, timeout, stall, rivals)

    def _call(self, address: str, method: str, request: Any, timeout: float | None,
              stall: float | None, rivals: Sequence[str] = ()) -> Any:
        # With a stall limit shorter than the timeout: half the limit waiting for the answer,
        # half for the status check, so a paused master is left after about ``stall`` seconds
        # (see CallWatch), or as soon as a rival leads.
        pending: Pending | None = None
        others = tuple(r for r in rivals if r != address)
        # A call that its own timeout ends before the stall limit is watched only for a rival
        # taking over (a cheap call to the leader).
        if stall is not None and (timeout is None or timeout > stall or others):
            pending = self._calls.begin(address, stall / 2, others)
        stub: Any = None
        try:
            stub = self._stub(address)
            return getattr(stub, method)(request, timeout=timeout, metadata=self._metadata)
        except InvalidArgument:  # a ValueError too: a closed client or unusable TLS files
            raise
        except (grpc.RpcError, ValueError) as exc:
            # ValueError: the channel was closed as this call began (cut for another call).
            if pending is not None and (pending.fired or self._was_cut(address, stub)):
                with self._lock:
                    successor = self._successors.pop(address, "")
                if successor:
                    raise LeaderMoved(
                        f"master {address} stopped answering {method} (paused or cut off) and"
                        f" {successor} leads now; trying it", successor) from None
                raise Unavailable(
                    f"master {address} stopped answering: {method} got no answer for"
                    f" {stall:g} s, or until another master led, and neither did a status check"
                    " (paused or cut off); trying another master"
                ) from None
            if isinstance(exc, grpc.RpcError):
                raise self._error(address, exc) from None
            raise
        finally:
            if pending is not None:
                self._calls.end(pending)

    def _was_cut(self, address: str, stub: Any) -> bool:
        """Whether ``stub``'s channel was closed because its master stopped answering."""
        with self._lock:
            return stub is not None and not self._closed and self._stubs.get(address) is not stub

    def _cut(self, address: str) -> None:
        """End every call to ``address`` (it answered no status check): its channel is closed,
        and the next call opens a new one."""
        with self._lock:
            channel = self._channels.pop(address, None)
            self._stubs.pop(address, None)
        self._stalls.cancel(f"master {address}",
                            f"master {address} stopped answering (it failed a status check)")
        if channel is not None:
            channel.close()

    def _answers(self, address: str, limit: float, rivals: tuple[str, ...] = ()) -> bool:
        """Whether ``address`` answers a status check within ``limit`` seconds; while it is
        silent, False as soon as one of ``rivals`` says it leads (a new term began: the
        silent master, which the caller took for the leader, is deposed)."""
        future = self._stub(address).NodeStatus.future(
            pb.NodeStatusRequest(), timeout=limit, metadata=self._metadata)
        try:
            while True:
                try:
                    # gRPC ends the check by its own deadline (then: silence, an RpcError).
                    future.result(timeout=_RIVAL_POLL_SECS if rivals else None)
                except grpc.FutureTimeoutError:
                    successor = self._leading_rival(rivals)
                    if successor:
                        with self._lock:
                            self._successors[address] = successor
                        return False
                    continue
                with self._lock:
                    self._successors.pop(address, None)
                return True
        except grpc.RpcError as exc:
            return _an_answer(exc)
        finally:
            future.cancel()

    def _leading_rival(self, rivals: tuple[str, ...]) -> str:
        """The one of ``rivals`` that answers a status check saying it leads, or ''."""
        futures = []
        try:
            for rival in rivals:
                futures.append(self._stub(rival).NodeStatus.future(
                    pb.NodeStatusRequest(), timeout=_RIVAL_POLL_SECS, metadata=self._metadata))
            for rival, f in zip(rivals, futures, strict=True):
                try:
                    if f.result().is_leader:
                        return rival
                except grpc.RpcError:
                    continue  # silent or refusing: no new term from it
            return ""
        finally:
            for f in futures:
                f.cancel()

    def client_stream(
        self, address: str, method: str, requests: Iterator[Any], timeout: float | None,
        stall: float | None = None, rivals: Sequence[str] = (),
    ) -> Any:
        return self._call(address, method, requests, timeout, stall, rivals)

    def data_host(self, address: str) -> str | None:
        return host_of(self._address_map.get(address, address))

    def data_tls(self) -> ssl.SSLContext | None:
        return self._credentials.data_tls()

    @property
    def credentials(self) -> Credentials:
        return self._credentials

    def server_stream(
        self, address: str, method: str, request: Any, timeout: float | None,
        stall: float | None = None,
    ) -> Iterator[Any]:
        multi = getattr(self._stub(address), method)
        call: Any = multi(request, timeout=timeout, metadata=self._metadata)
        try:
            if stall is None:
                try:
                    yield from call
                finally:
                    # Frees the stream at once when the consumer stops early (messages() does
                    # the same for a watched one); a no-op once finished.
                    call.cancel()
            else:
                yield from self._stalls.messages(call, stall, f"master {address}")
        except Stalled as e:
            raise Unavailable(f"{e}; moving on to another replica") from None
        except grpc.RpcError as exc:
            raise self._error(address, exc) from None

    def _error(self, address: str, exc: grpc.RpcError) -> BlobError:
        return error_from_rpc(address, exc, self._credentials.tls,
                              self._address_map.get(address, address))

    def probe(
        self, addresses: Sequence[str], method: str, request: Any, timeout: float
    ) -> Generator[tuple[str, Any], None, None]:
        results: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        futures: list[Any] = []
        try:
            for address in addresses:
                future = getattr(self._stub(address), method).future(
                    request, timeout=timeout, metadata=self._metadata
                )
                futures.append(future)
                future.add_done_callback(functools.partial(_probe_done, results, address))
            for _ in addresses:
                try:
                    # gRPC ends every call by its deadline; the margin only guards that promise.
                    address, result = results.get(timeout=timeout + 5.0)
                except queue.Empty:
                    return
                # Told apart here, not in gRPC's callback thread: it may check for TLS.
                yield address, (self._error(address, result)
                                if isinstance(result, grpc.RpcError) else result)
        finally:
            for future in futures:
                future.cancel()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._stalls.close()
            self._calls.close()
            channels = list(self._channels.values())
            self._channels.clear()
            self._stubs.clear()
        for channel in channels:
            channel.close()


def _an_answer(exc: grpc.RpcError) -> bool:
    """Whether a failed status check still heard from its master: any status is an answer,
    a refusal too; only silence or no connection is not."""
    code = exc.code() if isinstance(exc, grpc.Call) else None
    return code not in (None, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)


def _probe_done(results: queue.SimpleQueue[tuple[str, Any]], address: str,
                future: Any) -> None:
    try:
        results.put((address, future.result()))
    except grpc.RpcError as exc:
        results.put((address, exc))
    except grpc.FutureCancelledError:
        results.put((address, Unavailable(f"master {address}: probe cancelled")))
