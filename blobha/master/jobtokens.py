"""Job tokens (docs/security.md, "Job tokens"), modelled on Hadoop delegation tokens: the leader
issues and revokes them in fenced ZooKeeper transactions; every master verifies them against
their hashed records in ``/job-tokens``.

Verification is cheap per call: a record read from ZooKeeper is remembered for at most
:data:`CACHE_SECS`, and the watch set by that read forgets it as soon as it is deleted
(revoked), so a revoked token stops working on every master at once while its session is
connected, and within :data:`CACHE_SECS` in any case (a master that cannot re-read a record
refuses the token with UNAVAILABLE rather than trust what it remembers longer). The hash is
compared and the expiry checked on every call, cached or not.
"""

from __future__ import annotations

import hmac
import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError
from kazoo.protocol.states import WatchedEvent

from blobha.core import acl as acls
from blobha.core.admission import PeerCaps, costly
from blobha.core.auth import AuthMode, job_token_hash, job_token_id, new_job_token, split_job_token
from blobha.core.errors import (
    InvalidArgument,
    KeyNotFound,
    NotAuthorized,
    Unauthenticated,
    Unavailable,
)
from blobha.core.keys import validate_key
from blobha.leader import Deposed, LeaderElection
from blobha.master.metadata import Metadata
from blobha.master.quotas import Quotas
from blobha.master.rules import Authority, no_such_key
from blobha.wire.authn import Caller
from blobha.wire.status import JobToken
from blobha.zk.connection import UNREACHABLE
from blobha.zk.layout import JOB_TOKENS, MAX_STATE_BYTES, JobTokenRecord, job_token_path

log = logging.getLogger("blobha.master")

#: How long a master trusts a record it read without reading it again: the bound on how long
#: a revoked token may still work on a master whose watch did not fire (a lost connection).
CACHE_SECS = 5.0
#: A job token's lifetime when the caller asks for none (a day's job, as Hadoop's default).
DEFAULT_LIFETIME_SECS = 24 * 3600
_CACHE_SIZE = 4096
#: ZooKeeper look-ups of tokens not remembered, at once: whoever sends made-up tokens costs
#: ZooKeeper reads, and this bounds how many (user tokens bound their scrypt checks alike).
LOOKUP_SLOTS = 4
#: Records a leader looks at for expiry after each issue: more than one, so the expired ones
#: are removed faster than new ones come, and a bounded cost per call.
_SWEEP = 32
#: Records read at once when the leader counts the live tokens of every user.
_READ_AHEAD = 256
_REFUSED = ("the job token was refused (unknown, revoked or altered); ask the job's submitter"
            " for a valid one")


