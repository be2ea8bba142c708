"""Authenticators, tokens, client credentials, TLS reloading and security configuration, without
a network (the integration tests in test_security.py run them against real masters)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from blobha.client import Client
from blobha.core import auth
from blobha.core.admission import CALLER_PEER
from blobha.core.auth import (
    AUTHORIZATION_METADATA_KEY,
    MASTER_SECRET_METADATA_KEY,
    USER_METADATA_KEY,
    hash_token,
    new_token,
    parse_token_file,
    split_token,
)
from blobha.core.errors import Busy, InvalidArgument, Unauthenticated
from blobha.master.config import Config, ConfigError
from blobha.master.edge.audit import AuditRecord
from blobha.ops import certgen
from blobha.wire import authn, datatls
from blobha.wire.authn import (
    MappingRule,
    MtlsAuthenticator,
    ServerAuthentication,
    SimpleAuthenticator,
    TokenAuthenticator,
    make_authenticator,
)
from blobha.wire.credentials import Credentials
from blobha.wire.tls import ReloadingServerCredentials
from blobha.zk.lockdown import ZkCredentials, ZooKeeperAuthError

NO_PEER: dict[str, list[str]] = {}


def bearer(token: str) -> dict[str, str]:
    return {AUTHORIZATION_METADATA_KEY: f"Bearer {token}"}


# ---- tokens --------------------------------------------------------------------------------------


def test_a_token_verifies_against_its_line_and_nothing_else(tmp_path: Path) -> None:
    alice, bob = new_token("alice"), new_token("bob")
    assert split_token(alice)[0] == "alice"
    line = hash_token(alice)
    assert line.startswith("alice:scrypt$")
    assert split_token(alice)[1] not in line  # never in the clear on the server
    path = tmp_path / "tokens"
    path.write_text(f"# comment\n\n{line}\n{hash_token(bob)}\n")
    a = TokenAuthenticator(path)
    assert a.authenticate(bearer(alice), NO_PEER) == "alice"
    assert a.authenticate(bearer(alice), NO_PEER) == "alice"  # remembered
    assert a.authenticate(bearer(bob), NO_PEER) == "bob"
    for wrong in ("alice:" + "x" * 43, "bob:" + split_token(alice)[1], new_token("mallory")):
        with pytest.raises(Unauthenticated, match="token was refused"):
            a.authenticate(bearer(wrong), NO_PEER)


def test_token_header_problems_say_what_to_pass(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("")
    a = TokenAuthenticator(path)
    with pytest.raises(Unauthenticated, match="--token-file"):
        a.authenticate({}, NO_PEER)
    with pytest.raises(Unauthenticated, match="Bearer"):
        a.authenticate({AUTHORIZATION_METADATA_KEY: "Basic abc"}, NO_PEER)
    with pytest.raises(Unauthenticated, match="USER:SECRET"):
        a.authenticate(bearer("no-colon"), NO_PEER)


def test_token_file_reloads_and_survives_a_broken_edit(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(authn, "_RELOAD_CHECK_SECS", 0.0)
    alice, carol = new_token("alice"), new_token("carol")
    path = tmp_path / "tokens"
    path.write_text(hash_token(alice) + "\n")
    path.chmod(0o600)  # as a master requires; a reload checks it again
    a = TokenAuthenticator(path)
    with pytest.raises(Unauthenticated):
        a.authenticate(bearer(carol), NO_PEER)
    path.write_text(hash_token(carol) + "\n")  # alice revoked, carol added
    assert a.authenticate(bearer(carol), NO_PEER) == "carol"
    with pytest.raises(Unauthenticated):
        a.authenticate(bearer(alice), NO_PEER)
    path.write_text("garbage that is not a token line\n")
    assert a.authenticate(bearer(carol), NO_PEER) == "carol"  # previous file kept


def test_a_token_added_just_now_works_on_its_first_use(tmp_path: Path) -> None:
    # The periodic look at the file happened a moment ago; the new token must not wait for
    # the next one.
    alice, carol = new_token("alice"), new_token("carol")
    path = tmp_path / "tokens"
    path.write_text(hash_token(alice) + "\n")
    path.chmod(0o600)  # as a master requires; a reload checks it again
    a = TokenAuthenticator(path)
    assert a.authenticate(bearer(alice), NO_PEER) == "alice"
    with path.open("a") as f:
        f.write(hash_token(carol) + "\n")
    assert a.authenticate(bearer(carol), NO_PEER) == "carol"
    with pytest.raises(Unauthenticated, match="refused"):
        a.authenticate(bearer(new_token("dave")), NO_PEER)


def test_an_unknown_user_pays_the_same_capped_scrypt_check_as_a_known_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A refusal that came at once for an unknown user, and after scrypt for a known one,
    # would tell an attacker who has an account. Both go through one scrypt, in the capped
    # place, so they cost the same (asserted on the path taken, not on the clock).
    path = tmp_path / "tokens"
    path.write_text(hash_token(new_token("alice")) + "\n")
    a = TokenAuthenticator(path)
    checks: list[str] = []
    scrypt = auth._scrypt

    def counted(secret: str, salt: bytes) -> bytes:
        checks.append(secret)
        return scrypt(secret, salt)

    monkeypatch.setattr(auth, "_scrypt", counted)
    for user in ("alice", "mallory"):
        checks.clear()
        with pytest.raises(Unauthenticated, match="token was refused"):
            a.authenticate(bearer(f"{user}:{'x' * 43}"), NO_PEER)
        assert len(checks) == 1, f"{user}: {len(checks)} scrypt checks"
    # With every place of the caller's host taken, both are told to retry, as busy.
    host = "ipv4:10.9.9.9"
    held = [authn._SCRYPT_CHECKS.take(f"{host}:{port}") for port in (1, 2, 3)]
    caller = CALLER_PEER.set(f"{host}:4")
    try:
        for user in ("alice", "mallory"):
            checks.clear()
            with pytest.raises(Busy):
                a.authenticate(bearer(f"{user}:{'x' * 43}"), NO_PEER)
            assert checks == []
    finally:
        CALLER_PEER.reset(caller)
        for place in held:
            authn._SCRYPT_CHECKS.give(place)


def test_a_token_file_opened_to_others_is_not_taken_at_a_reload(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # At start a master refuses it (MasterSettings.refuse_exposed_secrets); later, whoever
    # may change it could add a token of their own, so a reload does not take it either.
    alice, carol = new_token("alice"), new_token("carol")
    path = tmp_path / "tokens"
    path.write_text(hash_token(alice) + "\n")
    path.chmod(0o600)
    a = TokenAuthenticator(path)
    path.chmod(0o666)
    with path.open("a") as f:
        f.write(hash_token(carol) + "\n")
    with caplog.at_level(logging.ERROR, logger="blobha.auth"):
        for _ in range(2):
            with pytest.raises(Unauthenticated, match="refused"):
                a.authenticate(bearer(carol), NO_PEER)
    said = [r.getMessage() for r in caplog.records if "not reloaded" in r.getMessage()]
    assert len(said) == 1, said  # once per change of the file, not once per call
    assert (f"auth.token.file {path} can be read by other accounts (mode 0666); run 'chmod 600"
            f" {path}'") in said[0]
    assert a.authenticate(bearer(alice), NO_PEER) == "alice"  # the previous file serves
    path.chmod(0o640)  # the fix: taken at once, with nothing else changed
    assert a.authenticate(bearer(carol), NO_PEER) == "carol"


def test_bad_token_files_are_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="line 2"):
        parse_token_file("# ok\nalice:md5$x$y\n", "tokens")
    with pytest.raises(ValueError, match="cannot use the token file"):
        TokenAuthenticator(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"auth\.token\.file"):
        make_authenticator("token", "", [])


# ---- simple, mtls, and the masters' principal ----------------------------------------------------


def test_simple_mode_needs_a_well_formed_user() -> None:
    s = SimpleAuthenticator()
    assert s.authenticate({USER_METADATA_KEY: "alice"}, NO_PEER) == "alice"
    with pytest.raises(Unauthenticated, match="--user"):
        s.authenticate({}, NO_PEER)
    with pytest.raises(Unauthenticated):
        s.authenticate({USER_METADATA_KEY: "a:b"}, NO_PEER)


def test_certificate_rules_map_names_to_users() -> None:
    m = MtlsAuthenticator([r"san ^spiffe://corp/user/(\w+)$ \1", r"cn ^(.+)\.corp$ \1"])
    assert m.authenticate({}, {"x509_subject_alternative_name": ["spiffe://corp/user/bob"],
                               "x509_common_name": ["x"]}) == "bob"
    assert m.authenticate({}, {"x509_common_name": ["alice.corp"]}) == "alice"
    # The metadata's claim is ignored: the certificate decides.
    assert m.authenticate({USER_METADATA_KEY: "root"},
                          {"x509_common_name": ["alice.corp"]}) == "alice"
    with pytest.raises(Unauthenticated, match="maps to no user"):
        m.authenticate({}, {"x509_common_name": ["stranger"]})
    with pytest.raises(Unauthenticated, match="no client certificate"):
        m.authenticate({}, NO_PEER)
    with pytest.raises(ValueError, match="cn\\|san"):
        MappingRule.parse("subject ^(.*)$ \\1")
    with pytest.raises(ValueError, match="regular expression"):
        MappingRule.parse("cn ^(.*$ \\1")


def test_the_master_principal_needs_the_cluster_secret() -> None:
    secret = auth.new_cluster_secret()
    a = ServerAuthentication(SimpleAuthenticator(), "blobha-master", lambda: secret)
    assert a.authenticate({USER_METADATA_KEY: "alice"}, NO_PEER) == "alice"
    with pytest.raises(Unauthenticated, match="reserved for the masters"):
        a.authenticate({USER_METADATA_KEY: "blobha-master"}, NO_PEER)
    with pytest.raises(Unauthenticated, match="cluster secret is wrong"):
        a.authenticate({USER_METADATA_KEY: "alice", MASTER_SECRET_METADATA_KEY: "guess"},
                       NO_PEER)
    assert a.authenticate({MASTER_SECRET_METADATA_KEY: secret}, NO_PEER) == "blobha-master"
    not_loaded = ServerAuthentication(SimpleAuthenticator(), "blobha-master", lambda: "")
    with pytest.raises(Unauthenticated):
        not_loaded.authenticate({MASTER_SECRET_METADATA_KEY: ""}, NO_PEER)


# ---- client credentials --------------------------------------------------------------------------


def test_client_credentials_from_the_environment(tmp_path: Path) -> None:
    token = new_token("alice")
    (tmp_path / "t").write_text(token + "\n")
    (tmp_path / "t").chmod(0o600)  # the client refuses a token file other accounts can read
    creds = Credentials.from_env({"BLOBHA_TOKEN_FILE": str(tmp_path / "t")}).check()
    assert not creds.tls
    assert creds.token_user() == "alice"
    assert (AUTHORIZATION_METADATA_KEY, f"Bearer {token}") in creds.metadata("alice")
    with Client("127.0.0.1:1", credentials=creds) as c:
        assert c.user == "alice"
    with pytest.raises(InvalidArgument, match="belongs to 'alice'"):
        Client("127.0.0.1:1", user="bob", credentials=creds)
    with pytest.raises(InvalidArgument, match="--cert and --tls-key"):
        Credentials(cert="c.pem").check()
    with pytest.raises(InvalidArgument, match="cannot read"):
        Credentials(ca=str(tmp_path / "missing.pem")).check()
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "empty").chmod(0o600)
    with pytest.raises(InvalidArgument, match="holds no token"):
        Credentials(token_file=str(tmp_path / "empty")).check()


def test_whether_tls_is_required_is_decided_for_every_credential(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("BLOBHA_")]:
        monkeypatch.delenv(name)
    profile = tmp_path / "client.toml"
    profile.write_text("[default]\nrequire_tls = true\n")
    monkeypatch.setenv("BLOBHA_CONFIG", str(profile))
    assert Credentials().require_tls  # however made: the profile's requirement
    assert Credentials(bearer="bjt1.x").require_tls and Credentials.from_env().require_tls
    assert not Credentials.from_env({}).require_tls  # a mapping given is all there is
    monkeypatch.setenv("BLOBHA_REQUIRE_TLS", "0")
    assert not Credentials().require_tls  # the variable wins over the profile, as always
    monkeypatch.setenv("BLOBHA_REQUIRE_TLS", "1")
    token = tmp_path / "t"
    token.write_text(new_token("alice") + "\n")
    # Never checked (a transport given them directly): still no channel in clear.
    with pytest.raises(InvalidArgument, match="TLS is required"):
        Credentials(token_file=str(token)).channel("127.0.0.1:1", [])
    Credentials(token_file=str(token), require_tls=False).channel("127.0.0.1:1", []).close()
    profile.write_text("[default]\nrequire_tls = 'yes'\n")
    monkeypatch.delenv("BLOBHA_REQUIRE_TLS")
    with pytest.raises(InvalidArgument, match=r"client\.toml, line 2: .*require_tls"):
        Credentials()  # a requirement it cannot read is not dropped unseen


# ---- TLS -----------------------------------------------------------------------------------------


def test_server_certificates_reload_only_when_usable(tmp_path: Path) -> None:
    ca = certgen.make_ca(tmp_path)
    first = certgen.issue(ca, tmp_path, "m", "m", hosts=["127.0.0.1"])
    creds = ReloadingServerCredentials(str(first.cert), str(first.key), str(ca.cert),
                                       require_client_cert=False)
    assert creds._fetch() is None  # unchanged
    certgen.issue(ca, tmp_path, "m", "m", hosts=["127.0.0.1"])
    os.utime(first.cert, ns=(1, 1))  # make the change visible whatever the clock resolution
    assert creds._fetch() is not None
    assert creds.reloads == 1
    # A key that does not match its certificate (a renewal half done) is not taken.
    other = certgen.issue(ca, tmp_path, "other", "other")
    first.key.write_bytes(other.key.read_bytes())
    assert creds._fetch() is None
    assert creds.reloads == 1
    with pytest.raises(ValueError, match="does not match"):
        ReloadingServerCredentials(str(first.cert), str(first.key), "", False)
    with pytest.raises(ValueError, match=r"tls\.ca"):
        ReloadingServerCredentials(str(other.cert), str(other.key), "", True)


def test_a_key_other_accounts_can_read_is_not_taken_at_a_reload(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # At start such a key is refused (MasterSettings.refuse_exposed_secrets); a renewal that
    # leaves it open must not bring it in later. Both the gRPC side and the data channel keep
    # what they serve, say why in one line, and take the files once they are chmodded.
    monkeypatch.setattr(datatls, "RELOAD_CHECK_SECS", 0.0)
    ca = certgen.make_ca(tmp_path)
    first = certgen.issue(ca, tmp_path, "m", "m", hosts=["127.0.0.1"])
    grpc_side = ReloadingServerCredentials(str(first.cert), str(first.key), str(ca.cert),
                                           require_client_cert=False)
    data_side = datatls.ReloadingServerContext(str(first.cert), str(first.key), str(ca.cert),
                                               require_client_cert=False)
    served = data_side.current()
    renewed = certgen.issue(ca, tmp_path / "renewed", "m", "m", hosts=["127.0.0.1"])
    first.key.chmod(0o644)
    first.key.write_bytes(renewed.key.read_bytes())
    first.cert.write_bytes(renewed.cert.read_bytes())
    with caplog.at_level(logging.ERROR, logger="blobha.tls"):
        assert grpc_side._fetch() is None
        assert data_side.current() is served
    assert grpc_side.reloads == 0
    said = (f"tls.key {first.key} can be read by other accounts (mode 0644); run"
            f" 'chmod 600 {first.key}'")
    lines = [r.getMessage() for r in caplog.records]
    assert len([m for m in lines if said in m and "keeping the previous ones" in m]) == 2, lines
    first.key.chmod(0o600)  # the fix the line names, and nothing else: taken at the next look
    assert grpc_side._fetch() is not None and grpc_side.reloads == 1
    assert data_side.current() is not served


# ---- configuration, ZooKeeper credentials, audit -------------------------------------------------


@pytest.mark.parametrize(("overrides", "message"), [
    ({"auth.mode": "kerberos"}, "auth.mode"),
    ({"auth.mode": "token"}, "auth.token.file"),
    ({"auth.mode": "mtls"}, "needs TLS"),
    ({"tls.cert": "c.pem"}, "tls.cert and tls.key"),
    ({"tls.ca": "ca.pem"}, "tls.ca is set"),
    ({"zookeeper.auth.scheme": "sasl"}, "zookeeper.auth.scheme"),
    ({"zookeeper.auth.scheme": "digest"}, "zookeeper.auth.file"),
    ({"zookeeper.auth.scheme": "digest", "zookeeper.auth.file": "zk",
      "zookeeper.chroot": "/"}, "below /"),
    ({"blobstore.list.visibility": "some"}, "blobstore.list.visibility"),
    ({"master.max.calls.per.client": 0}, "master.max.calls.per.client"),
    ({"auth.mtls.rules": "cn x y"}, "auth.mtls.rules"),
])
def test_bad_security_configuration_is_refused(overrides: dict[str, object], message: str
                                               ) -> None:
    with pytest.raises(ConfigError, match=message):
        Config.of(overrides)


def test_zookeeper_credentials_file(tmp_path: Path) -> None:
    path = tmp_path / "zk"
    path.write_text("blobha:s3cret\n")
    path.chmod(0o600)
    creds = ZkCredentials.from_file(path)
    assert (creds.user, creds.password) == ("blobha", "s3cret")
    assert creds.kazoo_args()["auth_data"] == [("digest", "blobha:s3cret")]
    assert creds.acl[0].id.id.startswith("blobha:")  # the hash, not the password
    assert "s3cret" not in creds.acl[0].id.id
    path.write_text("no-password\n")
    with pytest.raises(ZooKeeperAuthError, match="user:password"):
        ZkCredentials.from_file(path)
    with pytest.raises(ZooKeeperAuthError, match="cannot read"):
        ZkCredentials.from_file(tmp_path / "missing")


def test_audit_lines_quote_keys() -> None:
    line = AuditRecord("alice", "delete", 'a "b" c', 3, "PERMISSION_DENIED").line()
    assert line == ('audit user="alice" op=delete key="a \\"b\\" c" version=3'
                    " result=PERMISSION_DENIED")


# ---- the gatekeeper's caps on calls ---------------------------------------------------------


class _Refused(Exception):
    pass


class _Context:
    """What the gatekeeper reads of a call's context, and what it sets on a refusal."""

    def __init__(self, metadata: dict[str, str]) -> None:
        self._metadata = tuple(metadata.items())
        self.trailers: tuple[tuple[str, str], ...] = ()

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def auth_context(self) -> dict[str, list[bytes]]:
        return {}

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def set_trailing_metadata(self, trailers: tuple[tuple[str, str], ...]) -> None:
        self.trailers = trailers

    def abort(self, code: object, details: str) -> None:
        raise _Refused(f"{code}: {details}")


