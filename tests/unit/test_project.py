"""Project-level invariants: generated code matches the proto, docs match the code."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

import pytest

import blobha
from blobha.config import OPTIONS

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


def test_every_configuration_key_is_documented() -> None:
    readme = (ROOT / "README.md").read_text()
    missing = [o.key for o in OPTIONS if f"`{o.key}`" not in readme]
    assert not missing, f"README lacks {missing}"


def test_public_api_surface() -> None:
    assert set(blobha.__all__) == {
        "AccessControl",
        "BlobCache",
        "BlobError",
        "ChecksumMismatch",
        "Client",
        "Credentials",
        "DeadlineExceeded",
        "InternalError",
        "InvalidArgument",
        "KeyAlreadyExists",
        "KeyNotFound",
        "NotAuthorized",
        "NotLeader",
        "ResourceExhausted",
        "Unauthenticated",
        "Unavailable",
        "UploadNotFound",
        "VersionConflict",
        "__version__",
        "format_acl",
        "parse_acl",
    }
    for name in blobha.__all__:
        assert getattr(blobha, name) is not None
