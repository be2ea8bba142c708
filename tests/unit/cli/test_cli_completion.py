"""``blobha completion bash|zsh`` (issue 46 §3): the scripts shtab makes from the parser, run
through the real command and, for bash, through bash itself."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BLOBHA = str(Path(sys.executable).with_name("blobha"))


def completion(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([BLOBHA, "completion", *args], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_bash_script_is_valid_and_completes_commands_and_options(tmp_path: Path) -> None:
    r = completion("bash")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    script = tmp_path / "blobha.bash"
    script.write_text(r.stdout)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    for command in ("create", "put", "cat", "fetch", "wait-replication", "completion"):
        assert command in r.stdout
    # What bash offers at a TAB: commands, a command's options, the global options.
    probe = (f"source {script}\n"
             "offer() { COMP_WORDS=(\"$@\"); COMP_CWORD=$(($# - 1)); COMPREPLY=();"
             " _shtab_blobha blobha \"${@: -1}\"; echo \"${COMPREPLY[*]}\"; }\n"
             "offer blobha wait-r\noffer blobha fetch --cache\noffer blobha --time\n")
    offered = subprocess.run(["bash", "-c", probe], capture_output=True, text=True,
                             timeout=30).stdout.splitlines()
    assert offered == ["wait-replication", "--cache-dir", "--timeout"], offered


def test_zsh_script_and_json() -> None:
    r = completion("zsh")
    assert r.returncode == 0 and r.stdout.startswith("#compdef blobha"), r.stdout[:200]
    assert "wait-replication" in r.stdout
    r = completion("zsh", "--json")
    assert r.returncode == 0
    assert json.loads(r.stdout)["script"].startswith("#compdef blobha")


def test_other_shells_are_a_usage_error() -> None:
    r = completion("fish")
    assert r.returncode == 2 and "invalid choice: 'fish'" in r.stderr
