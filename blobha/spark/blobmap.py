"""The blob map, Storm's shape: which keys a job reads, under which local names, unpacked or not."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from blobha.core.errors import InvalidArgument
from blobha.core.keys import validate_key
from blobha.spark.conf import CONF_MAP

__all__ = ["BlobSpec", "blob_map_json", "check_local_name", "parse_blob_arg", "parse_blob_map"]

_SPEC_FIELDS = ("localname", "uncompress")


class BlobSpec(NamedTuple):
    """One entry of the blob map: ``key`` appears to the job as ``localname``.

    >>> BlobSpec("model.tgz", "model", uncompress=True).as_map_entry()
    {'localname': 'model', 'uncompress': True}
    """

    key: str
    localname: str
    uncompress: bool = False

    def as_map_entry(self) -> dict[str, Any]:
        return {"localname": self.localname, "uncompress": self.uncompress}


def check_local_name(name: str, of: str, label: str = "localname") -> str:
    """``name``, which becomes an entry of the job's working directory (a side file's
    ``localname``, a code file's name on executors), if nothing in it may point elsewhere;
    otherwise an :class:`InvalidArgument` naming it as the ``label`` of ``of``."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise InvalidArgument(
            f"invalid {label} {name!r} for {of}: use a plain file name without '/'")
    if len(name.encode("utf-8")) > 255:
        raise InvalidArgument(f"{label} of {of} is longer than 255 bytes")
    return name


def parse_blob_map(value: str | Mapping[str, Any] | None) -> tuple[BlobSpec, ...]:
    """Validate a blob map (a JSON string or a mapping) in Storm's shape.

    ``localname`` defaults to the key and ``uncompress`` to false; unknown fields, invalid
    keys, unsafe local names and two keys sharing a local name are errors.

    >>> parse_blob_map('{"geo": {"localname": "geo.bin"}, "model.tgz": {"uncompress": true}}')
    (BlobSpec(key='geo', localname='geo.bin', uncompress=False), \
BlobSpec(key='model.tgz', localname='model.tgz', uncompress=True))
    """
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        try:
            raw = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(
                f"{CONF_MAP} is not valid JSON ({exc}); expected e.g."
                ' {"key": {"localname": "name", "uncompress": false}}'
            ) from None
    else:
        raw = value
    if not isinstance(raw, Mapping):
        raise InvalidArgument(f"{CONF_MAP} must be a JSON object of key -> options")
    specs: list[BlobSpec] = []
    by_local: dict[str, str] = {}
    for key, options in raw.items():
        if not isinstance(key, str):
            raise InvalidArgument(f"blob map keys must be strings, not {key!r}")
        validate_key(key)
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise InvalidArgument(
                f"blob map entry for {key!r} must be an object like"
                ' {"localname": "name", "uncompress": false}'
            )
        unknown = sorted(set(options) - set(_SPEC_FIELDS))
        if unknown:
            raise InvalidArgument(
                f"blob map entry for {key!r} has unknown field(s) {', '.join(unknown)};"
                f" allowed: {', '.join(_SPEC_FIELDS)}"
            )
        localname = options.get("localname", key)
        if not isinstance(localname, str):
            raise InvalidArgument(f"localname of {key!r} must be a string")
        uncompress = options.get("uncompress", False)
        if not isinstance(uncompress, bool):
            raise InvalidArgument(f"uncompress of {key!r} must be true or false")
        check_local_name(localname, f"key {key!r}")
        if localname in by_local:
            raise InvalidArgument(
                f"keys {by_local[localname]!r} and {key!r} both map to localname {localname!r}"
            )
        by_local[localname] = key
        specs.append(BlobSpec(key, localname, uncompress))
    return tuple(specs)


def blob_map_json(specs: Iterable[BlobSpec]) -> str:
    """The canonical JSON form of a blob map (what goes into ``spark.blobha.blobstore.map``)."""
    return json.dumps({s.key: s.as_map_entry() for s in specs}, separators=(",", ":"))


def parse_blob_arg(text: str) -> BlobSpec:
    """Parse a launcher ``--blob KEY[:LOCALNAME][:uncompress]`` argument.

    Keys cannot contain ``:``, so the split is unambiguous; a last field ``uncompress`` is
    the flag (write ``KEY:uncompress:uncompress`` for a local name that is literally
    "uncompress").

    >>> parse_blob_arg("model.tgz:model:uncompress")
    BlobSpec(key='model.tgz', localname='model', uncompress=True)
    >>> parse_blob_arg("geo")
    BlobSpec(key='geo', localname='geo', uncompress=False)
    """
    parts = text.split(":")
    uncompress = False
    if len(parts) > 1 and parts[-1] == "uncompress":
        uncompress = True
        parts.pop()
    if len(parts) > 2:
        raise InvalidArgument(
            f"bad --blob {text!r}: expected KEY[:LOCALNAME][:uncompress] (keys have no ':')"
        )
    key = validate_key(parts[0])
    localname = parts[1] if len(parts) == 2 and parts[1] else key
    return BlobSpec(key, check_local_name(localname, f"key {key!r}"), uncompress)
