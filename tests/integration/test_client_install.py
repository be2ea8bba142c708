"""``pip install blobha`` is the client side alone: the client, the node cache, the Spark
executors' side and ``blobha://``, with grpcio, protobuf and xxhash; the server extra brings
what masters need. Checked in a virtualenv of its own, against a real cluster."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from blobha.ops.localcluster import LocalCluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
SERVER_ONLY = ("kazoo", "cryptography", "prometheus_client", "grpc_health", "grpc_reflection")


def _run(*args: str | os.PathLike[str], cwd: Path | None = None) -> str:
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True,
                          cwd=cwd, timeout=540)
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("client-install")
    _run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir",
         work / "wheels", ROOT)
    wheel = next((work / "wheels").glob("blobha-*.whl"))
    _run(sys.executable, "-m", "venv", work / "venv")
    python = work / "venv" / "bin" / "python"
    _run(python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", wheel)
    return python


def test_a_client_install_has_none_of_the_masters_dependencies(client_venv: Path) -> None:
    have = _run(client_venv, "-c", textwrap.dedent(f"""
        import importlib.util
        print(' '.join(m for m in {SERVER_ONLY!r} if importlib.util.find_spec(m)))
    """), cwd=Path("/")).split()
    assert have == []


def test_the_client_side_works_without_the_server_extra(client_venv: Path,
                                                        cluster: LocalCluster,
                                                        tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("not used: only handed to gRPC\n")
    script = textwrap.dedent(f"""
        import sys
        from blobha.client import Client
        from blobha.cache import BlobCache
        from blobha.spark import blob_path
        from blobha.wire.tls import channel_credentials

        channel_credentials({str(ca)!r}, None, None)  # a TLS client needs no cryptography
        with Client({cluster.cluster!r}, user="alice") as c:
            c.create("client-install", b"from a client-only install")
            assert c.read("client-install") == b"from a client-only install"
        with BlobCache({str(tmp_path / 'cache')!r}, cluster={cluster.cluster!r},
                       user="alice") as cache:
            assert cache.get("client-install").path.read_bytes().startswith(b"from a")
        heavy = [m for m in sys.modules if m.split(".")[0] in {SERVER_ONLY!r}]
        assert not heavy, heavy
        assert callable(blob_path)
        print("ok")
    """)
    assert _run(client_venv, "-c", script, cwd=Path("/")).strip() == "ok"
