"""Every relative link of README.md and docs/ reaches a file, and a heading where it names one."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "deploy" / "examples" / "README.md",
        *sorted((ROOT / "docs").rglob("*.md"))]

_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$", re.MULTILINE)
_FENCED = re.compile(r"^\s*```.*?^\s*```", re.MULTILINE | re.DOTALL)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = _FENCED.sub("", path.read_text())
    return {slug(h) for h in _HEADING.findall(text)}


def test_slugs_are_githubs() -> None:
    assert slug("ha-rule 16: ZooKeeper set-up") == "ha-rule-16-zookeeper-set-up"
    assert slug("The `blobha` command (CLI)") == "the-blobha-command-cli"


def test_every_relative_link_resolves() -> None:
    broken = []
    for doc in DOCS:
        text = _FENCED.sub("", doc.read_text())
        for target in _LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked here
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            where = f"{doc.relative_to(ROOT)} -> {target}"
            if not dest.exists():
                broken.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where}: no such heading")
    assert not broken, "\n".join(broken)