def _when(epoch_secs: float) -> str:
    return datetime.fromtimestamp(epoch_secs, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class JobTokens:
    """Issue and revoke (the leader), verify (every master: a
    :class:`blobha.wire.authn.JobTokenVerifier`)."""

    def __init__(self, zk: KazooClient, election: LeaderElection, meta: Metadata,
                 authority: Authority, auth_mode: AuthMode | str, max_lifetime_secs: int,
                 quotas: Quotas, clock: Callable[[], float] = time.time) -> None:
        self.zk = zk
        self.quotas = quotas
        self.election = election
        self.meta = meta
        self.authority = authority
        self.auth_mode = AuthMode(auth_mode)
        self.max_lifetime_secs = max_lifetime_secs
        self.clock = clock
        self._lock = threading.Lock()
        # Beyond these, a look-up is refused at once as busy rather than wait on a call thread;
        # one connection gets one at a time, one host all but one.
        self._lookups = PeerCaps("checking job tokens", total=LOOKUP_SLOTS, per_connection=1,
                                 per_host=LOOKUP_SLOTS - 1)
        # id -> (time.monotonic() when read, record)
        self._cache: OrderedDict[str, tuple[float, JobTokenRecord]] = OrderedDict()
        # The leader's count of live tokens per user, for auth.job.token.max.per.user: user ->
        # {id: expiry}, read from /job-tokens once in each leadership term (the epoch it was
        # read in), then kept by this leader's issues and revokes. Held across a check and its
        # issue, so that concurrent issues cannot pass the limit together.
        self._live: dict[str, dict[str, float]] = {}
        self._live_epoch = -1
        self._issuing = threading.Lock()

    def _record_changed(self, event: WatchedEvent) -> None:
        # A watch on one record (set by the read that cached it), not on /job-tokens: a
        # change of the children would make every master fetch every token's id.
        if event.path:
            with self._lock:
                self._cache.pop(event.path.rsplit("/", 1)[-1], None)

    # ---- every master ------------------------------------------------------------------------

    def verify(self, token_id: str, secret: str) -> Caller:
        record = self._record(token_id)
        if record is None or not hmac.compare_digest(record.digest,
                                                     job_token_hash(token_id, secret)):
            raise Unauthenticated(_REFUSED)
        if self.clock() >= record.expires_at:
            raise Unauthenticated(f"the job token {token_id} expired at"
                                  f" {_when(record.expires_at)}; ask for a new one")
        return Caller(record.user, frozenset(record.keys), token_id)

    def _record(self, token_id: str) -> JobTokenRecord | None:
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(token_id)
            if hit is not None and now - hit[0] < CACHE_SECS:
                return hit[1]
        try:
            self.meta.require_zk()
            with costly(self._lookups):
                data = self._read(token_id)
                if data is None:
                    # Issued just now through the leader's session, perhaps not yet seen by
                    # this master's ZooKeeper server: catch up once before saying it does not
                    # exist.
                    self.meta.answer(self.zk.sync_async(job_token_path(token_id)))
                    data = self._read(token_id)
        except UNREACHABLE:
            raise Unavailable("cannot check the job token: ZooKeeper is unreachable from this"
                              " master; retry shortly or use another master") from None
        if data is None:
            return None
        try:
            record = JobTokenRecord.decode(data)
        except ValueError as e:
            log.error("job token record %s unreadable (%s); refusing the token", token_id, e)
            return None
        with self._lock:
            self._cache[token_id] = (now, record)
            self._cache.move_to_end(token_id)
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return record

    def _read(self, token_id: str) -> bytes | None:
        try:
            data, _ = self.meta.answer(self.zk.get_async(job_token_path(token_id),
                                                         watch=self._record_changed))
        except NoNodeError:
            return None
        return bytes(data)

    # ---- the leader --------------------------------------------------------------------------

    def issue(self, user: str, keys: Sequence[str], lifetime_secs: int) -> JobToken:
        """A new job token for ``user``: READ on ``keys`` (each of which ``user`` must be able
        to read now) for ``lifetime_secs`` (0: the default), cut to the cluster's cap."""
        if self.auth_mode is AuthMode.SIMPLE:
            raise InvalidArgument(
                "job tokens are not issued in auth.mode 'simple', where a client names its user"
                " and holds no secret; use auth.mode 'token' or 'mtls'")
        if lifetime_secs < 0:
            raise InvalidArgument(f"a lifetime must be positive seconds, got {lifetime_secs}")
        wanted = list(dict.fromkeys(keys))  # once each, in the order given
        if not wanted:
            raise InvalidArgument("a job token needs at least one key")
        for key in wanted:
            validate_key(key)
        self.meta.require_leader()
        for key, state in zip(wanted, self.meta.read_states_for_write(wanted), strict=True):
            if isinstance(state, BaseException):
                raise state
            if state is None:
                raise no_such_key(key)
            self.authority.require(user, state.acl, acls.READ, key)
        with self._issuing:
            if self.quotas.limits.job_tokens and not self.quotas.exempt(user):
                self.quotas.check_job_token(user, self._live_count(user))
            issued = self._issue(user, wanted, lifetime_secs)
        self._sweep()
        return issued

    def _issue(self, user: str, wanted: list[str], lifetime_secs: int) -> JobToken:
        lifetime = min(lifetime_secs or DEFAULT_LIFETIME_SECS, self.max_lifetime_secs)
        token, token_id = new_job_token()
        now = self.clock()
        _, secret = split_job_token(token)
        record = JobTokenRecord(user, tuple(wanted), now, now + lifetime,
                                job_token_hash(token_id, secret))
        data = record.encode()
        if len(data) > MAX_STATE_BYTES:
            raise InvalidArgument(f"{len(wanted)} keys are too many for one job token (its"
                                  f" record would take {len(data)} bytes of"
                                  f" {MAX_STATE_BYTES}); split the job's blobs")

        def build(txn: Any) -> None:
            txn.create(job_token_path(token_id), data)

        try:
            self.election.fenced(build)
        except Deposed as e:
            raise Unavailable(f"not the leader any more ({e}); no token was issued, retry (the"
                              " client finds the new leader)") from None
        if self._live_epoch == self.election.epoch:
            self._live.setdefault(user, {})[token_id] = record.expires_at
        log.info("job token %s issued to %r for %d keys until %s", token_id, user, len(wanted),
                 _when(record.expires_at))
        return JobToken(token, token_id, record.expires_at, tuple(wanted), user)

    def revoke(self, user: str, token_or_id: str) -> str:
        """Revoke a job token: its user or an admin. Returns its id."""
        try:
            token_id = job_token_id(token_or_id)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        self.meta.require_leader()
        path = job_token_path(token_id)
        try:
            data, stat = self.meta.answer_write(self.zk.get_async(path))
        except NoNodeError:
            raise KeyNotFound(f"no job token {token_id} (never issued, revoked already, or"
                              " expired and removed)") from None
        try:
            owner = JobTokenRecord.decode(data).user
        except ValueError:
            owner = ""  # unreadable: only an admin may remove it
        if owner != user and not self.authority.privileged(user):
            raise NotAuthorized(f"job token {token_id} is not yours; its user or an admin may"
                                " revoke it")

        def build(txn: Any) -> None:
            txn.delete(path, version=stat.version)

        try:
            self.election.fenced(build)
        except NoNodeError:
            pass  # revoked meanwhile: the outcome asked for
        except Deposed as e:
            raise Unavailable(f"not the leader any more ({e}); the token was not revoked, retry"
                              " (the client finds the new leader)") from None
        with self._lock:
            self._cache.pop(token_id, None)
        with self._issuing:
            self._live.get(owner, {}).pop(token_id, None)
        log.info("job token %s revoked by %r", token_id, user)
        return token_id

    def _live_count(self, user: str) -> int:
        """``user``'s unexpired tokens (``_issuing`` held); the records are read once per
        leadership term, pipelined."""
        epoch = self.election.epoch
        if self._live_epoch != epoch:
            live: dict[str, dict[str, float]] = {}
            names = self.meta.answer_write(self.zk.get_children_async(JOB_TOKENS))
            for start in range(0, len(names), _READ_AHEAD):
                batch = names[start:start + _READ_AHEAD]
                pending = [(n, self.zk.get_async(job_token_path(n))) for n in batch]
                for name, result in pending:
                    try:
                        data, _ = self.meta.answer_write(result)
                        record = JobTokenRecord.decode(data)
                    except NoNodeError:
                        continue  # revoked or swept meanwhile
                    except ValueError:
                        continue  # unreadable: counted for nobody (it verifies for nobody)
                    live.setdefault(record.user, {})[name] = record.expires_at
            self._live, self._live_epoch = live, epoch
        now = self.clock()
        mine = self._live.get(user, {})
        for token_id in [t for t, until in mine.items() if until <= now]:
            del mine[token_id]
        return len(mine)

    def _sweep(self) -> None:
        """Remove some expired records (best effort: a failure only leaves them longer)."""
        try:
            names = self.meta.answer_write(self.zk.get_children_async(JOB_TOKENS))
            sample = random.sample(names, min(_SWEEP, len(names)))
            pending = [(n, self.zk.get_async(job_token_path(n))) for n in sample]
            now = self.clock()
            expired = []
            for name, result in pending:
                data, stat = self.meta.answer_write(result)
                if JobTokenRecord.decode(data).expires_at <= now:
                    expired.append((name, stat.version))
            if not expired:
                return

            def build(txn: Any) -> None:
                for name, version in expired:
                    txn.delete(job_token_path(name), version=version)

            self.election.fenced(build)
            log.info("removed %d expired job tokens", len(expired))
        except Exception as e:
            log.debug("expired job tokens not removed now (%s)", e)
