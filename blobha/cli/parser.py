"""The command line's grammar: every command, its options and their checks."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import NoReturn

from blobha.cli import admin, blobs, cluster, completion, servers
from blobha.cli.connect import DEFAULT_CLUSTER, DEFAULT_TIMEOUT, UNREACHABLE_SECS
from blobha.cli.examples import epilog
from blobha.cli.output import EXIT_CODES_EPILOG, PROG
from blobha.core import settings
from blobha.core.addresses import parse_cluster
from blobha.core.auth import MODES
from blobha.core.errors import InvalidArgument

DEFAULT_BASE_PORT = 6627
_UINT32_MAX = 2**32 - 1


class UsageError(Exception):
    """A bad command line, raised instead of printed so that --json can print it as JSON."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser
        self.message = message


class _Parser(argparse.ArgumentParser):
    # Subparsers are made of the same class (add_subparsers' default), so every usage error,
    # check_args' too, comes to main() as a UsageError.
    def error(self, message: str) -> NoReturn:
        raise UsageError(self, message)


class _Unlisted:
    """An argument group whose arguments work but are left out of the help."""

    def __init__(self, group: argparse._ArgumentGroup) -> None:
        self._group = group

    def add_argument(self, *names: str, **kwargs: object) -> argparse.Action:
        kwargs["help"] = argparse.SUPPRESS
        return self._group.add_argument(*names, **kwargs)  # type: ignore[arg-type]


