"""Job tokens without a cluster: the format, the stored record, verification (hash, expiry,
revocation, the cache), issue and revoke by the leader (on a fake ZooKeeper), the scope the
gatekeeper enforces, and client credentials carrying one."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from kazoo.protocol.states import EventType, KeeperState, WatchedEvent

from blobha.core import acl as acls
from blobha.core.auth import (
    AUTHORIZATION_METADATA_KEY,
    JOB_TOKEN_PREFIX,
    USER_METADATA_KEY,
    is_job_token,
    job_token_hash,
    job_token_id,
    new_job_token,
    new_token,
    split_job_token,
    split_token,
)
from blobha.core.blobstate import BlobState
from blobha.core.errors import (
    InvalidArgument,
    KeyNotFound,
    NotAuthorized,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from blobha.master import jobtokens
from blobha.master.config import Config, ConfigError
from blobha.master.edge.gatekeeper import Gatekeeper, scope_refusal
from blobha.master.jobtokens import JobTokens
from blobha.master.metadata import Metadata
from blobha.master.quotas import QuotaLimits, Quotas
from blobha.master.rules import Authority
from blobha.sync import Usage
from blobha.v1 import blobha_pb2 as pb
from blobha.wire.authn import Caller, ServerAuthentication, SimpleAuthenticator
from blobha.wire.credentials import Credentials
from blobha.zk.layout import JOB_TOKENS, JobTokenRecord, job_token_path, key_path

NO_PEER: dict[str, list[str]] = {}


# ---- the format ----------------------------------------------------------------------------------


def test_a_job_token_is_told_from_a_user_token_at_a_glance() -> None:
    token, token_id = new_job_token()
    assert re.fullmatch(r"bjt1\.[0-9a-f]{16}\.[A-Za-z0-9_-]{43}", token)
    assert token.startswith(JOB_TOKEN_PREFIX) and is_job_token(token)
    assert split_job_token(token) == (token_id, token.rsplit(".", 1)[1])
    assert job_token_id(token) == job_token_id(token_id) == token_id
    user_token = new_token("alice")
    assert not is_job_token(user_token)
    with pytest.raises(Unauthenticated, match="malformed token"):
        split_token(token)  # no colon: never mistaken for USER:SECRET
    assert new_job_token()[0] != token


@pytest.mark.parametrize("bad", [
    "bjt1.", "bjt1.0123456789abcdef", "bjt1.0123456789abcdef.short",
    "bjt1.XYZ3456789abcdef." + "A" * 43, "bjt1.0123456789abcdef." + "A" * 42 + "!",
    "bjt2.0123456789abcdef." + "A" * 43,
])
def test_a_malformed_job_token_is_refused(bad: str) -> None:
    with pytest.raises(Unauthenticated, match="malformed job token"):
        split_job_token(bad)
    with pytest.raises(ValueError):
        job_token_id(bad)


def test_the_stored_hash_binds_the_secret_to_its_id() -> None:
    token, token_id = new_job_token()
    _, secret = split_job_token(token)
    digest = job_token_hash(token_id, secret)
    assert re.fullmatch(r"[0-9a-f]{64}", digest) and secret not in digest
    assert job_token_hash("0" * 16, secret) != digest
    assert job_token_hash(token_id, secret[:-1] + ("A" if secret[-1] != "A" else "B")) != digest


def test_the_record_round_trips_and_junk_is_refused() -> None:
    record = JobTokenRecord("alice", ("a", "b ü"), 10.0, 20.0, "ab" * 32)
    assert JobTokenRecord.decode(record.encode()) == record
    assert job_token_path("0123456789abcdef") == f"{JOB_TOKENS}/0123456789abcdef"
    for junk in (b"", b"{}", b"[1]", b'{"user":"a","keys":"a","issued_at":1,"expires_at":2,'
                 b'"digest":"x"}'):
        with pytest.raises(ValueError):
            JobTokenRecord.decode(junk)


def test_the_lifetime_cap_is_a_master_option() -> None:
    assert Config.of({})["auth.job.token.max.lifetime.secs"] == 7 * 24 * 3600
    assert Config.of({"auth.job.token.max.lifetime.secs": "60"})[
        "auth.job.token.max.lifetime.secs"] == 60
    with pytest.raises(ConfigError, match=r"auth\.job\.token\.max\.lifetime\.secs"):
        Config.of({"auth.job.token.max.lifetime.secs": 0})


# ---- a fake ZooKeeper for the master's part ----------------------------------------------------


class _Done:
    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error

    def get(self, timeout: float | None = None) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class _Stat:
    def __init__(self, version: int) -> None:
        self.version = version


class _Zk:
    """Znodes in a dict: (data, version)."""

    def __init__(self) -> None:
        self.nodes: dict[str, tuple[bytes, int]] = {}
        self.reads = 0
        self.unreachable = False
        self.watches: dict[str, list[Any]] = {}

    def get_async(self, path: str, watch: Any = None) -> _Done:
        from kazoo.exceptions import ConnectionLoss, NoNodeError

        self.reads += 1
        if self.unreachable:
            return _Done(error=ConnectionLoss())
        if path not in self.nodes:
            return _Done(error=NoNodeError())
        if watch is not None:
            self.watches.setdefault(path, []).append(watch)
        data, version = self.nodes[path]
        return _Done((data, _Stat(version)))

    def sync_async(self, path: str) -> _Done:
        return _Done(path)

    def get_children_async(self, path: str) -> _Done:
        prefix = path + "/"
        return _Done([p[len(prefix):] for p in self.nodes if p.startswith(prefix)])

    def delete_elsewhere(self, path: str) -> None:
        """A deletion by another session: its data watches fire, once."""
        del self.nodes[path]
        for watch in self.watches.pop(path, []):
            watch(WatchedEvent(EventType.DELETED, KeeperState.CONNECTED, path))


class _Txn:
    def __init__(self, zk: _Zk) -> None:
        self.zk = zk
        self.ops: list[tuple[str, str, bytes]] = []

    def create(self, path: str, data: bytes) -> None:
        self.ops.append(("create", path, data))

    def delete(self, path: str, version: int = -1) -> None:
        self.ops.append(("delete", path, b""))


class _Election:
    """Applies a fenced transaction at once, as the leader."""

    def __init__(self, zk: _Zk) -> None:
        self.zk = zk
        self.epoch = 1

    def fenced(self, build: Any, changed: tuple[str, ...] = ()) -> list[Any]:
        txn = _Txn(self.zk)
        build(txn)
        for op, path, data in txn.ops:
            if op == "create":
                self.zk.nodes[path] = (data, 0)
            else:
                self.zk.nodes.pop(path, None)
        return []


class _Meta:
    def __init__(self, zk: _Zk, leader: bool = True) -> None:
        self.zk = zk
        self.leader = leader

    def require_zk(self) -> None:
        if self.zk.unreachable:
            raise Unavailable("ZooKeeper is unreachable")

    def require_leader(self) -> None:
        if not self.leader:
            raise Unavailable("not the leader")

    def answer(self, pending: _Done) -> Any:
        return pending.get()

    answer_write = answer

    # The real pipelined read, over this fake's ZooKeeper and answer().
    read_states = Metadata.read_states
    read_states_for_write = Metadata.read_states_for_write


class _Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _blob(zk: _Zk, key: str, acl: str) -> None:
    state = BlobState(1, 1, "d", tuple(acls.parse_acl(acl)), 1, "alice", 0.0, 0.0, 1, True)
    zk.nodes[key_path(key)] = (state.encode(), 0)


def _part(mode: str = "token", max_lifetime: int = 7 * 24 * 3600, per_user: int = 0
          ) -> tuple[JobTokens, _Zk, _Clock]:
    zk, clock = _Zk(), _Clock()
    _blob(zk, "job-a", "u:alice:rwa")
    _blob(zk, "job-b", "u:alice:r")
    _blob(zk, "bobs", "u:bob:rwa")
    fake: Any = (zk, _Election(zk), _Meta(zk))
    authority = Authority(frozenset({"root"}), "blobha-master")
    quotas = Quotas(QuotaLimits(job_tokens=per_user), authority, lambda user: Usage(),
                    lambda key: None, lambda: 0)
    part = JobTokens(*fake, authority, mode, max_lifetime, quotas, clock=clock)
    return part, zk, clock


def test_issue_stores_only_a_hash_and_the_token_verifies() -> None:
    part, zk, clock = _part()
    issued = part.issue("alice", ["job-a", "job-b", "job-a"], 0)
    assert issued.keys == ("job-a", "job-b") and issued.user == "alice"
    assert issued.expires_at == clock.now + jobtokens.DEFAULT_LIFETIME_SECS
    assert issued.token not in repr(issued)
    stored = zk.nodes[job_token_path(issued.token_id)][0]
    assert split_job_token(issued.token)[1].encode() not in stored
    assert part.verify(*split_job_token(issued.token)) == Caller(
        "alice", frozenset({"job-a", "job-b"}), issued.token_id)


def test_issue_checks_the_caller_keys_lifetime_and_mode() -> None:
    part, _, clock = _part(max_lifetime=3600)
    with pytest.raises(NotAuthorized, match="lacks READ"):
        part.issue("alice", ["job-a", "bobs"], 0)
    with pytest.raises(KeyNotFound):
        part.issue("alice", ["job-missing"], 0)
    with pytest.raises(InvalidArgument, match="at least one key"):
        part.issue("alice", [], 0)
    with pytest.raises(InvalidArgument, match="positive"):
        part.issue("alice", ["job-a"], -1)
    # Longer than the cap: cut to it, and the answer says when it ends.
    assert part.issue("alice", ["job-a"], 10**9).expires_at == clock.now + 3600
    assert part.issue("alice", ["job-a"], 60).expires_at == clock.now + 60
    assert part.issue("root", ["bobs"], 60).user == "root"  # an admin reads every key
    simple, _, _ = _part(mode="simple")
    with pytest.raises(InvalidArgument, match=r"not issued in auth\.mode .simple."):
        simple.issue("alice", ["job-a"], 0)


def test_tampered_expired_unknown_and_revoked_tokens_are_refused() -> None:
    part, _, clock = _part()
    issued = part.issue("alice", ["job-a"], 60)
    token_id, secret = split_job_token(issued.token)
    tampered = secret[:-1] + ("A" if secret[-1] != "A" else "B")
    with pytest.raises(Unauthenticated, match="refused"):
        part.verify(token_id, tampered)
    other_id = "0123456789abcdef" if token_id != "0123456789abcdef" else "fedcba9876543210"
    with pytest.raises(Unauthenticated, match="refused"):
        part.verify(other_id, secret)  # the secret with another id
    clock.now += 60
    with pytest.raises(Unauthenticated, match="expired at"):
        part.verify(token_id, secret)
    clock.now -= 30
    part.verify(token_id, secret)
    with pytest.raises(NotAuthorized, match="not yours"):
        part.revoke("bob", token_id)
    assert part.revoke("alice", issued.token) == token_id
    with pytest.raises(Unauthenticated, match="refused"):
        part.verify(token_id, secret)
    with pytest.raises(KeyNotFound, match="no job token"):
        part.revoke("alice", token_id)
    with pytest.raises(InvalidArgument, match="neither a job token"):
        part.revoke("alice", "alice:secret")
    admin_revoked = part.issue("alice", ["job-a"], 60)
    assert part.revoke("root", admin_revoked.token_id) == admin_revoked.token_id


def test_records_are_cached_briefly_and_a_deletion_is_seen_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    part, zk, _ = _part()
    issued = part.issue("alice", ["job-a"], 600)
    parts = split_job_token(issued.token)
    part.verify(*parts)
    reads = zk.reads
    for _ in range(10):
        part.verify(*parts)
    assert zk.reads == reads  # cached
    # Revoked by another master's leader: the watch forgets it at once.
    zk.delete_elsewhere(job_token_path(issued.token_id))
    with pytest.raises(Unauthenticated, match="refused"):
        part.verify(*parts)
    # Without the watch, the cache bound: then ZooKeeper must answer, or the token is refused.
    again = part.issue("alice", ["job-a"], 600)
    parts = split_job_token(again.token)
    part.verify(*parts)
    monkeypatch.setattr(jobtokens, "CACHE_SECS", 0.0)
    zk.unreachable = True
    with pytest.raises(Unavailable, match="unreachable"):
        part.verify(*parts)


# ---- the server's authentication and the gatekeeper ---------------------------------------------


class _Verifier:
    def verify(self, token_id: str, secret: str) -> Caller:
        if secret != "A" * 43:
            raise Unauthenticated("the job token was refused")
        return Caller("alice", frozenset({"job-a"}), token_id)


def _bearer(token: str) -> dict[str, str]:
    return {AUTHORIZATION_METADATA_KEY: f"Bearer {token}", USER_METADATA_KEY: "whoever"}


JOB = "bjt1.0123456789abcdef." + "A" * 43


def test_server_authentication_takes_a_job_token_with_its_scope() -> None:
    auth = ServerAuthentication(SimpleAuthenticator(), "blobha-master", lambda: "s",
                                job_tokens=_Verifier())
    caller = auth.identify(_bearer(JOB), NO_PEER)
    assert caller == Caller("alice", frozenset({"job-a"}), "0123456789abcdef")
    with pytest.raises(Unauthenticated, match="not accepted here"):
        auth.authenticate(_bearer(JOB), NO_PEER)  # the scope would be lost: fail closed
    with pytest.raises(Unauthenticated, match="refused"):
        auth.identify(_bearer(JOB[:-1] + "B"), NO_PEER)
    with pytest.raises(Unauthenticated, match="malformed job token"):
        auth.identify(_bearer("bjt1.nonsense"), NO_PEER)
    # Without job tokens (simple mode) the header means nothing: the asserted user counts.
    simple = ServerAuthentication(SimpleAuthenticator(), "blobha-master", lambda: "s")
    assert simple.identify(_bearer(JOB), NO_PEER) == Caller("whoever")


class _Refused(Exception):
    pass


class _Context:
    def __init__(self, metadata: dict[str, str]) -> None:
        self._metadata = tuple(metadata.items())

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def set_trailing_metadata(self, trailers: Any) -> None:
        pass

    def abort(self, code: object, details: str) -> None:
        raise _Refused(f"{code}: {details}")


SCOPE = frozenset({"job-a", "job-b"})


@pytest.mark.parametrize(("method", "request_"), [
    ("GetMeta", pb.GetMetaRequest(key="job-a")),
    ("Download", pb.DownloadRequest(key="job-b", version=1)),
    ("GetReplication", pb.GetReplicationRequest(key="job-a")),
    ("WaitForReplication", pb.WaitForReplicationRequest(keys=["job-a", "job-b"])),
    ("ClusterSummary", pb.ClusterSummaryRequest()),
    ("NodeStatus", pb.NodeStatusRequest()),
])
def test_a_job_token_reads_its_keys(method: str, request_: Any) -> None:
    assert scope_refusal(method, request_, SCOPE) == ""


@pytest.mark.parametrize(("method", "request_", "why"), [
    ("GetMeta", pb.GetMetaRequest(key="other"), "does not grant access to 'other'"),
    ("Download", pb.DownloadRequest(key="other"), "does not grant access"),
    ("GetReplication", pb.GetReplicationRequest(key="job-ab"), "does not grant access"),
    ("WaitForReplication", pb.WaitForReplicationRequest(keys=["job-a", "other"]),
     "does not grant access to 'other'"),
    ("List", pb.ListRequest(prefix="job-"), "cannot list keys"),
    ("Put", pb.PutRequest(begin=pb.BeginUploadRequest(key="job-a")), "Put is refused"),
    ("BeginUpload", pb.BeginUploadRequest(key="job-a"), "BeginUpload is refused"),
    ("AppendUpload", None, "AppendUpload is refused"),
    ("CommitUpload", pb.CommitUploadRequest(), "refused"),
    ("SetMeta", pb.SetMetaRequest(key="job-a"), "refused"),
    ("Delete", pb.DeleteRequest(key="job-a"), "refused"),
    ("FetchVersions", pb.FetchVersionsRequest(), "refused"),
    ("IssueJobToken", pb.IssueJobTokenRequest(keys=["job-a"]), "refused"),
    ("RevokeJobToken", pb.RevokeJobTokenRequest(), "refused"),
])
def test_a_job_token_is_refused_everything_else(method: str, request_: Any, why: str) -> None:
    refusal = scope_refusal(method, request_, SCOPE)
    assert why in refusal and "\n" not in refusal


def test_the_gatekeeper_enforces_the_scope() -> None:
    keeper = Gatekeeper(ServerAuthentication(SimpleAuthenticator(), "blobha-master",
                                             lambda: "s", job_tokens=_Verifier()),
                        max_calls_per_client=8, threads=16)
    ctx = _Context(_bearer(JOB))
    assert keeper._admit("GetMeta", ctx, pb.GetMetaRequest(key="job-a")) == "alice"
    keeper._release("alice", "GetMeta")
    with pytest.raises(_Refused, match=r"PERMISSION_DENIED.*does not grant access to .x."):
        keeper._admit("GetMeta", ctx, pb.GetMetaRequest(key="x"))
    with pytest.raises(_Refused, match=r"PERMISSION_DENIED.*Delete is refused"):
        keeper._admit("Delete", ctx, pb.DeleteRequest(key="job-a"))
    with pytest.raises(_Refused, match=r"UNAUTHENTICATED.*refused"):
        keeper._admit("GetMeta", _Context(_bearer(JOB[:-1] + "B")), pb.GetMetaRequest(key="a"))
    assert keeper.running("alice") == 0  # refusals take no slot


# ---- client credentials -------------------------------------------------------------------------


def test_credentials_carry_a_job_token_from_a_file_or_directly(tmp_path: Path) -> None:
    token, _ = new_job_token()
    (tmp_path / "job.token").write_text(token + "\n")
    (tmp_path / "job.token").chmod(0o600)  # the client refuses one other accounts can read
    from_file = Credentials(token_file=str(tmp_path / "job.token")).check()
    direct = Credentials(bearer=token).check()
    for creds in (from_file, direct):
        assert creds.token() == token
        assert creds.token_user() is None  # the masters know whose it is
        assert (AUTHORIZATION_METADATA_KEY, f"Bearer {token}") in creds.metadata("someone")
    assert token not in repr(direct)
    with pytest.raises(InvalidArgument, match=r"bjt1\.ID\.SECRET"):
        Credentials(bearer="bjt1.broken").check()


def test_live_tokens_per_user_are_capped_counted_from_zookeeper_by_each_new_leader() -> None:
    part, _, clock = _part(per_user=2)
    first = part.issue("alice", ["job-a"], 60)
    part.issue("alice", ["job-a"], 3600)
    with pytest.raises(ResourceExhausted, match=r"auth\.job\.token\.max\.per\.user"):
        part.issue("alice", ["job-a"], 0)
    part.issue("bob", ["bobs"], 0)  # bob's count is his own
    part.issue("root", ["job-a"], 0)  # an admin is exempt
    part.revoke("alice", first.token)
    part.issue("alice", ["job-a"], 60)
    clock.now += 61  # an expired token counts no more, removed or not
    part.issue("alice", ["job-a"], 0)
    # A new leadership term reads the records again: the revoked and expired do not count,
    # the two live ones do.
    part.election.epoch += 1
    with pytest.raises(ResourceExhausted, match="holds 2"):
        part.issue("alice", ["job-a"], 0)
