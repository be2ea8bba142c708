"""The attack tests share the integration harness: its fixtures (a real ZooKeeper and real
master processes per cluster) and helpers, loaded from tests/integration/conftest.py under a
name of its own so that ``from conftest import client_for`` works here too."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
# The integration harness imports its helpers (clusters, waiting, failures) from tests/support.
for _path in (_HERE.parent, _HERE.parent / "integration"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

_spec = importlib.util.spec_from_file_location(
    "integration_harness", _HERE.parent / "integration" / "conftest.py")
assert _spec is not None and _spec.loader is not None
harness = importlib.util.module_from_spec(_spec)
sys.modules["integration_harness"] = harness
_spec.loader.exec_module(harness)

# Fixtures and helpers, under the names the integration tests use.
from integration_harness import (  # noqa: E402
    FAST,
    _logs_on_failure,
    alice,
    client_for,
    cluster,
    fresh_cluster,
    make_cluster,
    master_metadata,
    md,
    mtls,
    stub,
    unique_key,
    wait_until,
)

__all__ = ["FAST", "_logs_on_failure", "alice", "client_for", "cluster", "fresh_cluster",
           "make_cluster", "master_metadata", "md", "mtls", "stub", "unique_key",
           "wait_until"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/security/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.integration)



# Every helper of the harness under this module's name too: when tests/integration and this
# directory are both named on the command line, pytest loads both conftest files before it
# imports a test module, and ``from conftest import ...`` there finds this one.
globals().update({name: value for name, value in vars(harness).items()
                  if not name.startswith("__") and name not in globals()})
