"""Storm's blob store scenarios 1-16 (storm-reference.md), against 3 real masters."""

from __future__ import annotations

import os

import grpc
import pytest
import xxhash
from support.harness import (
    client_for,
    master_metadata,
    md,
    store_dir,
    stub,
    version_files,
    wait_until,
)

from blobha import (
    InvalidArgument,
    KeyAlreadyExists,
    KeyNotFound,
    NotAuthorized,
    VersionConflict,
    parse_acl,
)
from blobha.client import Client
from blobha.core.keys import key_dirname
from blobha.ops.localcluster import LocalCluster
from blobha.v1 import blobha_pb2 as pb

pytestmark = pytest.mark.integration


def test_1_create_list_read_one_byte(alice: Client) -> None:
    alice.create("test", b"\x01", acl="o::rwa")
    assert "test" in set(alice.list())
    assert alice.read("test") == b"\x01"


def test_2_delete_recreate_update(alice: Client, unique_key: str) -> None:
    alice.create(unique_key, b"first")
    alice.delete(unique_key)
    with pytest.raises(KeyNotFound):
        alice.read(unique_key)
    alice.create(unique_key, b"second")
    alice.update(unique_key, b"third")
    assert alice.read(unique_key) == b"third"


def test_3_unfinished_update_is_invisible(cluster: LocalCluster, alice: Client,
                                          unique_key: str) -> None:
    alice.create(unique_key, b"committed")
    leader = stub(cluster.leader().address)
    begun = leader.BeginUpload(pb.BeginUploadRequest(key=unique_key, create=False),
                               metadata=md("alice"))
    leader.AppendUpload(iter([pb.UploadChunk(upload_id=begun.upload_id, offset=0,
                                             data=b"not yet")]), metadata=md("alice"))
    assert alice.read(unique_key) == b"committed"
    assert alice.get_meta(unique_key).version == 1


def test_4_empty_acl_keeps_creator_access(alice: Client, unique_key: str) -> None:
    meta = alice.create(unique_key, b"x", acl="")
    assert [str(a) for a in meta.acl] == ["u:alice:rwa"]
    assert alice.read(unique_key) == b"x"


def test_5_two_keys_are_independent(alice: Client, unique_key: str) -> None:
    a, b = unique_key + "-a", unique_key + "-b"
    alice.create(a, b"a1")
    alice.create(b, b"b1")
    alice.update(a, b"a2")
    alice.delete(b)
    alice.create(b, b"b2")
    assert alice.read(a) == b"a2"
    assert alice.read(b) == b"b2"
    assert alice.get_meta(a).version == 2


