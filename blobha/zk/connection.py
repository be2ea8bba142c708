"""The kazoo connection handler the masters use: kazoo's own, with a cheaper ``select``.

kazoo's connection thread waits on its socket through ``handler.select`` several times per
request and reply (the loop's wait, then one per read or write of a frame). The stock handler
builds, registers and closes a new epoll object on each call: four system calls and a few
Python objects. At the thousands of ZooKeeper requests a second a master makes while a
follower catches up, that was a large share of each master's CPU. One ``poll(2)`` does the
same wait far more cheaply, and unlike ``select(2)`` it has no limit on descriptor numbers (a
busy master has more than 1,024 open files).

It also adds what kazoo lacks, both from server 3.6 on: persistent recursive watches
(``addWatch``, see :func:`add_recursive_watch`) and reads of many nodes in one request
(``multiRead``, see :func:`read_many_async`).
"""

from __future__ import annotations

import logging
import math
import select
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import (
    EXCEPTIONS,
    ConnectionClosedError,
    ConnectionLoss,
    OperationTimeoutError,
    SessionExpiredError,
    SessionMovedError,
    UnimplementedError,
    ZookeeperError,
)
from kazoo.handlers.threading import KazooTimeoutError, SequentialThreadingHandler
from kazoo.interfaces import IAsyncResult
from kazoo.protocol.paths import _prefix_root
from kazoo.protocol.serialization import (
    Watch,
    int_struct,
    multiheader_struct,
    read_buffer,
    read_string,
    stat_struct,
    write_string,
)
from kazoo.protocol.states import EVENT_TYPE_MAP, Callback, WatchedEvent, ZnodeStat
from kazoo.retry import KazooRetry

from blobha.zk.lockdown import ZkCredentials
from blobha.zk.tls import ZkTls

log = logging.getLogger("blobha.zkclient")

#: What a ZooKeeper call fails with when ZooKeeper is out of reach, not because of the call:
#: the connection or session went, or the request was given up unanswered (KazooTimeoutError:
#: a connection dropping under it, or a session ZooKeeper granted longer than we wait for).
UNREACHABLE = (ConnectionLoss, SessionExpiredError, ConnectionClosedError, OperationTimeoutError,
               SessionMovedError, KazooTimeoutError)

_READ = select.POLLIN | select.POLLPRI
_WRITE = select.POLLOUT


def _fd(obj: Any) -> int:
    return obj if isinstance(obj, int) else int(obj.fileno())


def poll_select(rlist: Sequence[Any], wlist: Sequence[Any], xlist: Sequence[Any],
                timeout: float | None = None) -> tuple[list[Any], list[Any], list[Any]]:
    """``select.select``'s contract (objects ready to read, to write, and none exceptional),
    as kazoo's ``selector_select`` gives it, from one ``poll(2)``.

    As in :mod:`selectors`, an error or hang-up on a descriptor counts as ready for what was
    asked of it, so the caller's next ``recv`` or ``send`` reports the failure."""
    if timeout is not None and timeout < 0:
        raise ValueError("timeout must be non-negative")
    wanted: dict[int, int] = {}
    for obj in rlist:
        fd = _fd(obj)
        wanted[fd] = wanted.get(fd, 0) | _READ
    for obj in wlist:
        fd = _fd(obj)
        wanted[fd] = wanted.get(fd, 0) | _WRITE
    poller = select.poll()
    for fd, events in wanted.items():
        poller.register(fd, events)
    # A TLS socket may hold decrypted bytes its descriptor no longer shows (a second reply
    # read along with the first): it is ready now, whatever poll says.
    buffered = [obj for obj in rlist if not isinstance(obj, int)
                and getattr(obj, "pending", None) is not None and obj.pending() > 0]
    if buffered:
        timeout = 0
    # Rounded up: a wait shorter than a millisecond must not become a busy loop.
    ready = dict(poller.poll(None if timeout is None else math.ceil(timeout * 1000)))
    readable = [obj for obj in rlist if ready.get(_fd(obj), 0) & ~_WRITE or obj in buffered]
    writable = [obj for obj in wlist if ready.get(_fd(obj), 0) & ~_READ]
    return readable, writable, []


