"""Old import paths of the modules that moved into role packages: deprecated, gone in 0.3.

Until then ``import blobha.errors`` (say) warns once and binds the module at its new path,
``blobha.core.errors``: the same module object, so a name patched through either path is patched
for both. Installed by ``blobha/__init__.py``; it answers only for the names below.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    import importlib.abc

MOVED: dict[str, str] = {
    "errors": "core.errors",
    "keys": "core.keys",
    "digest": "core.digest",
    "acl": "core.acl",
    "addresses": "core.addresses",
    "placement": "core.placement",
    "locks": "core.locks",
    "logs": "core.logs",
    "version": "core.version",
    "auth": "core.auth",
    "status": "wire.status",
    "stallwatch": "wire.stallwatch",
    "chunkwire": "wire.chunks",
    "credentials": "wire.credentials",
    "tls": "wire.tls",
    "dataplane": "wire.dataplane",
    "segments": "store.segments",
    "zkstate": "zk.layout",
    "zkclient": "zk.connection",
    "zkauth": "zk.lockdown",
    "peers": "sync.peers",
    "uploads": "master.uploads",
    "groupcommit": "master.groupcommit",
    "scrub": "master.scrub",
    "config": "master.config",
    "service": "master.edge.service",
    "gatekeeper": "master.edge.gatekeeper",
    "interceptor": "master.edge.interceptor",
    "audit": "master.edge.audit",
    "health": "master.edge.health",
    "metrics": "master.edge.metrics",
    "statuspage": "master.edge.statuspage",
    "unpack": "cache.unpack",
    "bench": "ops.bench",
    "bench_spark": "ops.bench_spark",
    "localcluster": "ops.localcluster",
    "certgen": "ops.certgen",
    "zkserver": "ops.zkserver",
}


# Plain classes, not importlib.abc's: that module imports importlib.resources (10 ms at every
# start of every blobha process, the executor hook's included); the import system asks only
# for these methods.
class _Alias:
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        # The import system returns whatever sys.modules holds under the name once this ends.
        sys.modules[module.__name__] = importlib.import_module(self.target)


class MovedFinder:
    """Finds ``blobha.<old>`` for a module listed in :data:`MOVED`, after every real finder."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        prefix, _, name = fullname.partition(".")
        new = MOVED.get(name) if prefix == "blobha" else None
        if new is None:
            return None
        warnings.warn(
            f"{fullname} has moved to blobha.{new}; the old path goes in blobha 0.3",
            DeprecationWarning,
            stacklevel=2,
        )
        loader = cast("importlib.abc.Loader", _Alias(f"blobha.{new}"))
        return importlib.machinery.ModuleSpec(fullname, loader)


def install() -> None:
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedFinder())