def test_6_abandoned_upload_expires_and_old_version_stays(cluster: LocalCluster, alice: Client,
                                                          unique_key: str) -> None:
    alice.create(unique_key, b"keep me")
    leader = cluster.leader()
    s = stub(leader.address)
    begun = s.BeginUpload(pb.BeginUploadRequest(key=unique_key, create=False),
                          metadata=md("alice"))
    s.AppendUpload(iter([pb.UploadChunk(upload_id=begun.upload_id, offset=0, data=b"z" * 1000)]),
                   metadata=md("alice"))
    tmp = store_dir(leader) / "tmp"
    assert any(tmp.iterdir()), "the upload's temp file should exist while it is active"

    # Watch the disk, not the upload: a status query is activity and would keep it alive.
    wait_until(lambda: not any(tmp.iterdir()), 20, "the idle upload's data to be deleted")
    with pytest.raises(grpc.RpcError) as err:
        s.GetUploadStatus(pb.UploadStatusRequest(upload_id=begun.upload_id), metadata=md("alice"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert alice.read(unique_key) == b"keep me"


def test_7_admin_may_create_and_delete_anything(cluster: LocalCluster, alice: Client,
                                                unique_key: str) -> None:
    alice.create(unique_key, b"private", acl="u:alice:rwa")
    with client_for(cluster, "admin") as admin:
        assert admin.read(unique_key) == b"private"
        admin.update(unique_key, b"by admin")
        admin.delete(unique_key)
        admin.create(unique_key + "-admin", b"mine")
    with pytest.raises(KeyNotFound):
        alice.get_meta(unique_key)
    # The masters' own identity (their principal and the cluster secret) is privileged too.
    alice.create(unique_key + "-m", b"private", acl="u:alice:rwa")
    as_master = master_metadata(cluster)
    leader = stub(cluster.leader().address)
    chunks = leader.Download(pb.DownloadRequest(key=unique_key + "-m"), metadata=as_master)
    assert b"".join(c.data for c in chunks) == b"private"
    leader.Delete(pb.DeleteRequest(key=unique_key + "-m"), metadata=as_master)
    with pytest.raises(KeyNotFound):
        alice.get_meta(unique_key + "-m")


def test_8_user_only_acl_refuses_others(cluster: LocalCluster, alice: Client,
                                        unique_key: str) -> None:
    alice.create(unique_key, b"secret", acl="u:alice:rwa")
    with client_for(cluster, "bob") as bob:
        with pytest.raises(NotAuthorized):
            bob.read(unique_key)
        with pytest.raises(NotAuthorized):
            bob.update(unique_key, b"mine now")
        with pytest.raises(NotAuthorized):
            bob.delete(unique_key)
        with pytest.raises(NotAuthorized):
            bob.set_acl(unique_key, "o::rwa")
        with pytest.raises(NotAuthorized):
            bob.get_replication(unique_key)
    assert alice.read(unique_key) == b"secret"


def test_9_stray_temp_file_does_not_break_delete(cluster: LocalCluster, alice: Client,
                                                 unique_key: str) -> None:
    alice.create(unique_key, b"data", replication_factor=3)
    alice.wait_for_replication([unique_key], 3, timeout=10)
    for m in cluster.masters:
        assert version_files(m, unique_key)
        # A small version has no directory of its own (a segment record); a stray file
        # there is one a crash of a large version's install left.
        d = store_dir(m) / "keys" / key_dirname(unique_key)
        d.mkdir(exist_ok=True)
        (d / "v9.blob.tmp-stray").write_bytes(b"junk")
    alice.delete(unique_key)
    wait_until(lambda: all(not version_files(m, unique_key) for m in cluster.masters), 15,
               "every master to drop the deleted key")


def test_10_size_and_version(alice: Client, unique_key: str) -> None:
    data = os.urandom(1234567)
    meta = alice.create(unique_key, data)
    assert meta.size == len(data)
    assert meta.digest == xxhash.xxh3_128_hexdigest(data)
    v1 = meta.version
    meta2 = alice.update(unique_key, data[:10])
    assert meta2.size == 10 and meta2.version == v1 + 1
    assert alice.get_meta(unique_key).size == 10


def test_11_restarted_follower_downloads_exactly_the_missing_keys(
        cluster: LocalCluster, alice: Client, unique_key: str) -> None:
    follower = next(m for m in cluster.masters if m is not cluster.leader())
    held = [f"{unique_key}-held-{i}" for i in range(2)]
    for k in held:
        alice.create(k, k.encode(), replication_factor=3)
    assert alice.wait_for_replication(held, 3, timeout=30).reached
    # A copy downloaded again would be installed as a new record (or file): a new identity.
    before = {k: [f.identity for f in version_files(follower, k)] for k in held}
    follower.terminate()
    keys = [f"{unique_key}-{i}" for i in range(3)]
    for k in keys:
        alice.create(k, k.encode(), replication_factor=3)
    cluster.start_master(follower)
    assert alice.wait_for_replication([*held, *keys], 3, timeout=30).reached
    for k in keys:
        assert len(version_files(follower, k)) == 1
    # Exactly the missing ones: what it held is still the very same files.
    assert {k: [f.identity for f in version_files(follower, k)] for k in held} == before
    # And it serves them, verified, from its own disk.
    for k in keys:
        chunks = stub(follower.address).Download(pb.DownloadRequest(key=k), metadata=md("alice"))
        assert b"".join(c.data for c in chunks) == k.encode()


def test_12_13_replication_counts_only_latest_version(alice: Client, unique_key: str) -> None:
    alice.create(unique_key, b"v1", replication_factor=3)
    assert alice.wait_for_replication([unique_key], 3, timeout=10).reached
    alice.update(unique_key, b"v2")
    status = alice.wait_for_replication([unique_key], 3, timeout=10).statuses[0]
    assert status.version == 2 and status.replication == 3


def test_14_duplicate_acl_entries_rejected(alice: Client, unique_key: str) -> None:
    with pytest.raises(InvalidArgument):
        alice.create(unique_key, b"x", acl="u:bob:r,u:bob:w")
    with pytest.raises(KeyNotFound):
        alice.get_meta(unique_key)
    alice.create(unique_key, b"x")
    with pytest.raises(InvalidArgument):
        alice.set_acl(unique_key, "u:carol:r,o::r,u:carol:rw")


def test_15_unicode_keys(alice: Client) -> None:
    for key in ("données_2024", "日本語キー", "with space", "a-b_c.d"):
        alice.create(key, key.encode())
        assert alice.read(key) == key.encode()
        assert key in set(alice.list())


def test_16_non_leader_refuses_writes_and_names_leader(cluster: LocalCluster,
                                                       unique_key: str) -> None:
    leader = cluster.leader()
    follower = next(m for m in cluster.masters if m is not leader and m.alive())
    with pytest.raises(grpc.RpcError) as err:
        stub(follower.address).BeginUpload(pb.BeginUploadRequest(key=unique_key, create=True),
                                           metadata=md("alice"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert ("x-blobha-leader", leader.address) in [tuple(m) for m in
                                                   err.value.trailing_metadata()]
    with pytest.raises(grpc.RpcError) as err:
        stub(follower.address).Delete(pb.DeleteRequest(key=unique_key), metadata=md("alice"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_create_twice_is_already_exists(alice: Client, unique_key: str) -> None:
    alice.create(unique_key, b"one")
    with pytest.raises(KeyAlreadyExists):
        alice.create(unique_key, b"two")
    assert alice.read(unique_key) == b"one"


def test_invalid_keys_rejected(alice: Client) -> None:
    for key in ("a/b", "a:b", "..", ".", "tab\tkey"):
        with pytest.raises(InvalidArgument):
            alice.create(key, b"x")


def test_set_acl_expecting_metadata_version_0_is_a_condition(alice: Client,
                                                             unique_key: str) -> None:
    # A new key's metadata is at version 0 (W=1 commits acknowledged): expecting 0 must still
    # refuse once someone changed it, or `blobha set-acl KEY` undoes a change made meanwhile.
    meta = alice.create(unique_key, b"x", write_quorum=1)
    assert alice.get_meta(unique_key).meta_version == 0
    changed = alice.set_acl(unique_key, "o::r")
    assert changed.meta_version == 1
    with pytest.raises(VersionConflict):
        alice.set_acl(unique_key, "u:bob:r", expected_meta_version=meta.meta_version)
    after = alice.get_meta(unique_key)
    assert after.meta_version == 1 and [str(a) for a in after.acl] == [
        str(a) for a in changed.acl]
    assert alice.set_acl(unique_key, "u:bob:r", expected_meta_version=1).meta_version == 2


def test_set_acl_keeps_admin_for_setter(alice: Client, unique_key: str) -> None:
    alice.create(unique_key, b"x")
    meta = alice.set_acl(unique_key, "o::r")
    acl = {str(a) for a in meta.acl}
    assert "o::r--" in acl and "u:alice:--a" in acl
    assert parse_acl(",".join(acl))
