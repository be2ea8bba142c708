"""The server interceptor around every RPC a master serves: request id, metrics, access log,
and request decoding.

* **Request id**: ``x-request-id`` from the call metadata if it is sane (1-128 characters of
  ``[A-Za-z0-9._:-]``), else a fresh one. It is current for log lines while the call runs
  (:mod:`blobha.core.logs`) and returned in the trailing metadata, on success and on error.
* **Metrics**: started/handled counts and latency per method and status code, and the bytes of
  request and response messages (:class:`blobha.master.edge.metrics.RpcMetrics`). Only methods
  the server implements are counted, so callers cannot inflate the label set.
* **Decoding**: requests reach the handler as bytes and are decoded here. A message that does
  not parse (bad UTF-8 in a string field, truncated bytes) becomes INVALID_ARGUMENT through
  the servicer's abort, instead of grpcio's INTERNAL "Exception deserializing request".
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn

import grpc
from google.protobuf.message import DecodeError

from blobha.core import logs
from blobha.core.errors import BlobError, InvalidArgument
from blobha.master.edge.metrics import RpcMetrics

log = logging.getLogger("blobha.interceptor")

REQUEST_ID_KEY = "x-request-id"

if TYPE_CHECKING:  # grpc-stubs makes these generic; grpcio's classes are not subscriptable
    Handler = grpc.RpcMethodHandler[Any, Any]
    _ServerInterceptor = grpc.ServerInterceptor[Any, Any]
else:
    Handler = grpc.RpcMethodHandler
    _ServerInterceptor = grpc.ServerInterceptor
_SANE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def request_id_from(metadata: Any) -> str:
    for key, value in metadata or ():
        if key == REQUEST_ID_KEY:
            text = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
            if _SANE_ID.fullmatch(text):
                return text
            break  # an unusable id is replaced, not refused: it is only a tracing aid
    return uuid.uuid4().hex[:16]


def _decoder(deserializer: Callable[[bytes], Any] | None, method: str
             ) -> Callable[[bytes], Any]:
    def decode(raw: bytes) -> Any:
        if deserializer is None:
            return raw
        try:
            return deserializer(raw)
        except (DecodeError, ValueError, UnicodeDecodeError) as e:
            raise InvalidArgument(
                f"the request is not a valid {method} message ({type(e).__name__}); use a"
                " client generated from proto/blobha/v1/blobha.proto"
            ) from None
    return decode


class _Call:
    """One RPC's bookkeeping: time, bytes, status, request id."""

    def __init__(self, metrics: RpcMetrics, service: str, method: str, request_id: str) -> None:
        self.metrics = metrics
        self.labels = (service, method)
        self.method = method
        self.request_id = request_id
        self.started = time.perf_counter()
        self.received = 0
        self.sent = 0
        self._previous_id = logs.NO_REQUEST

    def enter(self) -> None:
        # Counted here, as the handler starts, not when the call was seen: grpcio refuses a call
        # that finds every thread taken after the interceptors have seen it, and that call
        # would count as started and never as handled.
        self.metrics.started.labels(*self.labels).inc()
        self.metrics.in_progress.labels(*self.labels).inc()
        self._previous_id = logs.set_request_id(self.request_id)

    def leave(self) -> None:
        logs.set_request_id(self._previous_id)

    def finish(self, context: grpc.ServicerContext, error: BaseException | None) -> None:
        self.metrics.in_progress.labels(*self.labels).dec()
        code = _code_of(context, error)
        elapsed = time.perf_counter() - self.started
        labels = (*self.labels, code.name)
        self.metrics.handled.labels(*labels).inc()
        self.metrics.latency.labels(*labels).observe(elapsed)
        if self.received:
            self.metrics.received_bytes.labels(*self.labels).inc(self.received)
        if self.sent:
            self.metrics.sent_bytes.labels(*self.labels).inc(self.sent)
        _add_trailer(context, self.request_id)
        if code == grpc.StatusCode.OK:
            log.debug("rpc %s OK in %.1f ms", self.method, elapsed * 1000)
        else:
            details = _details_of(context)
            log.info("rpc %s %s in %.1f ms: %s", self.method, code.name, elapsed * 1000, details)


