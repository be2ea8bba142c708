"""Writes whose answer is lost, retried by the client against a real cluster: each is made
once and reported as made, never written twice or reported as failed.

A transport that lets a call run on the master and then raises UNAVAILABLE, as a connection
dropped after the master answered would, stands for the lost answer."""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from support.harness import client_for

from blobha.client import PUT_MAX_BYTES, Client, GrpcTransport
from blobha.core.errors import KeyNotFound, Unavailable, VersionConflict
from blobha.ops.localcluster import LocalCluster

pytestmark = pytest.mark.integration


class LosesAnswers(GrpcTransport):
    """Runs each call, then loses the answer of the next call of a method named in ``lose``
    (running its hook first: what happens after the master committed). A method named in
    ``refuse`` fails once without being sent (its hook runs instead); one named in ``after``
    runs its hook once after the call, whose answer arrives."""

    def __init__(self, user: str) -> None:
        super().__init__(user)
        self.lose: dict[str, Callable[[], Any] | None] = {}
        self.refuse: dict[str, Callable[[], Any]] = {}
        self.after: dict[str, Callable[[], Any]] = {}
        self.calls: list[str] = []

    def unary(self, address: str, method: str, request: Any, timeout: float | None,
              stall: float | None = None, rivals: Any = ()) -> Any:
        self.calls.append(method)
        if method in self.refuse:
            self.refuse.pop(method)()
            raise Unavailable(f"master {address} unavailable: connection refused (test)")
        response = super().unary(address, method, request, timeout, stall)
        if method in self.lose:
            hook = self.lose.pop(method)
            if hook is not None:
                hook()
            raise Unavailable(f"master {address} unavailable: the answer was lost (test)")
        if method in self.after:
            self.after.pop(method)()
        return response


@pytest.fixture
def lossy(cluster: LocalCluster) -> Iterator[tuple[Client, LosesAnswers]]:
    transport = LosesAnswers("alice")
    with client_for(cluster, "alice", transport=transport) as c:
        yield c, transport


def versions(c: Client, key: str) -> tuple[int, bytes]:
    return c.get_meta(key).version, c.read(key)


def test_a_create_whose_answer_was_lost_reports_its_version(
        lossy: tuple[Client, LosesAnswers], unique_key: str) -> None:
    c, t = lossy
    t.lose["Put"] = None
    meta = c.create(unique_key, b"made once")
    # The client found its write in the metadata (it may read it): nothing sent twice.
    assert meta.version == 1 and t.calls.count("Put") == 1
    assert versions(c, unique_key) == (1, b"made once")


def test_an_update_retried_after_someone_elses_is_not_written_again(
        cluster: LocalCluster, lossy: tuple[Client, LosesAnswers], unique_key: str) -> None:
    c, t = lossy
    c.create(unique_key, b"v1", acl="u:carol:rw")
    with client_for(cluster, "carol") as carol:
        # Carol writes v3 after alice's v2 committed and before alice's client retries.
        t.lose["Put"] = lambda: carol.update(unique_key, b"carol's, newer")
        assert c.update(unique_key, b"alice's").version == 2
        # Before: alice's bytes were written again as v4, over carol's newer write.
        assert versions(carol, unique_key) == (3, b"carol's, newer")
        assert c.read(unique_key, version=2) == b"alice's"


@contextlib.contextmanager
def writer_who_may_not_read(cluster: LocalCluster, key: str
                            ) -> Iterator[tuple[Client, Client, LosesAnswers]]:
    """Alice, who created ``key`` granting bob WRITE only, and bob, through a lossy transport."""
    with client_for(cluster, "alice") as alice:
        alice.create(key, b"v1", acl="u:bob:w")
        transport = LosesAnswers("bob")
        with client_for(cluster, "bob", transport=transport) as bob:
            yield alice, bob, transport


def test_a_writer_who_may_not_read_writes_once(cluster: LocalCluster, unique_key: str) -> None:
    with writer_who_may_not_read(cluster, unique_key) as (alice, bob, transport):
        transport.lose["Put"] = None
        assert bob.update(unique_key, b"bob's").version == 2
        transport.lose["Put"] = None
        assert bob.update(unique_key, b"bob's", expected_version=2).version == 3
        # Before: each lost answer made one more version (the writer cannot read the metadata
        # to see its write there), or a VersionConflict for its own write.
        assert versions(alice, unique_key) == (3, b"bob's")


@pytest.mark.parametrize("source", ["file", "stream"])
def test_a_streamed_upload_whose_commit_answer_was_lost(
        cluster: LocalCluster, unique_key: str, source: str) -> None:
    data = os.urandom(PUT_MAX_BYTES + 4096)  # past Put: BeginUpload, AppendUpload, CommitUpload
    with writer_who_may_not_read(cluster, unique_key) as (alice, bob, transport):
        transport.lose["CommitUpload"] = None
        upload: Any = data if source == "file" else _Unseekable(data)
        meta = bob.update(unique_key, upload)
        assert meta.version == 2 and meta.size == len(data)
        # Bob may not read the metadata to look for his write: the retry's BeginUpload was
        # answered with the committed version, so nothing was sent twice, and a stream, which
        # cannot be read again, still succeeds (before: "nothing was written", exit 13).
        assert transport.calls.count("BeginUpload") == 2
        assert transport.calls.count("CommitUpload") == 1
        assert versions(alice, unique_key) == (2, data)


