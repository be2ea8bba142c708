"""One user filling what every user shares (issue 56, item 5), on a real cluster.

Any authenticated user could create keys, ACLs of up to 1 MB each, blobs and unfinished
uploads, and job tokens of up to 1 MB each, without end: ZooKeeper keeps all of it in memory
on every server, and the masters on their disks. Each is now counted per user, and a user at
a limit is refused with RESOURCE_EXHAUSTED while everybody else goes on. The limits are low
here so that a flood is a few calls; an admin is exempt from all of them.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from contextlib import ExitStack, suppress
from typing import Any

import pytest
from support.harness import FAST, wait_until

from blobha.client import Client
from blobha.core.digest import PUT_MAX_BYTES
from blobha.core.errors import KeyNotFound, ResourceExhausted
from blobha.ops.localcluster import LocalCluster

pytestmark = pytest.mark.integration

KEYS = 4
STORED = 6 * PUT_MAX_BYTES
ACL_BYTES = 2048
UPLOAD_BYTES = 4 * PUT_MAX_BYTES
TOKENS = 2
BIG = PUT_MAX_BYTES * 5 // 2  # more than one Put: an upload session with its size said

QUOTAS = {
    "blobstore.quota.user.keys": KEYS,
    "blobstore.quota.user.bytes": STORED,
    "blobstore.quota.user.acl.bytes": ACL_BYTES,
    "blobstore.quota.user.upload.bytes": UPLOAD_BYTES,
    "auth.job.token.max.per.user": TOKENS,
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("quotas"), nodes=3, base_port=0,
                     overrides={**FAST, **QUOTAS}, auth="token")
    try:
        c.start()
        yield c
    finally:
        c.stop()


class Users:
    """alice, bob and admin, each a client; every key made through :meth:`create` is deleted
    after the test, so each test finds its users' quotas as the last one left them."""

    def __init__(self, cluster: LocalCluster, stack: ExitStack) -> None:
        self.c = {u: stack.enter_context(Client(cluster.cluster, user=u, timeout=30,
                                                credentials=cluster.credentials(u)))
                  for u in ("alice", "bob", "admin")}
        self.made: list[str] = []

    def create(self, user: str, name: str, data: bytes | io.RawIOBase, **kw: Any) -> str:
        key = f"{name}-{os.getpid()}"
        self.c[user].create(key, data, **kw)
        self.made.append(key)
        return key

    def clean(self) -> None:
        for key in self.made:
            with suppress(KeyNotFound):
                self.c["admin"].delete(key)  # an ACL change may have left its creator none


@pytest.fixture
def users(cluster: LocalCluster) -> Iterator[Users]:
    with ExitStack() as stack:
        u = Users(cluster, stack)
        yield u
        u.clean()


def _refused(option: str, call: object, *args: object, **kwargs: object) -> str:
    assert callable(call)
    with pytest.raises(ResourceExhausted) as e:
        call(*args, **kwargs)
    message = str(e.value)
    assert option in message and "\n" not in message, message
    return message


class _Unsized(io.RawIOBase):
    """A body of unknown size (a pipe, to the client): no size hint, so the upload's bytes
    are counted as they arrive."""

    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, b: memoryview) -> int:  # type: ignore[override]
        n = min(len(b), self.left, 256 * 1024)
        b[:n] = b"u" * n
        self.left -= n
        return n


def test_a_user_creating_keys_without_end_stops_at_the_quota_and_nobody_else_does(
        users: Users) -> None:
    bob = users.c["bob"]
    for i in range(KEYS):
        users.create("bob", f"bob-key-{i}", b"k" * 10)
    # The group commit's path and the upload session's alike.
    message = _refused("blobstore.quota.user.keys", bob.create, f"bob-more-{os.getpid()}", b"k")
    assert f"holds {KEYS}" in message
    _refused("blobstore.quota.user.keys", bob.create, f"bob-big-{os.getpid()}", b"b" * BIG)
    with pytest.raises(KeyNotFound):
        bob.get_meta(f"bob-more-{os.getpid()}")  # nothing half-made
    users.create("alice", "alice-key", b"a")  # another user's quota is her own
    for i in range(KEYS + 1):  # the admin is exempt
        users.create("admin", f"admin-key-{i}", b"x")
    # Deleting frees the room.
    bob.delete(users.made[0])
    users.create("bob", "bob-key-again", b"k")


