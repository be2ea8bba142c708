"""The client a command talks through: the cluster it names, and the factory tests replace."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from blobha.cli.output import note
from blobha.core.errors import BlobError

if TYPE_CHECKING:
    # Imported when a command first needs a client (make_client), not with this module: gRPC
    # must not be loaded before main() has chosen its log level (app.quiet_grpc).
    from blobha.client import Client

DEFAULT_CLUSTER = "127.0.0.1:6627"
#: How long a command waits for the cluster without --timeout or BLOBHA_TIMEOUT.
DEFAULT_TIMEOUT = 60.0
#: How long a command goes on when no master answers at all (connection refused, no such
#: host): a wrong address or a stopped cluster is far likelier than a restart of every master.
UNREACHABLE_SECS = 3.0

#: Builds the client for a command; tests replace it with a fake (no network).
ClientFactory = Callable[[str, str | None], "Client"]


class _Wanted:
    """The --timeout of the command being run, for make_client (whose signature, that of
    ClientFactory, tests' factories share)."""

    timeout = DEFAULT_TIMEOUT


def make_client(cluster: str, user: str | None) -> Client:
    from blobha.client import Client

    # A negative timeout waits forever for replication; the calls keep the default.
    timeout = _Wanted.timeout if _Wanted.timeout > 0 else DEFAULT_TIMEOUT
    client = Client(cluster, user=user, timeout=timeout,
                    unreachable_after=min(UNREACHABLE_SECS, timeout))
    client.on_retry = say_retrying
    return client


def say_retrying(what: str, why: BlobError, left: float) -> None:
    note(f"blobha: still trying to {what} ({why}); giving up in {left:.0f} s")


#: Looked up on every call (not bound at import), so a replacement reaches every command.
client_factory: ClientFactory = make_client


def client_for(args: argparse.Namespace) -> Client:
    """The client for a command's ``--cluster`` (else ``$BLOBHA_CLUSTER``) and ``--user``; with
    ``--consistent``, reading linearizably."""
    cluster = args.cluster or os.environ.get("BLOBHA_CLUSTER") or DEFAULT_CLUSTER
    timeout = getattr(args, "timeout", None)
    _Wanted.timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    client = client_factory(cluster, args.user or None)
    if getattr(args, "consistent", False):
        client.consistency = "linearizable"
    return client
