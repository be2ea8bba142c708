"""Routing of the client's calls: known masters, the leader, redirects, retries.

It keeps the masters the client knows, the leader, and the master its reads stick to; and it
carries what the client's transfers share (the transport, data channels, timeouts, chunk
size)."""

from __future__ import annotations

import contextlib
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from blobha.client.limits import ClientLimits
from blobha.client.retry import (
    Deadline,
    Mismatches,
    backoff_delay,
    cut_short,
    gave_up,
    may_have_run,
    now,
)
from blobha.client.seen import DEFAULT_REMEMBERED_KEYS, SeenVersions
from blobha.client.transport import HandshakeFailed, LeaderMoved, NoConnection, Transport
from blobha.core.consistency import View
from blobha.core.errors import (
    BlobError,
    DeadlineExceeded,
    InvalidArgument,
    KeyNotFound,
    NotAuthorized,
    NotLeader,
    Stale,
    TlsMismatch,
    Unauthenticated,
    Unavailable,
    VersionConflict,
)
from blobha.v1 import blobha_pb2 as pb
from blobha.wire.convert import min_version_to_pb
from blobha.wire.datachannel import DataChannels

# One round of leader discovery; ClusterSummary itself asks every master, so allow it time.
PROBE_TIMEOUT = 10.0
#: Longest wait for a cheap control call (begin an upload, ask how much arrived). A leader that
#: takes longer is treated as gone (paused, partitioned, half-dead) and another is looked for;
#: retrying these calls is harmless, an unanswered upload simply expires on the server.
_CONTROL_TIMEOUT = 8.0
#: What a master answers about the caller, not about itself: no credential, a wrong one, no
#: permission, a bad request. Every master would say the same, so it is reported at once
#: instead of being retried until the deadline as if the cluster were unavailable.
_REFUSALS: tuple[type[BlobError], ...] = (NotAuthorized, InvalidArgument)
#: How long a call retries quietly before Client.on_retry hears of it: a failover's redirect
#: or a master's restart is usually over by then, and needs no word to the user.
_RETRY_NOTICE_AFTER = 2.0

#: How long, once no master was found in touch with ZooKeeper, reads with no minimum ask for
#: the last known view before looking again.
_OUTAGE_MEMORY = 5.0
#: How long the masters are given to say whether they are in touch with ZooKeeper.
_OUTAGE_PROBE_SECS = 2.0

_WIRE_VIEWS = {View.SESSION: pb.READ_VIEW_SESSION, View.LINEARIZABLE: pb.READ_VIEW_LINEARIZABLE,
               View.LAST_KNOWN: pb.READ_VIEW_LAST_KNOWN}

T = TypeVar("T")
#: The reads that carry a minimum view of their key.
R = TypeVar("R", pb.GetMetaRequest, pb.DownloadRequest, pb.GetReplicationRequest,
              pb.PeerPlanRequest)


class Silence:
    """One call's run of failures in which no master answered at all (no connection to any):
    since when, and each master's error. Any answer, a refusal too, ends the run."""

    def __init__(self) -> None:
        self.since: float | None = None
        self.errors: dict[str, str] = {}
        #: Whether the last failure left every known master without an answer.
        self.everyone = False

    def saw(self, exc: BlobError, addresses: Sequence[str]) -> BlobError:
        """Note ``exc``; the error to report: one naming every master's error once none of
        ``addresses`` answered, else ``exc``."""
        self.everyone = False
        if not isinstance(exc, NoConnection):
            self.since = None
            self.errors.clear()
            return exc
        if self.since is None:
            self.since = now()
        self.errors.update(exc.errors)
        if not addresses or not set(addresses).issubset(self.errors):
            return exc
        self.everyone = True
        named = "; ".join(f"{a}: {self.errors[a]}" for a in addresses)
        return NoConnection(f"none of the {len(addresses)} masters answered ({named})",
                            {a: self.errors[a] for a in addresses})

    def lasted(self) -> float:
        return 0.0 if self.since is None else now() - self.since


