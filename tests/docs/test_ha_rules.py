"""Every "ha-rule N" the code cites names a rule of docs/architecture.md."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
#: Where the code cites rules (the tests too, except these doc tests, which quote the forms).
CITING = ("blobha", "leader", "sync", "tests")
SKIP = (ROOT / "tests" / "docs",)

_RULE = re.compile(r"^### ha-rule (\d+):", re.MULTILINE)
_PART = re.compile(r"^- \*\*(\d+) ([a-z])\.\*\*", re.MULTILINE)
# One rule: a number, and a sub-letter only where punctuation, "and" or the end follows it
# ("ha-rule 10 a)" cites 10 a; "ha-rule 10 at run time" cites 10).
_ONE = r"\d+(?:\s[a-z](?=\s*(?:[-),.:;]|$|and\b)))?"
_CITATION = re.compile(rf"ha-rules?\s+({_ONE}(?:\s*(?:-|\u2013|,|and)\s*{_ONE})*)", re.IGNORECASE)


def defined_rules(text: str) -> set[str]:
    """The rules and sub-rules a document defines: "4", "10", "10 a", ..."""
    rules = set(_RULE.findall(text))
    parts = {f"{n} {letter}" for n, letter in _PART.findall(text)}
    return rules | parts


def cited_rules(text: str) -> set[str]:
    """The rules a text cites: "ha-rule 4", "ha-rule 10 a", "ha-rules 6-12", "ha-rules 6, 7"."""
    cited: set[str] = set()
    for match in _CITATION.finditer(text):
        spec = match.group(1)
        for m in re.finditer(rf"({_ONE})(?:\s*(?:-|\u2013)\s*({_ONE}))?", spec):
            first, last = m.group(1), m.group(2)
            if last is None:
                cited.add(" ".join(first.split()))
                continue
            lo, hi = int(first.split()[0]), int(last.split()[0])
            assert lo <= hi, f"backwards range in {match.group(0)!r}"
            cited.update(str(n) for n in range(lo, hi + 1))
    return cited


def _citations() -> dict[str, list[str]]:
    where: dict[str, list[str]] = {}
    for top in CITING:
        for path in sorted((ROOT / top).rglob("*.py")):
            if any(path.is_relative_to(s) for s in SKIP):
                continue
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                for rule in cited_rules(line):
                    where.setdefault(rule, []).append(f"{path.relative_to(ROOT)}:{number}")
    return where


def test_citation_forms_are_read() -> None:
    assert cited_rules("(ha-rule 14): the listener") == {"14"}
    assert cited_rules("# ha-rule 10 a: deletes") == {"10 a"}
    assert cited_rules('"""ha-rule 10 at run time') == {"10"}
    assert cited_rules("(ha-rules 6-12).") == {str(n) for n in range(6, 13)}
    assert cited_rules("(ha-rules 6, 7)") == {"6", "7"}
    assert cited_rules("ha-rules 10 b and 11 a)") == {"10 b", "11 a"}
    assert cited_rules("# ha-rule: after ConnectionLoss") == set()


def test_the_rules_are_numbered_one_to_sixteen() -> None:
    numbers = sorted(int(r) for r in defined_rules(ARCHITECTURE.read_text()) if " " not in r)
    assert numbers == list(range(1, 17))


def test_every_cited_rule_is_defined() -> None:
    defined = defined_rules(ARCHITECTURE.read_text())
    where = _citations()
    assert where, "no ha-rule citation found: is the pattern still right?"
    undefined = {rule: places for rule, places in where.items() if rule not in defined}
    assert not undefined, f"cited but not defined in docs/architecture.md: {undefined}"
