"""Every command block of README.md and docs/ runs against a real local cluster.

The conventions (``sh`` and ``python`` fences run, ``<!-- not tested: REASON -->``,
``<!-- expect: TEXT -->``, ``<!-- needs: spark -->``, ``<!-- doc-test: cluster tls -->``) are
described in docs/development.md, "Tested documentation".
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from support.clusters import running_cluster

from blobha.ops.localcluster import LocalCluster

ROOT = Path(__file__).resolve().parents[2]
#: docs/perf-log/ is left out: its pages record what was run, with the figures it gave (a bench
#: of the whole machine for minutes), and are not instructions (docs/perf-log/README.md).
DOCS = [ROOT / "README.md",
        *sorted(p for p in (ROOT / "docs").rglob("*.md")
                if not p.is_relative_to(ROOT / "docs" / "perf-log"))]
VENV_BIN = Path(sys.executable).parent
RUNNABLE = {"sh", "python"}
NEEDS = {"spark"}
#: How long one block may run (the Spark ones start a JVM and run a job).
BLOCK_TIMEOUT = 600.0


_FENCE = re.compile(r"^(\s*)(`{3,})(.*)$")
_COMMENT = re.compile(r"^\s*<!--(.*?)-->\s*$")
_DOC_TEST_TLS = "<!-- doc-test: cluster tls -->"
#: The local cluster as deploy/local-cluster.sh starts it, as the docs name it.
_DOC_CLUSTER = "127.0.0.1:6627,127.0.0.1:6628,127.0.0.1:6629"
_DOC_ADDRESS = re.compile(re.escape(_DOC_CLUSTER) + r"|127\.0\.0\.1:(66|67)(2[789])\b")


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    code: str
    not_tested: str | None = None
    expects: list[str] = field(default_factory=list)
    needs: set[str] = field(default_factory=set)

    @property
    def where(self) -> str:
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{path}:{self.line}"


class DocError(ValueError):
    """A document breaks the conventions."""


class BlockFailed(AssertionError):
    """A block exited with an error, or its output lacked what it expects."""


def parse(path: Path, text: str | None = None) -> list[Block]:
    """The fenced blocks of a Markdown file, with the directives in the comments before each."""
    lines = (path.read_text() if text is None else text).splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, ticks, info = m.group(1), m.group(2), m.group(3).strip()
        start = i
        lang = info.split()[0] if info else ""
        if not lang:
            raise DocError(f"{path}:{i + 1}: a fence without an info string (sh, python, text...)")
        body: list[str] = []
        i += 1
        while i < len(lines) and lines[i].strip() != ticks:
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        if i == len(lines):
            raise DocError(f"{path}:{start + 1}: a fence that is never closed")
        i += 1
        block = Block(path, start + 1, lang, "\n".join(body) + "\n")
        j = start - 1
        while j >= 0 and (c := _COMMENT.match(lines[j])):
            _directive(block, c.group(1).strip())
            j -= 1
        if (block.not_tested is not None or block.expects or block.needs) and lang not in RUNNABLE:
            raise DocError(f"{block.where}: directives before a {lang!r} block, which never runs")
        blocks.append(block)
    return blocks


def _directive(block: Block, text: str) -> None:
    key, _, value = text.partition(":")
    key, value = key.strip(), value.strip()
    if key == "not tested":
        if not value:
            raise DocError(f"{block.where}: 'not tested' needs a reason")
        block.not_tested = value
    elif key == "expect":
        if not value:
            raise DocError(f"{block.where}: 'expect' needs a text")
        block.expects.append(value)
    elif key == "needs":
        unknown = {v.strip() for v in value.split(",")} - NEEDS
        if unknown:
            raise DocError(f"{block.where}: needs {unknown}; known: {NEEDS}")
        block.needs.update(v.strip() for v in value.split(","))
    # Other comments (prose notes, the configuration doc's generator note) are not directives.


def runnable(blocks: list[Block]) -> list[Block]:
    return [b for b in blocks if b.lang in RUNNABLE and b.not_tested is None]


def substitute(code: str, cluster: LocalCluster) -> str:
    """The docs' local-cluster addresses replaced by the test cluster's."""
    masters = cluster.masters

    def one(m: re.Match[str]) -> str:
        if m.group(1) is None:
            return cluster.cluster
        index = int(m.group(2)) - 27
        if index >= len(masters):
            raise DocError(f"{m.group(0)} names master {index + 1} of {len(masters)}")
        master = masters[index]
        return master.address if m.group(1) == "66" else master.metrics_address

    return _DOC_ADDRESS.sub(one, code)


def _read_env(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in path.read_bytes().split(b"\0"):
        name, sep, value = item.decode(errors="surrogateescape").partition("=")
        if sep and name and not name.startswith("BASH_FUNC_"):
            env[name] = value
    return env


def _run(command: list[str], cwd: Path, env: Mapping[str, str]) -> tuple[int, str]:
    """Run in a session of its own, so that a timeout ends the block's children too."""
    proc = subprocess.Popen(command, cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=BLOCK_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return -1, out.decode(errors="replace") + f"\n(killed after {BLOCK_TIMEOUT} s)"
    finally:
        # Whatever a block left running in the background goes with it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out.decode(errors="replace")


def run_blocks(blocks: list[Block], workdir: Path, env: dict[str, str],
               cluster: LocalCluster | None) -> None:
    """Run the blocks of one document in order, as one shell session: files stay in
    ``workdir`` and a block's exports reach the blocks after it."""
    env_file = workdir.parent / f"{workdir.name}.env"
    for n, block in enumerate(runnable(blocks)):
        code = substitute(block.code, cluster) if cluster is not None else block.code
        if block.lang == "sh":
            script = (f"trap 'env -0 > {_quote(env_file)}' EXIT\nset -euo pipefail\n{code}")
            command = ["bash", "-c", script]
        else:
            source = workdir.parent / f"{workdir.name}-block-{n}.py"
            source.write_text(code)
            command = [sys.executable, str(source)]
        env_file.unlink(missing_ok=True)
        status, output = _run(command, workdir, env)
        shown = f"{block.where} ({block.lang}):\n{code}\n----- output\n{output[-6000:]}"
        if status != 0:
            raise BlockFailed(f"exit status {status} from {shown}")
        missing = [e for e in block.expects if e not in output]
        if missing:
            raise BlockFailed(f"output lacks {missing}: {shown}")
        if block.lang == "sh" and env_file.exists():
            env.clear()
            env.update(_read_env(env_file))


def _quote(path: Path) -> str:
    return "'" + str(path).replace("'", "'\\''") + "'"


def base_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("BLOBHA_", "PYTEST_")) and k != "XDG_CONFIG_HOME"}
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    env.update({
        # A home of the blocks' own: what they install there (a completion script, a client
        # profile) stays out of the user's, and no profile of the user's changes a block.
        "HOME": str(home),
        "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
        "BLOBHA_CACHE_DIR": str(tmp / "node-cache-default"),
        "SPARK_LOCAL_DIRS": str(tmp / "spark-local"),
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "PYTHONUNBUFFERED": "1",
    })
    return env


