"""blobha.client's pure helpers: cluster strings, backoff, deadlines, users and options,
conversions and sources."""

from __future__ import annotations

import getpass
import io
import re
from pathlib import Path
from typing import Any

import pytest
from support.client_fakes import (
    FakeCluster,
    KiB,
)

from blobha import client as client_mod
from blobha.client import (
    BACKOFF_BASE,
    BACKOFF_CAP,
    BlobInfo,
    BlobMeta,
    Client,
    ClusterSummary,
    MasterSummary,
    ReplicationStatus,
    WaitResult,
    backoff_delay,
    parse_cluster,
)
from blobha.client import arguments as arguments_mod
from blobha.client import retry as retry_mod
from blobha.client import sources as sources_mod
from blobha.core.acl import AccessControl
from blobha.core.errors import (
    BlobError,
    InvalidArgument,
)
from blobha.v1 import blobha_pb2 as pb
from blobha.wire import convert
from blobha.wire.convert import replication_from_pb


class TestParseCluster:
    def test_comma_separated_with_spaces_and_duplicates(self) -> None:
        assert parse_cluster(" a:1, b:2 ,a:1,") == ("a:1", "b:2")

    def test_list_and_default_port(self) -> None:
        assert parse_cluster(["m1", "m2:7000,m3"]) == ("m1:6627", "m2:7000", "m3:6627")

    def test_ipv6_in_brackets(self) -> None:
        assert parse_cluster("[::1]:7000,[fe80::1]") == ("[::1]:7000", "[fe80::1]:6627")

    @pytest.mark.parametrize(
        "text", ["", " , ", "h:0", "h:70000", "h:x", ":80", "::1", "[::1", "[]:80", "a b:1"]
    )
    def test_rejects(self, text: str) -> None:
        with pytest.raises(InvalidArgument):
            parse_cluster(text)


class TestBackoff:
    @pytest.mark.parametrize("attempt", range(12))
    def test_within_full_jitter_bounds(self, attempt: int) -> None:
        ceiling = min(BACKOFF_CAP, BACKOFF_BASE * 2**attempt)
        for _ in range(50):
            assert 0.0 <= backoff_delay(attempt) <= ceiling

    def test_extremes(self) -> None:
        assert backoff_delay(0, rand=lambda: 0.0) == 0.0
        assert backoff_delay(0, rand=lambda: 1.0) == pytest.approx(BACKOFF_BASE)
        assert backoff_delay(3, rand=lambda: 1.0) == pytest.approx(BACKOFF_BASE * 8)
        assert backoff_delay(100_000, rand=lambda: 1.0) == BACKOFF_CAP  # no overflow
        assert backoff_delay(-5, rand=lambda: 1.0) == pytest.approx(BACKOFF_BASE)

    def test_custom_base_and_cap(self) -> None:
        assert backoff_delay(10, base=1.0, cap=5.0, rand=lambda: 0.5) == 2.5


class TestDeadline:
    def test_remaining_expiry_and_restart(self) -> None:
        now = [100.0]
        d = retry_mod.Deadline(10.0, clock=lambda: now[0])
        assert d.remaining() == 10.0
        now[0] = 108.0
        assert d.remaining() == pytest.approx(2.0)
        now[0] = 111.0
        assert d.remaining() == 0.0 and d.expired()
        d.restart()
        assert d.remaining() == 10.0


