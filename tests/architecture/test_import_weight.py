"""What may not load grpc, protobuf or kazoo when imported: the shared core, the node cache,
what a Spark executor's Python worker imports, and the command line. A Spark task served from a
warm node cache, or ``blobha --help``, must not pay for the client's or the server's libraries;
those parts import them inside the functions that use them."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import blobha

HEAVY = ("grpc", "google.protobuf", "kazoo", "blobha.v1")

LIGHT_PACKAGES = ("blobha.core", "blobha.cache")
LIGHT_MODULES = ("blobha", "blobha.spark", "blobha.cli")


def _light_modules() -> list[str]:
    names = list(LIGHT_MODULES)
    for package in LIGHT_PACKAGES:
        names.append(package)
        path = Path(blobha.__file__).parent / package.split(".", 1)[1]
        names += [f"{package}.{m.name}" for m in pkgutil.iter_modules([str(path)])]
    return sorted(names)


def _loaded_on_import(module: str) -> list[str]:
    code = (f"import sys, {module}; heavy = {HEAVY!r}; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith(heavy))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd="/")
    return out.stdout.split()


@pytest.mark.parametrize("module", _light_modules())
def test_importing_loads_no_rpc_or_zookeeper_library(module: str) -> None:
    loaded = _loaded_on_import(module)
    assert not loaded, f"import {module} loads {loaded}: import them where they are used"


def test_the_check_sees_a_heavy_import() -> None:
    # The check itself: a module that does import grpc is caught.
    assert "grpc" in _loaded_on_import("blobha.client")
