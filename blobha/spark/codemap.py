"""The code map: the job's own code and environment (``--py-files``, ``--files``,
``--archives``) as content-addressed blobs, where each appears on an executor, and the
version and SHA-256 each is pinned to (executors use nothing else).

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
    ``pyfile``, which is also put on the import path) or an unpacked tree (``archive``); only
    its ``version``, and only if its bytes have the SHA-256 ``sha256`` (64 lower-case hex
    digits) the launcher computed from its own file."""

    key: str
    kind: str
    name: str
    version: int
    sha256: str

    def as_entry(self) -> list[str | int]:
        return [self.key, self.kind, self.name, self.version, self.sha256]


_ENTRY = "[key, kind, name, version, sha256]"


def _is_sha256(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def parse_code_map(value: str | None) -> tuple[CodeSpec, ...]:
    """Validate a code map: a JSON list of ``[key, kind, name, version, sha256]``; two
    entries may not share a name (Spark refuses that too). An entry without its pin (from a
    launcher before pins) is refused: its code could be anyone's.

    >>> pin = 64 * "a"
    >>> parse_code_map(f'[["code.alice.0f.lib.zip", "pyfile", "lib.zip", 1, "{pin}"]]')[0][:4]
    ('code.alice.0f.lib.zip', 'pyfile', 'lib.zip', 1)
    """
    if not value:
        return ()
    try:
        raw: Any = json.loads(value)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"the code map is not valid JSON: {exc}") from None
    if not isinstance(raw, list):
        raise InvalidArgument(f"the code map must be a JSON list of {_ENTRY}")
    out: list[CodeSpec] = []
    names: set[str] = set()
    for entry in raw:
        if (isinstance(entry, list) and len(entry) == 3
                and all(isinstance(x, str) for x in entry)):
            raise InvalidArgument(
                f"code map entry {entry!r} pins no version and SHA-256 (a launcher older than"
                " the blobha on the executors made it); launch the job again with this"
                " blobha's 'blobha spark-submit'")
        if (not isinstance(entry, list) or len(entry) != 5
                or not all(isinstance(x, str) for x in (*entry[:3], entry[4]))
                or isinstance(entry[3], bool) or not isinstance(entry[3], int)
                or entry[3] < 1 or not _is_sha256(entry[4])):
            raise InvalidArgument(f"code map entry {entry!r}: expected {_ENTRY} (version 1 or"
                                  " more, sha256 as 64 lower-case hex digits)")
        key, kind, name, version, sha256 = entry
        validate_key(key)
        if kind not in KINDS:
            raise InvalidArgument(f"code map entry {entry!r}: kind must be one of {KINDS}")
        check_local_name(name, repr(key), "name")
        if name in names:
            raise InvalidArgument(f"two entries of the code map are named {name!r}")
        names.add(name)
        out.append(CodeSpec(key, kind, name, version, sha256))
    return tuple(out)


def code_map_json(specs: tuple[CodeSpec, ...] | list[CodeSpec]) -> str:
    return json.dumps([s.as_entry() for s in specs], separators=(",", ":"))
