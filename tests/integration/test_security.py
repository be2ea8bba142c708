"""Security against real masters and a real ZooKeeper: authentication (simple with the
masters' cluster secret, tokens, client certificates), TLS, ZooKeeper lock-down, authorisation
on every master, the audit log and the per-client call cap.

Every refusal test counts its attempts in ``REFUSED`` (printed at the end with ``-s``), so the
project notes can say what was tried and refused.
"""

from __future__ import annotations

import collections
import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError, NotEmptyError
from kazoo.security import make_digest_acl
from support.harness import FAST, _dump_logs, followers, md, stub, wait_until

from blobha.client import Client
from blobha.core.auth import MASTER_SECRET_METADATA_KEY, new_token
from blobha.core.errors import (
    InvalidArgument,
    KeyNotFound,
    NotAuthorized,
    TlsMismatch,
    Unauthenticated,
    Unavailable,
)
from blobha.ops import certgen
from blobha.ops.localcluster import LocalCluster
from blobha.v1 import blobha_pb2 as pb
from blobha.v1 import blobha_pb2_grpc as pb_grpc
from blobha.wire.credentials import Credentials
from blobha.wire.peers import CHANNEL_OPTIONS

pytestmark = pytest.mark.integration

REFUSED: collections.Counter[str] = collections.Counter()


@pytest.fixture(scope="module", autouse=True)
def _report_refusals() -> Iterator[None]:
    yield
    print("\nrefused attempts by kind:", dict(sorted(REFUSED.items())),
          "total", sum(REFUSED.values()))


def _start(root: Path, **kw: Any) -> LocalCluster:
    overrides = {**FAST, **kw.pop("overrides", {})}
    c = LocalCluster(root, nodes=kw.pop("nodes", 3), base_port=0, overrides=overrides, **kw)
    try:
        c.start()
    except BaseException:
        _dump_logs(c)
        c.stop()
        raise
    return c


def _code(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, bytes):
            list(result)
    code: grpc.StatusCode = info.value.code()
    return code


# ------------------------------------------------------------------------------------------------
# simple mode: the masters' principal cannot be claimed; ACLs on every master; list; audit; caps
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def simple(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = _start(tmp_path_factory.mktemp("simple"),
               overrides={"master.max.calls.per.client": 3})
    try:
        yield c
    finally:
        c.stop()


def _client(c: LocalCluster, user: str, **kw: Any) -> Client:
    return Client(c.cluster, user=user, timeout=kw.pop("timeout", 30.0),
                  credentials=c.credentials(user) if c.auth != "simple" else Credentials(), **kw)


def test_claiming_the_master_principal_is_refused_in_simple_mode(simple: LocalCluster) -> None:
    with _client(simple, "alice") as alice:
        alice.create("principal-target", b"private", acl="u:alice:rwa", replication_factor=3)
        alice.wait_for_replication(["principal-target"], min_replication=3, timeout=20)
    for m in simple.masters:
        s = stub(m.address)
        # The sync path (a version number, as masters ask) must not be open to a claimed name.
        request = pb.DownloadRequest(key="principal-target", version=1)
        assert _code(lambda s=s, r=request: s.Download(r, timeout=5,
                                                       metadata=md("blobha-master"))
                     ) is grpc.StatusCode.UNAUTHENTICATED
        wrong = (*md("blobha-master"), (MASTER_SECRET_METADATA_KEY, "guessed"))
        assert _code(lambda s=s, r=request, w=wrong: s.Download(r, timeout=5, metadata=w)
                     ) is grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda s=s: s.GetMeta(pb.GetMetaRequest(key="principal-target"), timeout=5,
                                           metadata=md("blobha-master"))
                     ) is grpc.StatusCode.UNAUTHENTICATED
        REFUSED["simple: claimed master principal"] += 3


def test_a_call_without_a_user_is_unauthenticated_and_reveals_nothing(
    simple: LocalCluster,
) -> None:
    s = stub(simple.masters[0].address)
    for key in ("principal-target", "no-such-key-anywhere"):
        with pytest.raises(grpc.RpcError) as info:
            s.GetMeta(pb.GetMetaRequest(key=key), timeout=5)
        assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
        # The same answer whether or not the key exists.
        assert "no user given" in (info.value.details() or "")
        REFUSED["simple: no user"] += 1
    assert _code(lambda: s.ClusterSummary(pb.ClusterSummaryRequest(), timeout=5)
                 ) is grpc.StatusCode.UNAUTHENTICATED
    REFUSED["simple: no user"] += 1


