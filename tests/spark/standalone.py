"""A real standalone Spark cluster on this machine, started from the installed pyspark: one
master and N workers, each worker acting as its own node (its own work directory, HOME and so
node cache) with no BLOBHA_* setting in its environment, as a node of a real cluster has."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from waiting import wait_until

from blobha.ops.localcluster import LocalCluster


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def node_env(home: Path) -> dict[str, str]:
    """The environment of a node's daemon: this machine's, less every blobha setting, with
    its own HOME (so its own ~/.cache/blobha)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("BLOBHA_", "PYSPARK_", "SPARK_"))}
    home.mkdir(parents=True, exist_ok=True)
    env.update(HOME=str(home), SPARK_HOME=str(spark_home()), SPARK_DAEMON_MEMORY="256m",
               SPARK_LOG_DIR=str(home / "logs"), SPARK_NO_DAEMONIZE="1")
    # blobha is installed on every node, its commands (blobha-python) on the PATH.
    scripts = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([scripts, *(p for p in env.get("PATH", "").split(os.pathsep)
                                              if p and p != scripts)])
    return env


class StandaloneSpark:
    """``with StandaloneSpark(root, workers=2) as spark:`` ... ``spark.url``."""

    def __init__(self, root: Path, workers: int = 2, worker_memory: str = "1g") -> None:
        self.root = root
        self.workers = workers
        self.worker_memory = worker_memory
        self.master_port, self.ui_port, *self._worker_ports = _free_ports(2 + 2 * workers)
        self.url = f"spark://127.0.0.1:{self.master_port}"
        self.homes = [root / f"node-{i + 1}" / "home" for i in range(workers)]
        self._procs: list[subprocess.Popen[bytes]] = []

    def _start(self, name: str, args: list[str], env: dict[str, str]) -> None:
        log = open(self.root / f"{name}.log", "wb")  # noqa: SIM115 - kept open for the child
        cmd = [str(spark_home() / "bin" / "spark-class"), *args]
        self._procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True))

    def state(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=5) as r:
            return dict(json.load(r))

    def _alive(self) -> bool:
        try:
            return int(self.state().get("aliveworkers", 0)) == self.workers
        except OSError:
            return False

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._start("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                               "--port", str(self.master_port), "--webui-port",
                               str(self.ui_port)], node_env(self.root / "master-home"))
        for i, home in enumerate(self.homes):
            port, ui = self._worker_ports[2 * i], self._worker_ports[2 * i + 1]
            work = home.parent / "work"
            work.mkdir(parents=True, exist_ok=True)
            self._start(f"worker-{i + 1}", [
                "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                "--port", str(port), "--webui-port", str(ui), "--work-dir", str(work),
                "--cores", "1", "--memory", self.worker_memory, self.url,
            ], node_env(home))
        wait_until(self._alive, 120, f"{self.workers} Spark workers to register")

    def stop(self) -> None:
        for p in reversed(self._procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for p in self._procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def node_downloads(self) -> list[int]:
        """Each node's cache's download count: the counters its default cache directory (under
        the node's HOME) keeps on disk for every process on the node."""
        counts = []
        for home in self.homes:
            stats = home / ".cache" / "blobha" / "stats.json"
            counts.append(int(json.loads(stats.read_text())["downloads"]) if stats.exists() else 0)
        return counts

    def logs(self) -> str:
        return "\n".join(f"----- {p.name} -----\n" + p.read_text(errors="replace")[-4000:]
                         for p in sorted(self.root.glob("*.log")))

    def __enter__(self) -> StandaloneSpark:
        try:
            self.start()
        except BaseException:
            print(self.logs())
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is not None:
            print(self.logs())
        self.stop()


def master_downloads(cluster: LocalCluster) -> int:
    """Downloads the masters served, all told, from their metrics: a node cache's fetch of a
    blob is one, and so is a master's copy of a blob it syncs; a refused read is none."""
    total = 0.0
    for m in cluster.masters:
        with urllib.request.urlopen(m.status_url + "metrics", timeout=10) as r:
            text = r.read().decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if (s.name == "grpc_server_handled_total"
                        and s.labels.get("grpc_method") == "Download"
                        and s.labels.get("grpc_code") == "OK"):
                    total += s.value
    return int(total)
