"""The ``blobha`` command line, shaped after ``storm blobstore``.

Global options go before or after the command: ``--cluster HOST:PORT[,HOST:PORT...]``
(default ``$BLOBHA_CLUSTER``, else 127.0.0.1:6627) and ``--user NAME`` (default
``$BLOBHA_USER``, else the operating-system user).

Errors are one line on stderr, ``blobha: error: <message>``, and the exit status says which
kind of error it was:

====  =========================================================================
code  meaning
====  =========================================================================
0     success
1     other error, including a local file that cannot be read or written
2     usage error (bad command line)
3     the key does not exist
4     the key already exists
5     not authorized (the ACL does not allow it)
6     invalid argument (bad key, ACL, number...)
7     not the leader (no leader could be reached for a write)
8     version conflict (the blob changed meanwhile)
9     checksum mismatch (corrupt data detected)
10    resource exhausted (no disk space on the masters, message too large)
11    unavailable (no master or no leader reachable before the timeout)
12    deadline exceeded (also: wait-replication did not reach its minimum)
13    upload lost (it expired, or the leader changed and it could not restart)
14    internal error
15    not authenticated (no or a wrong token or client certificate)
16    TLS settings that every master's certificate proves wrong (--ca names another CA,
      the certificate does not name the address, or TLS on the client's side only)
17    busy (until the timeout, the masters refused the call: every call thread in use)
130   interrupted (Ctrl-C)
141   broken pipe (the reader of stdout went away, e.g. ``blobha cat k | head``)
143   terminated (SIGTERM); ``cat -f`` removes its partial file first
====  =========================================================================
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import math
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, BinaryIO, TextIO

from blobha.core.acl import format_access, format_acl, parse_acl
from blobha.core.addresses import parse_cluster
from blobha.core.errors import (
    BlobError,
    DeadlineExceeded,
    InternalError,
    InvalidArgument,
    KeyNotFound,
    NotAuthorized,
)

if TYPE_CHECKING:
    # Imported when a command first needs a client (_make_client), not with this module: gRPC
    # must not be loaded before main() has chosen its log level (_quiet_grpc).
    from blobha.client import BlobMeta, Client, ClusterSummary, ProgressCallback, ReplicationStatus

PROG = "blobha"
DEFAULT_CLUSTER = "127.0.0.1:6627"
DEFAULT_BASE_PORT = 6627
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141
EXIT_TERMINATED = 143
_UINT32_MAX = 2**32 - 1

EXIT_CODES_EPILOG = """\
exit codes:
  0 success            1 other error / local file    2 usage error
  3 key not found      4 key already exists          5 not authorized
  6 invalid argument   7 not leader                  8 version conflict
  9 checksum mismatch  10 resource exhausted         11 unavailable
  12 deadline exceeded (and wait-replication not reached)
  13 upload lost       14 internal error             15 not authenticated
  16 TLS settings that the masters' certificates prove wrong (--ca)
  17 busy: the masters kept refusing the call, every call thread taken; retry later
  130 interrupted      141 broken pipe      143 terminated (SIGTERM)

environment: BLOBHA_CLUSTER (default for --cluster), BLOBHA_USER (default for --user),
  BLOBHA_ADDRESS_MAP (ADVERTISED=DIAL,... to reach masters through NAT or published ports)
  BLOBHA_CA, BLOBHA_CERT, BLOBHA_KEY, BLOBHA_TOKEN_FILE (defaults for --ca, --cert, --key,
  --token-file)