def test_job_tokens_are_not_issued_in_simple_mode(simple: LocalCluster) -> None:
    # Simple mode has no secrets: a token would protect nothing a user name does not.
    with _client(simple, "alice") as alice:
        alice.create("simple-job-key", b"x", acl="u:alice:rwa", replication_factor=1)
        with pytest.raises(InvalidArgument, match=r"not issued in auth\.mode 'simple'"):
            alice.issue_job_token(["simple-job-key"])
    REFUSED["simple: job token"] += 1


def test_another_users_private_blob_is_refused_on_every_master(simple: LocalCluster) -> None:
    with _client(simple, "alice") as alice:
        alice.create("alice-private", b"secret", acl="u:alice:rwa", replication_factor=3)
        alice.wait_for_replication(["alice-private"], min_replication=3, timeout=20)
    # Straight at each master, followers included: a follower serves reads and must check too.
    for m in simple.masters:
        s = stub(m.address)
        for version in (0, 1):
            request = pb.DownloadRequest(key="alice-private", version=version)
            assert _code(lambda s=s, r=request: s.Download(r, timeout=5, metadata=md("bob"))
                         ) is grpc.StatusCode.PERMISSION_DENIED
            REFUSED["simple: read another user's private blob"] += 1
    with _client(simple, "bob") as bob:
        with pytest.raises(NotAuthorized):
            bob.read("alice-private")
        with pytest.raises(NotAuthorized):
            bob.delete("alice-private")
        REFUSED["simple: read another user's private blob"] += 2
    with _client(simple, "admin") as admin:
        assert admin.read("alice-private") == b"secret"


def test_list_shows_only_readable_keys_except_to_admins(simple: LocalCluster) -> None:
    with _client(simple, "alice") as alice:
        alice.create("list-private", b"x", acl="u:alice:rwa", replication_factor=1)
        alice.create("list-public", b"x", acl="u:alice:rwa,o::r", replication_factor=1)
        assert {"list-private", "list-public"} <= set(alice.list(prefix="list-"))
    with _client(simple, "bob") as bob:
        assert set(bob.list(prefix="list-")) == {"list-public"}
    with _client(simple, "admin") as admin:
        assert {"list-private", "list-public"} <= set(admin.list(prefix="list-"))
    # Visibility follows ACL changes (through the masters' watched views, within moments).
    with _client(simple, "alice") as alice:
        alice.set_acl("list-private", "u:alice:rwa,o::r")
        alice.set_acl("list-public", "u:alice:rwa")
    with _client(simple, "bob") as bob:
        wait_until(lambda: set(bob.list(prefix="list-")) == {"list-private"}, timeout=10,
                   what="the listing to follow the ACL changes")


def test_every_mutation_is_audited(simple: LocalCluster) -> None:
    with _client(simple, "alice") as alice:
        alice.create("audited key", b"v1", acl="u:alice:rwa", replication_factor=1)
        alice.update("audited key", b"v2")
        alice.set_acl("audited key", "u:alice:rwa,o::r")
    with _client(simple, "bob") as bob, pytest.raises(NotAuthorized):
        bob.delete("audited key")
    with _client(simple, "alice") as alice:
        alice.delete("audited key")
    leader = simple.leader()
    expected = [
        'user="alice" op=put-create key="audited key" version=1 result=OK',
        'user="alice" op=put-update key="audited key" version=2 result=OK',
        'user="alice" op=set-meta key="audited key" version=2 result=OK',
        'user="bob" op=delete key="audited key" version=0 result=PERMISSION_DENIED',
        'user="alice" op=delete key="audited key" version=0 result=OK',
    ]
    wait_until(lambda: all(e in leader.log_path.read_text() for e in expected), timeout=10,
               what="audit lines in the leader's log")