def _code_of(context: grpc.ServicerContext, error: BaseException | None) -> grpc.StatusCode:
    code: grpc.StatusCode | None = context.code()  # type: ignore[attr-defined]
    if code is not None:
        return code
    if isinstance(error, GeneratorExit):
        return grpc.StatusCode.CANCELLED  # the client went away mid-stream
    if error is not None:
        return grpc.StatusCode.UNKNOWN
    return grpc.StatusCode.OK


def _details_of(context: grpc.ServicerContext) -> str:
    details = context.details()  # type: ignore[attr-defined]
    if isinstance(details, bytes):
        return details.decode("utf-8", "replace")
    return str(details or "")


def _add_trailer(context: grpc.ServicerContext, request_id: str) -> None:
    # Handlers may have set trailers of their own (the leader's address on a redirect): add to
    # them, never replace them.
    existing = tuple(context.trailing_metadata() or ())
    if not any(k == REQUEST_ID_KEY for k, _ in existing):
        context.set_trailing_metadata((*existing, (REQUEST_ID_KEY, request_id)))


class ObservingInterceptor(_ServerInterceptor):
    """``abort`` is the servicer's abort (blobha.master.edge.service), the one place RPCs fail."""

    def __init__(self, metrics: RpcMetrics,
                 abort: Callable[[grpc.ServicerContext, BlobError], NoReturn]) -> None:
        self.metrics = metrics
        self._abort = abort

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Handler | None],
        details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = continuation(details)
        if handler is None:
            return None  # unknown method: grpcio answers UNIMPLEMENTED; nothing to count
        service, _, method = details.method.lstrip("/").rpartition("/")
        if any(getattr(b, "experimental_non_blocking", False) for b in (
                handler.unary_stream, handler.stream_stream)):
            # grpcio hands these (the health service's Watch) a send-callback that a wrapper
            # would hide; they are long-lived watches, not requests worth timing.
            return handler
        call = _Call(self.metrics, service, method, request_id_from(details.invocation_metadata))
        return self._wrap(handler, call, method)

    def _wrap(self, handler: Handler, call: _Call, method: str
              ) -> Handler:
        decode = _decoder(handler.request_deserializer, method)
        serialize = handler.response_serializer

        def encode(response: Any) -> bytes:
            data: bytes = serialize(response) if serialize is not None else response
            call.sent += len(data)
            return data

        def requests(raw_iterator: Iterator[bytes]) -> Iterator[Any]:
            # A bad message mid-stream raises InvalidArgument inside the handler's loop; the
            # servicer turns it into INVALID_ARGUMENT like any other bad input.
            for raw in raw_iterator:
                call.received += len(raw)
                yield decode(raw)

        abort = self._abort

        def one_request(raw: bytes, context: grpc.ServicerContext) -> Any:
            call.received += len(raw)
            try:
                return decode(raw)
            except InvalidArgument as e:
                abort(context, e)

        def run_unary(behavior: Callable[..., Any], request_of: Callable[..., Any]
                      ) -> Callable[..., Any]:
            def wrapped(raw: Any, context: grpc.ServicerContext) -> Any:
                call.enter()
                error: BaseException | None = None
                try:
                    return behavior(request_of(raw, context), context)
                except BaseException as e:
                    error = e
                    raise
                finally:
                    call.finish(context, error)
                    call.leave()
            return wrapped

        def run_stream(behavior: Callable[..., Iterator[Any]], request_of: Callable[..., Any]
                       ) -> Callable[..., Iterator[Any]]:
            def wrapped(raw: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                # grpcio drives a response stream on one worker thread and runs nothing else
                # there until it ends, so the request id may stay set across the yields.
                call.enter()
                error: BaseException | None = None
                try:
                    yield from behavior(request_of(raw, context), context)
                except BaseException as e:
                    error = e
                    raise
                finally:
                    call.finish(context, error)
                    call.leave()
            return wrapped

        def streamed_requests(raw: Iterator[bytes], context: grpc.ServicerContext
                              ) -> Iterator[Any]:
            return requests(raw)

        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                run_unary(handler.unary_unary, one_request),
                request_deserializer=None, response_serializer=encode)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                run_stream(handler.unary_stream, one_request),
                request_deserializer=None, response_serializer=encode)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                run_unary(handler.stream_unary, streamed_requests),
                request_deserializer=None, response_serializer=encode)
        assert handler.stream_stream is not None
        return grpc.stream_stream_rpc_method_handler(
            run_stream(handler.stream_stream, streamed_requests),
            request_deserializer=None, response_serializer=encode)