"""

#: Builds the client for a command; tests replace it with a fake (no network).
ClientFactory = Callable[[str, str | None], "Client"]


def _make_client(cluster: str, user: str | None) -> Client:
    from blobha.client import Client

    client = Client(cluster, user=user)
    client.on_retry = _say_retrying
    return client


def _say_retrying(what: str, why: BlobError, left: float) -> None:
    _note(f"blobha: still trying to {what} ({why}); giving up in {left:.0f} s")


#: Commands that run masters. Their gRPC log lines (a client's failed TLS handshake, say) are
#: how an operator sees the clients that cannot connect; local-cluster's masters inherit them.
_MASTER_COMMANDS = frozenset({"serve", "local-cluster"})


def _quiet_grpc(command: str) -> None:
    """Keep gRPC's own log lines off a client command's stderr: a failed TLS handshake would
    otherwise print lines of its own beside the command's one-line error. gRPC's C core reads
    GRPC_VERBOSITY once, as it is loaded, so the setting is made for that moment only: the
    masters a command starts (bench --local), and a process calling main() (tests), keep the
    environment they had. A GRPC_VERBOSITY the user set still wins."""
    if command in _MASTER_COMMANDS or "GRPC_VERBOSITY" in os.environ or "grpc" in sys.modules:
        return
    os.environ["GRPC_VERBOSITY"] = "ERROR"
    try:
        import grpc  # noqa: F401  (loaded now, to read the setting)
    finally:
        del os.environ["GRPC_VERBOSITY"]


client_factory: ClientFactory = _make_client


# --------------------------------------------------------------------------------------------
# Argument parsing
# --------------------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 1 <= value <= _UINT32_MAX:
        # The wire carries these as 32-bit counts: a larger one would fail deep in protobuf.
        raise argparse.ArgumentTypeError(f"expected 1 to {_UINT32_MAX}, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(
            f"expected a number of seconds, got {text!r} (a negative number waits forever)")
    return value


def _port(text: str) -> int:
    """A port, or 0 for "pick free ports"."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port 0-65535 (0 = any free), got {value}")
    return value