def test_one_client_cannot_take_all_of_a_masters_calls(simple: LocalCluster) -> None:
    # The cap is 3 running calls per user here; waits that cannot finish hold their slots.
    with _client(simple, "carol") as carol:
        carol.create("cap-key", b"x", acl="o::r", replication_factor=1)
    address = simple.leader().address
    s = stub(address)
    hold = pb.WaitForReplicationRequest(keys=["cap-key"], min_replication=99, timeout_secs=15)
    with ThreadPoolExecutor(4) as pool:
        held = [pool.submit(s.WaitForReplication, hold, timeout=20, metadata=md("carol"))
                for _ in range(4)]
        try:
            # Four calls at once, three slots: exactly one is refused at once.
            wait_until(lambda: sum(f.done() for f in held) == 1, timeout=10,
                       what="one of four concurrent calls refused")
            (failed,) = [f for f in held if f.done()]
            error = failed.exception()
            assert isinstance(error, grpc.RpcError), error
            assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "master.max.calls.per.client" in (error.details() or "")
            REFUSED["caps: calls beyond the per-client cap"] += 1
            # While three run, any further call of that user is refused; others are not.
            assert _code(lambda: s.GetMeta(pb.GetMetaRequest(key="cap-key"), timeout=5,
                                           metadata=md("carol"))
                         ) is grpc.StatusCode.RESOURCE_EXHAUSTED
            REFUSED["caps: calls beyond the per-client cap"] += 1
            # The client treats it as transient: it backs off and retries until its deadline.
            with Client(address, user="carol", timeout=2, credentials=Credentials()) as carol, \
                    pytest.raises(Unavailable, match="busy"):
                carol.get_meta("cap-key")
            REFUSED["caps: calls beyond the per-client cap"] += 1
            s.GetMeta(pb.GetMetaRequest(key="cap-key"), timeout=5, metadata=md("dave"))
        finally:
            for f in held:
                f.cancel()
    # Slots come back once the calls end.
    wait_until(lambda: _try_meta(s, "carol"), timeout=30, what="carol's slots released")


def _try_meta(s: Any, user: str) -> bool:
    try:
        s.GetMeta(pb.GetMetaRequest(key="cap-key"), timeout=5, metadata=md(user))
        return True
    except grpc.RpcError as e:
        if e.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
            return False
        raise


# ------------------------------------------------------------------------------------------------
# the secure set-up: TLS, tokens, ZooKeeper locked down
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = _start(tmp_path_factory.mktemp("secure"), tls=True)
    try:
        yield c
    finally:
        c.stop()


@pytest.mark.smoke
def test_secure_cluster_works_end_to_end_with_tokens(secure: LocalCluster) -> None:
    assert secure.auth == "token" and secure.zk_lockdown
    with _client(secure, "alice") as alice:
        assert alice.user == "alice"
        alice.create("secure-k", b"over tls", acl="u:alice:rwa", replication_factor=3)
        # Replication proves masters reach each other: TLS, cluster secret, locked ZooKeeper.
        assert alice.wait_for_replication(["secure-k"], min_replication=3, timeout=20).reached
        assert alice.read("secure-k") == b"over tls"
    with _client(secure, "bob") as bob, pytest.raises(NotAuthorized) as info:
        bob.read("secure-k")
    assert not isinstance(info.value, Unauthenticated)
    REFUSED["secure: read another user's private blob"] += 1


