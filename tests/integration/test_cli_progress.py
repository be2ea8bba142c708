"""The progress bar of the transfers (issue 46 §3), against a real cluster: drawn on stderr when
it is a terminal (a pseudo-terminal here), with the rate in MiB/s and the time left, and never
otherwise."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from blobha.ops.localcluster import LocalCluster

pytestmark = pytest.mark.integration

BLOBHA = str(Path(sys.executable).with_name("blobha"))
SIZE = 24 * 1024 * 1024
# A drawn line: MiB done of the total, then [elapsed<left, rate MiB/s].
DRAWN = re.compile(r"\d+\.\d/24\.0 MiB \[\d\d:\d\d<\d\d:\d\d, +\d+\.\d\d MiB/s\]")


def _env(cluster: LocalCluster) -> dict[str, str]:
    return {**os.environ, "BLOBHA_CLUSTER": cluster.cluster, "BLOBHA_USER": "alice"}


def on_terminal(cluster: LocalCluster, *args: str) -> tuple[int, str]:
    """Run blobha with stderr on a pseudo-terminal of 120 columns (stdout on a pipe): its
    status and what the terminal showed."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen([BLOBHA, *args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=terminal, env=_env(cluster))
    os.close(terminal)
    shown = bytearray()
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([controller], [], [], 1.0)
            if not ready:
                continue
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: every holder of the terminal's other end has closed it
                break
            if not chunk:
                break
            shown += chunk
        status = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        os.close(controller)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return status, shown.decode(errors="replace")


def test_transfers_draw_mib_rate_and_eta_on_a_terminal_only(cluster: LocalCluster,
                                                            tmp_path: Path) -> None:
    src = tmp_path / "big"
    src.write_bytes(os.urandom(SIZE))
    commands = {
        "create": ("create", "progress-k", "-f", str(src)),
        "update": ("update", "progress-k", "-f", str(src)),
        "put": ("put", "progress-k", "-f", str(src)),
        "cat": ("cat", "progress-k", "-f", str(tmp_path / "out")),
        "fetch": ("fetch", "progress-k", "--cache-dir", str(tmp_path / "cache")),
    }
    for name, args in commands.items():
        status, shown = on_terminal(cluster, *args)
        assert status == 0, (name, shown)
        assert f"{name} progress-k: 100%|" in shown, (name, shown)
        assert DRAWN.search(shown), (name, shown)
    assert (tmp_path / "out").read_bytes() == src.read_bytes()

    # Fetched already: a cache hit, nothing to draw.
    status, shown = on_terminal(cluster, *commands["fetch"])
    assert status == 0 and "MiB" not in shown, shown
    # --no-progress and --quiet on a terminal: no bar.
    for flag in ("--no-progress", "--quiet"):
        status, shown = on_terminal(cluster, *commands["cat"], flag)
        assert status == 0 and "MiB/s" not in shown, (flag, shown)

    # Without a terminal, nothing at all on stderr.
    for name, args in commands.items():
        if name == "create":
            args = ("create", "progress-k2", "-f", str(src))
        r = subprocess.run([BLOBHA, *args], capture_output=True, env=_env(cluster),
                           stdin=subprocess.DEVNULL, timeout=120)
        assert r.returncode == 0 and r.stderr == b"", (name, r.stderr)
