"""The code map: the job's own code and environment (``--py-files``, ``--files``,
``--archives``) as content-addressed blobs, and where each appears on an executor.

Light on purpose: the worker hook (:mod:`blobha.spark.worker`) reads it before every Python
worker starts.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from blobha.core.errors import InvalidArgument
from blobha.core.keys import validate_key
from blobha.spark.blobmap import check_local_name

__all__ = [
    "KINDS",
    "KIND_ARCHIVE",
    "KIND_FILE",
    "KIND_PYFILE",
    "CodeSpec",
    "code_map_json",
    "parse_code_map",
]

KIND_PYFILE = "pyfile"
KIND_FILE = "file"
KIND_ARCHIVE = "archive"
KINDS = (KIND_PYFILE, KIND_FILE, KIND_ARCHIVE)


class CodeSpec(NamedTuple):
    """Blob ``key`` appears in an executor's working directory as ``name``: a file (``file``,
    ``pyfile``, which is also put on the import path) or an unpacked tree (``archive``)."""

    key: str
    kind: str
    name: str

    def as_entry(self) -> list[str]:
        return [self.key, self.kind, self.name]


def parse_code_map(value: str | None) -> tuple[CodeSpec, ...]:
    """Validate a code map: a JSON list of ``[key, kind, name]``; two entries may not share a
    name (Spark refuses that too).

    >>> parse_code_map('[["code.alice.0f.lib.zip", "pyfile", "lib.zip"]]')
    (CodeSpec(key='code.alice.0f.lib.zip', kind='pyfile', name='lib.zip'),)
    """
    if not value:
        return ()
    try:
        raw: Any = json.loads(value)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"the code map is not valid JSON: {exc}") from None
    if not isinstance(raw, list):
        raise InvalidArgument("the code map must be a JSON list of [key, kind, name]")
    out: list[CodeSpec] = []
    names: set[str] = set()
    for entry in raw:
        if (not isinstance(entry, list) or len(entry) != 3
                or not all(isinstance(x, str) for x in entry)):
            raise InvalidArgument(f"code map entry {entry!r}: expected [key, kind, name]")
        key, kind, name = entry
        validate_key(key)
        if kind not in KINDS:
            raise InvalidArgument(f"code map entry {entry!r}: kind must be one of {KINDS}")
        check_local_name(name, repr(key), "name")
        if name in names:
            raise InvalidArgument(f"two entries of the code map are named {name!r}")
        names.add(name)
        out.append(CodeSpec(key, kind, name))
    return tuple(out)


def code_map_json(specs: tuple[CodeSpec, ...] | list[CodeSpec]) -> str:
    return json.dumps([s.as_entry() for s in specs], separators=(",", ":"))
