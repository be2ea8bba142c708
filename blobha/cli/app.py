"""Running one command: gRPC's log level, credentials, signals, errors to exit statuses."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterator

from blobha.cli import servers
from blobha.cli.hints import describe
from blobha.cli.output import (
    EXIT_BROKEN_PIPE,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    EXIT_USAGE,
    Chatter,
    describe_os_error,
    error_object,
    fail,
    print_json,
    report,
    silence_stdout,
)
from blobha.cli.parser import UsageError, build_parser, check_args
from blobha.cli.profiles import WITHOUT_PROFILE, profile_environment
from blobha.core.errors import BlobError, InternalError
from blobha.core.profiles import ProfileError

#: Commands that run masters. Their gRPC log lines (a client's failed TLS handshake, say) are
#: how an operator sees the clients that cannot connect; local-cluster's masters inherit them.
_MASTER_COMMANDS = frozenset({"serve", "local-cluster"})


def quiet_grpc(command: str) -> None:
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


def _export_credentials(args: argparse.Namespace) -> None:
    # Through the environment, so every client this command builds (the node cache's too)
    # uses them, exactly as if the BLOBHA_* variables had been set.
    for option, env in (("tls_ca", "BLOBHA_CA"), ("tls_cert", "BLOBHA_CERT"),
                        ("tls_key", "BLOBHA_KEY"),
                        ("token_file", "BLOBHA_TOKEN_FILE")):
        value = getattr(args, option, None)
        if value:
            os.environ[env] = value
    if getattr(args, "require_tls", False):
        os.environ["BLOBHA_REQUIRE_TLS"] = "1"


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
    """Run the command line; returns the exit status (the table in blobha.cli's docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["spark-submit"]:
        quiet_grpc("spark-submit")
        try:
            # The launcher parses its own options: the profile is $BLOBHA_PROFILE's.
            with profile_environment(None):
                return servers.run_spark_submit(argv[1:])
        except ProfileError as exc:
            fail(str(exc))
            return EXIT_USAGE
        except BlobError as exc:
            fail(describe(exc, "spark-submit"))
            return exc.exit_code
    parser = build_parser()
    # Looked for before parsing: a usage error comes before there are any parsed arguments.
    as_json = "--json" in argv
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        return _usage_error(exc, as_json)
    except SystemExit as exc:  # argparse: --help, --version
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USAGE)
    as_json = bool(getattr(args, "json", False))
    profile = (contextlib.nullcontext() if args.command in WITHOUT_PROFILE
               else profile_environment(args.profile))
    try:
        with profile:
            # Checked with the profile in place: its timeout stands in for BLOBHA_TIMEOUT.
            return _run(args, as_json)
    except ProfileError as exc:
        # A usage error, said in one line: the file and the line to fix.
        report(EXIT_USAGE, str(exc), as_json)
        return EXIT_USAGE


def _run(args: argparse.Namespace, as_json: bool) -> int:
    try:
        check_args(args)
    except UsageError as exc:
        return _usage_error(exc, as_json)
    quiet = bool(getattr(args, "quiet", False))
    Chatter.set(progress=not (quiet or getattr(args, "no_progress", False)), notes=not quiet)
    quiet_grpc(args.command)
    _export_credentials(args)
    try:
        with _sigterm_interrupts():
            return int(args.func(args))
    except UsageError as exc:
        return _usage_error(exc, as_json)
    except BlobError as exc:
        report(exc.exit_code, describe(exc, args.command), as_json)
        return exc.exit_code
    except BrokenPipeError:
        silence_stdout()
        return EXIT_BROKEN_PIPE
    except OSError as exc:
        report(1, describe_os_error(exc), as_json)
        return 1
    except Terminated:
        report(EXIT_TERMINATED, "terminated", as_json)
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        report(EXIT_INTERRUPTED, "interrupted", as_json)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if os.environ.get("BLOBHA_DEBUG"):
            traceback.print_exc()
        report(
            InternalError.exit_code,
            f"internal error: {type(exc).__name__}: {exc} (set BLOBHA_DEBUG=1 for a traceback"
            " and please report it)",
            as_json,
        )
        return InternalError.exit_code


def _usage_error(exc: UsageError, as_json: bool) -> int:
    if as_json:
        print_json(error_object(EXIT_USAGE, exc.message))
    else:
        # As argparse itself prints it.
        exc.parser.print_usage(sys.stderr)
        print(f"{exc.parser.prog}: error: {exc.message}", file=sys.stderr)
    return EXIT_USAGE