def _add_global_options(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    # On subcommands the default is SUPPRESS, so an option given only before the command is not
    # overwritten by the subcommand's default.
    default = argparse.SUPPRESS if suppress else None
    group = parser.add_argument_group("global options")
    group.add_argument(
        "--cluster",
        metavar="HOST:PORT[,HOST:PORT...]",
        default=default,
        help=f"masters to contact (default: $BLOBHA_CLUSTER, else {DEFAULT_CLUSTER})",
    )
    group.add_argument(
        "--user",
        metavar="NAME",
        default=default,
        help="who you are (default: the token's user, else $BLOBHA_USER, else the"
        " operating-system user)",
    )
    # dest names stay clear of the commands' own KEY argument.
    group.add_argument("--ca", metavar="FILE", default=default, dest="tls_ca",
                       help="CA certificate of the masters; turns TLS on (default: $BLOBHA_CA)")
    group.add_argument("--cert", metavar="FILE", default=default, dest="tls_cert",
                       help="client certificate for TLS (default: $BLOBHA_CERT)")
    group.add_argument("--key", metavar="FILE", default=default, dest="tls_key",
                       help="private key of --cert (default: $BLOBHA_KEY)")
    group.add_argument("--token-file", metavar="FILE", default=default,
                       help="file holding your token (default: $BLOBHA_TOKEN_FILE)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Command line of blobha, a highly available replicated blob store.",
        epilog=EXIT_CODES_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    _add_global_options(parser, suppress=False)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(
        name: str, help_text: str, func: Callable[[argparse.Namespace], int]
    ) -> argparse.ArgumentParser:
        sub = commands.add_parser(
            name,
            help=help_text,
            description=help_text,
            epilog=EXIT_CODES_EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        _add_global_options(sub, suppress=True)
        sub.set_defaults(func=func, parser=sub)
        return sub

    p = command("create", "create a blob from a file or stdin", _cmd_create)
    p.add_argument("key", metavar="KEY")
    p.add_argument("-f", "--file", metavar="FILE", help="read the content from FILE (- = stdin)")
    p.add_argument(
        "-a",
        "--acl",
        metavar="ACL[,ACL...]",
        default="",
        help="access list, e.g. u:alice:rwa,o::r (you always keep full access)",
    )
    p.add_argument(
        "-r",
        "--replication-factor",
        type=_positive_int,
        default=0,
        metavar="N",
        help="masters that should hold the blob (default: the cluster's)",
    )
    p.add_argument(
        "--wait-replication",
        type=_positive_int,
        default=0,
        metavar="N",
        help="after creating, wait until N masters hold the blob",
    )
    p.add_argument(
        "--timeout",
        type=_seconds,
        default=60.0,
        metavar="SECONDS",
        help="how long --wait-replication waits (default 60, negative = forever)",
    )
    p.add_argument(
        "--write-quorum",
        type=_positive_int,
        default=0,
        metavar="W",
        help="masters that must hold the data before the create returns (default: cluster's)",
    )

    p = command("update", "write a new version of a blob from a file or stdin", _cmd_update)
    p.add_argument("key", metavar="KEY")
    p.add_argument("-f", "--file", metavar="FILE", help="read the content from FILE (- = stdin)")

    p = command("cat", "write a blob to stdout or a file", _cmd_cat)
    p.add_argument("key", metavar="KEY")
    p.add_argument(
        "-f", "--file", metavar="FILE", help="write to FILE (replaced only when complete)"
    )

    p = command(
        "fetch", "put blobs in this node's cache (once per node) and print their paths (each"
        " one tried; the status is the first failure's)", _cmd_fetch
    )
    p.add_argument("keys", metavar="KEY", nargs="+")
    p.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="the node's cache (default: $BLOBHA_CACHE_DIR, else ~/.cache/blobha)",
    )
    p.add_argument(
        "--uncompress",
        action="store_true",
        help="unpack .tar/.tgz/.tar.gz/.zip/.jar archives; the path is then a directory",
    )
    p.add_argument("--json", action="store_true", help="print a JSON array")

    p = command("delete", "delete blobs (each one tried; the status is the first failure's)",
                _cmd_delete)
    p.add_argument("keys", metavar="KEY", nargs="+")

    p = command("list", "list keys (only the given ones that exist, if any)", _cmd_list)
    p.add_argument("keys", metavar="KEY", nargs="*")
    p.add_argument("--prefix", default="", metavar="P", help="only keys starting with P")
    p.add_argument("--json", action="store_true", help="print a JSON array")

    p = command("meta", "show a blob's metadata", _cmd_meta)
    p.add_argument("key", metavar="KEY")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command("set-acl", "replace a blob's access list", _cmd_set_acl)
    p.add_argument("key", metavar="KEY")
    p.add_argument(
        "-s", "--set", dest="acl", metavar="ACL[,ACL...]",
        help="the new ACL (without it, the current one is set again, as in Storm)",
    )

    p = command("replication", "read or change a blob's replication", _cmd_replication)
    p.add_argument("key", metavar="KEY")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--read", action="store_true", help="print the current replica count")
    mode.add_argument("--update", action="store_true", help="change the replication factor")
    p.add_argument("-r", "--replication-factor", type=_positive_int, metavar="N")

    p = command(
        "wait-replication", "wait until blobs have at least N replicas", _cmd_wait_replication
    )
    p.add_argument("keys", metavar="KEY", nargs="+")
    p.add_argument("--min", type=_positive_int, required=True, metavar="N", dest="minimum")
    p.add_argument(
        "--timeout",
        type=_seconds,
        default=60.0,
        metavar="SECONDS",
        help="give up after this long (default 60, negative = forever)",
    )

    p = command("cluster", "show the masters and the leader", _cmd_cluster)
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command("health", "check that one master answers (for health checks)", _cmd_health)
    p.add_argument("address", nargs="?", default="127.0.0.1:6627", metavar="HOST:PORT",
                   help="the master to ask (default 127.0.0.1:6627)")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command("serve", "run a master", _cmd_serve)
    p.add_argument("--config", required=True, metavar="FILE", help="the master's TOML file")

    p = command("local-cluster", "run ZooKeeper and N masters on this machine", _cmd_local_cluster)
    p.add_argument("--nodes", type=_positive_int, default=3, metavar="N")
    p.add_argument("--data-dir", metavar="DIR",
                   help="where to keep data; kept across runs (default: ./blobha-local)")
    p.add_argument("--base-port", type=_port, default=DEFAULT_BASE_PORT, metavar="PORT",
                   help="first master's port; the others follow (0 = any free ports)")
    p.add_argument("--zookeeper-home", metavar="DIR", help="a ZooKeeper installation to use")
    p.add_argument("--tls", action="store_true",
                   help="secure set-up: a throwaway CA, TLS everywhere, token authentication"
                   " (unless --auth says otherwise) and ZooKeeper locked down to the masters")
    p.add_argument("--auth", choices=("simple", "token", "mtls"), default=None,
                   help="authentication (default: token with --tls, else simple; mtls needs"
                   " --tls)")

    p = command("token", "make tokens for auth.mode = 'token'", _cmd_token)
    p.add_argument("action", choices=("create", "hash"),
                   help="create: a new token for USER and its token-file line; hash: the"
                   " token-file line for a token read from stdin")
    p.add_argument("token_user", nargs="?", metavar="USER", help="whose token to create")
    p.add_argument("--append", metavar="TOKEN_FILE",
                   help="append the line to this token file (the masters' auth.token.file)")
    p.add_argument("--out", metavar="FILE",
                   help="write the new token to FILE (mode 600) instead of stdout")

    # Listed for --help; main() hands the arguments to blobha.spark.submit_main directly.
    p = command("spark-submit", "wait for blobs' replication, then run spark-submit"
                " (blobha spark-submit --help)", _cmd_spark_submit)
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)

    p = command("bench", "measure this cluster against same-run baselines", _cmd_bench)
    p.add_argument("--local", action="store_true",
                   help="start a throw-away local cluster (needed for failover and scale)")
    p.add_argument("--json", action="store_true", help="one JSON object per metric")
    p.add_argument("--size-mb", type=_positive_int, default=1024, metavar="MIB",
                   help="size of the upload/download/replication blob (default 1024)")
    p.add_argument("--count", type=_positive_int, default=100, metavar="N",
                   help="1 MiB creates for the replication latency (default 100)")
    p.add_argument("--small-ops-seconds", type=_seconds, default=10.0, metavar="SECONDS",
                   help="duration of each small-operation run (default 10)")
    p.add_argument("--scale-keys", type=_positive_int, default=100_000, metavar="N",
                   help="keys in the cluster for the scale metrics (default 100000)")
    p.add_argument("--repeat", type=_positive_int, default=3, metavar="N",
                   help="rounds of the big-blob metrics; medians are reported (default 3)")
    p.add_argument("--metrics", metavar="NAME[,NAME...]",
                   help="run only these: upload_mbps, replication_1g_s, download_mbps,"
                        " replication_latency_ms, small_ops_per_s, spark, failover_term_s,"
                        " failover_kill_s, failover_kill_restart_s, scale (default: all)")
    p.add_argument("--spark-size-mb", type=_positive_int, default=256, metavar="MIB",
                   help="size of the blob every Spark executor gets (default 256)")
    p.add_argument("--zookeeper", metavar="HOST:PORT",
                   help="a remote cluster's ZooKeeper, for the ZooKeeper baselines")
    p.add_argument("--baseline-dir", metavar="DIR",
                   help="where the disk baselines write for a remote cluster (default: a"
                        " temporary directory)")
    return parser


def _check_args(args: argparse.Namespace) -> None:
    """Constraints argparse cannot express; reported as usage errors (exit 2)."""
    if args.command == "token":
        if args.action == "create" and not args.token_user:
            args.parser.error("'token create' needs the USER the token is for")
        if args.action == "hash" and (args.token_user or args.out):
            args.parser.error("'token hash' reads the token from stdin; it takes no USER or --out")
    if args.command == "local-cluster" and args.auth == "mtls" and not args.tls:
        args.parser.error("--auth mtls needs --tls")
    if getattr(args, "cluster", None):
        # A typo in an option is a usage error like any other (exit 2), found before the
        # command starts; the BLOBHA_CLUSTER variable is checked when the client is built.
        try:
            parse_cluster(args.cluster)
        except InvalidArgument as exc:
            args.parser.error(f"--cluster: {exc}")
    if getattr(args, "file", None) == "":
        # Otherwise the empty name reaches the file system as the current directory.
        args.parser.error("-f/--file needs a file name (or - for standard input/output)")
    if args.command == "replication":
        if args.update and args.replication_factor is None:
            args.parser.error("--update needs --replication-factor N")
        if args.read and args.replication_factor is not None:
            args.parser.error("--replication-factor goes with --update, not --read")


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("blobha")
    except Exception:  # not installed: running from a source tree
        return "unknown"


# --------------------------------------------------------------------------------------------
# Output helpers
# --------------------------------------------------------------------------------------------


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # unreachable; keeps the return type total


def _human_duration(secs: float) -> str:
    s = int(secs)
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d{hours}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{s:02d}s"
    return f"{s}s"


def _iso(ts: float) -> str:
    if ts <= 0:
        return "-"
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds")


class ProgressBar:
    """A one-line progress display on a terminal: bytes/total, percent, rate."""

    _INTERVAL = 0.1

    def __init__(self, label: str, stream: TextIO, clock: Callable[[], float] = time.monotonic):
        self._label = label
        self._stream = stream
        self._clock = clock
        self._started = clock()
        self._last_draw = 0.0
        self._width = 0
        self._done = 0
        self._total = -1

    def __call__(self, done: int, total: int) -> None:
        self._done, self._total = done, total
        now = self._clock()
        # Redrawing on every chunk would cost more than the transfer on a fast link.
        if now - self._last_draw >= self._INTERVAL:
            self._last_draw = now
            self._draw(now)

    def render(self, now: float) -> str:
        elapsed = max(now - self._started, 1e-6)
        rate = self._done / elapsed / 1e6
        if self._total >= 0:
            pct = 100.0 * self._done / self._total if self._total else 100.0
            return (
                f"{self._label}: {_human_bytes(self._done)} / {_human_bytes(self._total)}"
                f" {pct:5.1f}% {rate:7.1f} MB/s"
            )
        return f"{self._label}: {_human_bytes(self._done)} {rate:7.1f} MB/s"

    def _draw(self, now: float) -> None:
        line = self.render(now)
        pad = max(0, self._width - len(line))
        self._width = len(line)
        self._stream.write("\r" + line + " " * pad)
        self._stream.flush()

    def close(self) -> None:
        if self._width:
            self._draw(self._clock())
            self._stream.write("\n")
            self._stream.flush()


@contextlib.contextmanager
def _progress(label: str) -> Iterator[ProgressCallback | None]:
    if not sys.stderr.isatty():
        yield None
        return
    bar = ProgressBar(label, sys.stderr)
    try:
        yield bar
    finally:
        bar.close()


def _note(message: str) -> None:
    """Chatter for people at a terminal; scripts read stdout and the exit status."""
    if sys.stderr.isatty():
        print(message, file=sys.stderr)


def _meta_dict(meta: BlobMeta) -> dict[str, object]:
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
        ("size", f"{meta.size} ({_human_bytes(meta.size)})"),
        # Left out of the answer to a user without READ (the content's fingerprint).
        ("digest", f"xxh3-128:{meta.digest}" if meta.digest else "- (needs READ)"),
        ("acl", format_acl(meta.acl) or "-"),
        ("replication factor", str(meta.replication_factor)),
        ("meta version", str(meta.meta_version)),
        ("creator", meta.creator or "-"),
        ("created", _iso(meta.created_at)),
        ("updated", _iso(meta.updated_at)),
        ("your access", _access(meta)),
    ]
    width = max(len(name) for name, _ in rows) + 1
    return "\n".join(f"{name + ':':<{width}} {value}" for name, value in rows)


