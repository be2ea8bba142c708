"""A standalone Spark cluster on this machine, started from the installed pyspark: one master
and N workers, each worker acting as its own node (its own work directory and ``HOME``, and so
its own node cache under ``~/.cache/blobha``) with no ``BLOBHA_*`` setting in its environment,
as a node of a real cluster has. The Spark tests and the ``spark_env_start`` benchmark run
their applications on it.

::

    with StandaloneSpark(Path("/tmp/spark"), workers=2) as spark:
        subprocess.run(["spark-submit", "--master", spark.url, "job.py"], check=True)
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["StandaloneSpark", "node_env", "spark_home"]

_REGISTER_SECS = 120.0
_STOP_SECS = 20.0


def spark_home() -> Path:
    """``$SPARK_HOME``'s equivalent for the installed pyspark package."""
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
    """The environment of a node's daemon: this machine's, less every blobha, PySpark and
    Spark setting, with its own ``HOME`` (so its own ``~/.cache/blobha``)."""
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

    def __init__(self, root: Path, workers: int = 2, worker_memory: str = "1g",
                 java_options: str = "") -> None:
        self.root = root
        self.workers = workers
        self.worker_memory = worker_memory
        #: JVM options of the master and worker daemons (not of the applications' JVMs).
        self.java_options = java_options
        self.master_port, self.ui_port, *self._worker_ports = _free_ports(2 + 2 * workers)
        self.url = f"spark://127.0.0.1:{self.master_port}"
        #: Each node's HOME; its work directory (executor logs, Spark's own copies) is beside.
        self.homes = [root / f"node-{i + 1}" / "home" for i in range(workers)]
        self._procs: list[subprocess.Popen[bytes]] = []

    def _start(self, name: str, args: list[str], env: dict[str, str]) -> None:
        if self.java_options:
            env = {**env, "SPARK_DAEMON_JAVA_OPTS": self.java_options}
        log = open(self.root / f"{name}.log", "wb")  # noqa: SIM115 - kept open for the child
        cmd = [str(spark_home() / "bin" / "spark-class"), *args]
        self._procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True))
        log.close()  # the child holds its own descriptor

    def state(self) -> dict[str, Any]:
        """The Spark master's JSON status page (workers, active and completed applications)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=5) as r:
            return dict(json.load(r))

    def _alive(self) -> bool:
        try:
            return int(self.state().get("aliveworkers", 0)) == self.workers
        except (OSError, ValueError):
            # ValueError: a master starting up has answered /json/ with its HTML page.
            return False

    def _master_alive(self) -> bool:
        try:
            return self.state().get("status") == "ALIVE"
        except (OSError, ValueError):
            return False

    def _wait(self, ready: Callable[[], bool], what: str, deadline: float) -> None:
        while not ready():
            if time.monotonic() > deadline or any(p.poll() is not None for p in self._procs):
                raise RuntimeError(f"{what} within {_REGISTER_SECS:.0f} s; see the logs in"
                                   f" {self.root}")
            time.sleep(0.2)

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + _REGISTER_SECS
        self._start("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                               "--port", str(self.master_port), "--webui-port",
                               str(self.ui_port)], node_env(self.root / "master-home"))
        # The workers only once the master leads: a worker that reaches it sooner is not
        # registered, and tries again only 5-15 s later.
        self._wait(self._master_alive, "the Spark master did not come up", deadline)
        for i, home in enumerate(self.homes):
            port, ui = self._worker_ports[2 * i], self._worker_ports[2 * i + 1]
            work = self.work_dir(i)
            work.mkdir(parents=True, exist_ok=True)
            self._start(f"worker-{i + 1}", [
                "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                "--port", str(port), "--webui-port", str(ui), "--work-dir", str(work),
                "--cores", "1", "--memory", self.worker_memory, self.url,
            ], node_env(home))
        self._wait(self._alive, f"{self.workers} Spark workers did not register", deadline)

    def work_dir(self, node: int) -> Path:
        """Node ``node``'s (0-based) Spark work directory: one directory per application."""
        return self.homes[node].parent / "work"

    def stop(self) -> None:
        for p in reversed(self._procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + _STOP_SECS
        for p in self._procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def node_stats(self) -> list[dict[str, int]]:
        """Each node's cache counters: those its default cache directory (under the node's
        HOME) keeps on disk for every process on the node ({} before its first use)."""
        out = []
        for home in self.homes:
            stats = home / ".cache" / "blobha" / "stats.json"
            out.append({k: int(v) for k, v in json.loads(stats.read_text()).items()}
                       if stats.exists() else {})
        return out

    def node_downloads(self) -> list[int]:
        """Each node's cache's download count (see node_stats)."""
        return [s.get("downloads", 0) for s in self.node_stats()]

    def logs(self) -> str:
        """The tail of every daemon's log, for a failure report."""
        return "\n".join(f"----- {p.name} -----\n" + p.read_text(errors="replace")[-4000:]
                         for p in sorted(self.root.glob("*.log")))

    def __enter__(self) -> StandaloneSpark:
        try:
            self.start()
        except BaseException:
            print(self.logs(), file=sys.stderr)
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is not None:
            print(self.logs(), file=sys.stderr)
        self.stop()
