"""Integration harness: a real ZooKeeper and real ``blobha serve`` processes per cluster.

``cluster`` is shared by a module's non-destructive tests (each test uses its own keys);
``fresh_cluster`` gives a test its own cluster to kill, pause or partition. Every cluster is
stopped, processes and all, even when the test fails, and a failing test prints the tail of
every master's log.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.clusters import FAST
from support.failures import failed
from support.harness import _dump_logs, client_for, make_cluster

from blobha.client import Client
from blobha.ops.localcluster import LocalCluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = make_cluster(tmp_path_factory.mktemp("cluster"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture
def mtls(tmp_path: Path) -> Iterator[LocalCluster]:
    """A 2-master cluster with TLS and client certificates (auth.mode mtls)."""
    c = LocalCluster(tmp_path / "mtls", nodes=2, base_port=0, overrides=FAST, tls=True,
                     auth="mtls")
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture
def fresh_cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    """A cluster of the test's own; settings of its own come as the fixture's parameter
    (``@pytest.mark.parametrize("fresh_cluster", [{key: value}], indirect=True)``)."""
    c = make_cluster(tmp_path / "cluster", **getattr(request, "param", {}))
    try:
        c.start()
        yield c
    finally:
        if failed(request.node):
            _dump_logs(c)
        c.stop()


@pytest.fixture(autouse=True)
def _logs_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if failed(request.node) and "cluster" in request.fixturenames:
        _dump_logs(request.getfixturevalue("cluster"))




@pytest.fixture
def alice(cluster: LocalCluster) -> Iterator[Client]:
    with client_for(cluster, "alice") as c:
        yield c


@pytest.fixture
def unique_key(request: pytest.FixtureRequest) -> str:
    return f"{request.node.name[:80]}-{os.getpid()}".replace("[", "_").replace("]", "_")




















