"""The fan-out harness (blobha.ops.bench.fanout_net): real masters, ZooKeeper and node caches, each
in a network namespace of its own behind tc-shaped links, and nothing left behind."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from blobha.ops.bench import fanout_net as fanout

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _servers(work: Path) -> list[str]:
    """Processes still running from ``work`` (its ZooKeeper, its masters)."""
    out = subprocess.run(["pgrep", "-af", str(work)], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def _ours() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                         check=True).stdout
    return [line.split()[0] for line in out.splitlines()
            if line.startswith(f"bhfan-{os.getpid()}-")]


def test_nodes_fetch_through_shaped_links_and_everything_is_removed(tmp_path: Path) -> None:
    result = fanout.run_fanout(nodes=2, size_mib=4, rate_mbit=100, work=tmp_path)
    assert result.copies_verified == 2
    figures = result.figures()
    # 4 MiB at 100 Mbit/s takes at least 0.34 s on a shaped link (the cache verified each
    # copy's digest, or get() raised).
    assert result.one_node_s > 0.3 and len(result.node_secs) == 2
    assert max(result.node_secs) > 0.3
    # Every node's bytes came from the masters or the other node, through shaped links.
    assert sum(result.master_egress_mib.values()) + result.peer_mib >= 2 * 4 * 0.95, figures
    assert sum(result.master_egress_mib.values()) <= 3 * 4 * 1.1, figures
    assert _ours() == []
    assert _servers(tmp_path) == []


def test_node_caches_serve_each_other(tmp_path: Path) -> None:
    """The issue's CI check: 4 nodes, 32 MiB, 100 Mbit/s links."""
    result = fanout.run_fanout(nodes=4, size_mib=32, rate_mbit=100, work=tmp_path)
    figures = result.figures()
    assert result.copies_verified == 4, figures
    assert result.peer_mib >= 0.5 * 4 * 32, figures
    assert sum(result.master_egress_mib.values()) < 3 * 32, figures
    assert _ours() == []
    assert _servers(tmp_path) == []


def test_without_peers_every_byte_comes_from_the_masters(tmp_path: Path) -> None:
    result = fanout.run_fanout(nodes=2, size_mib=4, rate_mbit=100, work=tmp_path,
                               peers=False)
    assert result.peer_mib == 0 and result.copies_verified == 2
    assert sum(result.master_egress_mib.values()) >= 2 * 4 * 0.95


def test_a_failed_run_removes_what_it_made(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fanout, "_LOAD", "raise SystemExit(3)")
    with pytest.raises(RuntimeError, match="writing the blob: the process ended"):
        fanout.run_fanout(nodes=1, size_mib=1, rate_mbit=100, work=tmp_path)
    assert _ours() == []
    assert _servers(tmp_path) == []


def test_it_refuses_to_run_without_root(tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert fanout.main(["--nodes", "1"]) == 2
    assert "run it as root" in capsys.readouterr().err
    assert _ours() == []
