"""The standard gRPC health service (``grpc.health.v1.Health``) of a master.

A master is SERVING while its ZooKeeper session is connected: then it answers reads, and writes
if it leads (or redirects them to the leader). While the connection is suspended or lost it
reports NOT_SERVING, so a load balancer or ``grpc_health_probe`` steers clients to another
master. The overall status ("") and the ``blobha.v1.BlobStore`` service report the same.
"""

from __future__ import annotations

import logging
import threading

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from kazoo.client import KazooClient, KazooState

from blobha.v1 import blobha_pb2 as pb

log = logging.getLogger("blobha.health")

BLOBSTORE_SERVICE = pb.DESCRIPTOR.services_by_name["BlobStore"].full_name
SERVICES = (health.OVERALL_HEALTH, BLOBSTORE_SERVICE)


class MasterHealth:
    def __init__(self, zk: KazooClient) -> None:
        self.zk = zk
        self.servicer = health.HealthServicer()
        for service in SERVICES:
            self.servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._changed = threading.Event()
        self._stopping = False
        self._last: int | None = None
        # Updates notify Watch streams, which must not happen on kazoo's event thread
        # (ha-rule 14): the listener only wakes this thread, which reads the current state.
        self._thread = threading.Thread(target=self._run, name="health", daemon=True)

    def add_to_server(self, server: grpc.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    def start(self) -> None:
        self.zk.add_listener(self._on_state)
        self._thread.start()
        self._changed.set()

    def stop(self) -> None:
        """Report NOT_SERVING for good (the master is shutting down)."""
        self._stopping = True
        self._changed.set()
        self.servicer.enter_graceful_shutdown()
        if self._thread.is_alive():
            self._thread.join(timeout=2)

    def status(self) -> int:
        return int(self._last if self._last is not None
                   else health_pb2.HealthCheckResponse.NOT_SERVING)

    def _on_state(self, state: str) -> None:
        self._changed.set()

    def _run(self) -> None:
        while True:
            self._changed.wait()
            self._changed.clear()
            if self._stopping:
                return
            serving = self.zk.state == KazooState.CONNECTED
            status = (health_pb2.HealthCheckResponse.SERVING if serving
                      else health_pb2.HealthCheckResponse.NOT_SERVING)
            if status != self._last:
                self._last = status
                log.info("health: %s", health_pb2.HealthCheckResponse.ServingStatus.Name(status))
                for service in SERVICES:
                    self.servicer.set(service, status)
