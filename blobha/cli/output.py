"""How the command line speaks: sizes, notes, one-line errors, exit codes (the progress bar:
blobha.cli.progress)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from blobha.client import ReplicationStatus

PROG = "blobha"
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141
EXIT_TERMINATED = 143

EXIT_CODES_EPILOG = """\
exit codes:
  0 success            1 other error / local file    2 usage error
  3 key not found      4 key already exists          5 not authorized
  6 invalid argument   7 not leader                  8 version conflict
  9 checksum mismatch  10 resource exhausted         11 unavailable
  12 deadline exceeded (and wait-replication not reached)
  13 upload lost       14 internal error             15 not authenticated
  16 TLS settings that the masters prove wrong (--ca; TLS on one side only)
  17 busy: the masters kept refusing the call, every call thread taken; retry later
  130 interrupted      141 broken pipe      143 terminated (SIGTERM)

environment: BLOBHA_CLUSTER (default for --cluster), BLOBHA_USER (default for --user),
  BLOBHA_ADDRESS_MAP (ADVERTISED=DIAL,... to reach masters through NAT or published ports)
  BLOBHA_CA, BLOBHA_CERT, BLOBHA_KEY, BLOBHA_TOKEN_FILE (defaults for --ca, --cert,
  --tls-key, --token-file), BLOBHA_TIMEOUT (default for --timeout), BLOBHA_PROFILE
  (default for --profile), BLOBHA_CONFIG (the profile file)
"""


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # unreachable; keeps the return type total


def human_duration(secs: float) -> str:
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


def iso(ts: float) -> str:
    if ts <= 0:
        return "-"
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds")


class Chatter:
    """What a command may say on stderr besides errors (--no-progress, --quiet); set by main()
    for each command."""

    progress = True
    notes = True

    @classmethod
    def set(cls, *, progress: bool, notes: bool) -> None:
        cls.progress, cls.notes = progress, notes


def note(message: str) -> None:
    """Chatter for people at a terminal; scripts read stdout and the exit status."""
    if Chatter.notes and sys.stderr.isatty():
        print(message, file=sys.stderr)


def fail(message: str) -> None:
    # One line, whatever the message holds: scripts grep it and logs keep it whole.
    text = " ".join(message.split()) or "unknown error"
    print(f"{PROG}: error: {text}", file=sys.stderr)


#: The "code" of a JSON error, by exit status: a name that says the class, stable for scripts.
ERROR_CODES = {
    1: "error", 2: "usage", 3: "key_not_found", 4: "key_already_exists",
    5: "not_authorized", 6: "invalid_argument", 7: "not_leader", 8: "version_conflict",
    9: "checksum_mismatch", 10: "resource_exhausted", 11: "unavailable",
    12: "deadline_exceeded", 13: "upload_lost", 14: "internal", 15: "not_authenticated",
    16: "tls_mismatch", 17: "busy", EXIT_INTERRUPTED: "interrupted",
    EXIT_TERMINATED: "terminated",
}


def error_object(exit_code: int, message: str) -> dict[str, object]:
    """What --json prints for an error: ``{"error": {"code", "exit", "message"}}``."""
    text = " ".join(message.split()) or "unknown error"
    return {"error": {"code": ERROR_CODES.get(exit_code, "error"), "exit": exit_code,
                      "message": text}}


def print_json(value: object, *, indent: int | None = None) -> None:
    print(json.dumps(value, indent=indent), flush=True)


def report(exit_code: int, message: str, as_json: bool) -> None:
    """An error, as one line on stderr or, with --json, as a JSON object on stdout."""
    if as_json:
        print_json(error_object(exit_code, message))
    else:
        fail(message)


def describe_os_error(exc: OSError) -> str:
    reason = exc.strerror or str(exc)
    if exc.filename is not None:
        return f"{exc.filename}: {reason}"
    return reason


def silence_stdout() -> None:
    # After EPIPE, the interpreter's final flush of stdout would fail again and print a
    # traceback; point stdout at /dev/null so shutdown stays quiet.
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def describe_statuses(statuses: Sequence[ReplicationStatus]) -> str:
    return ", ".join(
        f"{s.key} has {s.replication} (version {s.version}, factor {s.replication_factor})"
        for s in statuses
    )
