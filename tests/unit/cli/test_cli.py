"""Unit tests of the ``blobha`` command line with a fake client (no network, no processes),
except one that runs the command in a process against an in-process fake master, for what
only happens at interpreter shutdown."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import threading
import types
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import grpc
import pytest

from blobha import cli
from blobha.cli import connect, hints
from blobha.client import (
    DEFAULT_CHUNK_SIZE,
    BlobInfo,
    BlobMeta,
    ClusterSummary,
    MasterSummary,
    ReplicationStatus,
    WaitResult,
)
from blobha.core import errors
from blobha.core.acl import AccessControl
from blobha.core.errors import (
    BlobError,
    KeyAlreadyExists,
    KeyNotFound,
    NotAuthorized,
    Unavailable,
)
from blobha.v1 import blobha_pb2 as pb
from blobha.v1 import blobha_pb2_grpc as pb_grpc


class FakeClient:
    """Stands in for blobha.client.Client; blobs live in the shared ``store``."""

    def __init__(self, store: FakeStore, cluster: str, user: str | None) -> None:
        self.store = store
        store.opened.append((cluster, user))

    def __enter__(self) -> FakeClient:
        return self

    @property
    def consistency(self) -> str:
        return self.store.consistencies[-1] if self.store.consistencies else "session"

    @consistency.setter
    def consistency(self, value: str) -> None:
        self.store.consistencies.append(value)

    def __exit__(self, *exc: object) -> None:
        self.store.closed += 1

    def _raise_next(self) -> None:
        if self.store.error is not None:
            error, self.store.error = self.store.error, None
            raise error

    def _meta(self, key: str) -> BlobMeta:
        if key not in self.store.blobs:
            raise KeyNotFound(f"no blob with key {key!r}")
        data, acl, version = self.store.blobs[key]
        return BlobMeta(key, version, len(data), "ab" * 16, acl, 3, 1, 1.0, 2.0, "alice", 1)

    def create(
        self,
        key: str,
        data: Path | BinaryIO,
        acl: Sequence[AccessControl] = (),
        replication_factor: int = 0,
        write_quorum: int = 0,
        progress: Any = None,
    ) -> BlobMeta:
        self._raise_next()
        self.store.created.append((key, tuple(acl), replication_factor, write_quorum))
        if key in self.store.blobs:
            raise KeyAlreadyExists(f"key {key!r} already exists")
        content = data.read_bytes() if isinstance(data, Path) else data.read()
        self.store.blobs[key] = (content, tuple(acl), 1)
        return self._meta(key)

    def put(self, key: str, data: Path | BinaryIO, acl: Sequence[AccessControl] = (),
            replication_factor: int = 0, write_quorum: int = 0,
            progress: Any = None) -> BlobMeta:
        self._raise_next()
        self.store.puts.append((key, tuple(acl), replication_factor, write_quorum))
        content = data.read_bytes() if isinstance(data, Path) else data.read()
        old = self.store.blobs.get(key)
        acl_kept, version = (old[1], old[2] + 1) if old else (tuple(acl), 1)
        self.store.blobs[key] = (content, acl_kept, version)
        return self._meta(key)

    def update(self, key: str, data: Path | BinaryIO, progress: Any = None) -> BlobMeta:
        self._raise_next()
        old = self._meta(key)
        content = data.read_bytes() if isinstance(data, Path) else data.read()
        self.store.blobs[key] = (content, old.acl, old.version + 1)
        return self._meta(key)

    def download(self, key: str, dest: str | BinaryIO, progress: Any = None, **kw: Any) -> BlobInfo:
        self._raise_next()
        meta = self._meta(key)
        data = self.store.blobs[key][0]
        if isinstance(dest, str):
            Path(dest).write_bytes(data)
        else:
            dest.write(data)
        return BlobInfo(meta.version, meta.size, meta.digest)

    def delete(self, key: str) -> None:
        self._raise_next()
        self._meta(key)
        del self.store.blobs[key]

    def list(self, prefix: str = "", page_size: int = 1000, *,
             detail: bool = False) -> Iterator[Any]:
        self._raise_next()
        self.store.list_pages.append(page_size)
        keys = sorted(k for k in self.store.blobs if k.startswith(prefix) and not (
            self.store.list_readable_only and k in self.store.forbidden))
        return iter([self._meta(k) for k in keys] if detail else keys)

    def get_meta(self, key: str) -> BlobMeta:
        self._raise_next()
        if key in self.store.forbidden:
            raise NotAuthorized(f"user lacks READ permission on {key!r}")
        return self._meta(key)

    def set_acl(self, key: str, acl: Sequence[AccessControl],
                expected_meta_version: int | None = None) -> BlobMeta:
        self.store.expected_meta_versions.append(expected_meta_version)
        data, _, version = self.store.blobs[key]
        self.store.blobs[key] = (data, tuple(acl), version)
        return self._meta(key)

    def get_replication(self, key: str) -> ReplicationStatus:
        self._meta(key)
        return ReplicationStatus(key, 1, self.store.replicas, 3, ("m1:1",))

    def set_replication_factor(self, key: str, n: int) -> BlobMeta:
        self.store.replication_factor = n
        return self._meta(key)

    def wait_for_replication(
        self, keys: Iterable[str], min_replication: int, timeout: float
    ) -> WaitResult:
        names = list(keys)
        self.store.waits.append((names, min_replication, timeout))
        statuses = tuple(ReplicationStatus(k, 1, self.store.replicas, 3, ()) for k in names)
        return WaitResult(self.store.replicas >= min_replication, statuses, max(timeout, 0.0))

    def cluster_summary(self) -> ClusterSummary:
        self._raise_next()
        return ClusterSummary(
            masters=(
                MasterSummary(
                    "m1:6627", True, 3725.0, "0.1.0", 2, 3 * 1024**2, 50 * 1024**3, 0, True, 4
                ),
                MasterSummary(
                    "m2:6627", False, 59.0, "0.1.0", 2, 3 * 1024**2, 40 * 1024**3, 1, True, 4
                ),
                MasterSummary("m3:6627", False, 0.0, "", 0, 0, 0, 0, False, 0),
            ),
            leader="m1:6627",
            epoch=4,
            blob_count=0 if self.store.cut_off else 2,
            under_replicated=1,
            zookeeper_unreachable=self.store.cut_off,
        )


class FakeStore:
    def __init__(self) -> None:
        self.blobs: dict[str, tuple[bytes, tuple[AccessControl, ...], int]] = {}
        self.opened: list[tuple[str, str | None]] = []
        self.created: list[tuple[str, tuple[AccessControl, ...], int, int]] = []
        self.puts: list[tuple[str, tuple[AccessControl, ...], int, int]] = []
        self.waits: list[tuple[list[str], int, float]] = []
        self.forbidden: set[str] = set()
        #: Listings leave out forbidden keys (blobstore.list.visibility = "readable").
        self.list_readable_only = False
        self.list_pages: list[int] = []  # the page size of each listing asked for
        self.replicas = 1
        self.replication_factor = 0
        self.closed = 0
        self.cut_off = False  # the summary's master has no ZooKeeper connection
        self.error: BaseException | None = None
        self.expected_meta_versions: list[int | None] = []
        self.consistencies: list[str] = []  # what each command set its client's to


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> FakeStore:
    fake = FakeStore()
    monkeypatch.setattr(
        connect, "client_factory", lambda cluster, user: FakeClient(fake, cluster, user)
    )
    monkeypatch.delenv("BLOBHA_CLUSTER", raising=False)
    monkeypatch.delenv("BLOBHA_USER", raising=False)
    return fake


def set_stdin(monkeypatch: pytest.MonkeyPatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))


def one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("blobha: error: ")
    assert "Traceback" not in err
    return lines[0]


# ------------------------------------------------------------------------------------------------
# Parsing
# ------------------------------------------------------------------------------------------------


class TestParsing:
    def test_global_options_before_and_after_the_command(self) -> None:
        parser = cli.build_parser()
        a = parser.parse_args(["--cluster", "h:1", "--user", "u", "meta", "k"])
        b = parser.parse_args(["meta", "k", "--cluster", "h:1", "--user", "u"])
        assert (a.cluster, a.user, a.key) == (b.cluster, b.user, b.key) == ("h:1", "u", "k")
        c = parser.parse_args(["--cluster", "h:1", "meta", "k", "--user", "u"])
        assert (c.cluster, c.user) == ("h:1", "u")
        d = parser.parse_args(["meta", "k"])
        assert d.cluster is None and d.user is None

    def test_storm_style_create(self) -> None:
        a = cli.build_parser().parse_args(
            ["create", "k", "-f", "F", "-a", "u:a:rwa,o::r", "--replication-factor", "2"]
        )
        assert (a.key, a.file, a.acl, a.replication_factor) == ("k", "F", "u:a:rwa,o::r", 2)
        assert (a.wait_replication, a.write_quorum) == (0, 0)
        cli.parser.check_args(a)
        assert a.timeout == 60.0  # the global --timeout's default, given by check_args

    @pytest.mark.parametrize(
        "argv",
        [
            [],
            ["nope"],
            ["create"],
            ["create", "k", "--replication-factor", "0"],
            ["create", "k", "--replication-factor", "x"],
            ["set-acl"],
            ["delete"],
            ["replication", "k"],
            ["replication", "--read", "--update", "k"],
            ["replication", "--update", "k"],
            ["replication", "--read", "--replication-factor", "2", "k"],
            ["wait-replication", "k"],
            ["wait-replication", "--min", "1"],
            ["serve"],
            ["local-cluster", "--base-port", "70000"],
            ["--cluster", "127.0.0.1:abc", "list"],
            ["list", "--cluster", "[::1"],
            ["cat", "k", "-f", ""],
            ["create", "k", "--file", ""],
            ["token", "create"],
            ["token", "create", "a", "b"],
            ["token", "hash", "alice"],
            ["token", "job"],
            ["token", "job", "k", "--lifetime", "0"],
            ["token", "job", "k", "--append", "f"],
            ["token", "revoke", "a", "--out", "f"],
            ["token", "revoke"],
            ["token", "revoke", "a", "b"],
            ["token", "create", "alice", "--lifetime", "60"],
        ],
    )
    def test_usage_errors_exit_2(self, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
        assert cli.main(argv) == 2
        assert "usage:" in capsys.readouterr().err

    def test_help_lists_exit_codes(self, capsys: pytest.CaptureFixture[str]) -> None:
        assert cli.main(["--help"]) == 0
        out = capsys.readouterr().out
        assert "exit codes:" in out and "3 key not found" in out and "130 interrupted" in out

    def test_docstring_table_matches_error_classes(self) -> None:
        doc = cli.__doc__ or ""
        table = dict(
            (int(m.group(1)), m.group(2)) for m in re.finditer(r"^(\d+)\s+(\S.*)$", doc, re.M)
        )
        for cls in vars(errors).values():
            if isinstance(cls, type) and issubclass(cls, BlobError) and cls is not BlobError:
                assert cls.exit_code in table, cls
                assert str(cls.exit_code) in cli.EXIT_CODES_EPILOG
        assert {0, 1, 2, 130}.issubset(table)


# ------------------------------------------------------------------------------------------------
# Commands
# ------------------------------------------------------------------------------------------------


def test_create_from_stdin_and_cat_to_stdout(
    store: FakeStore, monkeypatch: pytest.MonkeyPatch, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    set_stdin(monkeypatch, b"\x00binary\xff")
    assert cli.main(["create", "k", "-a", "o::r"]) == 0
    assert store.created == [("k", (AccessControl("o", "", 1),), 0, 0)]
    assert cli.main(["cat", "k"]) == 0
    assert capsysbinary.readouterr().out == b"\x00binary\xff"


def test_cluster_and_user_resolution(store: FakeStore, monkeypatch: pytest.MonkeyPatch) -> None:
    cli.main(["list"])
    monkeypatch.setenv("BLOBHA_CLUSTER", "env:1")
    cli.main(["list", "--user", "bob"])
    cli.main(["--cluster", "opt:2", "list"])
    assert store.opened == [("127.0.0.1:6627", None), ("env:1", "bob"), ("opt:2", None)]
    assert store.closed == 3


def test_create_update_and_cat_with_files(store: FakeStore, tmp_path: Path) -> None:
    src, dest = tmp_path / "in", tmp_path / "out"
    src.write_bytes(b"v1")
    assert cli.main(["create", "k", "-f", str(src), "--write-quorum", "2"]) == 0
    src.write_bytes(b"v2")
    assert cli.main(["update", "k", "--file", str(src)]) == 0
    assert cli.main(["cat", "k", "-f", str(dest)]) == 0
    assert dest.read_bytes() == b"v2" and store.blobs["k"][2] == 2
    assert store.created[0][3] == 2


def test_list_keys_and_json(store: FakeStore, capsys: pytest.CaptureFixture[str]) -> None:
    for k in ["a", "b", "secret"]:
        store.blobs[k] = (b"", (), 1)
    store.forbidden = {"secret"}
    assert cli.main(["list"]) == 0
    assert capsys.readouterr().out == "a\nb\nsecret\n"
    assert cli.main(["list", "b", "missing", "secret", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == ["b", "secret"]
    assert cli.main(["list", "--prefix", "s"]) == 0
    assert capsys.readouterr().out == "secret\n"
    # Named keys follow the masters' listing rule: where listings show only readable keys,
    # naming an unreadable one does not show it either.
    store.list_readable_only = True
    store.blobs["secret-2"] = (b"", (), 1)
    store.list_pages.clear()
    assert cli.main(["list", "b", "secret", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == ["b"]
    assert store.list_pages == [1]  # one key's listing asks for one key, not a page of 1,000


def test_put_creates_then_writes_the_next_version(
    store: FakeStore, monkeypatch: pytest.MonkeyPatch, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    set_stdin(monkeypatch, b"one")
    assert cli.main(["put", "k", "-a", "o::r", "-r", "2", "--write-quorum", "2"]) == 0
    set_stdin(monkeypatch, b"two")
    assert cli.main(["put", "k"]) == 0
    assert store.puts == [("k", (AccessControl("o", "", 1),), 2, 2), ("k", (), 0, 0)]
    assert store.blobs["k"] == (b"two", (AccessControl("o", "", 1),), 2)
    assert store.created == []  # one call, Client.put, creates or updates
    assert cli.main(["cat", "k"]) == 0
    assert capsysbinary.readouterr().out == b"two"


def test_put_from_a_file_and_waiting_for_replication(store: FakeStore, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "in"
    src.write_bytes(b"file")
    store.replicas = 1
    assert cli.main(["put", "k", "-f", str(src), "--wait-replication", "2",
                     "--timeout", "0"]) == 12
    assert "fewer than 2 masters hold it" in one_error_line(capsys.readouterr().err)
    assert store.blobs["k"][0] == b"file" and store.waits == [(["k"], 2, 0.0)]


def test_stat_is_meta(store: FakeStore, capsys: pytest.CaptureFixture[str]) -> None:
    store.blobs["k"] = (b"12345", (AccessControl("u", "alice", 7),), 2)
    assert cli.main(["stat", "k", "--json"]) == 0
    stat = capsys.readouterr().out
    assert cli.main(["meta", "k", "--json"]) == 0
    assert stat == capsys.readouterr().out and json.loads(stat)["version"] == 2
    assert cli.main(["stat", "missing"]) == 3


def test_list_long_and_its_json(store: FakeStore, capsys: pytest.CaptureFixture[str]) -> None:
    store.blobs["a"] = (b"xyz", (), 4)
    store.blobs["b"] = (b"", (), 1)
    assert cli.main(["list", "-l"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "a\t4\t3\t1970-01-01T00:00:02+00:00\t1", "b\t1\t0\t1970-01-01T00:00:02+00:00\t1"]
    assert cli.main(["list", "--long", "--json", "--prefix", "a"]) == 0
    assert json.loads(capsys.readouterr().out) == [
        {"key": "a", "version": 4, "size": 3, "updated": "1970-01-01T00:00:02+00:00",
         "replication": 1}]
    assert cli.main(["list", "-l", "b", "missing", "--json"]) == 0
    assert [row["key"] for row in json.loads(capsys.readouterr().out)] == ["b"]


def test_consistent_reads_ask_for_a_linearizable_client(store: FakeStore,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    store.blobs["k"] = (b"12345", (AccessControl("u", "alice", 7),), 2)
    assert cli.main(["meta", "k"]) == 0 and store.consistencies == []
    for argv in (["meta", "--consistent", "k"], ["cat", "k", "--consistent"],
                 ["replication", "k", "--read", "--consistent"]):
        assert cli.main(argv) == 0
    assert store.consistencies == ["linearizable"] * 3
    capsys.readouterr()
    assert cli.main(["list", "--consistent"]) == 2  # a listing is always read from ZooKeeper
    assert "unrecognized arguments: --consistent" in capsys.readouterr().err


def test_meta_text_and_json(store: FakeStore, capsys: pytest.CaptureFixture[str]) -> None:
    store.blobs["k"] = (b"12345", (AccessControl("u", "alice", 7), AccessControl("o", "", 1)), 2)
    assert cli.main(["meta", "k"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^acl:\s+u:alice:rwa,o::r--$", out, re.M)
    assert re.search(r"^version:\s+2$", out, re.M)
    assert re.search(r"^replication factor:\s+3$", out, re.M)
    assert "creator:" in out and "1970-01-01T00:00:01+00:00" in out
    assert cli.main(["meta", "k", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["acl"] == ["u:alice:rwa", "o::r--"] and data["size"] == 5


def test_set_acl_and_replication(store: FakeStore, capsys: pytest.CaptureFixture[str]) -> None:
    store.blobs["k"] = (b"x", (), 1)
    store.replicas = 2
    assert cli.main(["set-acl", "k", "-s", "u:bob:r,o::-"]) == 0
    assert store.blobs["k"][1] == (AccessControl("u", "bob", 1), AccessControl("o", "", 0))
    assert cli.main(["replication", "--read", "k"]) == 0
    assert capsys.readouterr().out == "2\n"
    assert cli.main(["replication", "--update", "--replication-factor", "5", "k"]) == 0
    assert store.replication_factor == 5


def test_delete(store: FakeStore) -> None:
    store.blobs["k"] = (b"x", (), 1)
    assert cli.main(["delete", "k"]) == 0
    assert "k" not in store.blobs


def test_delete_of_several_keys_tries_each_and_returns_the_first_failure(
    store: FakeStore, capsys: pytest.CaptureFixture[str]
) -> None:
    store.blobs["a"] = (b"x", (), 1)
    store.blobs["c"] = (b"x", (), 1)
    assert cli.main(["delete", "a", "missing", "c"]) == errors.KeyNotFound.exit_code
    assert "a" not in store.blobs and "c" not in store.blobs
    assert "missing" in capsys.readouterr().err


def test_storm_spellings_of_set_acl_and_the_replication_factor(store: FakeStore) -> None:
    a = cli.build_parser().parse_args(["create", "k", "-r", "2"])
    assert a.replication_factor == 2
    a = cli.build_parser().parse_args(["replication", "--update", "-r", "4", "k"])
    assert a.replication_factor == 4
    # Without -s, Storm sets the current ACL again.
    acl = (AccessControl("u", "bob", 1), AccessControl("o", "", 0))
    store.blobs["k"] = (b"x", acl, 1)
    assert cli.main(["set-acl", "k"]) == 0
    assert store.blobs["k"][1] == acl
    # Set again only if still the ACL read: a change made meanwhile is never undone.
    assert store.expected_meta_versions[-1] == 1  # the meta_version get_meta gave


def test_cluster_table_and_json(store: FakeStore, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["cluster"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["ADDRESS", "ROLE", "UPTIME"]
    assert lines[1].split()[:4] == ["m1:6627", "leader", "1h02m", "0.1.0"]
    assert lines[2].split()[:3] == ["m2:6627", "follower", "59s"]
    assert lines[3].split()[:2] == ["m3:6627", "unreachable"]
    assert lines[4] == "leader: m1:6627  epoch: 4  blobs: 2  under-replicated: 1"
    assert cli.main(["cluster", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["leader"] == "m1:6627" and data["masters"][2]["role"] == "unreachable"
    assert data["blob_count"] == 2 and data["zookeeper_unreachable"] is False
    # Answered without ZooKeeper: the count is unknown, not 0, and the table says why.
    store.cut_off = True
    assert cli.main(["cluster"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[4] == "leader: m1:6627  epoch: 4  blobs: unknown  under-replicated: 1"
    assert lines[5].startswith("ZooKeeper is unreachable from the master that answered")
    assert cli.main(["cluster", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["blob_count"] is None and data["zookeeper_unreachable"] is True


def test_wait_replication_exit_codes(store: FakeStore, capsys: pytest.CaptureFixture[str]) -> None:
    store.replicas = 2
    assert cli.main(["wait-replication", "a", "b", "--min", "2", "--timeout", "5"]) == 0
    assert store.waits[-1] == (["a", "b"], 2, 5.0)
    code = cli.main(["wait-replication", "a", "--min", "3", "--timeout", "-1"])
    assert code == errors.DeadlineExceeded.exit_code
    assert "fewer than 3 replicas" in one_error_line(capsys.readouterr().err)
    assert store.waits[-1][2] == -1.0
    # Values the wire or the wait cannot take are usage errors, before any call.
    waits = len(store.waits)
    for argv in (["wait-replication", "a", "--min", "2", "--timeout", "inf"],
                 ["wait-replication", "a", "--min", "2", "--timeout", "nan"],
                 ["wait-replication", "a", "--min", str(2**32)],
                 ["replication", "a", "--update", "-r", str(2**32)]):
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "negative number waits forever" in err or "expected 1 to 4294967295" in err, err
    assert len(store.waits) == waits


def test_create_wait_replication(
    store: FakeStore, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    set_stdin(monkeypatch, b"x")
    code = cli.main(["create", "k", "--wait-replication", "2", "--timeout", "7"])
    assert code == errors.DeadlineExceeded.exit_code
    assert store.waits == [(["k"], 2, 7.0)]
    line = one_error_line(capsys.readouterr().err)
    assert "k version 1 was created" in line
    set_stdin(monkeypatch, b"x")
    assert cli.main(["create", "k2", "--wait-replication", "1"]) == 0


def test_serve_and_local_cluster_are_loaded_lazily(
    store: FakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[Any, ...]] = []

    def serve_main(path: str) -> int:
        calls.append(("serve", path))
        return 0

    def local_main(*args: Any, **kw: Any) -> int:
        calls.append(("local", *args, *sorted(kw.items())))
        return 3

    master = types.ModuleType("blobha.master.process")
    master.serve_main = serve_main  # type: ignore[attr-defined]
    local = types.ModuleType("blobha.ops.localcluster")
    local.main = local_main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "blobha.master.process", master)
    monkeypatch.setitem(sys.modules, "blobha.ops.localcluster", local)
    assert cli.main(["serve", "--config", "m.toml"]) == 0
    assert cli.main(["local-cluster", "--nodes", "5", "--data-dir", "d"]) == 3
    assert cli.main(["local-cluster"]) == 3
    assert cli.main(["local-cluster", "--tls"]) == 3
    assert calls == [
        ("serve", "m.toml"),
        ("local", 5, "d", 6627, None, ("auth", None), ("tls", False)),
        ("local", 3, None, 6627, None, ("auth", None), ("tls", False)),
        ("local", 3, None, 6627, None, ("auth", None), ("tls", True)),
    ]


# ------------------------------------------------------------------------------------------------
# Errors: one line on stderr, the class's exit code, never a traceback
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "error",
    [
        errors.KeyNotFound("no blob with key 'k'"),
        errors.NotAuthorized("user 'u' lacks READ"),
        errors.Unavailable("master m1:1 unavailable: failed to connect\nto all addresses"),
        errors.ChecksumMismatch("corrupt"),
        errors.VersionConflict("moved"),
        errors.InternalError(""),
    ],
)
def test_blob_errors_map_to_exit_codes(
    store: FakeStore, error: BlobError, capsys: pytest.CaptureFixture[str]
) -> None:
    store.error = error
    assert cli.main(["cluster"]) == error.exit_code
    line = one_error_line(capsys.readouterr().err)
    assert line.removeprefix("blobha: error: ").startswith(
        " ".join(str(error).split()) or "InternalError")


def test_key_not_found(store: FakeStore, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["meta", "missing"]) == 3
    assert one_error_line(capsys.readouterr().err) == (
        "blobha: error: no blob with key 'missing'; 'blobha list' shows the keys")


def test_the_command_line_adds_its_hints_to_the_library_messages(
        store: FakeStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The library states the fact; which command helps is the command line's to say.
    store.blobs["k"] = (b"", (), 1)
    src = tmp_path / "f"
    src.write_bytes(b"")
    assert cli.main(["create", "k", "-f", str(src)]) == 4
    assert one_error_line(capsys.readouterr().err) == (
        "blobha: error: key 'k' already exists; use 'blobha update'")
    assert cli.main(["update", "new", "-f", str(src)]) == 3
    assert one_error_line(capsys.readouterr().err).endswith("; use 'blobha create' first")


@pytest.mark.parametrize(("error", "command", "hint"), [
    (errors.NotAuthorized("user 'u' lacks READ permission on 'k'; ask a user with ADMIN on it"
                          " to grant access"), "read", "'blobha set-acl' grants it"),
    (errors.Unauthenticated("no token; pass one"), "read", ""),
    (errors.InvalidArgument("write quorum 3 exceeds the replication factor 2 of 'k'; lower it,"
                            " or raise the key's factor first"), "update",
     "'blobha replication --update -r N KEY' raises it"),
    (errors.Unavailable("unavailable; an earlier attempt's commit got no answer, so the update"
                        " 'k' may have been made: check its metadata before writing again"),
     "update", "'blobha meta KEY' shows whether it was"),
    (errors.Unavailable("no reachable master holds v2 of 'k': retry later"), "read",
     "'blobha replication --read KEY' shows how many masters hold it"),
    (errors.Unavailable("no master answered: check the cluster's addresses and that its"
                        " masters run"), "list",
     "the addresses come from --cluster, BLOBHA_CLUSTER or the client profile"),
    (errors.ChecksumMismatch("corrupt"), "read", ""),
])
def test_hints_by_error_class_and_situation(error: BlobError, command: str, hint: str) -> None:
    assert hints.hint(error, command) == hint
    assert hints.describe(error, command) == (f"{error}; {hint}" if hint else str(error))


def test_create_existing_key(store: FakeStore, tmp_path: Path) -> None:
    store.blobs["k"] = (b"", (), 1)
    src = tmp_path / "f"
    src.write_bytes(b"")
    assert cli.main(["create", "k", "-f", str(src)]) == 4


def test_bad_acl_is_invalid_argument(store: FakeStore, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["create", "k", "-a", "x:y:z"]) == errors.InvalidArgument.exit_code
    assert "bad ACL entry" in one_error_line(capsys.readouterr().err)
    assert store.created == [] and store.opened == []  # checked before connecting
    assert cli.main(["set-acl", "k", "-s", "u:a:r,u:a:w"]) == errors.InvalidArgument.exit_code


def test_missing_file_is_exit_1(
    store: FakeStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope"
    assert cli.main(["create", "k", "-f", str(missing)]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert str(missing) in line and "No such file" in line


def test_keyboard_interrupt_is_130(store: FakeStore, capsys: pytest.CaptureFixture[str]) -> None:
    store.error = KeyboardInterrupt()
    assert cli.main(["cluster"]) == 130
    assert one_error_line(capsys.readouterr().err) == "blobha: error: interrupted"


def test_unexpected_exception_has_no_traceback(
    store: FakeStore, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("BLOBHA_DEBUG", raising=False)
    store.error = RuntimeError("boom")
    assert cli.main(["cluster"]) == errors.InternalError.exit_code
    assert "internal error: RuntimeError: boom" in one_error_line(capsys.readouterr().err)


def test_invalid_cluster_address_from_real_factory(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # From the environment (the option is checked as a usage error): the real Client rejects
    # the address before any connection is attempted.
    monkeypatch.setenv("BLOBHA_CLUSTER", "h:notaport")
    assert cli.main(["list"]) == errors.InvalidArgument.exit_code
    assert "bad port" in one_error_line(capsys.readouterr().err)
    assert cli.main(["--cluster", "h:notaport", "list"]) == 2
    assert "--cluster: bad port" in capsys.readouterr().err


def test_unavailable_message_is_one_line(
    store: FakeStore, capsys: pytest.CaptureFixture[str]
) -> None:
    store.error = Unavailable("a\n  b\tc")
    assert cli.main(["list"]) == errors.Unavailable.exit_code
    assert one_error_line(capsys.readouterr().err) == "blobha: error: a b c"


class _DiskFullMaster(pb_grpc.BlobStoreServicer):
    """A leader that begins an upload, then refuses it after its first chunk (a full disk)."""

    def __init__(self) -> None:
        self.address = ""
        self.aborted = threading.Event()

    def ClusterSummary(self, request: pb.ClusterSummaryRequest, context: grpc.ServicerContext
                       ) -> pb.ClusterSummaryResponse:
        me = pb.MasterSummary(address=self.address, is_leader=True, reachable=True)
        return pb.ClusterSummaryResponse(masters=[me], leader=self.address)

    def BeginUpload(self, request: pb.BeginUploadRequest, context: grpc.ServicerContext
                    ) -> pb.BeginUploadResponse:
        return pb.BeginUploadResponse(upload_id="up-1")

    def GetUploadStatus(self, request: pb.UploadStatusRequest, context: grpc.ServicerContext
                        ) -> pb.UploadStatus:
        # As a master without a data channel answers: no ticket, so the bytes go in a stream.
        return pb.UploadStatus(upload_id=request.upload_id, received=0)

    def AppendUpload(self, request_iterator: Iterator[pb.UploadChunk],
                     context: grpc.ServicerContext) -> pb.UploadStatus:
        next(request_iterator)
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the disk is full")
        raise AssertionError("abort raises")

    def AbortUpload(self, request: pb.AbortUploadRequest, context: grpc.ServicerContext
                    ) -> pb.AbortUploadResponse:
        self.aborted.set()
        return pb.AbortUploadResponse()


def test_a_stdin_upload_refused_mid_stream_exits_cleanly(tmp_path: Path) -> None:
    # The upload's request thread is left blocked reading stdin (the pipe stays open) when the
    # leader refuses the upload: the process must still exit with the refusal's status, not
    # abort at interpreter shutdown over a lock that thread holds on stdin.
    master = _DiskFullMaster()
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_BlobStoreServicer_to_server(master, server)  # type: ignore[no-untyped-call]
    master.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLOBHA_")}
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "blobha", "--cluster", master.address, "--user", "alice",
             "create", "k"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            cwd=tmp_path, env=env,
        )
        assert child.stdin is not None
        try:
            # One whole chunk (the client's first, read before the call), then a little more
            # that fits in the pipe: the next read waits for data that never comes.
            with contextlib.suppress(BrokenPipeError):
                child.stdin.write(b"x" * (DEFAULT_CHUNK_SIZE + 16 * 1024))
                child.stdin.flush()
            # Not communicate(): it would close stdin, and the reader would see its end.
            status = child.wait(timeout=60)
            assert child.stderr is not None
            err = child.stderr.read()
        finally:
            child.kill()
            child.stdin.close()
            child.wait()
    finally:
        server.stop(0)
    assert b"Fatal Python error" not in err, err.decode(errors="replace")
    assert status == errors.ResourceExhausted.exit_code, err.decode(errors="replace")
    assert b"the disk is full" in err
    assert master.aborted.is_set()


# ------------------------------------------------------------------------------------------------
# Progress display
# ------------------------------------------------------------------------------------------------


def test_token_create_out_keeps_the_token_private_and_appends_only_what_it_kept(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tokens, out = tmp_path / "tokens.txt", tmp_path / "erin.token"
    out.write_text("an old token\n")
    out.chmod(0o644)
    assert cli.main(["token", "create", "erin", "--out", str(out), "--append", str(tokens)]) == 0
    assert out.stat().st_mode & 0o777 == 0o600
    token = out.read_text().strip()
    assert token.startswith("erin") and tokens.read_text().count("\n") == 1
    # A token that cannot be written adds no hash (a credential nobody would hold).
    assert cli.main(["token", "create", "erin", "--out", str(tmp_path / "no" / "such"),
                     "--append", str(tokens)]) != 0
    assert tokens.read_text().count("\n") == 1
    assert "Traceback" not in capsys.readouterr().err


def test_progress_shows_mib_the_rate_and_the_time_left() -> None:
    out = io.StringIO()
    bar = cli.Progress("cat k", out)
    bar(0, 4 * 1024 * 1024)
    bar(2 * 1024 * 1024, 4 * 1024 * 1024)
    bar.close()
    last = out.getvalue().rstrip("\n").split("\r")[-1]
    assert last.startswith("cat k:  50%|") and "2.0/4.0 MiB" in last, last
    assert re.search(r"\[\d\d:\d\d<(\d\d:\d\d|\?), (\d+\.\d\d|\?) MiB/s\]", last), last
    unknown = io.StringIO()
    bar = cli.Progress("put k", unknown)
    bar(3 * 1024 * 1024, -1)
    bar.close()
    assert "put k: 3.0 MiB [" in unknown.getvalue() and "%" not in unknown.getvalue()


def test_no_progress_bar_when_stderr_is_not_a_terminal(
    store: FakeStore, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "f"
    src.write_bytes(b"abc")
    assert cli.main(["create", "k", "-f", str(src)]) == 0
    assert capsys.readouterr().err == ""


def test_spark_submit_goes_to_the_launcher(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("pyspark")
    assert cli.main(["spark-submit", "--help"]) == 0
    assert "SPARK_SUBMIT_ARGS" in capsys.readouterr().out
    assert cli.main(["--user", "x", "spark-submit", "--blob", "k"]) == 2


# ------------------------------------------------------------------------------------------------
# gRPC's own log lines

# Runs main() in a fresh interpreter (gRPC reads its log level once, as it is loaded), with a
# client that makes gRPC log: a connection attempt to a closed port, traced.
_GRPC_PROBE = """
import os, sys
from blobha import cli
from blobha.cli import app, connect