def test_a_delete_whose_answer_was_lost_is_reported_done(
        lossy: tuple[Client, LosesAnswers], unique_key: str) -> None:
    c, t = lossy
    c.create(unique_key, b"v1")
    t.lose["Delete"] = None
    c.delete(unique_key)
    assert t.calls.count("Delete") == 2  # the retry found the key gone
    with pytest.raises(KeyNotFound):
        c.get_meta(unique_key)


@pytest.mark.parametrize("acl", ["", "u:alice:rw"], ids=["private", "shared"])
def test_a_delete_retried_after_the_key_was_created_again_leaves_the_new_key(
        cluster: LocalCluster, lossy: tuple[Client, LosesAnswers], unique_key: str,
        acl: str) -> None:
    c, t = lossy
    c.create(unique_key, b"alice's")
    with client_for(cluster, "carol") as carol:
        # Alice's delete is made; before her client retries, carol creates the key anew.
        t.lose["Delete"] = lambda: carol.create(unique_key, b"carol's", acl=acl or None)
        c.delete(unique_key)
        # Before: the retry deleted carol's new key, which alice never saw, if its ACL let
        # alice write; if not, alice was told she may not delete it, though her delete was made.
        assert versions(carol, unique_key) == (1, b"carol's")
        assert t.calls.count("Delete") == 2


def test_a_key_created_again_between_the_read_and_the_delete_is_deleted(
        cluster: LocalCluster, lossy: tuple[Client, LosesAnswers], unique_key: str) -> None:
    c, t = lossy
    c.create(unique_key, b"first", acl="u:carol:rw")
    with client_for(cluster, "carol") as carol:
        def recreate() -> None:
            carol.delete(unique_key)
            carol.create(unique_key, b"second", acl="u:carol:rwa,u:alice:rw")
        # The delete's condition (the key alice read) no longer holds, and no answer of hers
        # was lost: the key there now is the one she asked to delete.
        t.after["GetMeta"] = recreate
        c.delete(unique_key)
        with pytest.raises(KeyNotFound):
            carol.get_meta(unique_key)
        assert t.calls.count("Delete") == 2 and t.calls.count("GetMeta") == 2


def test_a_writer_who_may_not_read_deletes_only_the_key_it_meant(
        cluster: LocalCluster, unique_key: str) -> None:
    with writer_who_may_not_read(cluster, unique_key) as (alice, bob, transport):
        # Bob's delete is made; before his client retries, alice creates the key anew, again
        # granting him WRITE.
        transport.lose["Delete"] = lambda: alice.create(unique_key, b"alice's, new",
                                                        acl="u:bob:w")
        bob.delete(unique_key)
        # Before: bob was not shown the metadata, so his delete named no key, and its retry
        # deleted alice's new one.
        assert versions(alice, unique_key) == (1, b"alice's, new")
        assert transport.calls.count("Delete") == 2
        transport.lose["Delete"] = None
        bob.delete(unique_key)
        with pytest.raises(KeyNotFound):
            alice.get_meta(unique_key)


class _Unseekable(io.RawIOBase):
    """A pipe-like source: read once, never again."""

    def __init__(self, data: bytes) -> None:
        self._data = memoryview(data)

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = min(len(b), len(self._data))
        b[:n] = self._data[:n]
        self._data = self._data[n:]
        return n


def test_concurrent_updates_with_a_write_quorum_all_succeed_once(
        cluster: LocalCluster, unique_key: str) -> None:
    # Before: an acknowledgement written between a group commit's read and its conditional
    # write failed that update with a conflict nobody asked for; and an update superseded by
    # the next before two masters held it waited out the whole write timeout, then was told
    # it was not acknowledged.
    with client_for(cluster, "alice") as c:
        c.create(unique_key, b"v0", replication_factor=3, write_quorum=2)
        errors: list[BaseException] = []
        versions_made: list[int] = []

        def writer(n: int) -> None:
            for i in range(8):
                try:
                    versions_made.append(c.update(unique_key, b"%d-%d" % (n, i),
                                                  write_quorum=2).version)
                except BaseException as e:  # every failure is the finding
                    errors.append(e)

        threads = [threading.Thread(target=writer, args=(n,)) for n in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
        assert errors == []
        # Each write made exactly one version: none written twice by a retry.
        made = sorted(versions_made)
        assert made == list(range(2, 2 + 24)), ",".join(map(str, made))
        meta = c.get_meta(unique_key)
        assert meta.version == 25 and meta.acknowledged


def test_a_conditional_acl_change_whose_answer_was_lost_reports_success(
        lossy: tuple[Client, LosesAnswers], unique_key: str) -> None:
    c, t = lossy
    c.create(unique_key, b"x")
    before = c.get_meta(unique_key).meta_version
    t.lose["SetMeta"] = None
    meta = c.set_acl(unique_key, "o::r,u:bob:r", expected_meta_version=before)
    # Before: the retry met its own change as a conflict (ABORTED, exit 8).
    assert meta.meta_version == before + 1 and t.calls.count("SetMeta") == 2
    assert {str(e) for e in c.get_meta(unique_key).acl} == {"o::r--", "u:bob:r--", "u:alice:--a"}
    # A conflict with someone else's change, after an attempt that failed unsent, stands.
    t.refuse["SetMeta"] = lambda: c.set_acl(unique_key, "o::r")
    with pytest.raises(VersionConflict):
        c.set_acl(unique_key, "u:carol:r", expected_meta_version=before + 1)
    assert {str(e) for e in c.get_meta(unique_key).acl} == {"o::r--", "u:alice:--a"}