@pytest.mark.smoke
def test_no_token_and_wrong_tokens_are_unauthenticated(secure: LocalCluster,
                                                       tmp_path: Path) -> None:
    ca = secure.credentials().ca
    with Client(secure.cluster, user="alice", timeout=5, credentials=Credentials(ca=ca)) as c:
        with pytest.raises(Unauthenticated, match="no token given"):
            c.get_meta("secure-k")
        with pytest.raises(Unauthenticated):
            c.get_meta("no-such-key")  # same answer: nothing about keys leaks
        REFUSED["secure: no token"] += 2
    cases = {
        "wrong secret": "alice:" + "A" * 43,
        "unknown user": new_token("mallory"),
        "another user's name with alice's secret": "bob:" + (
            Path(secure.credentials("alice").token_file or "").read_text().strip().split(":")[1]
        ),
    }
    for name, token in cases.items():
        path = tmp_path / f"{name}.token"
        path.write_text(token + "\n")
        path.chmod(0o600)  # the client refuses a token file other accounts can read
        with Client(secure.cluster, timeout=5,
                    credentials=Credentials(ca=ca, token_file=str(path))) as c:
            with pytest.raises(Unauthenticated, match="token was refused"):
                c.get_meta("secure-k")
            REFUSED[f"secure: wrong token ({name})"] += 1
    # The CLI says so with its own exit status.
    bad = tmp_path / "wrong secret.token"
    r = subprocess.run([sys.executable, "-m", "blobha", "--cluster", secure.cluster,
                        "--ca", ca or "", "--token-file", str(bad), "meta", "secure-k"],
                       capture_output=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 15, r.stderr
    assert b"token was refused" in r.stderr
    REFUSED["secure: wrong token (cli)"] += 1


def test_a_write_without_a_valid_token_fails_at_once(secure: LocalCluster,
                                                     tmp_path: Path) -> None:
    # The leader search is refused like any call; that is the answer, not a sign that the
    # cluster is unavailable, so it comes at once and not after the client's whole timeout.
    ca = secure.credentials().ca
    wrong = tmp_path / "wrong.token"
    wrong.write_text("alice:" + "A" * 43 + "\n")
    wrong.chmod(0o600)  # a token file open to others is refused before anything is sent
    timeout = 60.0
    for credentials, reason in ((Credentials(ca=ca), "no token given"),
                                (Credentials(ca=ca, token_file=str(wrong)), "token was refused")):
        with Client(secure.cluster, user="alice", timeout=timeout,
                    credentials=credentials) as c:
            started = time.monotonic()
            with pytest.raises(Unauthenticated, match=reason):
                c.create("fast-refusal", b"never written")
            assert time.monotonic() - started < timeout / 2
        REFUSED["secure: write without a valid token"] += 1
    # The CLI (whose client waits 60 s) says so with its own exit status, as docs/cli.md says.
    data = tmp_path / "f"
    data.write_bytes(b"never written")
    for token_file, reason in (("", b"no token given"), (str(wrong), b"token was refused")):
        started = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "blobha", "--cluster", secure.cluster,
                            "--ca", ca or "", "create", "fast-refusal", "-f", str(data)],
                           capture_output=True, timeout=120, cwd=tmp_path,
                           env={**os.environ, "BLOBHA_TOKEN_FILE": token_file,
                                "BLOBHA_USER": "alice"})
        assert time.monotonic() - started < 30.0, r.stderr
        assert r.returncode == Unauthenticated.exit_code == 15, r.stderr
        assert reason in r.stderr
        REFUSED["secure: write without a valid token (cli)"] += 1


