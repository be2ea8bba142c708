"""Fixtures of the chaos suite: a fresh containerised cluster per scenario, torn down (and its
logs shown) even when the scenario fails, and a report of every scenario's figures written to
test-output/chaos-report.{json,md} after each one."""

from __future__ import annotations

import os

# Before testcontainers is imported: its reaper image cannot be pulled here, and cleanup is
# done by the fixtures below and by the label sweep.
os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from chaos_harness import IMAGE, ChaosCluster, sweep_leftovers
from support.failures import failed

REPORT_DIR = Path(os.environ.get("BLOBHA_TEST_OUTPUT", "test-output"))
_RESULTS: list[dict[str, Any]] = []


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/chaos/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.chaos)



@pytest.fixture(scope="session")
def docker_ready() -> None:
    """The engine answers and the image exists; otherwise fail with what to run."""
    import docker

    try:
        client = docker.from_env()
        client.ping()
    except Exception as e:
        pytest.fail(f"no Docker engine answers ({e}); run deploy/docker/ensure-engine.sh as root",
                    pytrace=False)
    try:
        client.images.get(IMAGE)
    except Exception:
        pytest.fail(f"image {IMAGE} is missing; build it with deploy/docker/build-image.sh",
                    pytrace=False)
    finally:
        client.close()
    swept = sweep_leftovers()
    if swept:
        print(f"removed {swept} leftover chaos containers/networks")


@pytest.fixture
def scenario(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """A dict the scenario fills with its figures; recorded with pass/fail afterwards."""
    figures: dict[str, Any] = {}
    started = time.monotonic()
    yield figures
    entry = {
        "scenario": request.node.name,
        "passed": not failed(request.node),
        "duration_s": round(time.monotonic() - started, 1),
        **figures,
    }
    _RESULTS.append(entry)
    _write_report()


def _write_report() -> None:
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    (REPORT_DIR / "chaos-report.json").write_text(json.dumps(_RESULTS, indent=2) + "\n")
    lines = ["# blobha chaos report", "",
             f"Image `{IMAGE}`; 3 ZooKeeper nodes and blobha masters in containers, session"
             " timeout 6 s, write quorum 2.", ""]
    for r in _RESULTS:
        lines.append(f"## {r['scenario']}: {'PASS' if r['passed'] else 'FAIL'}")
        for k, v in r.items():
            if k not in ("scenario", "passed"):
                lines.append(f"- {k}: {v}")
        lines.append("")
    (REPORT_DIR / "chaos-report.md").write_text("\n".join(lines))


@pytest.fixture
def chaos_cluster(docker_ready: None, tmp_path: Path,
                  request: pytest.FixtureRequest) -> Iterator[ChaosCluster]:
    # Indirect parameters: ChaosCluster's keyword arguments (a larger ZooKeeper heap).
    c = ChaosCluster(tmp_path, **getattr(request, "param", {}))
    try:
        c.start()
        yield c
    finally:
        if failed(request.node):
            for node in [*c.masters, *c.zks]:
                print(f"\n----- {node.name} -----\n{c.logs(node)}")
        keep = os.environ.get("BLOBHA_CHAOS_LOGS", "").strip()
        if keep:  # every node's whole log, for reading a run's timeline afterwards
            folder = Path(keep) / request.node.name
            folder.mkdir(parents=True, exist_ok=True)
            for node in [*c.masters, *c.zks]:
                (folder / f"{node.name}.log").write_text(c.logs(node, lines=None))
        c.stop()