class PollHandler(SequentialThreadingHandler):  # type: ignore[misc]
    """kazoo's threading handler with :func:`poll_select`."""

    def select(self, *args: Any, **kwargs: Any) -> tuple[list[Any], list[Any], list[Any]]:
        return poll_select(*args, **kwargs)


#: ZooKeeper's ``addWatch`` operation and its recursive mode (``AddWatchMode``).
_ADD_WATCH = 106
_PERSISTENT_RECURSIVE = 1


class _AddWatch:
    """The request, in the shape kazoo's connection sends (``type``, ``serialize``) and answers
    (``deserialize``)."""

    type = _ADD_WATCH

    def __init__(self, path: str, mode: int) -> None:
        self.path = path
        self.mode = mode

    def __repr__(self) -> str:
        return f"AddWatch(path={self.path!r}, mode={self.mode})"

    def serialize(self) -> bytearray:
        b = bytearray(write_string(self.path))
        b.extend(int_struct.pack(self.mode))
        return b

    @classmethod
    def deserialize(cls, buffer: bytes, offset: int) -> bool:
        return True  # the reply is its header alone


#: ZooKeeper's ``multiRead`` operation, and the read operations and error result in it.
_MULTI_READ = 22
_GET_DATA = 4
_GET_CHILDREN = 8
_ERROR = -1

#: One read's answer: (data, stat) of a node, the names of its children, or the error.
ReadResult = tuple[bytes, ZnodeStat] | list[str] | Exception


class _MultiRead:
    """The request (``type``, ``serialize``) and its answer (``deserialize``), as for
    :class:`_AddWatch`: ``ops`` are (``_GET_DATA`` or ``_GET_CHILDREN``, full path)."""

    type = _MULTI_READ

    def __init__(self, ops: list[tuple[int, str]]) -> None:
        self.ops = ops

    def __repr__(self) -> str:
        return f"MultiRead({len(self.ops)} reads)"

    def serialize(self) -> bytearray:
        b = bytearray()
        for op, path in self.ops:
            b.extend(multiheader_struct.pack(op, False, -1))
            b.extend(write_string(path))
            b.append(0)  # no watch: a multiRead sets none
        b.extend(multiheader_struct.pack(-1, True, -1))
        return b

    @classmethod
    def deserialize(cls, buffer: bytes, offset: int) -> list[ReadResult]:
        results: list[ReadResult] = []
        while True:
            op, done, _ = multiheader_struct.unpack_from(buffer, offset)
            offset += multiheader_struct.size
            if done:
                return results
            if op == _GET_DATA:
                data, offset = read_buffer(buffer, offset)
                stat = ZnodeStat._make(stat_struct.unpack_from(buffer, offset))
                offset += stat_struct.size
                results.append((data or b"", stat))
            elif op == _GET_CHILDREN:
                count = int_struct.unpack_from(buffer, offset)[0]
                offset += int_struct.size
                names = []
                for _ in range(max(count, 0)):
                    name, offset = read_string(buffer, offset)
                    names.append(name)
                results.append(names)
            elif op == _ERROR:
                code = int_struct.unpack_from(buffer, offset)[0]
                offset += int_struct.size
                results.append(EXCEPTIONS[code]())
            else:
                raise ValueError(f"multiRead answer with an operation of type {op}")


def read_many_async(zk: KazooClient, reads: Sequence[tuple[str, bool]]) -> IAsyncResult:
    """Send one ``multiRead`` request: for each (path, children) in ``reads``, the node's data
    and stat, or with ``children`` the names of its children. The async result gives a list
    of :data:`ReadResult`, in order; a read that failed (the node does not exist) holds its
    exception, and the others are still answered. No watch is set.

    One request instead of one per read: a follower reads each new key once, and each request
    and answer costs ZooKeeper and kazoo's connection thread the same whatever it carries.
    A server older than 3.6 fails the request with
    :class:`kazoo.exceptions.UnimplementedError`."""
    result = zk.handler.async_result()
    ops = [(_GET_CHILDREN if children else _GET_DATA, _prefix_root(zk.chroot, path))
           for path, children in reads]
    zk._call(_MultiRead(ops), result)
    return result


