"""The commands on blobs themselves: create, put, update, cat, fetch, delete, list and meta."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from blobha.cli.connect import client_for
from blobha.cli.hints import describe
from blobha.cli.output import (
    Chatter,
    describe_statuses,
    error_object,
    human_bytes,
    iso,
    note,
    print_json,
    report,
)
from blobha.cli.progress import progress_bar
from blobha.core.acl import format_access, format_acl, parse_acl
from blobha.core.errors import BlobError, DeadlineExceeded, KeyNotFound, NotAuthorized

if TYPE_CHECKING:
    from blobha.client import BlobMeta, Client


def _stdin() -> BinaryIO:
    if sys.stdin.isatty() and Chatter.notes:
        print("reading the blob from stdin; end it with Ctrl-D", file=sys.stderr)
    try:
        fd = sys.stdin.fileno()
    except (OSError, ValueError):  # replaced by an in-memory stream (io.UnsupportedOperation)
        return sys.stdin.buffer
    # Unbuffered, so without a lock: gRPC reads the upload on a thread of its own, and a
    # refused upload leaves that thread blocked in a read of a pipe that stays open. Holding
    # sys.stdin.buffer's lock there made interpreter shutdown abort the process ("Fatal Python
    # error: _enter_buffered_busy", exit 134) instead of exiting with the refusal's status.
    return open(fd, "rb", buffering=0, closefd=False)


def _upload_source(path: str | None) -> Path | BinaryIO:
    return _stdin() if path is None or path == "-" else Path(path)


def cmd_create(args: argparse.Namespace) -> int:
    return _create_or_put(args, "create")


def cmd_put(args: argparse.Namespace) -> int:
    return _create_or_put(args, "put")


def _create_or_put(args: argparse.Namespace, verb: str) -> int:
    acl = parse_acl(args.acl)  # parsed before connecting so a typo costs nothing
    with client_for(args) as c:
        write = c.create if verb == "create" else c.put
        with progress_bar(f"{verb} {args.key}") as progress:
            meta = write(
                args.key,
                _upload_source(args.file),
                acl=acl,
                replication_factor=args.replication_factor,
                write_quorum=args.write_quorum,
                progress=progress,
            )
        done = "created" if verb == "create" or meta.version == 1 else "written"
        note(f"{meta.key} version {meta.version} {done} ({human_bytes(meta.size)})")
        if not args.wait_replication:
            _print_written(args, meta)
            return 0
        result = c.wait_for_replication([args.key], args.wait_replication, args.timeout)
        if not result.reached:
            raise DeadlineExceeded(
                f"{args.key} version {meta.version} was {done}, but fewer than"
                f" {args.wait_replication} masters hold it after {result.waited_secs:.0f} s:"
                f" {describe_statuses(result.statuses)}"
            )
    _print_written(args, meta)
    return 0


def cmd_update(args: argparse.Namespace) -> int:
    with client_for(args) as c, progress_bar(f"update {args.key}") as progress:
        meta = c.update(args.key, _upload_source(args.file), progress=progress)
    note(f"updated {meta.key} to version {meta.version} ({human_bytes(meta.size)})")
    _print_written(args, meta)
    return 0


def _print_written(args: argparse.Namespace, meta: BlobMeta) -> None:
    # Without --json a write prints nothing on stdout, as before (a note on a terminal).
    if args.json:
        print_json({"key": meta.key, "version": meta.version, "size": meta.size,
                    "digest": meta.digest})


def cmd_cat(args: argparse.Namespace) -> int:
    with client_for(args) as c, progress_bar(f"cat {args.key}") as progress:
        if args.file in (None, "-"):
            sys.stdout.flush()
            c.download(args.key, sys.stdout.buffer, progress=progress)
            sys.stdout.buffer.flush()
        else:
            info = c.download(args.key, args.file, progress=progress)
            if args.json:  # only with -f: check_args refuses --json with stdout
                print_json({"key": args.key, "version": info.version, "size": info.size,
                            "digest": info.digest, "path": args.file})
    return 0


def cmd_fetch(args: argparse.Namespace) -> int:
    # Local, like the command itself: the cache is used by no other command.
    from blobha.cache import BlobCache, default_cache_dir

    cache_dir = args.cache_dir or default_cache_dir()
    fetched: list[dict[str, object]] = []
    # Like delete: every key is tried, each failure said, and the first one's status returned.
    status = 0
    # Interval 0: a command asks the cluster for the current version (its user may just have
    # updated the key) instead of reusing a check that another process recorded for the node.
    with client_for(args) as c, BlobCache(cache_dir, client=c, update_interval_secs=0) as cache:
        for key in args.keys:
            try:
                with progress_bar(f"fetch {key}") as progress:
                    blob = cache.get(key, uncompress=args.uncompress, progress=progress)
            except BlobError as exc:
                if args.json:
                    fetched.append({"key": key, **error_object(exc.exit_code,
                                                               describe(exc, args.command))})
                else:
                    report(exc.exit_code, describe(exc, args.command), False)
                status = status or exc.exit_code
                continue
            if args.json:
                fetched.append(
                    {
                        "key": blob.key,
                        "version": blob.version,
                        "size": blob.size,
                        "digest": blob.digest,
                        "path": str(blob.path),
                    }
                )
            else:
                # One line per key as soon as it is ready, for scripts reading a pipe.
                print(f"{blob.key}\t{blob.version}\t{blob.path}", flush=True)
    if args.json:
        print(json.dumps(fetched))
    return status


def cmd_delete(args: argparse.Namespace) -> int:
    # Like rm: every key is tried, each failure said, and the first one's status returned.
    status = 0
    results: list[dict[str, object]] = []
    with client_for(args) as c:
        for key in args.keys:
            try:
                c.delete(key)
                results.append({"key": key, "deleted": True})
            except BlobError as exc:
                if args.json:
                    results.append({"key": key, "deleted": False,
                                    **error_object(exc.exit_code, describe(exc, args.command))})
                else:
                    report(exc.exit_code, describe(exc, args.command), False)
                status = status or exc.exit_code
    if args.json:
        print_json(results)
    return status


def cmd_list(args: argparse.Namespace) -> int:
    with client_for(args) as c:
        if args.long:
            _print_long(_metas(c, args.keys, args.prefix), args.json)
            return 0
        keys: Iterator[str] = (
            _existing(c, args.keys, args.prefix) if args.keys else c.list(args.prefix)
        )
        if args.json:
            print(json.dumps(list(keys)))
        else:
            for key in keys:
                print(key)
    return 0


def _metas(c: Client, keys: Sequence[str], prefix: str) -> Iterator[BlobMeta]:
    if not keys:
        # The client asks for the metadata a few keys at a time, leaving out deleted keys.
        yield from c.list(prefix, detail=True)
        return
    for key in _existing(c, keys, prefix):
        try:
            yield c.get_meta(key)
        except (KeyNotFound, NotAuthorized):
            continue  # deleted since, or listed without any access to its metadata


def _print_long(metas: Iterator[BlobMeta], as_json: bool) -> None:
    rows: list[dict[str, object]] = []
    for meta in metas:
        row = _long_row(meta)
        if as_json:
            rows.append(row)
        else:
            # Tab-separated, flushed per key: scripts cut it, pipes see each key as it comes.
            print("\t".join(str(value) for value in row.values()), flush=True)
    if as_json:
        print(json.dumps(rows))


def _long_row(meta: BlobMeta) -> dict[str, object]:
    return {
        "key": meta.key,
        "version": meta.version,
        "size": meta.size,
        "updated": iso(meta.updated_at),
        "replication": meta.replication,
    }


def _existing(c: Client, keys: Sequence[str], prefix: str) -> Iterator[str]:
    for key in keys:
        if not key.startswith(prefix):
            continue
        try:
            readable = c.get_meta(key).readable
        except KeyNotFound:
            continue
        except NotAuthorized:
            readable = False
        # It exists, but where its user may not read it a listing shows it only if the masters
        # list keys their user cannot read (blobstore.list.visibility = "all", as in Storm).
        if not readable and next(iter(c.list(key, page_size=1)), None) != key:
            continue
        yield key


def cmd_meta(args: argparse.Namespace) -> int:
    with client_for(args) as c:
        meta = c.get_meta(args.key)
    print(json.dumps(meta_dict(meta), indent=2) if args.json else format_meta(meta))
    return 0


def meta_dict(meta: BlobMeta) -> dict[str, object]:
    return {
        "key": meta.key,
        "version": meta.version,
        "size": meta.size,
        "digest": meta.digest,
        "acl": [str(e) for e in meta.acl],
        "replication_factor": meta.replication_factor,
        "meta_version": meta.meta_version,
        "creator": meta.creator,
        "created_at": meta.created_at,
        "updated_at": meta.updated_at,
        "access": _access(meta),  # the caller's own: "rw-", say
    }


def _access(meta: BlobMeta) -> str:
    # An older master does not say (it answered readers alone).
    return format_access(meta.access) if meta.access else "r (at least)"


def format_meta(meta: BlobMeta) -> str:
    rows = [
        ("key", meta.key),
        ("version", str(meta.version)),
        ("size", f"{meta.size} ({human_bytes(meta.size)})"),
        # Left out of the answer to a user without READ (the content's fingerprint).
        ("digest", f"xxh3-128:{meta.digest}" if meta.digest else "- (needs READ)"),
        ("acl", format_acl(meta.acl) or "-"),
        ("replication factor", str(meta.replication_factor)),
        ("meta version", str(meta.meta_version)),
        ("creator", meta.creator or "-"),
        ("created", iso(meta.created_at)),
        ("updated", iso(meta.updated_at)),
        ("your access", _access(meta)),
    ]
    width = max(len(name) for name, _ in rows) + 1
    return "\n".join(f"{name + ':':<{width}} {value}" for name, value in rows)
