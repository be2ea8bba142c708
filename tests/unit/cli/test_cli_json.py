"""``--json`` on every command (fake client, no network): results as JSON on stdout, and every
error as ``{"error": {"code", "exit", "message"}}`` there too, with the usual exit status."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_cli import FakeStore, set_stdin, store  # noqa: F401  (store: the fixture)

from blobha import cli
from blobha.core.acl import AccessControl
from blobha.core.errors import Unavailable


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, Any]:
    code = cli.main(argv)
    captured = capsys.readouterr()
    assert captured.err == "", captured.err  # nothing for a script to parse on stderr
    return code, json.loads(captured.out)


def test_writes_print_version_size_and_digest(store: FakeStore, tmp_path: Path,  # noqa: F811
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    set_stdin(monkeypatch, b"abc")
    for argv, version in ((["create", "k"], 1), (["update", "k"], 2), (["put", "k"], 3),
                          (["put", "new"], 1)):
        set_stdin(monkeypatch, b"abc")
        code, out = run_json([*argv, "--json"], capsys)
        assert code == 0
        assert out == {"key": argv[1], "version": version, "size": 3, "digest": "ab" * 16}
    code, out = run_json(["cat", "k", "-f", str(tmp_path / "out"), "--json"], capsys)
    assert code == 0 and out["version"] == 3 and out["path"] == str(tmp_path / "out")


def test_admin_and_replication_commands(store: FakeStore,  # noqa: F811
                                        capsys: pytest.CaptureFixture[str]) -> None:
    store.blobs["k"] = (b"12345", (AccessControl("u", "alice", 7),), 2)
    store.replicas = 2
    code, out = run_json(["--json", "set-acl", "k", "-s", "u:alice:rwa,o::r"], capsys)
    assert code == 0 and out["acl"] == ["u:alice:rwa", "o::r--"] and out["version"] == 2
    code, out = run_json(["replication", "--update", "-r", "2", "k", "--json"], capsys)
    assert code == 0 and out["key"] == "k" and "replication_factor" in out
    code, out = run_json(["replication", "--read", "k", "--json"], capsys)
    assert code == 0 and out == {"key": "k", "version": 1, "replication": 2,
                                 "replication_factor": 3, "holders": ["m1:1"]}
    code, out = run_json(["wait-replication", "k", "--min", "2", "--json"], capsys)
    assert code == 0 and out["reached"] is True
    assert out["keys"] == [{"key": "k", "version": 1, "replication": 2,
                            "replication_factor": 3}]
    # Short of the minimum: the counts and the error in one object, exit 12 as without --json.
    code, out = run_json(["wait-replication", "k", "--min", "3", "--timeout", "0", "--json"],
                         capsys)
    assert code == 12 and out["reached"] is False and out["keys"][0]["replication"] == 2
    assert out["error"]["code"] == "deadline_exceeded" and out["error"]["exit"] == 12


def test_delete_reports_each_key(store: FakeStore,  # noqa: F811
                                 capsys: pytest.CaptureFixture[str]) -> None:
    store.blobs["a"] = (b"", (), 1)
    code, out = run_json(["delete", "a", "missing", "--json"], capsys)
    assert code == 3
    assert out[0] == {"key": "a", "deleted": True}
    assert out[1]["key"] == "missing" and out[1]["deleted"] is False
    assert out[1]["error"]["code"] == "key_not_found"


@pytest.mark.parametrize(("argv", "exit_code", "code"), [
    (["cat", "missing", "-f", "x"], 3, "key_not_found"),
    (["meta", "missing"], 3, "key_not_found"),
    (["create", "k", "-a", "bad:acl:entry:x"], 6, "invalid_argument"),
    (["list", "--nope"], 2, "usage"),
    (["nope"], 2, "usage"),
    (["cat", "k"], 2, "usage"),
])
def test_errors_are_json_on_stdout_with_the_usual_exit_status(
        store: FakeStore, argv: list[str], exit_code: int, code: str,  # noqa: F811
        capsys: pytest.CaptureFixture[str]) -> None:
    status, out = run_json([*argv, "--json"], capsys)
    assert status == exit_code
    assert set(out) == {"error"} and out["error"]["code"] == code
    assert out["error"]["exit"] == exit_code and out["error"]["message"]


def test_an_unavailable_cluster_is_a_json_error(store: FakeStore,  # noqa: F811
                                               capsys: pytest.CaptureFixture[str]) -> None:
    store.error = Unavailable("no master answered at h:1")
    status, out = run_json(["cluster", "--json"], capsys)
    assert status == 11 and out["error"]["code"] == "unavailable"
    assert "h:1" in out["error"]["message"]
    # Without --json: the one line on stderr, as before.
    store.error = Unavailable("no master answered at h:1")
    assert cli.main(["cluster"]) == 11
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("blobha: error: no master answered")


def test_token_create_and_hash(monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_json(["token", "create", "alice", "--json"], capsys)
    assert code == 0 and out["user"] == "alice" and out["line"].startswith("alice:")
    token = out["token"]
    set_stdin(monkeypatch, token.encode() + b"\n")
    code, out = run_json(["token", "hash", "--json"], capsys)
    assert code == 0 and out["user"] == "alice" and "token" not in out
