"""docs/configuration.md is the one made by ``python -m blobha.ops.configdoc`` from the code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from blobha.master.config import OPTIONS
from blobha.ops import configdoc
from blobha.spark import OPTIONS as SPARK_OPTIONS

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / configdoc.DOC_PATH


def test_the_committed_configuration_doc_is_current() -> None:
    assert DOC.read_text() == configdoc.render(), (
        "docs/configuration.md is stale: run"
        " python -m blobha.ops.configdoc --write docs/configuration.md"
    )


def test_every_configuration_key_is_documented() -> None:
    text = DOC.read_text()
    missing = [o.key for o in (*OPTIONS, *SPARK_OPTIONS) if f"| `{o.key}` |" not in text]
    assert not missing, f"docs/configuration.md lacks {missing}"


def test_the_check_mode_fails_on_a_stale_file(tmp_path: Path) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text(configdoc.render().replace("| `blobstore.dir` |", "| `blobstore.dirs` |"))
    command = [sys.executable, "-m", "blobha.ops.configdoc", "--check"]
    r = subprocess.run([*command, str(stale)], capture_output=True, text=True)
    assert r.returncode == 1 and "stale" in r.stderr
    r = subprocess.run([*command, str(DOC)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
