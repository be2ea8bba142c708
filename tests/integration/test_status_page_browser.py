"""The status page in a real headless Chromium (Debian's ``chromium``; ``tests/run`` installs it)
against a real 3-master cluster: the page's script renders /status.json, and the rendered DOM
shows the leader and a blob's replication. A screenshot goes to test-output/."""

from __future__ import annotations

import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from support.harness import wait_until

from blobha.client import Client
from blobha.ops.localcluster import LocalCluster, MasterProcess

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "test-output" / "status-page.png"


def chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("Chromium is not installed: 'apt-get install -y chromium' (tests/run does it)")


def browse(tmp: Path, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    # Without the background-networking flags Chromium phones home, which fails on a closed
    # network; the virtual time budget lets the page's fetch and rendering finish first.
    cmd = [
        chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--disable-extensions", "--disable-default-apps",
        f"--user-data-dir={tmp}", "--virtual-time-budget=5000", *args, url,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


class Page(HTMLParser):
    """What the test reads from the rendered DOM: texts by element id, blob rows by key."""

    def __init__(self) -> None:
        super().__init__()
        self.by_id: dict[str, str] = {}
        self.rows: dict[str, dict[str, str]] = {}  # data-key -> td class -> text
        self.row_class: dict[str, str] = {}
        self.master_roles: dict[str, str] = {}
        self._open: list[tuple[str, str, str]] = []  # (tag, id, class)
        self._row: str | None = None
        self._master: str | None = None
        self.loaded = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "body" and a.get("data-loaded") == "true":
            self.loaded = True
        if tag == "tr" and "data-key" in a:
            self._row = a["data-key"]
            self.rows[self._row] = {}
            self.row_class[self._row] = a.get("class", "")
        if tag == "tr" and "data-address" in a:
            self._master = a["data-address"]
        self._open.append((tag, a.get("id", ""), a.get("class", "")))

    def handle_endtag(self, tag: str) -> None:
        while self._open:
            if self._open.pop()[0] == tag:
                break
        if tag == "tr":
            self._row = self._master = None

    def handle_data(self, data: str) -> None:
        for _, ident, _ in self._open:
            if ident:
                self.by_id[ident] = self.by_id.get(ident, "") + data
        if self._open and self._open[-1][0] in ("td", "span"):
            cls = next((c for t, _, c in reversed(self._open) if t == "td"), "")
            if self._row is not None:
                cell = cls.split()[0] if cls else ""
                self.rows[self._row][cell] = self.rows[self._row].get(cell, "") + data
            if self._master is not None and cls == "role":
                self.master_roles[self._master] = data


def render(tmp: Path, m: MasterProcess) -> Page:
    page = Page()
    page.feed(browse(tmp, m.status_url, "--dump-dom").stdout)
    return page


def test_status_page_in_chromium_shows_leader_and_replication(
    cluster: LocalCluster, alice: Client, unique_key: str, tmp_path: Path,
) -> None:
    under = unique_key + "-wants-5"
    alice.create(unique_key, b"b" * 4096, replication_factor=3)
    alice.create(under, b"u" * 100, replication_factor=5)
    assert alice.wait_for_replication([unique_key, under], 3, timeout=30).reached
    leader = cluster.leader()

    for m in cluster.masters:  # every master serves the page
        page = wait_until(
            lambda m=m: (p := render(tmp_path / "chrome", m)).loaded
            and p.rows.get(unique_key, {}).get("replication") == "3 / 3" and p,
            30, f"{m.address}'s page to show {unique_key} at 3 / 3",
        )
        assert page.by_id["leader"].strip() == leader.address
        assert page.master_roles == {
            x.address: ("leader" if x is leader else "follower") for x in cluster.masters
        }
        # The under-replicated blob is flagged and listed first.
        assert page.rows[under]["replication"].startswith("3 / 5")
        assert "under-replicated" in page.rows[under]["replication"]
        assert "under" in page.row_class[under].split()
        assert "under" not in page.row_class[unique_key].split()
        assert list(page.rows).index(under) < list(page.rows).index(unique_key)
        assert int(page.by_id["under-replicated"]) >= 1
        assert page.by_id.get("errors", "").strip() == ""

    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    SCREENSHOT.unlink(missing_ok=True)
    browse(tmp_path / "chrome", leader.status_url, f"--screenshot={SCREENSHOT}",
           "--window-size=1280,1000", "--hide-scrollbars")
    data = SCREENSHOT.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 20_000
    print(f"status page screenshot: {SCREENSHOT}")
