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

#: Builds the client for a command; tests replace it with a fake (no network).
ClientFactory = Callable[[str, str | None], "Client"]


def make_client(cluster: str, user: str | None) -> Client:
    from blobha.client import Client

    client = Client(cluster, user=user)
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
    client = client_factory(cluster, args.user or None)
    if getattr(args, "consistent", False):
        client.consistency = "linearizable"
    return client
