"""Project-level invariants: generated code matches the proto, docs match the code."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_generated_protobuf_code_is_fresh(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is part of the 'test' extra")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{ROOT / 'proto'}",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            str(ROOT / "proto/blobha/v1/blobha.proto"),
        ],
        check=True,
    )
    for name in ("blobha_pb2.py", "blobha_pb2.pyi", "blobha_pb2_grpc.py"):
        assert filecmp.cmp(
            tmp_path / "blobha/v1" / name, ROOT / "blobha/v1" / name, shallow=False
        ), f"blobha/v1/{name} is stale: run proto/generate.sh"


def test_a_spark_worker_loads_no_client_with_blobha_spark(tmp_path: Path) -> None:
    # Every Python worker of a job that reads a blob imports blobha.spark. A task served from
    # the warm node cache needs neither the client (grpc, protobuf), ZooKeeper's client nor
    # archive unpacking: each is loaded where first needed, or a worker pays for it regardless.
    # dataclasses too: each costs a worker about 1 ms to create, so the records are named
    # tuples.
    heavy = ["grpc", "google.protobuf", "kazoo", "blobha.client", "blobha.cache.unpack", "tarfile",
             "zipfile", "dataclasses"]
    code = f"import sys, blobha.spark; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", f"importing blobha.spark loaded {out.stdout.strip()}"


def test_test_files_have_unique_names() -> None:
    # pytest imports test files by their basename (rootdir import mode): two files of one
    # name in different tiers stop the whole collection.
    names: dict[str, list[str]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert not {n: p for n, p in names.items() if len(p) > 1}
