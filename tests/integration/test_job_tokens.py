"""Job tokens against real masters (TLS, token authentication, ZooKeeper locked down): issued by
the leader, read with on every master, and refused for writes, other keys, once expired, once
revoked (on every master) and when tampered with; the CLI commands too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from support.harness import FAST, _dump_logs, wait_until

from blobha.client import Client
from blobha.core.auth import split_job_token
from blobha.core.errors import InvalidArgument, NotAuthorized, Unauthenticated
from blobha.ops.localcluster import LocalCluster
from blobha.v1 import blobha_pb2 as pb
from blobha.v1 import blobha_pb2_grpc as pb_grpc
from blobha.wire.credentials import Credentials
from blobha.wire.peers import CHANNEL_OPTIONS

pytestmark = pytest.mark.integration

KEYS = ["jt-a", "jt-b"]
OTHER = "jt-other"


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("jobtokens"), nodes=3, base_port=0,
                     overrides={**FAST, "auth.job.token.max.lifetime.secs": 3600}, tls=True)
    try:
        c.start()
    except BaseException:
        _dump_logs(c)
        c.stop()
        raise
    try:
        with _user(c, "alice") as alice:
            for key in [*KEYS, OTHER]:
                alice.create(key, key.encode(), acl="u:alice:rwa", replication_factor=3)
            assert alice.wait_for_replication([*KEYS, OTHER], min_replication=3,
                                              timeout=30).reached
        yield c
    finally:
        c.stop()


def _user(c: LocalCluster, user: str) -> Client:
    return Client(c.cluster, user=user, timeout=30.0, credentials=c.credentials(user))


def _job(c: LocalCluster, token: str, timeout: float = 30.0) -> Client:
    # As an executor would: the CA and the job token, nothing of the user's own.
    return Client(c.cluster, timeout=timeout,
                  credentials=Credentials(ca=c.credentials().ca, bearer=token))


def _get_meta_on(c: LocalCluster, address: str, token: str, key: str) -> grpc.StatusCode:
    """GetMeta straight at one master (no routing) with ``token``: its status code."""
    creds = Credentials(ca=c.credentials().ca, bearer=token)
    channel = creds.channel(address, CHANNEL_OPTIONS)
    try:
        pb_grpc.BlobStoreStub(channel).GetMeta(  # type: ignore[no-untyped-call]
            pb.GetMetaRequest(key=key), timeout=10, metadata=creds.metadata("executor"))
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        code: grpc.StatusCode = e.code()
        return code
    finally:
        channel.close()


@pytest.mark.smoke
def test_a_job_token_reads_exactly_its_keys_on_every_master(secure: LocalCluster) -> None:
    with _user(secure, "alice") as alice:
        issued = alice.issue_job_token(KEYS, lifetime_secs=600)
    assert issued.token.startswith("bjt1.") and issued.user == "alice"
    assert issued.keys == tuple(KEYS)
    with _job(secure, issued.token) as job:
        assert job.read("jt-a") == b"jt-a"
        assert job.read("jt-b") == b"jt-b"
        assert job.get_meta("jt-a").version == 1
        assert job.get_replication("jt-b").replication == 3
        assert job.wait_for_replication(KEYS, min_replication=1, timeout=5).reached
        assert len(job.cluster_summary().masters) == 3
    for m in secure.masters:  # followers verify it too, from ZooKeeper
        assert _get_meta_on(secure, m.address, issued.token, "jt-a") is grpc.StatusCode.OK


@pytest.mark.smoke
def test_a_job_token_cannot_write_or_touch_other_keys(secure: LocalCluster) -> None:
    with _user(secure, "alice") as alice:
        token = alice.issue_job_token(KEYS, lifetime_secs=600).token
    with _job(secure, token, timeout=10) as job:
        attempts: dict[str, Any] = {
            "update a scoped key": lambda: job.update("jt-a", b"overwritten"),
            "create a key": lambda: job.create("jt-new", b"x"),
            "delete a scoped key": lambda: job.delete("jt-a"),
            "set the ACL of a scoped key": lambda: job.set_acl("jt-a", "o::rwa"),
            "read another key": lambda: job.read(OTHER),
            "read another key's metadata": lambda: job.get_meta(OTHER),
            "list keys": lambda: list(job.list(prefix="jt-")),
            "issue another token": lambda: job.issue_job_token(KEYS),
            "revoke a token": lambda: job.revoke_job_token("0123456789abcdef"),
        }
        for what, attempt in attempts.items():
            with pytest.raises(NotAuthorized) as info:
                attempt()
            assert not isinstance(info.value, Unauthenticated), what
            assert "job token" in str(info.value) and "\n" not in str(info.value), what
    with _user(secure, "alice") as alice:
        assert alice.read("jt-a") == b"jt-a"
        assert OTHER in set(alice.list(prefix="jt-"))


def test_issue_needs_read_on_every_key_and_no_job_token(secure: LocalCluster) -> None:
    with _user(secure, "bob") as bob, pytest.raises(NotAuthorized, match="lacks READ"):
        bob.issue_job_token(["jt-a"])
    with _user(secure, "alice") as alice:
        with pytest.raises(InvalidArgument):
            alice.issue_job_token([])
        # Longer than the cluster's cap (an hour here): cut to it (the masters run on this
        # machine's clock).
        asked = time.time()
        issued = alice.issue_job_token(["jt-a"], lifetime_secs=10 * 24 * 3600)
        assert asked + 3600 <= issued.expires_at <= time.time() + 3600


def test_a_tampered_token_is_unauthenticated(secure: LocalCluster) -> None:
    with _user(secure, "alice") as alice:
        token = alice.issue_job_token(KEYS, lifetime_secs=600).token
    token_id, secret = split_job_token(token)
    flipped = secret[:-1] + ("A" if secret[-1] != "A" else "B")
    with _user(secure, "alice") as alice:
        other_id = alice.issue_job_token(KEYS, lifetime_secs=600).token_id
    cases = {
        "secret altered": f"bjt1.{token_id}.{flipped}",
        "secret moved to another token's id": f"bjt1.{other_id}.{secret}",
        "unknown id": f"bjt1.{'f' * 16}.{secret}",
    }
    for what, bad in cases.items():
        with _job(secure, bad, timeout=5) as job, \
                pytest.raises(Unauthenticated, match="job token was refused"):
            job.get_meta("jt-a")
        for m in secure.masters:
            assert _get_meta_on(secure, m.address, bad, "jt-a") is \
                grpc.StatusCode.UNAUTHENTICATED, what


def test_an_expired_token_is_unauthenticated(secure: LocalCluster) -> None:
    with _user(secure, "alice") as alice:
        issued = alice.issue_job_token(KEYS, lifetime_secs=2)
    with _job(secure, issued.token, timeout=5) as job:
        assert job.read("jt-a") == b"jt-a"

        def refused() -> bool:
            try:
                job.get_meta("jt-a")
            except Unauthenticated as e:
                return "expired" in str(e)
            return False

        wait_until(refused, timeout=20, what="the job token to expire")
    for m in secure.masters:
        assert _get_meta_on(secure, m.address, issued.token, "jt-a") is \
            grpc.StatusCode.UNAUTHENTICATED


def test_a_revoked_token_stops_working_on_every_master(secure: LocalCluster) -> None:
    with _user(secure, "alice") as alice:
        issued = alice.issue_job_token(KEYS, lifetime_secs=600)
    for m in secure.masters:  # verified, and so cached, on every master first
        assert _get_meta_on(secure, m.address, issued.token, "jt-a") is grpc.StatusCode.OK
    with _user(secure, "bob") as bob, pytest.raises(NotAuthorized, match="not yours"):
        bob.revoke_job_token(issued.token_id)
    with _user(secure, "alice") as alice:
        assert alice.revoke_job_token(issued.token_id) == issued.token_id
    for m in secure.masters:
        wait_until(lambda m=m: _get_meta_on(secure, m.address, issued.token, "jt-a")
                   is grpc.StatusCode.UNAUTHENTICATED,
                   timeout=10, what=f"master {m.address} to refuse the revoked token")


def test_the_cli_issues_and_revokes_job_tokens(secure: LocalCluster, tmp_path: Path) -> None:
    creds = secure.credentials("alice")
    base = [sys.executable, "-m", "blobha", "--cluster", secure.cluster, "--ca", creds.ca or "",
            "--token-file", creds.token_file or ""]
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLOBHA_")}
    r = subprocess.run([*base, "token", "job", *KEYS, "--lifetime", "600", "--json"],
                       capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["keys"] == KEYS and out["user"] == "alice" and out["token"].startswith("bjt1.")
    assert out["token_id"] == split_job_token(out["token"])[0]
    (tmp_path / "job.token").write_text(out["token"] + "\n")
    (tmp_path / "job.token").chmod(0o600)  # the client refuses one other accounts can read
    as_job = [sys.executable, "-m", "blobha", "--cluster", secure.cluster, "--ca",
              creds.ca or "", "--token-file", str(tmp_path / "job.token")]
    r = subprocess.run([*as_job, "cat", "jt-a"], capture_output=True, timeout=60, env=env,
                       cwd=tmp_path)
    assert r.returncode == 0 and r.stdout == b"jt-a", r.stderr
    r = subprocess.run([*base, "token", "revoke", out["token_id"]], capture_output=True,
                       text=True, timeout=60, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    wait_until(lambda: subprocess.run([*as_job, "cat", "jt-a"], capture_output=True, timeout=60,
                                      env=env, cwd=tmp_path).returncode != 0,
               timeout=15, what="the CLI to be refused with the revoked token")
    r = subprocess.run([*base, "token", "job", *KEYS], capture_output=True, text=True,
                       timeout=60, env=env, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("bjt1."), r.stderr
