"""The quieter options (--no-progress, --quiet) and --tls-key, with its old spelling --key kept
working but out of the help (fake client, no network)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from test_cli import FakeClient, FakeStore, store  # noqa: F401  (store: the fixture)

from blobha import cli


class Recording(FakeClient):
    """Keeps the progress callback each upload was given."""

    def create(self, key: str, data: Any, acl: Any = (), replication_factor: int = 0,
               write_quorum: int = 0, progress: Any = None) -> Any:
        self.store.progress = progress  # type: ignore[attr-defined]
        return super().create(key, data, acl, replication_factor, write_quorum, progress)


@pytest.fixture
def terminal(store: FakeStore, monkeypatch: pytest.MonkeyPatch) -> FakeStore:  # noqa: F811
    """stderr is a terminal, where progress and notes are shown."""
    from blobha.cli import connect

    monkeypatch.setattr(connect, "client_factory",
                        lambda cluster, user: Recording(store, cluster, user))
    return store


@pytest.mark.parametrize(("flags", "progress", "notes"), [
    ((), True, True),
    (("--no-progress",), False, True),
    (("--quiet",), False, False),
    (("-q",), False, False),
])
def test_progress_and_notes_on_a_terminal(terminal: FakeStore, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch,
                                          flags: tuple[str, ...], progress: bool,
                                          notes: bool) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    src = tmp_path / "f"
    src.write_bytes(b"abc")
    assert cli.main(["create", f"k{len(flags)}{progress}", "-f", str(src), *flags]) == 0
    assert (terminal.progress is not None) == progress  # type: ignore[attr-defined]
    assert ("version 1 created" in capsys.readouterr().err) == notes


def test_quiet_keeps_errors(terminal: FakeStore, monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert cli.main(["--quiet", "meta", "missing"]) == 3
    assert capsys.readouterr().err.startswith("blobha: error: no blob with key 'missing'")


@pytest.mark.parametrize("spelling", ["--tls-key", "--key"])
def test_tls_key_and_its_old_spelling(spelling: str) -> None:
    parser = cli.build_parser()
    before = parser.parse_args([spelling, "k.pem", "meta", "blob"])
    after = parser.parse_args(["meta", "blob", spelling, "k.pem"])
    assert before.tls_key == after.tls_key == "k.pem" and after.key == "blob"


def test_help_shows_tls_key_not_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--tls-key FILE" in out and "--key " not in out
    assert "--no-progress" in out and "--quiet" in out


def test_global_options_and_exit_codes_are_listed_once(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.count("\nexit codes:\n") == 1 and out.count("\nglobal options:\n") == 1
    assert "  --timeout SECONDS" in out


@pytest.mark.parametrize("command", [
    "create", "put", "update", "cat", "fetch", "delete", "list", "meta", "stat", "set-acl",
    "replication", "wait-replication", "cluster", "health", "serve", "local-cluster", "token",
    "bench", "completion"])
def test_each_command_help_has_its_own_options_and_an_example(
        command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([command, "--help"]) == 0
    out = capsys.readouterr().out
    name = "meta" if command == "stat" else command
    assert f"usage: blobha {name}" in out
    example = out.split("example:\n", 1)[1].splitlines()[0].strip()
    assert f"blobha {name} " in example
    # The global options and the exit codes are in "blobha --help" only.
    assert "\nexit codes:\n" not in out and "global options:\n" not in out
    assert "--cluster HOST" not in out and "--tls-key" not in out and "--profile" not in out
    assert "BLOBHA_TIMEOUT" not in out  # the environment list goes with the exit codes
    assert "blobha --help" in out