def test_plaintext_and_untrusted_connections_are_refused(secure: LocalCluster,
                                                         tmp_path: Path) -> None:
    token_file = secure.credentials("alice").token_file
    # A connection the master closes at once may also be a proxy with no master behind it; a
    # master found to speak TLS is not one: said at once, with the fix.
    started = time.monotonic()
    with Client(secure.cluster, timeout=60, credentials=Credentials(token_file=token_file)) as c, \
            pytest.raises(TlsMismatch, match="it uses TLS and this client does not; pass --ca"):
        c.get_meta("secure-k")
    assert time.monotonic() - started < 10
    REFUSED["secure: plaintext connection"] += 1
    # A certificate that does not verify is the caller's to fix: reported soon, as such, with
    # what to change, not retried for the client's whole timeout (60 s here).
    other_ca = certgen.make_ca(tmp_path / "other")
    credentials = Credentials(ca=str(other_ca.cert), token_file=token_file)
    for operation in ("get_meta", "create"):
        started = time.monotonic()
        with Client(secure.cluster, timeout=60, credentials=credentials) as c, \
                pytest.raises(TlsMismatch, match="did not verify against the CA given in --ca"):
            if operation == "get_meta":
                c.get_meta("secure-k")
            else:
                c.create("never-made", b"x")
        assert time.monotonic() - started < 30
    REFUSED["secure: server certificate from another CA"] += 1
    # The command line says it in its one line, with an exit status of its own, and gRPC's
    # own log lines about the handshake stay out of the way.
    r = subprocess.run([sys.executable, "-m", "blobha", "--cluster", secure.cluster,
                        "--ca", str(other_ca.cert), "--token-file", token_file or "",
                        "meta", "secure-k"],
                       capture_output=True, timeout=60, cwd=tmp_path,
                       env={k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"})
    assert r.returncode == TlsMismatch.exit_code == 16, r.stderr
    lines = r.stderr.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith("blobha: error: "), lines
    assert "did not verify against the CA given in --ca" in lines[0]
    REFUSED["secure: server certificate from another CA (cli)"] += 1
    with _client(secure, "alice") as alice, pytest.raises(KeyNotFound):
        alice.get_meta("never-made")


def test_token_file_changes_apply_without_restart(secure: LocalCluster, tmp_path: Path) -> None:
    token_path = tmp_path / "erin.token"
    r = subprocess.run(
        [sys.executable, "-m", "blobha", "token", "create", "erin", "--out", str(token_path),
         "--append", str(secure.secure_dir / "tokens.txt")],
        capture_output=True, timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert oct(token_path.stat().st_mode & 0o777) == "0o600"
    creds = Credentials(ca=secure.credentials().ca, token_file=str(token_path))

    def erin_gets_in() -> bool:
        with Client(secure.cluster, timeout=5, credentials=creds) as c:
            try:
                list(c.list())
                return True
            except Unauthenticated:
                return False

    wait_until(erin_gets_in, timeout=15, what="the new token accepted by every master")


def test_certificate_files_reload_without_restart(secure: LocalCluster) -> None:
    m = secure.masters[0]
    d = secure.secure_dir
    before = _served_serial(m.address, d / "ca.pem")
    ca = certgen.CertFiles(d / "ca.pem", d / "ca-key.pem")
    renewed = certgen.issue(ca, d, f"master-{m.index + 1}", m.address,
                            hosts=["127.0.0.1", "localhost"])
    after = x509.load_pem_x509_certificate(renewed.cert.read_bytes()).serial_number
    assert after != before
    wait_until(lambda: _served_serial(m.address, d / "ca.pem") == after, timeout=15,
               what="the renewed certificate served on new connections")
    with _client(secure, "alice") as alice:
        assert alice.read("secure-k") == b"over tls"


def _served_serial(address: str, ca: Path) -> int:
    host, port = address.rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection((host, int(port)), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname=host) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def _blobha_paths(zk: KazooClient) -> list[str]:
    """Every node under the chroot, walked with the masters' credentials."""
    out = ["/blobha"]
    i = 0
    while i < len(out):
        out.extend(f"{out[i]}/{c}" for c in zk.get_children(out[i]))
        i += 1
    return out


def test_zookeeper_refuses_forged_writes_on_every_blobha_path(secure: LocalCluster) -> None:
    with _client(secure, "alice") as alice:
        alice.create("zk-target", b"x", acl="u:alice:rwa", replication_factor=3)
        alice.wait_for_replication(["zk-target"], min_replication=3, timeout=20)
    user, password = (secure.secure_dir / "zookeeper.auth").read_text().strip().split(":", 1)
    # ZooKeeper serves TLS only, and wants a client certificate from the cluster's CA: these
    # clients (the intruders below too) hold one, as another application of that CA would.
    assert secure.zk.tls is not None
    tls = secure.zk.tls.client_args()
    masters = KazooClient(hosts=secure.zk.connect_string,
                          auth_data=[("digest", f"{user}:{password}")], **tls)
    masters.start(timeout=15)
    try:
        paths = _blobha_paths(masters)
        ours = [make_digest_acl(user, password, all=True)]
        for path in paths:
            assert masters.get_acls(path)[0] == ours, path
    finally:
        masters.stop()
        masters.close()
    kinds = {"/blobha/blobstore/zk-target", "/blobha/election", "/blobha/epoch",
             "/blobha/masters", "/blobha/master-secret", "/blobha/blobstore-id"}
    assert kinds <= set(paths)
    assert any(p.startswith("/blobha/blobstore/zk-target/") for p in paths)  # replica nodes
    assert any(p.startswith("/blobha/election/n_") for p in paths)
    assert any(p.startswith("/blobha/masters/") for p in paths)
    for auth_data in (None, [("digest", f"{user}:wrong-password")]):
        label = "unauthenticated" if auth_data is None else "wrong password"
        intruder = KazooClient(hosts=secure.zk.connect_string, auth_data=auth_data, **tls)
        intruder.start(timeout=15)
        try:
            zk = intruder
            for path in paths:
                for name, attempt in (
                    ("create", lambda p=path, z=zk: z.create(f"{p}/forged-1:1-99", b"")),
                    ("set", lambda p=path, z=zk: z.set(p, b'{"forged": true}')),
                    ("delete", lambda p=path, z=zk: z.delete(p, recursive=False)),
                    ("read", lambda p=path, z=zk: z.get(p)),
                ):
                    # Deleting the chroot is judged by the ACL of ZooKeeper's root, which is
                    # not blobha's: it stays refused because the chroot is never empty.
                    refusal = ((NoAuthError, NotEmptyError)
                               if name == "delete" and path == "/blobha" else NoAuthError)
                    with pytest.raises(refusal):
                        attempt()
                    REFUSED[f"zookeeper ({label}): {name}"] += 1
        finally:
            intruder.stop()
            intruder.close()
    with _client(secure, "alice") as alice:
        assert alice.read("zk-target") == b"x"


# ------------------------------------------------------------------------------------------------
# client certificates; migration of an open ZooKeeper tree
# ------------------------------------------------------------------------------------------------


def test_mtls_takes_the_user_from_the_certificate(tmp_path: Path) -> None:
    c = _start(tmp_path / "mtls", tls=True, auth="mtls", nodes=2,
               overrides={"blobstore.replication.factor": 2})
    try:
        with Client(c.cluster, timeout=20, credentials=c.credentials("alice")) as alice:
            alice.create("cert-k", b"by cert", acl="u:alice:rwa", replication_factor=2)
            assert alice.wait_for_replication(["cert-k"], min_replication=2, timeout=20).reached
            assert alice.get_meta("cert-k").creator == "alice"
        # Claiming another name in metadata changes nothing: the certificate says bob.
        with Client(c.cluster, user="alice", timeout=20,
                    credentials=c.credentials("bob")) as bob, pytest.raises(NotAuthorized):
            bob.read("cert-k")
        REFUSED["mtls: claimed another user"] += 1
        ca = c.credentials().ca
        other_ca = certgen.make_ca(tmp_path / "other")
        foreign = certgen.issue(other_ca, tmp_path / "other", "alice", "alice")
        # The TLS handshake itself fails, and the failure says what to pass.
        for name, credentials in (
                ("no client certificate", Credentials(ca=ca)),
                ("certificate from another CA",
                 Credentials(ca=ca, cert=str(foreign.cert), key=str(foreign.key)))):
            with Client(c.cluster, user="alice", timeout=3, credentials=credentials) as who, \
                    pytest.raises(Unavailable, match="pass --cert/--tls-key"):
                who.read("cert-k")
            REFUSED[f"mtls: {name}"] += 1
    except BaseException:
        _dump_logs(c)
        raise
    finally:
        c.stop()


def test_an_open_tree_is_locked_down_on_restart(tmp_path: Path) -> None:
    c = _start(tmp_path / "migrate", nodes=2, overrides={"blobstore.replication.factor": 2})
    try:
        with _client(c, "alice") as alice:
            alice.create("old-key", b"before", acl="u:alice:rwa", replication_factor=2)
            alice.wait_for_replication(["old-key"], min_replication=2, timeout=20)
        for m in c.masters:
            m.terminate()
        c.zk_lockdown = True
        c.prepare_security()
        for m in c.masters:
            c.start_master(m)
        c.wait_ready(60)
        with _client(c, "alice") as alice:
            assert alice.read("old-key") == b"before"
        intruder = KazooClient(hosts=c.zk.connect_string)
        intruder.start(timeout=15)
        try:
            for path in ("/blobha", "/blobha/blobstore", "/blobha/blobstore/old-key",
                         "/blobha/epoch", "/blobha/master-secret"):
                with pytest.raises(NoAuthError):
                    intruder.set(path, b"forged")
                REFUSED["zookeeper (after migration): set"] += 1
        finally:
            intruder.stop()
            intruder.close()
        # A master without the credentials now stops at start with a clear message.
        c.zk_lockdown = False
        extra = c.masters[0]
        extra.terminate()
        c.start_master(extra)
        assert extra.wait(60), "a master without ZooKeeper credentials kept running"
        assert "locked down" in extra.log_path.read_text()
        REFUSED["zookeeper: master without credentials"] += 1
    except BaseException:
        _dump_logs(c)
        raise
    finally:
        c.stop()


def test_followers_check_reads_too(simple: LocalCluster) -> None:
    with _client(simple, "alice") as alice:
        alice.create("follower-check", b"x", acl="u:alice:rwa", replication_factor=3)
        alice.wait_for_replication(["follower-check"], min_replication=3, timeout=20)
    for m in followers(simple):
        channel = grpc.insecure_channel(m.address, options=CHANNEL_OPTIONS)
        try:
            s = pb_grpc.BlobStoreStub(channel)  # type: ignore[no-untyped-call]
            r = pb.GetReplicationRequest(key="follower-check")
            assert _code(lambda s=s, r=r: s.GetReplication(r, timeout=5, metadata=md("bob"))
                         ) is grpc.StatusCode.PERMISSION_DENIED
            REFUSED["simple: follower metadata read by another user"] += 1
        finally:
            channel.close()
