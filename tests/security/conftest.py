"""The attack tests share the integration harness: its fixtures (a real ZooKeeper and real
master processes per cluster), loaded from tests/integration/conftest.py under a name of its
own; its helpers come from tests/support/harness.py, as in the integration tests."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location(
    "integration_harness", _HERE.parent / "integration" / "conftest.py")
assert _spec is not None and _spec.loader is not None
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)

# The fixtures, under the names the integration tests use.
_logs_on_failure = harness._logs_on_failure
alice = harness.alice
cluster = harness.cluster
fresh_cluster = harness.fresh_cluster
mtls = harness.mtls
unique_key = harness.unique_key

__all__ = ["_logs_on_failure", "alice", "cluster", "fresh_cluster", "mtls", "unique_key"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/security/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.integration)
