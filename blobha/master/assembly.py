"""The composition root: one master with the ways it is reached (the gRPC server, its health
service, metrics, the status page and the data channel), started and stopped in order."""

from __future__ import annotations

import logging

import grpc

from blobha.core.addresses import host_of, status_url
from blobha.core.auth import AuthMode
from blobha.core.errors import BlobError
from blobha.core.version import __version__
from blobha.master.config import Config, ConfigError, data_port
from blobha.master.edge.datachannel import DataChannelServer
from blobha.master.edge.gatekeeper import Gatekeeper
from blobha.master.edge.health import MasterHealth
from blobha.master.edge.metrics import MasterMetrics
from blobha.master.edge.service import add_to_server, new_server, translate_error
from blobha.master.edge.statuspage import StatusServer
from blobha.master.facade import Master
from blobha.wire.datatls import ReloadingServerContext

log = logging.getLogger("blobha.master")


class MasterServer:
    """A master as a process serves it. :meth:`start` brings the parts up in the order that
    lets a bad setting fail before anything registers in ZooKeeper; :meth:`stop` hands
    leadership over before it stops serving."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.master = Master(config)
        self.health = MasterHealth(self.master.zk)
        self.metrics = MasterMetrics(self.master.status)
        self.status_server: StatusServer | None = None
        self.server: grpc.Server | None = None
        self.datachannel: DataChannelServer | None = None
        self.gatekeeper: Gatekeeper | None = None

    def start(self) -> None:
        listen = self.config.metrics_listen
        if listen:
            # First, so a taken port fails the start before anything registers in ZooKeeper.
            try:
                self.status_server = StatusServer(self.master.status, listen, self.metrics)
            except OSError as e:
                raise ConfigError(f"cannot listen on metrics.listen {listen}: {e}") from None
        try:
            self.master.connect()
            self.health.start()
            self._serve()
            self.master.join()
        except (ConfigError, BlobError, OSError):
            self._stop_serving(grace=0)
            raise
        if self.status_server is not None:
            self.status_server.start()
            log.info("status page and metrics on %s", status_url(listen, self.master.identity))
        log.info("master %s reachable (blobha %s)", self.master.identity, __version__)

    def _serve(self) -> None:
        threads = self.config["master.rpc.threads"]
        self.gatekeeper = Gatekeeper(self.master.authentication,
                                     self.config["master.max.calls.per.client"], threads,
                                     receive_secs=self.config["master.request.receive.secs"],
                                     metrics=self.metrics.rpc)
        server = new_server(
            [self.gatekeeper],
            [("grpc.max_concurrent_streams", self.config["master.max.streams.per.connection"])],
            metrics=self.metrics.rpc,
            threads=threads,
        )
        add_to_server(self.master, server, self.health)
        listen = self.config["master.listen"]
        tls = self.master.server_tls
        try:
            if tls is not None:
                port = server.add_secure_port(listen, tls.credentials)
            else:
                port = server.add_insecure_port(listen)
        except RuntimeError:  # grpcio's "Failed to bind", the reason only in its log
            port = 0
        if port == 0:
            raise ConfigError(f"cannot listen on master.listen {listen}: the address is in"
                              " use (another master?) or not this host's")
        server.start()
        self.server = server
        asked = int(listen.rsplit(":", 1)[1])
        self._start_datachannel(host_of(listen),
                              data_port(self.config["blobstore.data.port"], port, asked))

    def _start_datachannel(self, host: str, port: int) -> None:
        if port < 0:
            return
        master = self.master
        s = master.settings
        tls = (ReloadingServerContext(s.tls_cert, s.tls_key, s.tls_ca,
                                      require_client_cert=s.auth_mode is AuthMode.MTLS)
               if master.server_tls is not None else None)
        datachannel = DataChannelServer(
            master.store, host, port, append=master.append,
            translate=lambda e: translate_error(master.identity, "an upload on the data channel",
                                                e),
            tls=tls, stage=master.stage_versions)
        try:
            datachannel.start()
        except OSError as e:
            raise ConfigError(f"cannot listen on blobstore.data.port {port} on {host}: {e}"
                              " (set another port, +N for the gRPC port plus N, 0 for any free"
                              " one, or -1 for none)") from None
        self.datachannel = datachannel
        master.channel.offers = datachannel
        log.info("data channel on port %d%s", datachannel.port, " (TLS)" if tls else "")

    def _stop_serving(self, grace: float) -> None:
        if self.server is not None:
            self.server.stop(grace).wait(grace + 1.0)
        if self.datachannel is not None:
            self.datachannel.stop()

    def stop(self) -> None:
        """Graceful stop: report NOT_SERVING, resign leadership at once, drain the calls in
        flight, then disconnect."""
        self.health.stop()
        self.master.resign()
        self._stop_serving(grace=2.0)
        self.master.stop()
        if self.status_server is not None:
            self.status_server.stop()
