"""The one mapping between blobha errors and gRPC statuses."""

from __future__ import annotations

import errno
import os
import pickle

import grpc
import pytest

from blobha.core import errors
from blobha.core.errors import (
    LEADER_METADATA_KEY,
    BlobError,
    KeyNotFound,
    NotLeader,
    ResourceExhausted,
    Unavailable,
    UploadNotFound,
    from_status,
    to_status,
    upload_not_found,
)

ALL_CLASSES = sorted(
    (c for c in vars(errors).values()
     if isinstance(c, type) and issubclass(c, BlobError) and c is not BlobError),
    key=lambda c: c.__name__,
)


def _round_trip(error: BlobError) -> BlobError:
    code, details, trailers = to_status(error)
    return from_status(code, details, trailers)


def test_every_class_is_covered() -> None:
    # A new class must be added here on purpose, after checking it round-trips.
    assert {c.__name__ for c in ALL_CLASSES} == {
        "KeyNotFound", "KeyAlreadyExists", "NotAuthorized", "InvalidArgument", "NotLeader",
        "VersionConflict", "ChecksumMismatch", "ResourceExhausted", "Unavailable",
        "DeadlineExceeded", "UploadNotFound", "InternalError", "Unauthenticated",
        "TlsMismatch", "Busy", "Refused", "Stale",
    }


def test_a_client_side_tls_mismatch_reads_as_unauthenticated_on_the_wire() -> None:
    # Found by the client, never sent by a master; if one did, it would read as this.
    back = _round_trip(errors.TlsMismatch("no TLS connection"))
    assert type(back) is errors.Unauthenticated and str(back) == "no TLS connection"


@pytest.mark.parametrize("cls", [c for c in ALL_CLASSES if c is not errors.TlsMismatch],
                         ids=lambda c: c.__name__)
def test_round_trip_keeps_class_and_message(cls: type[BlobError]) -> None:
    if cls is UploadNotFound:
        original: BlobError = upload_not_found("u-123")
    elif cls is NotLeader:
        original = NotLeader("not the leader", "10.0.0.2:6627")
    else:
        original = cls(f"something about {cls.__name__}")
    back = _round_trip(original)
    assert type(back) is cls
    assert str(back) == str(original)
    assert back.code == original.code


@pytest.mark.parametrize("cls", ALL_CLASSES, ids=lambda c: c.__name__)
def test_codes_and_exit_codes(cls: type[BlobError]) -> None:
    assert isinstance(cls.code, grpc.StatusCode)
    assert cls.code is not grpc.StatusCode.OK
    assert cls.exit_code > 1 or cls is BlobError


def test_exit_codes_are_distinct() -> None:
    # A refusal is an Unavailable to a script (same status, same exit code); the client alone
    # tells them apart, by the trailer.
    own = [c for c in ALL_CLASSES if c not in (errors.Refused, errors.Stale)]
    exit_codes = [c.exit_code for c in own]
    assert len(set(exit_codes)) == len(exit_codes)
    for refusal in (errors.Refused, errors.Stale):
        assert refusal.exit_code == Unavailable.exit_code
        assert refusal.code == Unavailable.code


def test_a_stale_view_is_unavailable_with_its_own_trailer_and_the_refused_one() -> None:
    # The refused trailer too: a client that predates the stale one still retries elsewhere
    # and knows the read did not run.
    code, details, trailers = to_status(errors.Stale("master m1's view of 'k' is behind"))
    assert code is grpc.StatusCode.UNAVAILABLE
    assert dict(trailers) == {errors.STALE_METADATA_KEY: "1", errors.REFUSED_METADATA_KEY: "1"}
    back = from_status(code, details, trailers)
    assert type(back) is errors.Stale and str(back) == details
    assert type(from_status(code, details, ((errors.REFUSED_METADATA_KEY, "1"),))) is (
        errors.Refused)


def test_not_leader_carries_the_leader_in_trailing_metadata() -> None:
    code, details, trailers = to_status(NotLeader("go elsewhere", "nimbus-2:6627"))
    assert code is grpc.StatusCode.FAILED_PRECONDITION
    assert trailers == ((LEADER_METADATA_KEY, "nimbus-2:6627"),)
    back = from_status(code, details, trailers)
    assert isinstance(back, NotLeader)
    assert back.leader == "nimbus-2:6627"


def test_not_leader_leader_may_arrive_as_bytes_among_other_metadata() -> None:
    trailers = (("other", "x"), (LEADER_METADATA_KEY, b"nimbus-3:6627"))
    back = from_status(grpc.StatusCode.FAILED_PRECONDITION, "no", trailers)
    assert isinstance(back, NotLeader)
    assert back.leader == "nimbus-3:6627"


def test_not_leader_without_a_known_leader_sends_no_metadata() -> None:
    code, details, trailers = to_status(NotLeader("no leader yet"))
    assert trailers == ()
    back = from_status(code, details, trailers)
    assert isinstance(back, NotLeader)
    assert back.leader == ""


