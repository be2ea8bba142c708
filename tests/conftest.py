"""Shared test set-up."""

from __future__ import annotations

import signal


def _interrupt(signum: int, frame: object) -> None:
    # CI or `timeout` stop a hung run with SIGTERM; turning it into KeyboardInterrupt makes
    # pytest run fixture teardown, so no ZooKeeper or master process is left behind.
    raise KeyboardInterrupt(f"signal {signum}")


signal.signal(signal.SIGTERM, _interrupt)
