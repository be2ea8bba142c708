"""Shared test set-up."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import pytest
from support.failures import FAILED


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


#: Work units that take minutes, longest first (from test-output/junit.xml of a full run):
#: under pytest-xdist they start first, so that no long one is left to run alone at the end.
#: A module's tests stay on one worker, as its shared cluster does; the chaos and Spark tiers
#: are one unit each (the chaos report is one file, and Spark's JVMs want the CPUs).
LONGEST_FIRST = (
    "chaos", "spark", "tests/docs/test_doc_commands.py",
    "tests/integration/test_scale_faults.py",
    "tests/integration/test_stalled_masters.py",
    "tests/integration/test_fanout.py", "tests/integration/test_truthful_shutdown.py",
    "tests/integration/test_security.py", "tests/integration/test_failover.py",
    "tests/integration/test_read_your_writes.py", "tests/integration/test_group_commit.py",
    "tests/integration/test_limits.py", "tests/security/test_secret_rotation.py",
    "tests/security/test_zookeeper_tls.py", "tests/integration/test_forward_writes.py",
    "tests/integration/test_replication.py", "tests/integration/test_operations.py",
)


def _work_unit(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    tier = path.split("/")[1] if path.count("/") >= 2 else ""
    return tier if tier in ("chaos", "spark") else path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Stable: the rest keep their order after the long ones. Every run, not only under
    # xdist: a test must not depend on the order it runs in.
    rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_work_unit(item.nodeid), len(rank)))


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``-n N``: whole work units (see LONGEST_FIRST) to a worker, in collection order."""
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

    config.option.loadscopereorder = False  # collection order is longest first already
    return WorkUnits(config, log)