def _positive_int(text: str) -> int:
    try:
        value = settings.whole(text)
    except settings.SettingError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 1 <= value <= _UINT32_MAX:
        # The wire carries these as 32-bit counts: a larger one would fail deep in protobuf.
        raise argparse.ArgumentTypeError(f"expected 1 to {_UINT32_MAX}, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        return settings.real(text)
    except settings.SettingError:
        raise argparse.ArgumentTypeError(
            f"expected a number of seconds, got {text!r} (a negative number waits forever)"
        ) from None


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of Mbit/s, got {text!r}")
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
    if suppress:
        # Accepted after a command too, but listed once, in "blobha --help".
        group = _Unlisted(group)  # type: ignore[assignment]
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
    group.add_argument("--tls-key", metavar="FILE", default=default, dest="tls_key",
                       help="private key of --cert (default: $BLOBHA_KEY)")
    # The old spelling, kept working but unlisted: beside commands taking a KEY, "--key"
    # read as the blob's key.
    group.add_argument("--key", metavar="FILE", default=default, dest="tls_key",
                       help=argparse.SUPPRESS)
    group.add_argument("--token-file", metavar="FILE", default=default,
                       help="file holding your token (default: $BLOBHA_TOKEN_FILE)")
    group.add_argument("--require-tls", action="store_true", default=default,
                       help="refuse to talk to the cluster without TLS, so that a token is"
                       " never sent in clear (default: $BLOBHA_REQUIRE_TLS)")
    group.add_argument("--profile", metavar="NAME", default=default,
                       help="the client profile whose settings stand in for unset BLOBHA_*"
                       " variables (default: $BLOBHA_PROFILE, else [default] of"
                       " $BLOBHA_CONFIG or ~/.config/blobha/client.toml)")
    group.add_argument("--no-progress", action="store_true", default=default,
                       help="no progress bar on a terminal")
    group.add_argument("-q", "--quiet", action="store_true", default=default,
                       help="nothing on stderr but errors: no progress bar, no notes")
    group.add_argument("--timeout", type=_seconds, default=default, metavar="SECONDS",
                       help="how long to wait for the cluster: for a leader, for a call, for"
                       " wait-replication (default: $BLOBHA_TIMEOUT, else 60; negative: wait"
                       " forever, for replication only). When no master answers at all, a"
                       f" command gives up after {UNREACHABLE_SECS:g} s")
    group.add_argument("--json", action="store_true", default=default,
                       help="print the result as JSON on stdout, and any error as"
                       ' {"error": {"code", "exit", "message"}} there too')


def _add_consistent(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--consistent", action="store_true",
        help="read the latest committed version, confirmed with ZooKeeper (fails, exit 11,"
        " when no master can confirm it, instead of answering from a master's last view)")


def _add_upload_options(p: argparse.ArgumentParser, verb: str) -> None:
    """The options of ``create`` and ``put`` (which applies the ACL and factor only when it
    creates the key)."""
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
        help=f"after the {verb}, wait until N masters hold the blob",
    )
    p.add_argument(
        "--write-quorum",
        type=_positive_int,
        default=0,
        metavar="W",
        help=f"masters that must hold the data before the {verb} returns (default: cluster's)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Command line of blobha, a highly available replicated blob store.",
        epilog=EXIT_CODES_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    _add_global_options(parser, suppress=False)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(
        name: str, help_text: str, func: Callable[[argparse.Namespace], int],
        aliases: tuple[str, ...] = (),
    ) -> argparse.ArgumentParser:
        sub = commands.add_parser(
            name,
            aliases=list(aliases),
            help=help_text,
            description=help_text,
            epilog=epilog(name),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        _add_global_options(sub, suppress=True)
        sub.set_defaults(func=func, parser=sub)
        return sub

    p = command("create", "create a blob from a file or stdin", blobs.cmd_create)
    _add_upload_options(p, "create")

    p = command("put", "create a blob or write its next version, from a file or stdin",
                blobs.cmd_put)
    _add_upload_options(p, "put")

    p = command("update", "write a new version of a blob from a file or stdin",
                blobs.cmd_update)
    p.add_argument("key", metavar="KEY")
    p.add_argument("-f", "--file", metavar="FILE", help="read the content from FILE (- = stdin)")

    p = command("cat", "write a blob to stdout or a file", blobs.cmd_cat)
    p.add_argument("key", metavar="KEY")
    p.add_argument(
        "-f", "--file", metavar="FILE", help="write to FILE (replaced only when complete)"
    )
    _add_consistent(p)

    p = command(
        "fetch", "put blobs in this node's cache (once per node) and print their paths (each"
        " one tried; the status is the first failure's)", blobs.cmd_fetch
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

    p = command("delete", "delete blobs (each one tried; the status is the first failure's)",
                blobs.cmd_delete)
    p.add_argument("keys", metavar="KEY", nargs="+")

    p = command("list", "list keys (only the given ones that exist, if any)", blobs.cmd_list)
    p.add_argument("keys", metavar="KEY", nargs="*")
    p.add_argument("--prefix", default="", metavar="P", help="only keys starting with P")
    p.add_argument("-l", "--long", action="store_true",
                   help="one line per key: key, version, size, updated (UTC), replication")

    p = command("meta", "show a blob's metadata (alias: stat)", blobs.cmd_meta,
                aliases=("stat",))
    p.add_argument("key", metavar="KEY")
    _add_consistent(p)

    p = command("set-acl", "replace a blob's access list", admin.cmd_set_acl)
    p.add_argument("key", metavar="KEY")
    p.add_argument(
        "-s", "--set", dest="acl", metavar="ACL[,ACL...]",
        help="the new ACL (without it, the current one is set again, as in Storm)",
    )

    p = command("replication", "read or change a blob's replication", admin.cmd_replication)
    p.add_argument("key", metavar="KEY")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--read", action="store_true", help="print the current replica count")
    mode.add_argument("--update", action="store_true", help="change the replication factor")
    p.add_argument("-r", "--replication-factor", type=_positive_int, metavar="N")
    _add_consistent(p)

    p = command(
        "wait-replication", "wait until blobs have at least N replicas",
        cluster.cmd_wait_replication,
    )
    p.add_argument("keys", metavar="KEY", nargs="+")
    p.add_argument("--min", type=_positive_int, required=True, metavar="N", dest="minimum")

    p = command("cluster", "show the masters and the leader", cluster.cmd_cluster)

    p = command("health", "check that one master answers (for health checks)",
                cluster.cmd_health)
    p.add_argument("address", nargs="?", default="127.0.0.1:6627", metavar="HOST:PORT",
                   help="the master to ask (default 127.0.0.1:6627)")

    p = command("serve", "run a master", servers.cmd_serve)
    p.add_argument("--config", required=True, metavar="FILE", help="the master's TOML file")

    p = command("local-cluster", "run ZooKeeper and N masters on this machine",
                servers.cmd_local_cluster)
    p.add_argument("--nodes", type=_positive_int, default=3, metavar="N")
    p.add_argument("--data-dir", metavar="DIR",
                   help="where to keep data; kept across runs (default: ./blobha-local)")
    p.add_argument("--base-port", type=_port, default=DEFAULT_BASE_PORT, metavar="PORT",
                   help="first master's port; the others follow (0 = any free ports)")
    p.add_argument("--zookeeper-home", metavar="DIR", help="a ZooKeeper installation to use")
    p.add_argument("--tls", action="store_true",
                   help="secure set-up: a throwaway CA, TLS everywhere, token authentication"
                   " (unless --auth says otherwise) and ZooKeeper locked down to the masters")
    p.add_argument("--auth", choices=MODES, default=None,
                   help="authentication (default: token with --tls, else simple; mtls needs"
                   " --tls)")

    p = command("token", "make tokens for auth.mode = 'token'; issue and revoke job tokens",
                admin.cmd_token)
    p.add_argument("action", choices=("create", "hash", "job", "revoke"),
                   help="create: a new token for USER and its token-file line; hash: the"
                   " token-file line for a token read from stdin; job: a job token reading"
                   " only KEY... (from the leader); revoke: revoke a job token")
    p.add_argument("names", nargs="*", metavar="USER|KEY|TOKEN_OR_ID",
                   help="create: whose token; job: the keys it may read; revoke: the job token"
                   " or its id")
    p.add_argument("--append", metavar="TOKEN_FILE",
                   help="append the line to this token file (the masters' auth.token.file)")
    p.add_argument("--out", metavar="FILE",
                   help="create, job: write the new token to FILE (mode 600) instead of"
                   " stdout")
    p.add_argument("--lifetime", type=_positive_int, default=0, metavar="SECONDS",
                   help="job: how long the token works (default 24 hours; the cluster caps it"
                   " at auth.job.token.max.lifetime.secs)")

    p = command("admin", "cluster administration by an admin: rotate-secret replaces the"
                " secret the masters prove themselves to each other with", admin.cmd_admin)
    p.add_argument("action", choices=("rotate-secret",),
                   help="rotate-secret: a new cluster secret (the leader writes it; every"
                   " master still accepts the old one for twice its ZooKeeper session timeout)")

    p = command("completion", "print the shell completion script for bash or zsh",
                completion.cmd_completion)
    p.add_argument("shell", choices=completion.SHELLS, metavar="bash|zsh")
    # The script is made from this very parser.
    p.set_defaults(root=parser)

    # Listed for --help; main() hands the arguments to blobha.spark.submit_main directly.
    p = command("spark-submit", "wait for blobs' replication, then run spark-submit"
                " (blobha spark-submit --help)", servers.cmd_spark_submit)
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)

    p = command("bench", "measure this cluster against same-run baselines", servers.cmd_bench)
    p.add_argument("--local", action="store_true",
                   help="start a throw-away local cluster (needed for failover, scale and the"
                        " TLS comparison)")
    p.add_argument("--tls", action="store_true",
                   help="with --local: the cluster serves TLS (token authentication), so every"
                        " figure is measured over TLS")
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
                        " replication_latency_ms, small_ops_per_s, upload_w2_mbps,"
                        " upload_w2_apart_mbps, small_ops_w2_per_s, replication_latency_w2_ms,"
                        " upload_tls_mbps, download_tls_mbps, spark, spark_env_start,"
                        " failover_term_s, failover_kill_s, failover_kill_restart_s, scale"
                        " (default: all); fanout only when named, alone (see --fanout)")
    p.add_argument("--spark-size-mb", type=_positive_int, default=256, metavar="MIB",
                   help="size of the blob every Spark executor gets, and every node of"
                        " --fanout (default 256)")
    p.add_argument("--fanout", action="store_true",
                   help="the fan-out benchmark (root only; alone, as --metrics fanout): N node"
                        " caches fetch one blob at once, every host in a network namespace of"
                        " its own behind a tc-shaped link")
    p.add_argument("--nodes", type=_positive_int, default=8, metavar="N",
                   help="with --fanout: node caches (default 8)")
    p.add_argument("--rate-mbit", type=_rate, default=200.0, metavar="MBIT",
                   help="with --fanout: every link's rate, Mbit/s (default 200)")
    p.add_argument("--no-peers", action="store_true",
                   help="with --fanout: the caches do not serve each other (the baseline)")
    p.add_argument("--spark-env-size-mb", type=_positive_int, default=320, metavar="MIB",
                   help="size of the packed Python environment of spark_env_start"
                        " (default 320)")
    p.add_argument("--spark-java-options", default="", metavar="OPTS",
                   help="JVM options for every Spark JVM of spark and spark_env_start (drivers,"
                        " executors, the standalone cluster's daemons), both sides alike; with"
                        " an equals sign: --spark-java-options=-XX:TieredStopAtLevel=1"
                        " (default none)")
    p.add_argument("--session-timeout-ms", type=_positive_int, default=None, metavar="MS",
                   help="with --local: the ZooKeeper session timeout of the clusters the run"
                        " starts, which failover_kill_s waits out and is set against"
                        " (default 6000; at least 1000)")
    p.add_argument("--zookeeper", metavar="HOST:PORT",
                   help="a remote cluster's ZooKeeper, for the ZooKeeper baselines")
    p.add_argument("--baseline-dir", metavar="DIR",
                   help="where the disk baselines write for a remote cluster (default: a"
                        " temporary directory)")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Constraints argparse cannot express; reported as usage errors (exit 2)."""
    if args.command == "token":
        _check_token_args(args)
    if args.command == "local-cluster" and args.auth == "mtls" and not args.tls:
        args.parser.error("--auth mtls needs --tls")
    if getattr(args, "cluster", None):
        # A typo in an option is a usage error like any other (exit 2), found before the
        # command starts; the BLOBHA_CLUSTER variable is checked when the client is built.
        try:
            parse_cluster(args.cluster)
        except InvalidArgument as exc:
            args.parser.error(f"--cluster: {exc}")
    if args.timeout is None:
        args.timeout = _env_timeout(args.parser)
    if args.command == "cat" and args.json and args.file in (None, "-"):
        args.parser.error("--json needs -f FILE: the blob itself goes to stdout otherwise")
    if getattr(args, "file", None) == "":
        # Otherwise the empty name reaches the file system as the current directory.
        args.parser.error("-f/--file needs a file name (or - for standard input/output)")
    if args.command == "replication":
        if args.update and args.replication_factor is None:
            args.parser.error("--update needs --replication-factor N")
        if args.read and args.replication_factor is not None:
            args.parser.error("--replication-factor goes with --update, not --read")


def _env_timeout(parser: argparse.ArgumentParser) -> float:
    text = os.environ.get("BLOBHA_TIMEOUT", "")
    if not text:
        return DEFAULT_TIMEOUT
    try:
        return _seconds(text)
    except argparse.ArgumentTypeError as exc:
        parser.error(f"BLOBHA_TIMEOUT: {exc}")


def _check_token_args(args: argparse.Namespace) -> None:
    action, names = args.action, args.names
    args.token_user = names[0] if action == "create" and names else None
    if action == "create" and len(names) != 1:
        args.parser.error("'token create' needs the USER the token is for (one)")
    if action == "hash" and (names or args.out):
        args.parser.error("'token hash' reads the token from stdin; it takes no USER or --out")
    if action == "job" and not names:
        args.parser.error("'token job' needs the KEY... the job token may read")
    if action == "revoke" and len(names) != 1:
        args.parser.error("'token revoke' needs one TOKEN_OR_ID")
    if action == "revoke" and args.out:
        args.parser.error("'token revoke' takes no --out")
    if action in ("job", "revoke") and args.append:
        args.parser.error(f"'token {action}' takes no --append (job tokens live in"
                          " ZooKeeper, not in the masters' token file)")
    if action != "job" and args.lifetime:
        args.parser.error("--lifetime goes with 'token job'")


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("blobha")
    except Exception:  # not installed: running from a source tree
        return "unknown"
