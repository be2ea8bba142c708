"""Anyone who reaches a master's data port can open connections to it without a ticket.
Connections that send nothing, or send slowly, take no transfer slot and no thread: a client
with a ticket is served over the data channel meanwhile, not sent to the slower gRPC stream."""

from __future__ import annotations

import os
import socket
import time

from support.harness import client_for, md, stub

from blobha.ops.localcluster import LocalCluster
from blobha.v1 import blobha_pb2 as pb
from blobha.wire.datachannel import receive

MiB = 1024 * 1024


def test_idle_connections_to_the_data_port_do_not_stop_transfers(
        cluster: LocalCluster) -> None:
    key = f"data-flood-{os.getpid()}"
    data = os.urandom(2 * MiB)
    with client_for(cluster, "alice") as alice:
        alice.create(key, data, acl="u:alice:rwa", replication_factor=3)
    address = cluster.leader().address

    def offer() -> pb.DownloadResponse:
        first, = stub(address).Download(
            pb.DownloadRequest(key=key, data_channel=True), metadata=md("alice"), timeout=10)
        assert first.ticket and first.data_port
        return first

    port = offer().data_port
    # More than the master's transfer slots and threads (64 each by default), and a few
    # that send a byte and stop, as a slow attacker would.
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(200)]
    for s in idle[:20]:
        s.sendall(b"B")
    try:
        for _ in range(3):
            start = time.monotonic()
            got = bytearray()
            o = offer()
            receive("127.0.0.1", o.data_port, o.ticket, len(data), 10.0, got.extend)
            assert bytes(got) == data
            assert time.monotonic() - start < 5
    finally:
        for s in idle:
            s.close()
