"""The writes of :class:`~blobha.client.facade.Client` beyond one upload: create, update, put
(create or update in one call), and delete. Functions of the router the facade delegates to."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence

from blobha.client.arguments import UINT32_MAX, check_count, normalize_acl
from blobha.client.retry import Deadline
from blobha.client.routing import Router
from blobha.client.upload import upload
from blobha.client.values import BlobMeta, ProgressCallback, UploadData, check_body
from blobha.core.acl import AccessControl
from blobha.core.errors import KeyAlreadyExists, KeyNotFound, NotAuthorized, VersionConflict
from blobha.core.keys import validate_key
from blobha.v1 import blobha_pb2 as pb
from blobha.wire.convert import acl_to_pb

#: Rounds of update-then-create a put makes before it gives up: each lost round means another
#: writer created or deleted the key in between, so a few rounds settle any real contention.
PUT_ROUNDS = 8


def create(router: Router, key: str, data: UploadData,
           acl: str | Sequence[AccessControl] | None, replication_factor: int,
           write_quorum: int, progress: ProgressCallback | None) -> BlobMeta:
    validate_key(key)
    check_count("replication_factor", replication_factor, UINT32_MAX)
    check_count("write_quorum", write_quorum, UINT32_MAX)
    request = pb.BeginUploadRequest(
        key=key,
        create=True,
        acl=acl_to_pb(normalize_acl(acl)),
        replication_factor=replication_factor,
        write_quorum=write_quorum,
    )
    return saw(router, key, upload(router, request, data, progress))


def update(router: Router, key: str, data: UploadData, expected_version: int,
           write_quorum: int, progress: ProgressCallback | None) -> BlobMeta:
    validate_key(key)
    check_count("expected_version", expected_version)
    check_count("write_quorum", write_quorum, UINT32_MAX)
    request = pb.BeginUploadRequest(
        key=key, create=False, expected_version=expected_version, write_quorum=write_quorum
    )
    return saw(router, key, upload(router, request, data, progress))


def put(router: Router, key: str, data: UploadData,
        acl: str | Sequence[AccessControl] | None, replication_factor: int,
        write_quorum: int, progress: ProgressCallback | None) -> BlobMeta:
    """Update ``key``, or create it when it does not exist. Concurrent puts of a new key all
    succeed: the one whose create loses finds the key and updates it, becoming the next
    version."""
    validate_key(key)
    check_body(data)
    normalize_acl(acl)  # refused before anything is written
    rewind = _rewinder(data)
    last: KeyNotFound | KeyAlreadyExists | None = None
    for _ in range(PUT_ROUNDS):
        try:
            return update(router, key, data, 0, write_quorum, progress)
        except KeyNotFound as e:
            last = e
        rewind()
        try:
            return create(router, key, data, acl, replication_factor, write_quorum, progress)
        except KeyAlreadyExists as e:  # created meanwhile by another writer: update that
            last = e
        rewind()
    assert last is not None
    raise last


def _rewinder(data: UploadData) -> Callable[[], None]:
    """What puts a file object body back where it was handed over, for the next attempt.
    Bytes and paths are read afresh by every attempt; a stream that cannot seek is not
    rewound (its attempts are refused before they read it: an update finds no key when it
    reads the metadata, a create finds one when it begins its upload)."""
    if isinstance(data, (bytes, bytearray, memoryview, os.PathLike)):
        return lambda: None
    f = data
    start: int | None = None
    with contextlib.suppress(AttributeError, OSError, ValueError):
        if f.seekable():
            start = f.tell()
    if start is None:
        return lambda: None
    position = start

    def rewind() -> None:
        f.seek(position)

    return rewind


def delete(router: Router, key: str, timeout: float) -> None:
    validate_key(key)
    what = f"delete {key!r}"
    deadline = Deadline(timeout)
    while True:
        # The delete names the key it read (by its creation time): a retry after a lost
        # answer must not delete a key created again meanwhile by someone else.
        request = pb.DeleteRequest(key=key)
        created_at = _created_at(router, key, deadline)
        if created_at is not None:
            request.expected_created_at = created_at
        try:
            router.leader_call(
                what, "Delete", request, missing_ok_on_retry=True,
                # The key read is gone, and a newer one of the same name is not ours to
                # delete: an attempt whose answer was lost deleted it (or someone did).
                conflict_on_retry=lambda _: pb.DeleteResponse(), deadline=deadline,
            )
            if created_at is not None:
                router.seen.deleted(key, created_at)
            return
        except VersionConflict:
            # Deleted and created again between the read and the delete, by others: the
            # key asked to be deleted is the one there now.
            if deadline.expired():
                raise
            continue


def _created_at(router: Router, key: str, deadline: Deadline) -> float | None:
    """The creation time of ``key`` as the leader sees it (a follower may not know of a
    key just created), or None when the leader will not show this user the metadata (a
    master older than showing it to writers): the delete is then unconditional, as before
    the condition existed."""
    try:
        meta = router.leader_call(f"read the metadata of {key!r}", "GetMeta",
                                  pb.GetMetaRequest(key=key, any_access=True),
                                  deadline=deadline)
    except NotAuthorized:
        return None
    router.seen.saw(key, meta.version, meta.created_at)
    return float(meta.created_at)


def saw(router: Router, key: str, meta: BlobMeta) -> BlobMeta:
    """``meta``, a write's answer, remembered: later reads of ``key`` accept no older view."""
    router.seen.saw(key, meta.version, meta.created_at)
    return meta