def probe(cluster, user):
    import grpc
    channel = grpc.insecure_channel("127.0.0.1:1")
    try:
        grpc.channel_ready_future(channel).result(timeout=1)
    except grpc.FutureTimeoutError:
        pass
    print("GRPC_VERBOSITY=%s" % os.environ.get("GRPC_VERBOSITY"))
    raise SystemExit(0)

connect.client_factory = probe
if sys.argv[1] == "--as-master":
    app.quiet_grpc("serve")
    probe("", None)
sys.exit(cli.main(sys.argv[1:]))
"""


def _probe_grpc(tmp_path: Path, *args: str) -> tuple[str, list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    env["GRPC_TRACE"] = "connectivity_state"  # a few lines per connection attempt
    r = subprocess.run([sys.executable, "-c", _GRPC_PROBE, *args], capture_output=True,
                       timeout=60, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    return r.stdout.decode(), r.stderr.decode().splitlines()


def test_grpc_log_lines_stay_off_a_client_commands_stderr(tmp_path: Path) -> None:
    # Before, the choice was made from the raw command line when cli was imported: a key named
    # "serve" left gRPC's lines on, and every process importing cli (the tests, the bench)
    # passed GRPC_VERBOSITY on to the masters it started.
    out, err = _probe_grpc(tmp_path, "meta", "serve")
    assert err == []
    assert out.strip() == "GRPC_VERBOSITY=None"  # not left for the processes it starts
    # The same trace reaches stderr where the lines are kept: a master's operator sees them.
    _, err = _probe_grpc(tmp_path, "--as-master")
    assert any("connectivity_state" in line for line in err), err


def test_importing_the_command_line_does_not_load_grpc(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-c", "import sys, blobha.cli;"
                        " print('grpc' in sys.modules)"], capture_output=True, timeout=60,
                       cwd=tmp_path)
    assert r.stdout.decode().strip() == "False", r.stderr.decode(errors="replace")


def test_a_long_retry_is_said_on_a_terminal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    c = connect.make_client("127.0.0.1:1", "alice")
    with c:
        assert c.on_retry is connect.say_retrying
    why = Unavailable("ZooKeeper is unreachable from master m1:6627; retry shortly")
    connect.say_retrying("create 'k'", why, 57.4)
    assert capsys.readouterr().err == ""  # not a terminal: scripts get the outcome only
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    connect.say_retrying("create 'k'", why, 57.4)
    assert capsys.readouterr().err == (
        "blobha: still trying to create 'k' (ZooKeeper is unreachable from master m1:6627;"
        " retry shortly); giving up in 57 s\n")
