"""The installed version of blobha, reported in the cluster summary."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("blobha")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0+unknown"