def test_users_calls_together_leave_threads_for_the_masters() -> None:
    from blobha.core.errors import BUSY_METADATA_KEY
    from blobha.master.edge.gatekeeper import Gatekeeper, client_call_threads, status_call_threads

    threads = 8
    assert (client_call_threads(threads), status_call_threads(threads)) == (6, 1)
    for n in range(4, 200):
        users, status = client_call_threads(n), status_call_threads(n)
        assert users >= 2 and status >= 1 and n - users - status >= 1, n
    secret = auth.new_cluster_secret()
    keeper = Gatekeeper(ServerAuthentication(SimpleAuthenticator(), "blobha-master",
                                             lambda: secret),
                        max_calls_per_client=32, threads=threads)

    def admit(method: str, user: str) -> str:
        return keeper._admit(method, _Context({USER_METADATA_KEY: user}))

    held = [admit("GetMeta", f"user-{i}") for i in range(6)]
    refused = _Context({USER_METADATA_KEY: "someone-else"})
    with pytest.raises(_Refused, match=r"RESOURCE_EXHAUSTED.*master\.rpc\.threads"):
        keeper._admit("GetMeta", refused)
    assert refused.trailers == ((BUSY_METADATA_KEY, "1"),)  # busy: the client retries
    # A status check still gets in, but only so many: they may not take the masters' share.
    status = admit("NodeStatus", "someone-else")
    with pytest.raises(_Refused, match=r"master\.rpc\.threads"):
        admit("NodeStatus", "another")
    # The other masters are not counted, nor capped.
    for _ in range(threads):
        keeper._admit("FetchVersions", _Context({MASTER_SECRET_METADATA_KEY: secret}))
    # Calls that end give their place back.
    for user in held:
        keeper._release(user, "GetMeta")
    keeper._release(status, "NodeStatus")
    assert admit("GetMeta", "someone-else") == "someone-else"
    keeper._release("someone-else", "GetMeta")
    assert keeper._all_running == 0 and keeper._running == {}