class Router:
    """Routes and retries the calls of one client; shared by its threads."""

    def __init__(self, addresses: Sequence[str], transport: Transport, timeout: float,
                 stall_timeout: float, chunk_size: int,
                 remembered_keys: int = DEFAULT_REMEMBERED_KEYS,
                 limits: ClientLimits | None = None) -> None:
        self.transport = transport
        self.limits = limits or ClientLimits()
        #: The newest version of each key this client wrote or read: every read carries it as
        #: the oldest view it accepts (read-your-writes, monotonic reads).
        self.seen = SeenVersions(remembered_keys)
        #: SESSION, or LINEARIZABLE for every read (Client's ``consistency``).
        self.view = View.SESSION
        self.timeout = timeout
        self.stall_timeout = stall_timeout
        self.chunk_size = chunk_size
        self.data_channels = DataChannels(tls=transport.data_tls)
        self.rng = random.Random()
        #: Replaceable so tests do not wait for real backoff.
        self.sleep: Callable[[float], None] = time.sleep
        #: Told, once per call, when it has retried for a while: (what, why, seconds left before
        #: it gives up). The command line says it on a terminal, so a long wait (a ZooKeeper
        #: outage, say, retried for the whole timeout) is not a silent one.
        self.on_retry: Callable[[str, BlobError, float], None] | None = None
        #: How long a call goes on while no master answers at all (every one refuses the
        #: connection or has no address), before it gives up naming each one's error; None:
        #: for the whole timeout, as for masters that answer without a leader. The command
        #: line sets a few seconds: a person waits on it, and a wrong address is the likely
        #: cause.
        self.unreachable_after: float | None = None
        self._lock = threading.Lock()
        self._silences: weakref.WeakKeyDictionary[Deadline, Silence] = (
            weakref.WeakKeyDictionary())
        self._known: list[str] = list(addresses)
        self._leader: str | None = None
        # Until when reads with no minimum ask for the last known view (no master in touch).
        self._outage_until = 0.0
        # Metadata reads stick to one master (the leader after a write, for read-your-writes)
        # and move on when it fails; the first pick is random to spread clients out.
        self._preferred = self.rng.choice(addresses)

    def learn(self, addresses: Iterable[str]) -> None:
        with self._lock:
            for address in addresses:
                if address and address not in self._known:
                    self._known.append(address)

    def known_addresses(self) -> list[str]:
        with self._lock:
            return list(self._known)

    def redirect(self, tried: str, leader: str) -> None:
        with self._lock:
            # A follower naming itself, or naming nobody, knows no better than we do:
            # forget and discover again after the backoff.
            self._leader = leader if leader and leader != tried else None
        if leader:
            self.learn([leader])

    def leader_moved(self, tried: str, leader: str) -> None:
        """``tried`` went silent and ``leader`` leads now: calls go there, reads that stuck to
        ``tried`` too (the next one may settle a write left there, and must not wait on it)."""
        self.redirect(tried, leader)
        with self._lock:
            if self._preferred == tried:
                self._preferred = leader

    def forget_leader(self, address: str) -> None:
        with self._lock:
            if self._leader == address:
                self._leader = None
            if self._preferred == address:
                self._preferred = self._next_known(address)

    def _next_known(self, address: str) -> str:
        # Lock held by the caller.
        if address not in self._known:
            return self._known[0]
        return self._known[(self._known.index(address) + 1) % len(self._known)]

    def preferred(self) -> str:
        """The master reads go to."""
        with self._lock:
            return self._preferred

    def after_write(self, leader: str) -> None:
        with self._lock:
            self._preferred = leader

    def discover_leader(self, deadline: Deadline) -> str:
        with self._lock:
            if self._leader:
                return self._leader
        addresses = self.known_addresses()
        timeout = min(deadline.remaining(), PROBE_TIMEOUT)
        if timeout <= 0:
            raise DeadlineExceeded("no leader found before the deadline")
        first_error: BlobError | None = None
        refusal: BlobError | None = None
        cut_off: BlobError | None = None
        answered = False
        no_handshake: set[str] = set()
        lasting = True
        unreached: dict[str, str] = {}
        with contextlib.closing(
            self.transport.probe(addresses, "ClusterSummary", pb.ClusterSummaryRequest(), timeout)
        ) as results:
            for source, result in results:
                if isinstance(result, _REFUSALS):
                    # About the caller, not the cluster: a retry would only be refused again.
                    refusal = refusal or result
                    continue
                if isinstance(result, BlobError):
                    if isinstance(result, NoConnection):
                        unreached.update(result.errors)
                    if isinstance(result, HandshakeFailed):
                        no_handshake.update(result.addresses)
                        lasting = lasting and result.lasting
                    # A master's own reason ("ZooKeeper is unreachable") says more than
                    # another one's silence, whichever came first.
                    if first_error is None or isinstance(first_error, DeadlineExceeded):
                        first_error = result
                    continue
                self.learn(m.address for m in result.masters)
                if result.leader:
                    self.learn([result.leader])
                    with self._lock:
                        self._leader = result.leader
                    return str(result.leader)
                if result.zookeeper_unreachable:
                    # It answered from what it last saw: its reason says more than silence.
                    cut_off = cut_off or Unavailable(
                        f"ZooKeeper is unreachable from master {source}, and no master it"
                        " knows of leads; retry when ZooKeeper is back")
                    continue
                answered = True
        if unreached.keys() >= set(addresses):
            # Nobody answered at all: not "no leader yet", which is worth the whole timeout.
            named = "; ".join(f"{a}: {unreached[a]}" for a in addresses)
            raise NoConnection(f"none of the {len(addresses)} masters answered ({named})",
                               unreached)
        if answered:
            # Some master accepted us (one that refused may not have reloaded its tokens yet).
            raise Unavailable("no leader is elected yet (a failover may be in progress)")
        if cut_off is not None:
            raise cut_off
        if refusal is not None:
            waited = deadline.seconds - deadline.remaining()
            if (isinstance(refusal, Unauthenticated)
                    and waited < self.limits.refusal_patience_secs):
                raise Unavailable(f"{refusal} (asking again for a moment: a token added just now"
                                  " may not be loaded yet)")
            raise refusal
        if isinstance(first_error, HandshakeFailed) and no_handshake.issuperset(addresses):
            raise HandshakeFailed(str(first_error), frozenset(no_handshake), lasting)
        if isinstance(first_error, DeadlineExceeded) and deadline.expired():
            # Every probe ran into the end of the caller's deadline: the caller reports why it
            # was retrying (see _retry), not that its last look for a leader was cut short.
            raise DeadlineExceeded(f"no master answered at {', '.join(addresses)} before the"
                                   f" deadline ({first_error})")
        # Not "no master answered": each may have answered, with its reason ("ZooKeeper is
        # unreachable"), and the first such reason is given.
        raise Unavailable(
            f"no master at {', '.join(addresses)} named a leader"
            + (f" ({first_error})" if first_error else "")
        )

    def pause(self, attempt: int, deadline: Deadline, last: BlobError, what: str) -> None:
        """Sleep before retry ``attempt``, or raise ``last`` if the deadline would pass; once
        no master has answered at all, the error names each one's, and it is raised after
        :attr:`unreachable_after` of that."""
        with self._lock:
            # Every retry loop (uploads' and downloads' too) comes here with its call's deadline.
            silence = self._silences.setdefault(deadline, Silence())
        last = silence.saw(last, self.known_addresses())
        if (self.unreachable_after is not None and silence.everyone
                and silence.lasted() >= self.unreachable_after):
            raise gave_up(last, what, self.unreachable_after)
        delay = backoff_delay(attempt, rand=self.rng.random)
        left = deadline.remaining()
        if delay >= left:
            raise gave_up(last, what, deadline.seconds)
        if (self.on_retry is not None and not deadline.noticed
                and deadline.seconds - left >= _RETRY_NOTICE_AFTER):
            deadline.noticed = True
            self.on_retry(what, last, left)
        self.sleep(delay)

    def retry(self, what: str, deadline: Deadline, attempt_fn: Callable[[], T]) -> T:
        attempt = 0
        last: BlobError | None = None
        mismatches = Mismatches()
        while True:
            try:
                return attempt_fn()
            except (NotLeader, Unavailable) as exc:
                last = exc
                self.give_up_on_tls(exc, mismatches)
                self.pause(attempt, deadline, exc, what)
            except DeadlineExceeded as exc:
                cut_short(exc, last, what, deadline)
            attempt += 1

    def give_up_on_tls(self, exc: BlobError, run: Mismatches) -> None:
        """Raise :class:`TlsMismatch` once every known master has failed the TLS handshake, in
        failures one after the other for at least ``limits.refusal_patience_secs`` (``run``: this
        call's current run of them): the client's TLS settings are wrong, and waiting out the
        whole timeout would not change them. Any other failure ends the run."""
        if not isinstance(exc, HandshakeFailed):
            run.clear()
            return
        at = now()
        if run.since is None:
            run.since = at
        run.addresses.update(exc.addresses)
        # A lasting mismatch (TLS on the masters' side only) needs no patience: no reload of
        # certificates ends it.
        if ((exc.lasting or at - run.since >= self.limits.refusal_patience_secs)
                and run.addresses.issuperset(self.known_addresses())):
            raise TlsMismatch(str(exc)) from None

    def leader_call(
        self, what: str, method: str, request: Any, missing_ok_on_retry: bool = False,
        conflict_on_retry: Callable[[Deadline], Any] | None = None,
        deadline: Deadline | None = None,
    ) -> Any:
        """Call the leader, retried until the deadline. ``conflict_on_retry``: for a
        conditional change, given a conflict after an attempt whose answer was lost, the
        response that attempt made (None: not ours, the conflict stands)."""
        deadline = deadline or Deadline(self.timeout)
        uncertain = False

        def attempt() -> Any:
            nonlocal uncertain
            leader = self.discover_leader(deadline)
            try:
                response = self.transport.unary(leader, method, request, deadline.remaining(),
                                                 stall=self.stall_timeout,
                                                 rivals=self.known_addresses())
            except NotLeader as exc:
                self.redirect(leader, exc.leader)
                raise
            except LeaderMoved as exc:
                uncertain = True
                self.leader_moved(leader, exc.leader)
                raise
            except Unavailable as exc:
                uncertain = uncertain or may_have_run(exc)
                self.forget_leader(leader)
                raise
            except KeyNotFound:
                # An earlier attempt may have deleted the key before its answer was lost.
                if missing_ok_on_retry and uncertain:
                    return None
                raise
            except VersionConflict:
                if conflict_on_retry is not None and uncertain:
                    made = conflict_on_retry(deadline)
                    if made is not None:
                        return made
                raise
            self.after_write(leader)
            return response

        return self.retry(what, deadline, attempt)

    def control_call(self, address: str, method: str, request: Any, deadline: Deadline,
                     to_leader: bool = False) -> Any:
        """A cheap call, given at most :data:`_CONTROL_TIMEOUT` of ``deadline``: a master that
        neither answers nor refuses in that time (paused, cut off) raises :class:`Unavailable`,
        so the caller moves on to another master; only the deadline's own end raises
        :class:`DeadlineExceeded`. ``to_leader``: a silent leader is left sooner, once another
        master leads."""
        remaining = deadline.remaining()
        limit = min(remaining, _CONTROL_TIMEOUT)
        try:
            if to_leader:
                return self.transport.unary(address, method, request, limit,
                                            stall=self.stall_timeout,
                                            rivals=self.known_addresses())
            return self.transport.unary(address, method, request, limit)
        except DeadlineExceeded:
            # Whether the deadline's end was the limit, as it stood when the call began:
            # compared after the call, a limit that merely took what it was given (8 of the
            # 14 s left) read as the deadline's end, and the caller tried no other master.
            if limit >= remaining:
                raise
            raise Unavailable(f"master {address} did not answer {method} within"
                              f" {_CONTROL_TIMEOUT:.0f}s; trying another") from None

    def read_call(
        self, what: str, method: str, request: Any, deadline: Deadline | None = None,
        key: str | None = None,
    ) -> Any:
        """A read at the preferred master, then the others, within ``deadline``. With ``key``,
        ``request`` is a read of it: each attempt carries the view it needs
        (:meth:`with_minimum`)."""
        deadline = deadline or Deadline(self.timeout)

        def attempt() -> Any:
            address = self.preferred()
            if key is not None:
                self.with_minimum(key, request)
            with self._lock:
                # Reads stick to the leader after a write: a paused one is left as soon as
                # its successor leads, as its writes are, not after the control timeout.
                leading = address == self._leader
            try:
                return self.control_call(address, method, request, deadline, to_leader=leading)
            except Stale:
                self.forget_leader(address)
                self.refused_as_stale(address, request)  # may name the next master
                raise
            except LeaderMoved as exc:
                self.leader_moved(address, exc.leader)
                raise
            except Unavailable:
                self.forget_leader(address)
                raise

        return self.retry(what, deadline, attempt)

    def with_minimum(self, key: str, request: R) -> R:
        """``request`` (a read of ``key``) carrying the oldest view of it this client accepts:
        a master whose view is older refuses it as :class:`Stale`, an Unavailable, and the
        read moves on to another master like any retry. Its view: the client's; for a read
        with no minimum while every known master refused one as cut off from ZooKeeper (an
        outage of ZooKeeper itself), the last view a master knows."""
        minimum = self.seen.minimum(key)
        if minimum is not None:
            request.min_version.CopyFrom(min_version_to_pb(minimum))
        else:
            request.ClearField("min_version")
        view = self.view
        if view == View.SESSION and minimum is None and self.in_outage():
            view = View.LAST_KNOWN
        request.view = _WIRE_VIEWS[view]
        return request

    def refused_as_stale(self, address: str, request: Any) -> None:
        """``address`` refused ``request`` as stale. With no minimum, that says it is cut off
        from ZooKeeper: ask every known master at once, briefly, whether it is in touch. The
        next read goes to one that is; if none is (ZooKeeper itself is out, and nothing newer
        can commit), reads with no minimum ask for the last known view for a while, at a
        master that answered."""
        if request.view != View.SESSION or request.HasField("min_version"):
            return
        in_touch: list[str] = []
        cut_off = {address}
        with contextlib.closing(self.transport.probe(
                self.known_addresses(), "NodeStatus", pb.NodeStatusRequest(),
                _OUTAGE_PROBE_SECS)) as results:
            for source, result in results:
                if isinstance(result, BlobError):
                    continue  # silent or busy: not a master to read from now
                if result.zookeeper_unreachable:
                    cut_off.add(source)
                elif source != address:
                    in_touch.append(source)
        with self._lock:
            # More masters in touch than cut off: this one is cut off alone. Otherwise take it
            # as ZooKeeper's own outage: a master that says it is in touch then may not have
            # noticed yet, and its reads would wait on ZooKeeper for the session timeout.
            if len(in_touch) > len(cut_off):
                self._preferred = in_touch[0]
                self._outage_until = 0.0
            else:
                self._preferred = address
                self._outage_until = now() + _OUTAGE_MEMORY

    def in_outage(self) -> bool:
        """Whether reads with no minimum now ask for the last known view (no master found in
        touch with ZooKeeper): they go to the master that said so, which answers at once."""
        return now() < self._outage_until

    def read_meta(self, key: str, deadline: Deadline | None) -> Any:
        """GetMeta's answer, within ``deadline`` (None: the client's timeout), from a master
        whose view is at least what this client has seen of ``key``."""
        meta = self.read_call(f"read the metadata of {key!r}", "GetMeta",
                              pb.GetMetaRequest(key=key, any_access=True), deadline, key)
        self.seen.saw(key, meta.version, meta.created_at)
        return meta