def format_cluster(summary: ClusterSummary) -> str:
    header = ("ADDRESS", "ROLE", "UPTIME", "VERSION", "BLOBS", "BYTES", "DISK FREE", "LAG")
    rows: list[tuple[str, ...]] = [header]
    for m in summary.masters:
        if not m.reachable:
            rows.append((m.address, "unreachable", "-", "-", "-", "-", "-", "-"))
            continue
        rows.append(
            (
                m.address,
                "leader" if m.is_leader else "follower",
                _human_duration(m.uptime_secs),
                m.version or "-",
                str(m.blob_count),
                _human_bytes(m.bytes_stored),
                _human_bytes(m.disk_free),
                str(m.lag_blobs),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    ]
    blobs = "unknown" if summary.zookeeper_unreachable else str(summary.blob_count)
    lines.append(
        f"leader: {summary.leader or '(none)'}  epoch: {summary.epoch}"
        f"  blobs: {blobs}  under-replicated: {summary.under_replicated}"
    )
    if summary.zookeeper_unreachable:
        lines.append("ZooKeeper is unreachable from the master that answered: these are the"
                     " masters it last saw; writes wait until ZooKeeper is back")
    return "\n".join(lines)


def _cluster_dict(summary: ClusterSummary) -> dict[str, object]:
    return {
        "leader": summary.leader,
        "epoch": summary.epoch,
        # Unknown without ZooKeeper, not 0.
        "blob_count": None if summary.zookeeper_unreachable else summary.blob_count,
        "under_replicated": summary.under_replicated,
        "zookeeper_unreachable": summary.zookeeper_unreachable,
        "masters": [
            {
                "address": m.address,
                "role": "unreachable"
                if not m.reachable
                else ("leader" if m.is_leader else "follower"),
                "reachable": m.reachable,
                "is_leader": m.is_leader,
                "uptime_secs": m.uptime_secs,
                "version": m.version,
                "blob_count": m.blob_count,
                "bytes_stored": m.bytes_stored,
                "disk_free": m.disk_free,
                "lag_blobs": m.lag_blobs,
                "epoch": m.epoch,
                "zookeeper_unreachable": m.zookeeper_unreachable,
            }
            for m in summary.masters
        ],
    }


def _describe_statuses(statuses: Sequence[ReplicationStatus]) -> str:
    return ", ".join(
        f"{s.key} has {s.replication} (version {s.version}, factor {s.replication_factor})"
        for s in statuses
    )


# --------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------


def _client(args: argparse.Namespace) -> Client:
    cluster = args.cluster or os.environ.get("BLOBHA_CLUSTER") or DEFAULT_CLUSTER
    return client_factory(cluster, args.user or None)


def _stdin() -> BinaryIO:
    if sys.stdin.isatty():
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


def _upload_source(path: str | None) -> str | BinaryIO:
    return _stdin() if path in (None, "-") else str(path)


def _cmd_create(args: argparse.Namespace) -> int:
    acl = parse_acl(args.acl)  # parsed before connecting so a typo costs nothing
    with _client(args) as c:
        with _progress(f"create {args.key}") as progress:
            meta = c.create(
                args.key,
                _upload_source(args.file),
                acl=acl,
                replication_factor=args.replication_factor,
                write_quorum=args.write_quorum,
                progress=progress,
            )
        _note(f"created {meta.key} version {meta.version} ({_human_bytes(meta.size)})")
        if not args.wait_replication:
            return 0
        result = c.wait_for_replication([args.key], args.wait_replication, args.timeout)
        if not result.reached:
            raise DeadlineExceeded(
                f"{args.key} version {meta.version} was created, but fewer than"
                f" {args.wait_replication} masters hold it after {result.waited_secs:.0f} s:"
                f" {_describe_statuses(result.statuses)}"
            )
    return 0


def _cmd_update(args: argparse.Namespace) -> int:
    with _client(args) as c, _progress(f"update {args.key}") as progress:
        meta = c.update(args.key, _upload_source(args.file), progress=progress)
    _note(f"updated {meta.key} to version {meta.version} ({_human_bytes(meta.size)})")
    return 0


def _cmd_cat(args: argparse.Namespace) -> int:
    with _client(args) as c, _progress(f"cat {args.key}") as progress:
        if args.file in (None, "-"):
            sys.stdout.flush()
            c.download(args.key, sys.stdout.buffer, progress=progress)
            sys.stdout.buffer.flush()
        else:
            c.download(args.key, args.file, progress=progress)
    return 0


def _cmd_fetch(args: argparse.Namespace) -> int:
    # Local, like the command itself: the cache is used by no other command.
    from blobha.cache import BlobCache, default_cache_dir

    cache_dir = args.cache_dir or default_cache_dir()
    fetched: list[dict[str, object]] = []
    # Like delete: every key is tried, each failure said, and the first one's status returned.
    status = 0
    # Interval 0: a command asks the cluster for the current version (its user may just have
    # updated the key) instead of reusing a check that another process recorded for the node.
    with _client(args) as c, BlobCache(cache_dir, client=c, update_interval_secs=0) as cache:
        for key in args.keys:
            try:
                blob = cache.get(key, uncompress=args.uncompress)
            except BlobError as exc:
                _fail(str(exc) or type(exc).__name__)
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


def _cmd_delete(args: argparse.Namespace) -> int:
    # Like rm: every key is tried, each failure said, and the first one's status returned.
    status = 0
    with _client(args) as c:
        for key in args.keys:
            try:
                c.delete(key)
            except BlobError as exc:
                _fail(str(exc) or type(exc).__name__)
                status = status or exc.exit_code
    return status


def _cmd_list(args: argparse.Namespace) -> int:
    with _client(args) as c:
        keys: Iterator[str] = (
            _existing(c, args.keys, args.prefix) if args.keys else c.list(args.prefix)
        )
        if args.json:
            print(json.dumps(list(keys)))
        else:
            for key in keys:
                print(key)
    return 0


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


def _cmd_meta(args: argparse.Namespace) -> int:
    with _client(args) as c:
        meta = c.get_meta(args.key)
    print(json.dumps(_meta_dict(meta), indent=2) if args.json else format_meta(meta))
    return 0


def _cmd_set_acl(args: argparse.Namespace) -> int:
    acl = None if args.acl is None else parse_acl(args.acl)
    with _client(args) as c:
        if acl is None:
            # Storm's set-acl without -s sets the current ACL again (ADMIN still needed); only
            # if it is still the one read, so a change made meanwhile is never undone.
            current = c.get_meta(args.key)
            meta = c.set_acl(args.key, current.acl, expected_meta_version=current.meta_version)
        else:
            meta = c.set_acl(args.key, acl)
    _note(f"ACL of {meta.key} is now {format_acl(meta.acl)}")
    return 0


def _cmd_replication(args: argparse.Namespace) -> int:
    with _client(args) as c:
        if args.read:
            print(c.get_replication(args.key).replication)
        else:
            meta = c.set_replication_factor(args.key, args.replication_factor)
            _note(f"replication factor of {meta.key} is now {meta.replication_factor}")
    return 0


def _cmd_wait_replication(args: argparse.Namespace) -> int:
    with _client(args) as c:
        result = c.wait_for_replication(args.keys, args.minimum, args.timeout)
    for s in result.statuses:
        print(f"{s.key}\t{s.replication}\tversion {s.version}")
    if not result.reached:
        raise DeadlineExceeded(
            f"fewer than {args.minimum} replicas after {result.waited_secs:.0f} s:"
            f" {_describe_statuses(result.statuses)}"
        )
    return 0


def _cmd_cluster(args: argparse.Namespace) -> int:
    with _client(args) as c:
        summary = c.cluster_summary()
    print(json.dumps(_cluster_dict(summary), indent=2) if args.json else format_cluster(summary))
    return 0


def _cmd_health(args: argparse.Namespace) -> int:
    with _client(args) as c:
        status = c.node_status(args.address)
    if args.json:
        print(json.dumps(dataclasses.asdict(status), indent=2))
    else:
        # The epoch is the term this master leads: a follower's would read as 0 (or as the
        # term it last led), which looks like a fault.
        role = f"leader epoch {status.epoch}" if status.is_leader else "follower"
        # Still "ok" (exit 0): the master answers and serves reads of what it holds, and a
        # health check that failed it would have every master restarted during a ZooKeeper
        # outage, which restarting cannot mend. The line says what it cannot do.
        cut_off = (": ZooKeeper unreachable, serving reads of what it holds and no writes"
                   if status.zookeeper_unreachable else "")
        print(f"ok {status.address} {role} blobs {status.blob_count}"
              f" lag {status.lag_blobs} up {status.uptime_secs:.0f}s{cut_off}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    serve_main: Callable[[str], int] = _load("blobha.master.process", "serve_main",
                                             "start a master")
    return int(serve_main(args.config))


def _cmd_local_cluster(args: argparse.Namespace) -> int:
    run: Callable[..., int] = _load("blobha.ops.localcluster", "main", "start a local cluster")
    return int(run(args.nodes, args.data_dir, args.base_port, args.zookeeper_home,
                   tls=args.tls, auth=args.auth))


def _cmd_token(args: argparse.Namespace) -> int:
    from blobha.core.auth import hash_token, new_token
    from blobha.core.errors import Unauthenticated

    try:
        if args.action == "create":
            token = new_token(args.token_user)
        else:
            token = sys.stdin.readline().strip()
        line = hash_token(token)
    except Unauthenticated as exc:
        raise InvalidArgument(str(exc)) from None
    if args.action == "create" and args.out:
        # The token first: a hash appended for a token that could not be kept would be a
        # credential nobody holds.
        fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            # The mode given to open applies only to a new file; one that existed keeps its
            # own (often 0644) unless changed, before the token is in it.
            os.fchmod(f.fileno(), 0o600)
            f.write(token + "\n")
    if args.append:
        with open(args.append, "a") as f:
            f.write(line + "\n")
        _note(f"added a line for {line.split(':', 1)[0]!r} to {args.append}")
    else:
        print(line)
    if args.action == "create":
        if args.out:
            _note(f"token written to {args.out}; pass it with --token-file")
        else:
            _note("the token (shown once; the masters keep only its hash):")
            print(token)
    return 0


def _cmd_spark_submit(args: argparse.Namespace) -> int:
    # Reached only when global options came first; the launcher takes its own --cluster/--user.
    args.parser.error("put 'spark-submit' first: blobha spark-submit [--cluster ...] ... -- ...")
    return EXIT_USAGE


def _cmd_bench(args: argparse.Namespace) -> int:
    run: Callable[..., int] = _load("blobha.ops.bench", "main", "run the benchmark")
    cluster = None if args.local else (args.cluster or os.environ.get("BLOBHA_CLUSTER"))
    return int(run(
        cluster, args.local, args.json, count=args.count, size_mb=args.size_mb,
        small_ops_seconds=args.small_ops_seconds, scale_keys=args.scale_keys,
        repeat=args.repeat, metrics=args.metrics, zookeeper=args.zookeeper,
        baseline_dir=args.baseline_dir, spark_size_mb=args.spark_size_mb,
    ))


def _load(module: str, name: str, purpose: str) -> Any:
    # Imported on use: the client commands must work where the master's dependencies (or the
    # master itself) are absent, and must not pay for importing them.
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise InternalError(f"cannot {purpose}: {exc}") from None


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------


def _fail(message: str) -> None:
    # One line, whatever the message holds: scripts grep it and logs keep it whole.
    text = " ".join(message.split()) or "unknown error"
    print(f"{PROG}: error: {text}", file=sys.stderr)


def _describe_os_error(exc: OSError) -> str:
    reason = exc.strerror or str(exc)
    if exc.filename is not None:
        return f"{exc.filename}: {reason}"
    return reason


def _silence_stdout() -> None:
    # After EPIPE, the interpreter's final flush of stdout would fail again and print a
    # traceback; point stdout at /dev/null so shutdown stays quiet.
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def _export_credentials(args: argparse.Namespace) -> None:
    # Through the environment, so every client this command builds (the node cache's too)
    # uses them, exactly as if the BLOBHA_* variables had been set.
    for option, env in (("tls_ca", "BLOBHA_CA"), ("tls_cert", "BLOBHA_CERT"),
                        ("tls_key", "BLOBHA_KEY"),
                        ("token_file", "BLOBHA_TOKEN_FILE")):
        value = getattr(args, option, None)
        if value:
            os.environ[env] = value


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is, as Ctrl-C raises KeyboardInterrupt."""


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM (``timeout``, a service manager, CI) unwinds the command like Ctrl-C, so its
    clean-up runs: a download's partial file is removed, a benchmark's local cluster stopped
    (dying outright would orphan its ZooKeeper JVM). Commands that handle the signal
    themselves (``serve``, ``local-cluster``) put their own handler in place of this one."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        raise Terminated(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["spark-submit"]:
        _quiet_grpc("spark-submit")
        # Its arguments (ours, then spark-submit's after "--") are the launcher's to parse;
        # argparse would try to read spark-submit's options as blobha's.
        submit: Callable[[list[str]], int] = _load(
            "blobha.spark", "submit_main", "launch spark-submit (install 'blobha[spark]')"
        )
        try:
            return int(submit(argv[1:]))
        except BlobError as exc:
            _fail(str(exc) or type(exc).__name__)
            return exc.exit_code
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        _check_args(args)
    except SystemExit as exc:  # argparse: --help, --version, usage errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USAGE)
    _quiet_grpc(args.command)
    _export_credentials(args)
    try:
        with _sigterm_interrupts():
            return int(args.func(args))
    except BlobError as exc:
        _fail(str(exc) or type(exc).__name__)
        return exc.exit_code
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except OSError as exc:
        _fail(_describe_os_error(exc))
        return 1
    except Terminated:
        _fail("terminated")
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        _fail("interrupted")
        return EXIT_INTERRUPTED
    except Exception as exc:
        if os.environ.get("BLOBHA_DEBUG"):
            traceback.print_exc()
        _fail(
            f"internal error: {type(exc).__name__}: {exc} (set BLOBHA_DEBUG=1 for a traceback"
            " and please report it)"
        )
        return InternalError.exit_code