def test_long_calls_leave_threads_for_the_rest() -> None:
    from blobha.master.edge.gatekeeper import Gatekeeper

    keeper = Gatekeeper(ServerAuthentication(SimpleAuthenticator(), "blobha-master",
                                             auth.new_cluster_secret),
                        max_calls_per_client=8, threads=16)
    assert (keeper.max_waits, keeper.max_all_waits) == (3, 6)

    def admit(method: str, user: str) -> str:
        return keeper._admit(method, _Context({USER_METADATA_KEY: user}))

    held = [admit("WaitForReplication", "alice")]
    held += [admit("AppendUpload", "alice") for _ in range(2)]
    with pytest.raises(_Refused, match="waits for replication or upload streams"):
        admit("WaitForReplication", "alice")
    held += [admit("AppendUpload", u) for u in ("bob", "carol", "carol")]
    with pytest.raises(_Refused, match="users' waits and upload streams hold all 6"):
        admit("WaitForReplication", "dave")
    assert admit("GetMeta", "dave") == "dave"  # everything else still gets in
    keeper._release("dave", "GetMeta")
    keeper._release(held[0], "WaitForReplication")
    for user in held[1:]:
        keeper._release(user, "AppendUpload")
    assert keeper._all_waiting == 0 and keeper._waiting == {}
    assert keeper._all_running == 0


