"""Shared test set-up."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
from failures import FAILED


def _interrupt(signum: int, frame: object) -> None:
    # CI or `timeout` stop a hung run with SIGTERM; turning it into KeyboardInterrupt makes
    # pytest run fixture teardown, so no ZooKeeper or master process is left behind.
    raise KeyboardInterrupt(f"signal {signum}")


signal.signal(signal.SIGTERM, _interrupt)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        item.stash[FAILED] = True