def read_many(zk: KazooClient, reads: Sequence[tuple[str, bool]], per_request: int,
              timeout: float, in_flight: int = 0) -> list[ReadResult]:
    """:func:`read_many_async`'s answers for ``reads``, in order, in requests of
    ``per_request`` reads, at most ``in_flight`` of them sent at once (0: all): answers held
    in memory are bounded that way at 100,000s of keys. A request that fails gives each of its
    reads its exception; :class:`kazoo.exceptions.UnimplementedError` (a server older than
    3.6) is raised."""
    out: list[ReadResult] = []
    chunks = [reads[i:i + per_request] for i in range(0, len(reads), per_request)]
    window = in_flight or max(len(chunks), 1)
    for start in range(0, len(chunks), window):
        pending = [(len(chunk), read_many_async(zk, chunk))
                   for chunk in chunks[start:start + window]]
        for asked, request in pending:
            try:
                answers = request.get(timeout=timeout)
                if len(answers) != asked:
                    raise ZookeeperError(f"a multiRead of {asked} reads came back with"
                                         f" {len(answers)} answers")
                out.extend(answers)
            except UnimplementedError:
                raise
            except Exception as e:
                out.extend([e] * asked)
    return out


class _Recursive:
    """The persistent recursive watches of one client, and the hook that delivers them.

    kazoo hands each watch event to the one-shot watchers registered for its exact path; this
    wraps its connection's event reader so that every event at or below a watched path also
    goes to that path's callback, in the order ZooKeeper sent them: through kazoo's callback
    thread (in order with the one-shot watches' events too), or inline."""

    def __init__(self, zk: KazooClient) -> None:
        self.zk = zk
        self.lock = threading.Lock()
        # Chrooted path -> (its prefix for the paths below it, callback, whether it runs on
        # the connection thread).
        self.watches: dict[str, tuple[str, Callable[[WatchedEvent], None], bool]] = {}
        connection = zk._connection
        self._read_event = connection._read_watch_event
        connection._read_watch_event = self._on_event_frame

    def _on_event_frame(self, buffer: bytes, offset: int) -> None:
        zk = self.zk
        watch, _ = Watch.deserialize(buffer, offset)
        path = watch.path
        with self.lock:
            callbacks = [(cb, inline) for base, (below, cb, inline) in self.watches.items()
                         if path == base or path.startswith(below)]
        etype = EVENT_TYPE_MAP.get(watch.type)
        # A child event comes only for a one-shot watch on the same connection: ZooKeeper
        # sends recursive watches created, deleted and changed events alone.
        if callbacks and etype not in (None, "CHILD") and not zk._stopped.is_set():
            event = WatchedEvent(etype, zk._state, zk.unchroot(path))
            for cb, inline in callbacks:
                if inline:
                    try:
                        cb(event)
                    except Exception:
                        # Never let a callback end kazoo's connection thread.
                        log.exception("recursive watch callback failed on %s", path)
                else:
                    zk.handler.dispatch_callback(Callback("watch", cb, (event,)))
        # kazoo's own reader only hands events to one-shot watchers: with none on this path
        # (nearly every event of a recursive watch), it would parse the frame again for nothing.
        if path in zk._data_watchers or path in zk._child_watchers:
            self._read_event(buffer, offset)


def on_session_timeout(zk: KazooClient, callback: Callable[[float], None]) -> None:
    """Call ``callback`` with the session timeout ZooKeeper granted (seconds) at every
    connection, on kazoo's connection thread, right after kazoo reports the connection.

    The server bounds what a client asks for by its minSessionTimeout and maxSessionTimeout
    (by default 2 and 20 ticks), and kazoo keeps the figure it got to itself (its connect
    answer's ``time_out``, of which it returns two thirds as the read timeout). A watchdog
    timed on the configured figure would count a session as alive after ZooKeeper ended it."""
    connection = zk._connection
    connect = connection._connect

    def connected(host: str, hostip: str, port: int) -> Any:
        result = connect(host, hostip, port)
        try:
            callback(round(result[0] * 1.5) / 1000.0)  # read timeout = granted * 2/3, in ms
        except Exception:
            # Never let a callback end kazoo's connection thread.
            log.exception("session timeout callback failed")
        return result

    connection._connect = connected