def test_acls_that_would_fill_zookeeper_stop_at_the_quota(users: Users) -> None:
    bob = users.c["bob"]
    big = ",".join(f"u:reader-{i:04d}-{'x' * 40}:r" for i in range(60))
    assert len(big) > ACL_BYTES
    _refused("blobstore.quota.user.acl.bytes", bob.create, f"bob-acl-big-{os.getpid()}", b"a",
             acl=big)
    key = users.create("bob", "bob-acl", b"a", acl="u:carol:r")
    _refused("blobstore.quota.user.acl.bytes", bob.set_acl, key, big)
    assert "carol" in {e.name for e in bob.get_meta(key).acl}  # the ACL as it was
    bob.set_acl(key, "u:carol:r,u:dave:r")  # growing within it is fine
    users.create("admin", "admin-acl", b"a", acl=big)


def test_stored_bytes_stop_at_the_quota_before_the_upload_is_sent(users: Users) -> None:
    bob = users.c["bob"]
    first = users.create("bob", "bob-bytes-1", b"1" * BIG)
    second = users.create("bob", "bob-bytes-2", b"2" * BIG)
    sent: list[int] = []
    # Its size is said when the upload begins: refused then, before its bytes go.
    _refused("blobstore.quota.user.bytes", bob.create, f"bob-bytes-3-{os.getpid()}",
             b"3" * BIG, progress=lambda done, total: sent.append(done))
    assert max(sent, default=0) < BIG
    with pytest.raises(KeyNotFound):
        bob.get_meta(f"bob-bytes-3-{os.getpid()}")
    # An update is charged its growth only.
    bob.update(first, b"1" * (BIG + PUT_MAX_BYTES // 2))
    _refused("blobstore.quota.user.bytes", bob.update, second, b"2" * (BIG + PUT_MAX_BYTES))
    assert bob.get_meta(second).version == 1


def test_unfinished_uploads_stop_at_the_quota_and_are_freed(users: Users) -> None:
    bob = users.c["bob"]
    _refused("blobstore.quota.user.upload.bytes", bob.create, f"bob-stream-{os.getpid()}",
             _Unsized(UPLOAD_BYTES + PUT_MAX_BYTES))
    with pytest.raises(KeyNotFound):
        bob.get_meta(f"bob-stream-{os.getpid()}")
    # The refused session was given up: its bytes no longer count.
    users.create("bob", "bob-stream-ok", _Unsized(UPLOAD_BYTES - PUT_MAX_BYTES))
    users.create("alice", "alice-stream", _Unsized(UPLOAD_BYTES - PUT_MAX_BYTES // 2))


def test_job_tokens_stop_at_the_quota_on_every_leader(users: Users,
                                                     cluster: LocalCluster) -> None:
    bob = users.c["bob"]
    key = users.create("bob", "bob-job-input", b"in")
    tokens = [bob.issue_job_token([key]) for _ in range(TOKENS)]
    _refused("auth.job.token.max.per.user", bob.issue_job_token, [key])
    bob.revoke_job_token(tokens[0].token_id)
    tokens[0] = bob.issue_job_token([key])
    tokens.append(users.c["admin"].issue_job_token([key]))  # exempt
    # A new leader counts what ZooKeeper holds, not what the old one remembered.
    old = cluster.leader()
    old.terminate()
    try:
        wait_until(lambda: cluster.leader(timeout=5).address != old.address, timeout=30,
                   what="a new leader")
        _refused("auth.job.token.max.per.user", bob.issue_job_token, [key])
        for i in range(KEYS - 1):
            users.create("bob", f"bob-after-failover-{i}", b"k")
        _refused("blobstore.quota.user.keys", bob.create, f"bob-more-after-{os.getpid()}",
                 b"k")
    finally:
        cluster.start_master(old)
        for t in tokens:
            users.c["admin"].revoke_job_token(t.token_id)
