"""The versions a job reads at least: what the driver saw of each blob before launch, carried
to the executors with the rest of the configuration (``spark.blobha.min.versions``).

Light on purpose, like the blob map: every Python worker reads it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, NamedTuple

from blobha.core.errors import InvalidArgument
from blobha.core.keys import validate_key
from blobha.spark.conf import CONF_MIN_VERSIONS

__all__ = ["SeenVersion", "merge_min_versions", "min_versions_json", "parse_min_versions"]


class SeenVersion(NamedTuple):
    """``version`` of ``key``, the key created at ``created_at`` (versions count again from 1
    after a delete and create, so the creation time orders incarnations first).

    >>> SeenVersion("model", 3, 1700000000.5).order
    (1700000000.5, 3)
    """

    key: str
    version: int
    created_at: float

    @property
    def order(self) -> tuple[float, int]:
        return (self.created_at, self.version)


def parse_min_versions(value: str | None) -> tuple[SeenVersion, ...]:
    """Read ``spark.blobha.min.versions``: a JSON object of key -> [version, created_at].
    Absent or empty (a configuration from before it): no minimums.

    >>> parse_min_versions('{"model": [3, 1700000000.5]}')
    (SeenVersion(key='model', version=3, created_at=1700000000.5),)
    """
    if not value:
        return ()
    try:
        raw: Any = json.loads(value)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"{CONF_MIN_VERSIONS} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise InvalidArgument(f"{CONF_MIN_VERSIONS} must be a JSON object of key ->"
                              " [version, created_at]")
    out = []
    for key, entry in raw.items():
        validate_key(key)
        if (not isinstance(entry, list) or len(entry) != 2
                or isinstance(entry[0], bool) or not isinstance(entry[0], int)
                or entry[0] < 1 or isinstance(entry[1], bool)
                or not isinstance(entry[1], int | float) or not entry[1] > 0):
            raise InvalidArgument(f"{CONF_MIN_VERSIONS} entry {key!r}: expected [version,"
                                  f" created_at], a version of 1 or more and a time, not"
                                  f" {entry!r}")
        out.append(SeenVersion(key, entry[0], float(entry[1])))
    return tuple(out)


def min_versions_json(versions: Iterable[SeenVersion]) -> str:
    return json.dumps({m.key: [m.version, m.created_at] for m in versions},
                      separators=(",", ":"))


def merge_min_versions(*groups: Iterable[SeenVersion]) -> tuple[SeenVersion, ...]:
    """The newest of each key's minimums, in the order keys first appear."""
    by_key: dict[str, SeenVersion] = {}
    for group in groups:
        for m in group:
            old = by_key.get(m.key)
            if old is None or m.order > old.order:
                by_key[m.key] = m
    return tuple(by_key.values())
