"""A blob master: the :class:`Master` facade over its named parts (see docs/architecture.md),
its upload sessions, group commit, scrubber and configuration, and how a process serves it.

Nothing is imported with the package, so loading one part does not load the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from blobha.master.facade import Master


def __getattr__(name: str) -> Any:
    # ``from blobha.master import Master`` from before the move into a package.
    if name == "Master":
        from blobha.master.facade import Master

        return Master
    raise AttributeError(f"module 'blobha.master' has no attribute {name!r}")


__all__ = ["Master"]