def test_costly_checks_are_capped_per_ipv4_address_and_ipv6_network() -> None:
    from blobha.core.admission import host_of_peer

    assert host_of_peer("ipv4:10.0.0.1:5000") == "10.0.0.1"
    # One IPv4 address whether it comes as IPv4 or in IPv6 form.
    assert host_of_peer("ipv6:[::ffff:10.0.0.1]:5000") == "10.0.0.1"
    # Every address of a /64 is one host: it cannot take a place per address it holds.
    assert host_of_peer("ipv6:[2001:db8:1:2::7]:1") == host_of_peer("ipv6:[2001:db8:1:2::8]:2")
    assert host_of_peer("ipv6:[2001:db8:1:3::7]:1") != host_of_peer("ipv6:[2001:db8:1:2::7]:1")


def test_a_reload_keeps_the_tokens_verified_of_users_whose_lines_did_not_change(
        tmp_path: Path) -> None:
    alice, bob = new_token("alice"), new_token("bob")
    path = tmp_path / "tokens"
    alice_line = hash_token(alice)  # salted: a line made again would differ
    path.write_text(alice_line + "\n" + hash_token(bob) + "\n")
    path.chmod(0o600)  # as a master requires; a reload checks it again
    authenticator = TokenAuthenticator(str(path))
    for token in (alice, bob):
        authenticator.authenticate({AUTHORIZATION_METADATA_KEY: f"Bearer {token}"}, {})
    bob2 = new_token("bob")
    path.write_text(alice_line + "\n" + hash_token(bob2) + "\n")
    later = path.stat().st_mtime_ns + 10**9
    os.utime(path, ns=(later, later))  # a change the reload sees, however fast the writes
    authenticator._load()
    assert set(authenticator._verified.values()) == {"alice"}