def test_upload_not_found_is_told_apart_from_key_not_found() -> None:
    upload = to_status(upload_not_found("abc"))
    key = to_status(KeyNotFound("key 'k' does not exist"))
    assert upload[0] == key[0] == grpc.StatusCode.NOT_FOUND
    up_back = from_status(*upload)
    key_back = from_status(*key)
    assert type(up_back) is UploadNotFound
    assert type(key_back) is KeyNotFound
    assert "abc" in str(up_back)


def test_unknown_codes_become_internal_errors() -> None:
    back = from_status(grpc.StatusCode.UNIMPLEMENTED, "no such method")
    assert type(back) is errors.InternalError
    assert str(back) == "no such method"


def test_empty_unavailable_details_get_an_actionable_message() -> None:
    back = from_status(grpc.StatusCode.UNAVAILABLE, "")
    assert isinstance(back, Unavailable)
    assert str(back) == ("no master answered: check the cluster's addresses and that its"
                         " masters run")


def test_other_empty_details_fall_back_to_the_code_name() -> None:
    back = from_status(grpc.StatusCode.ABORTED, "")
    assert str(back) == "ABORTED"


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_past_the_reservation_is_resource_exhausted_not_internal(code: int) -> None:
    from blobha.master.edge.service import translate_error

    e = translate_error("m1:6627", "Put", OSError(code, os.strerror(code)))
    assert isinstance(e, ResourceExhausted)
    assert "out of disk space" in str(e) and "m1:6627" in str(e)
    other = translate_error("m1:6627", "Put", OSError(errno.EIO, "Input/output error"))
    assert type(other) is BlobError and "internal error" in str(other)


def test_a_zookeeper_request_given_up_unanswered_is_unavailable_not_internal() -> None:
    # The group commit's read of a key waits the session timeout; one given up surfaced as
    # INTERNAL ("report it"), which the client does not retry.
    from kazoo.handlers.threading import KazooTimeoutError

    from blobha.master.edge.service import translate_error

    e = translate_error("m1:6627", "Put", KazooTimeoutError("Value not received within 4 seconds"))
    assert isinstance(e, Unavailable)
    assert "ZooKeeper is unreachable from master m1:6627" in str(e) and "retry" in str(e)


BUILT_INS: list[tuple[type[BlobError], tuple[type[Exception], ...]]] = [
    (errors.KeyNotFound, (FileNotFoundError, KeyError)),
    (errors.KeyAlreadyExists, (FileExistsError,)),
    (errors.NotAuthorized, (PermissionError,)),
    (errors.Unauthenticated, (PermissionError,)),
    (errors.Unavailable, (ConnectionError,)),
    (errors.Refused, (ConnectionError,)),
    (errors.Stale, (ConnectionError,)),
    (errors.Busy, (ConnectionError,)),
    (errors.DeadlineExceeded, (TimeoutError,)),
    (errors.InvalidArgument, (ValueError,)),
]


@pytest.mark.parametrize(("cls", "built_ins"), BUILT_INS, ids=lambda v: getattr(v, "__name__", ""))
def test_errors_are_caught_as_the_matching_built_ins(
        cls: type[BlobError], built_ins: tuple[type[Exception], ...]) -> None:
    for built_in in built_ins:
        with pytest.raises(built_in):
            raise cls("key 'a' not found")
        with pytest.raises(BlobError):
            raise cls("key 'a' not found")


@pytest.mark.parametrize(("cls", "built_ins"), BUILT_INS, ids=lambda v: getattr(v, "__name__", ""))
def test_errors_keep_the_plain_message_and_survive_pickling(
        cls: type[BlobError], built_ins: tuple[type[Exception], ...]) -> None:
    e = cls("key 'a' not found")
    assert str(e) == "key 'a' not found"  # not KeyError's quoted form, not OSError's [Errno]
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is cls and str(back) == "key 'a' not found"
    code, details, trailers = to_status(e)
    assert str(from_status(code, details, trailers)) == "key 'a' not found"


def test_errors_without_a_built_in_meaning_stay_apart_from_them() -> None:
    for cls in (errors.NotLeader, errors.VersionConflict, errors.ChecksumMismatch,
                errors.ResourceExhausted, errors.UploadNotFound, errors.InternalError,
                errors.TlsMismatch):
        assert not issubclass(cls, (OSError, LookupError, ValueError)), cls


def test_a_missing_key_reads_like_a_missing_file_or_mapping_entry() -> None:
    e = from_status(grpc.StatusCode.NOT_FOUND, "key 'a' not found")
    assert isinstance(e, FileNotFoundError) and isinstance(e, KeyError)
    assert e.errno is None  # never mistaken for a disk error (ENOSPC checks) by errno