class TestUserAndOptions:
    def test_user_from_environment(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("BLOBHA_USER", "carol")
        assert client_mod.default_user() == "carol"
        assert Client("h:1", transport=FakeCluster()).user == "carol"

    def test_explicit_user_wins(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("BLOBHA_USER", "carol")
        assert Client("h:1", user="dave", transport=FakeCluster()).user == "dave"

    def test_os_user_fallback(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv("BLOBHA_USER", raising=False)
        monkeypatch.setattr(getpass, "getuser", lambda: "osuser")
        assert client_mod.default_user() == "osuser"

    @pytest.mark.parametrize("user", ["", " bob", "bob\n", "zoé"])
    def test_bad_user(self, user: str, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("BLOBHA_USER", "x")
        with pytest.raises(InvalidArgument):
            arguments_mod.check_user(user)

    @pytest.mark.parametrize(
        ("user", "problem"),
        [
            ("carol,x", "must not contain ':' or ','"),
            ("a:b", "must not contain ':' or ','"),
            ("x" * 257, "must be 1-256 characters"),
            ("tab\tname", "must not contain control characters"),
        ],
    )
    def test_user_names_follow_the_masters_rules(self, user: str, problem: str) -> None:
        # The masters refuse these names (they would break an ACL's text form): the client
        # says why before making any call.
        with pytest.raises(InvalidArgument, match=re.escape(problem)):
            Client("h:1", user=user, transport=FakeCluster())

    @pytest.mark.parametrize("size", [1, 256 * KiB - 1, 1024 * KiB + 1])
    def test_chunk_size_bounds(self, size: int) -> None:
        with pytest.raises(InvalidArgument):
            Client("h:1", user="u", chunk_size=size, transport=FakeCluster())

    def test_timeout_must_be_positive(self) -> None:
        with pytest.raises(InvalidArgument):
            Client("h:1", user="u", timeout=0, transport=FakeCluster())

    def test_acl_forms(self) -> None:
        entries = [AccessControl("u", "a", 7)]
        assert arguments_mod.normalize_acl(None) == []
        assert arguments_mod.normalize_acl("u:a:rwa") == entries
        assert arguments_mod.normalize_acl(entries) == entries
        with pytest.raises(InvalidArgument):
            arguments_mod.normalize_acl("u:a:rwa,u:a:r")
        with pytest.raises(InvalidArgument):
            arguments_mod.normalize_acl(["u:a:rwa"])  # type: ignore[list-item]

    @pytest.mark.parametrize(
        ("entry", "problem"),
        [
            (AccessControl("u", "carol,x", 1), "must not contain ':' or ','"),
            (AccessControl("u", "a:b", 1), "must not contain ':' or ','"),
            (AccessControl("u", " bob", 1), "must not start or end with spaces"),
            (AccessControl("u", "", 1), "must be 1-256 characters"),
            (AccessControl("u", "bob", 8), "bad ACL access 8"),
            (AccessControl("x", "bob", 1), "bad ACL entry type 'x'"),
            (AccessControl("o", "bob", 1), "takes no name"),
        ],
    )
    def test_acl_values_follow_the_string_rules(
        self, entry: AccessControl, problem: str, cluster: FakeCluster
    ) -> None:
        # Entries built in code skip the parser; they are refused locally all the same, before
        # any call (a ',' or ':' in a stored name would make the key's ACL unreadable).
        with pytest.raises(InvalidArgument, match=re.escape(problem)):
            arguments_mod.normalize_acl([entry])
        c = Client("h:1", user="alice", transport=cluster)
        with pytest.raises(InvalidArgument, match=re.escape(problem)):
            c.create("k", b"x", acl=[entry])
        with pytest.raises(InvalidArgument, match=re.escape(problem)):
            c.set_acl("k", [entry])
        assert cluster.calls == []


    @pytest.mark.parametrize(("factor", "problem"), [
        (0, "whole number from 1 to 4294967295, not 0"),
        (-3, "whole number from 1 to 4294967295, not -3"),
        (2.5, "whole number from 1 to 4294967295, not 2.5"),
        (2**32, "whole number from 1 to 4294967295, not 4294967296"),
    ])
    def test_a_replication_factor_the_wire_cannot_carry_is_refused_before_any_call(
        self, factor: Any, problem: str, cluster: FakeCluster
    ) -> None:
        c = Client("h:1", user="alice", transport=cluster)
        with pytest.raises(InvalidArgument, match=re.escape(problem)):
            c.set_replication_factor("k", factor)
        assert cluster.calls == []


class TestConversions:
    def test_meta(self) -> None:
        m = pb.BlobMeta(
            key="k",
            version=3,
            size=10,
            digest="d" * 32,
            acl=[pb.AccessControl(type="u", name="alice", access=7), pb.AccessControl(type="o")],
            replication_factor=2,
            meta_version=5,
            created_at=1.5,
            updated_at=2.5,
            creator="alice",
            replication=2,
            acknowledged=True,
            access=3,
        )
        meta = convert.meta_from_pb(m)
        assert meta == BlobMeta(
            key="k",
            version=3,
            size=10,
            digest="d" * 32,
            acl=(AccessControl("u", "alice", 7), AccessControl("o", "", 0)),
            replication_factor=2,
            meta_version=5,
            created_at=1.5,
            updated_at=2.5,
            creator="alice",
            replication=2,
            access=3,
        )
        assert meta.readable
        with pytest.raises(AttributeError):
            meta.version = 4  # type: ignore[misc]
        # Without READ, the metadata only; a master that does not say answered readers alone.
        assert not convert.meta_from_pb(pb.BlobMeta(key="k", access=6)).readable
        assert convert.meta_from_pb(pb.BlobMeta(key="k")).readable

    def test_acl_round_trip(self) -> None:
        acl = [AccessControl("u", "bob", 3), AccessControl("o", "", 1)]
        assert list(convert.acl_from_pb(convert.acl_to_pb(acl))) == acl

    def test_info_replication_wait(self) -> None:
        assert convert.info_from_pb(pb.BlobInfo(version=2, size=5, digest="x")) == BlobInfo(
            2, 5, "x"
        )
        status = pb.ReplicationStatus(
            key="k", version=2, replication=1, replication_factor=3, holders=["a:1"]
        )
        expected = ReplicationStatus("k", 2, 1, 3, ("a:1",))
        assert replication_from_pb(status) == expected
        wait = pb.WaitForReplicationResponse(reached=True, status=[status], waited_secs=1.25)
        assert convert.wait_result_from_pb(wait) == WaitResult(True, (expected,), 1.25)

    def test_cluster_summary(self) -> None:
        s = pb.ClusterSummaryResponse(
            masters=[
                pb.MasterSummary(
                    address="a:1",
                    is_leader=True,
                    uptime_secs=9.0,
                    version="0.1",
                    blob_count=4,
                    bytes_stored=100,
                    disk_free=1000,
                    lag_blobs=1,
                    reachable=True,
                    epoch=7,
                )
            ],
            leader="a:1",
            epoch=7,
            blob_count=4,
            under_replicated=1,
        )
        assert convert.summary_from_pb(s) == ClusterSummary(
            masters=(MasterSummary("a:1", True, 9.0, "0.1", 4, 100, 1000, 1, True, 7),),
            leader="a:1",
            epoch=7,
            blob_count=4,
            under_replicated=1,
        )


class TestSources:
    def test_stream_source_replays_until_acknowledged(self) -> None:
        src = sources_mod.StreamSource(io.BufferedReader(io.BytesIO(b"abcdefghij")))
        assert src.read_at(0, 4) == b"abcd"
        assert src.read_at(4, 4) == b"efgh"
        assert src.read_at(2, 4) == b"cdef"  # a resend after a broken stream
        assert src.can_restart()
        src.ack(6)
        assert not src.can_restart()
        assert src.read_at(6, 100) == b"ghij"
        assert src.read_at(10, 4) == b""
        with pytest.raises(BlobError):
            src.read_at(0, 1)

    def test_file_source_is_relative_to_start(self, tmp_path: Path) -> None:
        path = tmp_path / "f"
        path.write_bytes(b"0123456789")
        with path.open("rb") as f:
            f.seek(3)
            src = sources_mod.open_source(f)
            assert src.size == 7
            assert src.read_at(0, 3) == b"345"
            assert src.can_restart()

    def test_rejects_other_types(self) -> None:
        with pytest.raises(InvalidArgument):
            sources_mod.open_source(12)  # type: ignore[arg-type]