def make_workdir(tmp: Path) -> Path:
    """A directory that looks like a clone where the blocks need one: deploy/ and .venv/."""
    work = tmp / "work"
    work.mkdir()
    (work / "deploy").symlink_to(ROOT / "deploy")
    (work / ".venv").symlink_to(VENV_BIN.parent)
    return work


def _spark_missing() -> str | None:
    try:
        import pyspark  # noqa: F401
    except ImportError:
        return "pyspark is not installed (the 'spark' extra)"
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        return "no Java runtime for Spark"
    return None


def _params() -> Iterator[Any]:
    for path in DOCS:
        blocks = parse(path)
        if not runnable(blocks):
            continue
        marks = [pytest.mark.timeout(1800)]
        if any("spark" in b.needs for b in blocks):
            marks.append(pytest.mark.spark)
        yield pytest.param(path, marks=marks, id=str(path.relative_to(ROOT)))


# --------------------------------------------------------------------------------------------


def test_every_document_follows_the_conventions() -> None:
    counts = {"run": 0, "not tested": 0}
    for path in DOCS:
        for block in parse(path):
            if block.lang in RUNNABLE:
                counts["run" if block.not_tested is None else "not tested"] += 1
    assert counts["run"] >= 20, counts


def test_the_parser_reads_the_directives(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    text = (
        "<!-- not tested: systemd -->\n```sh\nsystemctl start x\n```\n\n"
        "<!-- expect: exit 3 -->\n<!-- needs: spark -->\n```sh\necho exit 3\n```\n"
        "```text\nblobha cat KEY\n```\n"
    )
    a, b, c = parse(doc, text)
    assert (a.not_tested, b.expects, b.needs, c.lang) == ("systemd", ["exit 3"], {"spark"}, "text")
    assert runnable([a, b, c]) == [b]
    for bad in ("```\nls\n```\n", "<!-- not tested: -->\n```sh\nls\n```\n",
                "<!-- expect: x -->\n```text\nls\n```\n", "```sh\nls\n"):
        with pytest.raises(DocError):
            parse(doc, bad)


def test_a_failing_block_or_a_missing_output_fails_the_document(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    work = tmp_path / "w"
    work.mkdir()
    env = base_env(tmp_path)
    ok = "```sh\nexport GREETING=hello\necho one > made.txt\n```\n```sh\ncat made.txt\n```\n"
    run_blocks(parse(doc, ok), work, env, None)
    assert env["GREETING"] == "hello"  # exports reach later blocks, as in one shell
    failing = ok + "```sh\necho before\nfalse\necho after\n```\n"
    with pytest.raises(BlockFailed, match="exit status 1"):
        run_blocks(parse(doc, failing), work, base_env(tmp_path), None)
    with pytest.raises(BlockFailed, match="exit status 1"):
        run_blocks(parse(doc, "```python\nraise SystemExit(1)\n```\n"), work, env, None)
    with pytest.raises(BlockFailed, match="lacks"):
        run_blocks(parse(doc, "<!-- expect: exit 5 -->\n```sh\necho exit 3\n```\n"), work,
                   env, None)


@pytest.mark.parametrize("path", list(_params()))
def test_the_commands_of(path: Path, tmp_path: Path) -> None:
    blocks = parse(path)
    if any("spark" in b.needs for b in blocks) and (why := _spark_missing()):
        pytest.skip(why)
    work = make_workdir(tmp_path)
    tls = _DOC_TEST_TLS in path.read_text()
    # A secure cluster keeps its set-up where the docs' commands look: ./blobha-local/secure.
    data = work / "blobha-local" if tls else tmp_path / "cluster"
    with running_cluster(data, tls=tls, log_lines=20) as cluster:
        env = base_env(tmp_path)
        env["BLOBHA_CLUSTER"] = cluster.cluster
        run_blocks(blocks, work, env, cluster)
