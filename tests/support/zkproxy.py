"""A TCP forwarder between one master and ZooKeeper that a test can hold: while held, no byte
passes either way and the connections stay open, as in a network partition of that master
alone (the other masters and ZooKeeper go on). Its ZooKeeper client sees no answer, suspends,
and its session expires on the server; the master serves reads from its last view."""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any

from blobha.ops.localcluster import LocalCluster, MasterProcess


class ZooKeeperProxy:
    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._passing = threading.Event()
        self._passing.set()
        # The master's requests alone (hold_requests): ZooKeeper's answers and watch events
        # still reach it.
        self._asking = threading.Event()
        self._asking.set()
        self._closed = False
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, name="zk-proxy", daemon=True).start()

    def hold(self) -> None:
        """Stop passing bytes, in both directions, on every connection, new ones included."""
        self._passing.clear()

    def hold_requests(self) -> None:
        """Stop passing the master's bytes to ZooKeeper only: what ZooKeeper sends (a watch
        event about a change) still arrives, and the master's reads and pings get no answer,
        so it soon finds ZooKeeper unreachable with the news in hand but not read."""
        self._asking.clear()

    def release(self) -> None:
        self._asking.set()
        self._passing.set()

    def close(self) -> None:
        self._closed = True
        self._passing.set()  # wakes every pump, which then sees the proxy closed
        self._asking.set()
        self._listener.close()
        with self._lock:
            for s in self._sockets:
                with contextlib.suppress(OSError):
                    s.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                near, _ = self._listener.accept()
            except OSError:
                return
            try:
                far = socket.create_connection(self._target, timeout=5)
                far.settimeout(None)
            except OSError:
                near.close()
                continue
            with self._lock:
                self._sockets += [near, far]
            for src, dst, gates in ((near, far, (self._passing, self._asking)),
                                    (far, near, (self._passing,))):
                threading.Thread(target=self._pump, args=(src, dst, gates),
                                 name="zk-proxy-pump", daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket,
              gates: tuple[threading.Event, ...]) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                for gate in gates:
                    gate.wait()  # held: the bytes wait here, never sent
                if self._closed:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


class ProxiedCluster(LocalCluster):
    """A local cluster whose every master reaches ZooKeeper through a proxy of its own
    (``proxies``, by master index), so a test can cut off any master, or all of them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.proxies: dict[int, ZooKeeperProxy] = {}
        super().__init__(*args, **kwargs)

    def write_config(self, m: MasterProcess) -> None:
        super().write_config(m)
        proxy = self.proxies.get(m.index)
        if proxy is None:
            proxy = self.proxies[m.index] = ZooKeeperProxy(self.zk.connect_string)
        text = m.config_path.read_text()
        m.config_path.write_text(text.replace(self.zk.connect_string, proxy.address))

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            for proxy in self.proxies.values():
                proxy.close()