def before_each_connection(zk: KazooClient, callback: Callable[[], None]) -> None:
    """Call ``callback`` on kazoo's connection thread before each attempt to connect, before
    kazoo reads its TLS files for it (a failing callback is logged; the attempt goes on)."""
    connection = zk._connection
    connect = connection._connect

    def connecting(host: str, hostip: str, port: int) -> Any:
        try:
            callback()
        except Exception:
            log.exception("callback before a connection to ZooKeeper failed")
        return connect(host, hostip, port)

    connection._connect = connecting


_hooks_lock = threading.Lock()


def add_recursive_watch(zk: KazooClient, path: str, callback: Callable[[WatchedEvent], None],
                        timeout: float | None = None, inline: bool = False) -> None:
    """Watch ``path`` and everything below it until the connection ends: ``callback`` gets a
    :class:`WatchedEvent` (CREATED, DELETED or CHANGED, never CHILD) for every change at or
    below ``path``, in ZooKeeper's order, for as long as the connection lasts.

    It runs on kazoo's callback thread, or with ``inline`` on its connection thread, as the
    event is read: before any reply that follows it, and without a hand-over between threads
    per event (a recursive watch brings several per write). An inline callback must be quick
    and must not wait on kazoo (no synchronous calls, no waiting on async results).

    ZooKeeper keeps the watch on the connection: after any reconnect (kazoo re-sends no
    watches), call this again, and read again what may have changed in between. Raises what
    the request raised: :class:`kazoo.exceptions.UnimplementedError` from a server older than
    3.6.

    Set no one-shot watch on ``path`` itself: before ZooKeeper 3.9 (ZOOKEEPER-4466) a
    standard watch added on the same path by the same client can replace the persistent one.
    One-shot watches below it are fine, and kazoo still delivers them. One callback per path:
    adding a watch on a path again replaces the earlier callback."""
    with _hooks_lock:
        hook: _Recursive | None = getattr(zk, "_blobha_recursive", None)
        if hook is None:
            hook = _Recursive(zk)
            zk._blobha_recursive = hook
    full = _prefix_root(zk.chroot, path)
    with hook.lock:
        # Registered first: events can follow the server's answer before it reaches us.
        previous = hook.watches.get(full)
        hook.watches[full] = (full.rstrip("/") + "/", callback, inline)
    result = zk.handler.async_result()
    try:
        zk._call(_AddWatch(full, _PERSISTENT_RECURSIVE), result)
        result.get(timeout=timeout)
    except BaseException:
        # No new watch on the server: back to what was there before. A first add leaves no
        # callback, which must not take the events of one-shot watches below the path (a
        # fallback to them would see every change twice).
        with hook.lock:
            if previous is None:
                hook.watches.pop(full, None)
            else:
                hook.watches[full] = previous
        raise


__all__ = ["UNREACHABLE", "PollHandler", "ReadResult", "add_recursive_watch",
           "before_each_connection", "poll_select", "read_many", "read_many_async"]


def master_client(hosts: str, timeout: float, credentials: ZkCredentials | None,
                  tls: ZkTls | None = None) -> KazooClient:
    """A master's ZooKeeper client, over TLS with ``tls``. It reconnects forever, but never
    lets kazoo retry an *operation* across sessions: a leader write must not land on a fresh
    session after leadership was lost (ha-rule 3)."""
    return KazooClient(
        hosts=hosts,
        timeout=timeout,
        connection_retry=KazooRetry(max_tries=-1, max_delay=2.0),
        command_retry=KazooRetry(max_tries=0, ignore_expire=False),
        handler=PollHandler(),
        **(credentials.kazoo_args() if credentials else {}),
        **(tls.kazoo_args() if tls else {}),
    )
