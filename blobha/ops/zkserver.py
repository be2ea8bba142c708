"""A real ZooKeeper server run as a child process, for ``blobha local-cluster`` and tests.

Nothing here imitates ZooKeeper: it finds the jars of an installed ZooKeeper (a tarball under
``ZOOKEEPER_HOME``, Debian's ``zookeeper`` package, or the copy shipped inside the ``pyspark``
wheel), writes a standalone ``zoo.cfg`` and runs ``QuorumPeerMain`` on the machine's Java.
With :class:`ServerTls` it serves TLS only (a ``secureClientPort`` and no plaintext port),
from PEM files, through ZooKeeper's Netty connection factory.

>>> with EmbeddedZooKeeper(Path("/tmp/zk")) as zk:  # doctest: +SKIP
...     client = KazooClient(zk.connect_string)
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import importlib.util
import os
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = [
    "DEFAULT_HEAP_MB",
    "HEAP_BYTES_PER_KEY",
    "EmbeddedZooKeeper",
    "JavaNotFound",
    "ServerTls",
    "ZooKeeperNotFound",
    "ZooKeeperStartError",
    "find_java",
    "find_zookeeper_classpath",
    "four_letter_word",
    "heap_mb_for",
    "tls_client_args",
]

MAIN_CLASS = "org.apache.zookeeper.server.quorum.QuorumPeerMain"

#: Debian's ``zookeeper`` package: its own directory, then the shared jar directory that holds
#: zookeeper.jar and its dependencies. Module-level so tests can point it elsewhere.
DEBIAN_DIRS: tuple[Path, ...] = (Path("/usr/share/zookeeper"), Path("/usr/share/java"))

_INSTALL_HINT = (
    "install one: 'apt-get install zookeeper' (Debian/Ubuntu), or 'pip install pyspark' (its"
    " wheel ships ZooKeeper), or unpack a ZooKeeper release and set ZOOKEEPER_HOME to it"
)


class ZooKeeperNotFound(RuntimeError):
    """No ZooKeeper jars were found; the message says what to install."""


class JavaNotFound(RuntimeError):
    """No Java runtime was found; the message says what to install."""


class ZooKeeperStartError(RuntimeError):
    """The server exited or did not answer in time; the message ends with its log tail."""

    def __init__(self, message: str, port_in_use: bool = False) -> None:
        super().__init__(message)
        self.port_in_use = port_in_use


# ---- locating ZooKeeper and Java ------------------------------------------------------------


def _has_zookeeper_jar(directory: Path) -> bool:
    # zookeeper-jute-*.jar and the contrib jars exist without the server classes, so only the
    # main jar counts: zookeeper.jar (Debian's symlink) or zookeeper-<version>.jar.
    if (directory / "zookeeper.jar").is_file():
        return True
    return any(
        Path(p).is_file() for p in glob.glob(glob.escape(str(directory)) + "/zookeeper-[0-9]*.jar")
    )


def _classpath(dirs: list[Path], first: list[Path] | None = None) -> str:
    entries = [str(p) for p in first or []] + [f"{d}/*" for d in dirs]
    return os.pathsep.join(entries)


def _debian_classpath(dirs: tuple[Path, ...]) -> str | None:
    existing = [d for d in dirs if d.is_dir()]
    if not any(_has_zookeeper_jar(d) for d in existing):
        return None
    # /usr/share/java holds several SLF4J bindings (nop among them) and the JVM expands a
    # wildcard in directory order, so ZooKeeper's log could end up silently discarded. Naming
    # slf4j-simple first makes it win: it logs to stderr, which is what ends up in our log file
    # and in the error raised when the server fails to start.
    first = [d / "slf4j-simple.jar" for d in existing if (d / "slf4j-simple.jar").is_file()][:1]
    return _classpath(existing, first)


def _home_classpath(home: Path) -> str | None:
    # Release tarball: lib/ holds every jar (or the main jar sits in the top directory of older
    # releases); conf/ carries the logging configuration.
    tar_dirs = [d for d in (home / "lib", home) if d.is_dir()]
    if any(_has_zookeeper_jar(d) for d in tar_dirs):
        conf = [home / "conf"] if (home / "conf").is_dir() else []
        return os.pathsep.join([*(str(c) for c in conf), _classpath(tar_dirs)])
    # Debian-like: the home is .../share/zookeeper and the jars are in the sibling java/ dir.
    return _debian_classpath((home, home.parent / "java"))


def _pyspark_jars_dir() -> Path | None:
    # find_spec locates the package without importing it (importing pyspark is slow and would
    # drag its dependencies into this process).
    try:
        spec = importlib.util.find_spec("pyspark")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        jars = Path(location) / "jars"
        if jars.is_dir():
            return jars
    return None


def find_zookeeper_classpath(zookeeper_home: str | None = None) -> str:
    """A Java classpath that runs a ZooKeeper server, or raise :class:`ZooKeeperNotFound`.

    Searched in order: ``zookeeper_home``, ``$ZOOKEEPER_HOME``, Debian's package, pyspark's
    jars. An explicitly given home that holds no ZooKeeper is an error, not a reason to fall
    back: the caller asked for that installation.
    """
    for source, home in (("zookeeper_home", zookeeper_home),
                         ("ZOOKEEPER_HOME", os.environ.get("ZOOKEEPER_HOME"))):
        if home:
            cp = _home_classpath(Path(home).expanduser())
            if cp is None:
                raise ZooKeeperNotFound(
                    f"{source}={home!r} holds no zookeeper jar (looked in lib/, the directory"
                    f" itself and ../java); point it at an unpacked ZooKeeper release, or unset"
                    f" it and {_INSTALL_HINT}"
                )
            return cp
    cp = _debian_classpath(DEBIAN_DIRS)
    if cp is not None:
        return cp
    jars = _pyspark_jars_dir()
    # pyspark's ZooKeeper needs snappy and friends from the same directory, hence the whole
    # directory rather than a hand-picked list.
    if jars is not None and _has_zookeeper_jar(jars):
        return _classpath([jars])
    raise ZooKeeperNotFound(f"no ZooKeeper installation found; {_INSTALL_HINT}")


def find_java() -> str:
    """Path of the ``java`` executable: ``$JAVA_HOME/bin/java``, else ``java`` on PATH."""
    java_home = os.environ.get("JAVA_HOME")
    if java_home:
        candidate = Path(java_home) / "bin" / "java"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("java")
    if found:
        return found
    where = f" (JAVA_HOME={java_home!r} has no bin/java)" if java_home else ""
    raise JavaNotFound(
        f"no Java runtime found{where}; ZooKeeper needs Java 11 or later:"
        " 'apt-get install openjdk-17-jre-headless', or set JAVA_HOME"
    )


# ---- the server -----------------------------------------------------------------------------


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def four_letter_word(host: str, port: int, word: str, timeout: float = 2.0,
                     context: ssl.SSLContext | None = None) -> str:
    """Send a ZooKeeper four-letter command and return the whole answer ('' if refused);
    over TLS with ``context`` (a secure client port)."""
    with socket.create_connection((host, port), timeout=timeout) as raw:
        s = context.wrap_socket(raw, server_hostname=host) if context else raw
        with s:
            s.sendall(word.encode("ascii"))
            parts: list[bytes] = []
            while chunk := s.recv(4096):
                parts.append(chunk)
    return b"".join(parts).decode("utf-8", "replace")


@dataclass(frozen=True)
class ServerTls:
    """PEM files of a server that serves TLS only: its certificate and key, and the CA its
    clients' certificates must be signed by. ``client_auth`` is ZooKeeper's ssl.clientAuth:
    'need' (its default: every client shows a certificate), 'want' or 'none'. The server's
    own certificate must be usable as a client certificate too: its probes present it."""

    cert: Path
    key: Path
    ca: Path
    client_auth: str = "need"

    def client_args(self) -> dict[str, Any]:
        """KazooClient arguments of a client trusting the CA and presenting the server's
        certificate (for tests and tools; masters have their own)."""
        return {"use_ssl": True, "ca": str(self.ca), "certfile": str(self.cert),
                "keyfile": str(self.key), "check_hostname": True}

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca))
        ctx.load_cert_chain(str(self.cert), str(self.key))
        return ctx


# Servers still running when the interpreter exits are stopped, so an aborted test run or a
# crashed local-cluster does not leave a JVM holding the port.
_LIVE: weakref.WeakSet[EmbeddedZooKeeper] = weakref.WeakSet()


#: The embedded server's heap unless told otherwise: enough for a test or a local cluster with
#: tens of thousands of keys.
DEFAULT_HEAP_MB = 512
#: What a key costs ZooKeeper's heap, as measured with 3 masters (its metadata znode and three
#: replica nodes, their watches, and the room a snapshot and a listing of every key take while
#: they are written): see docs/operations.md.
HEAP_BYTES_PER_KEY = 4096


def heap_mb_for(keys: int) -> int:
    """The heap a ZooKeeper holding ``keys`` keys of a 3-master cluster needs (MiB): the
    default, plus :data:`HEAP_BYTES_PER_KEY` per key."""
    return DEFAULT_HEAP_MB + -(-keys * HEAP_BYTES_PER_KEY // (1024 * 1024))


@atexit.register
def _stop_all() -> None:
    for zk in list(_LIVE):
        with contextlib.suppress(Exception):
            zk.stop()


def tls_client_args(connect_string: str) -> dict[str, Any]:
    """KazooClient arguments for reaching the embedded server of this process that serves
    ``connect_string`` (chroot allowed): its TLS client arguments, or none for a plaintext or
    unknown server. Lets tools that are handed only a connect string reach a TLS server."""
    address = connect_string.split("/", 1)[0]
    for zk in list(_LIVE):
        if zk.tls is not None and zk.port and zk.connect_string == address:
            return zk.tls.client_args()
    return {}


class EmbeddedZooKeeper:
    """A standalone ZooKeeper server in a child process, with its files in ``data_dir``.

    ``data_dir`` holds ``zoo.cfg``, ``zookeeper.log`` (the server's output) and ``data/`` (its
    snapshots and transaction log), so a stopped server restarted on the same directory keeps
    its znodes. ``port=0`` picks a free port once; a restart reuses it so clients reconnect.
    With ``tls`` that port is a secure client port, and the only one.
    """

    def __init__(
        self,
        data_dir: Path,
        port: int = 0,
        host: str = "127.0.0.1",
        zookeeper_home: str | None = None,
        tick_ms: int = 2000,
        tls: ServerTls | None = None,
        heap_mb: int = DEFAULT_HEAP_MB,
    ) -> None:
        if tick_ms < 1:
            raise ValueError(f"tick_ms must be positive, got {tick_ms}")
        if tls is not None and tls.client_auth not in ("need", "want", "none"):
            raise ValueError(f"client_auth must be need, want or none, got {tls.client_auth!r}")
        if heap_mb < 64:
            raise ValueError(f"heap_mb must be at least 64, got {heap_mb}")
        self.heap_mb = heap_mb
        self.tls = tls
        self.data_dir = Path(data_dir)
        self.host = host
        self.tick_ms = tick_ms
        self.zookeeper_home = zookeeper_home
        self._requested_port = port
        self._port = port
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    # ---- properties -------------------------------------------------------------------------

    @property
    def port(self) -> int:
        return self._port

    @property
    def connect_string(self) -> str:
        if not self._port:
            raise RuntimeError("the server has no port yet; call start() first")
        return f"{self.host}:{self._port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def log_path(self) -> Path:
        return self.data_dir / "zookeeper.log"

    @property
    def config_path(self) -> Path:
        return self.data_dir / "zoo.cfg"

    @property
    def min_session_timeout_ms(self) -> int:
        return 2 * self.tick_ms

    @property
    def max_session_timeout_ms(self) -> int:
        # ZooKeeper's default ceiling is 20 ticks, which with a short test tick would silently
        # clamp the 20 s sessions masters ask for; a minute covers every configuration we use.
        return max(60_000, 20 * self.tick_ms)

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # ---- life cycle -------------------------------------------------------------------------

    def _listen_config(self) -> list[str]:
        if self.tls is None:
            return [f"clientPort={self._port}", f"clientPortAddress={self.host}"]
        # ZooKeeper's PEM key store holds the key and its certificate in one file; written at
        # each start, so a renewed certificate is taken, and private as the key is.
        keystore = self.data_dir.resolve() / "keystore.pem"
        fd = os.open(keystore, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self.tls.key.read_bytes() + b"\n" + self.tls.cert.read_bytes())
        return [
            # No clientPort: nothing is served in clear, four-letter words included.
            f"secureClientPort={self._port}",
            f"secureClientPortAddress={self.host}",
            # Only Netty's connection factory serves TLS.
            "serverCnxnFactory=org.apache.zookeeper.server.NettyServerCnxnFactory",
            f"ssl.keyStore.location={keystore}",
            "ssl.keyStore.type=PEM",
            f"ssl.trustStore.location={self.tls.ca.resolve()}",
            "ssl.trustStore.type=PEM",
            f"ssl.clientAuth={self.tls.client_auth}",
        ]

    def _write_config(self) -> None:
        lines = [
            f"tickTime={self.tick_ms}",
            f"dataDir={self.data_dir.resolve() / 'data'}",
            *self._listen_config(),
            "admin.enableServer=false",
            "4lw.commands.whitelist=*",
            f"minSessionTimeout={self.min_session_timeout_ms}",
            f"maxSessionTimeout={self.max_session_timeout_ms}",
            # Tests and local clusters open many sessions from one address.
            "maxClientCnxns=0",
        ]
        tmp = self.config_path.with_name("zoo.cfg.tmp")
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
        os.replace(tmp, self.config_path)

    def start(self, timeout: float = 30) -> None:
        """Launch the server and return once it answers ``ruok``; idempotent while running.

        Raises :class:`ZooKeeperNotFound` / :class:`JavaNotFound` if it cannot be launched, and
        :class:`ZooKeeperStartError` (with the log tail) if it exits or stays silent.
        """
        with self._lock:
            if self.is_running():
                return
            java = find_java()
            classpath = find_zookeeper_classpath(self.zookeeper_home)
            self.data_dir.mkdir(parents=True, exist_ok=True)
            (self.data_dir / "data").mkdir(exist_ok=True)
            # An automatically chosen port can be taken between probing and binding; only then
            # is trying another port right (a fixed port the caller asked for must not move).
            attempts = 3 if self._requested_port == 0 and self._port == 0 else 1
            for attempt in range(attempts):
                if self._requested_port == 0 and self._port == 0:
                    self._port = _free_port(self.host)
                try:
                    self._launch(java, classpath, timeout)
                    return
                except ZooKeeperStartError as e:
                    if attempt + 1 < attempts and e.port_in_use:
                        self._port = 0
                        continue
                    raise

    def _launch(self, java: str, classpath: str, timeout: float) -> None:
        self._write_config()
        log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        cmd = [
            java,
            # Bounded: the JVM default (a quarter of RAM) adds up when a test run or a local
            # cluster starts several servers (see heap_mb_for for a store of many keys).
            f"-Xmx{self.heap_mb}m",
            # The JIT's first tier only: on a small shared machine the JIT's compiler threads
            # take much CPU from the masters beside the server, and small creates ran faster
            # overall with the first tier only, though ZooKeeper's own work got slower.
            "-XX:+IgnoreUnrecognizedVMOptions", "-XX:TieredStopAtLevel=1",
            # Keeps the log free of log4j-1 JMX warnings that hide the real error.
            "-Dzookeeper.jmx.log4j.disable=true",
            "-cp",
            classpath,
            MAIN_CLASS,
            str(self.config_path.resolve()),
        ]
        with open(self.log_path, "ab") as log:
            # A session of its own: a Ctrl-C aimed at the CLI or test runner is not delivered
            # to the server behind our back; stop() decides when it goes.
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.data_dir,
                start_new_session=True,
            )
        self._proc = proc
        _LIVE.add(self)
        try:
            self._wait_ready(proc, timeout, log_offset)
        except BaseException:
            self._terminate(proc)
            raise

    def command(self, word: str, timeout: float = 2.0) -> str:
        """A four-letter command to this server (``mntr``, ``wchs``...), over TLS if it
        serves TLS; the whole answer."""
        context = self.tls.client_context() if self.tls is not None else None
        return four_letter_word(self.host, self._port, word, timeout, context)

    def _answers(self) -> bool:
        try:
            if self.command("ruok", timeout=1.0) != "imok":
                return False
            # Another server could already own the port while ours is still starting (and
            # about to die on the bind); only our own data directory proves it is this one.
            conf = self.command("conf", timeout=1.0)
        except OSError:  # ssl.SSLError included: a server still starting its TLS
            return False
        expected = str(self.data_dir.resolve() / "data")
        return any(
            line.startswith("dataDir=") and line[len("dataDir="):].startswith(expected)
            for line in conf.splitlines()
        )

    def _wait_ready(self, proc: subprocess.Popen[bytes], timeout: float, log_offset: int) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise ZooKeeperStartError(
                    f"ZooKeeper exited with status {proc.returncode} while starting on"
                    f" {self.host}:{self._port}; log {self.log_path}:\n"
                    + self._log_tail(log_offset),
                    port_in_use="Address already in use" in self._log_text(log_offset),
                )
            if self._answers():
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ZooKeeperStartError(
                    f"ZooKeeper did not answer 'ruok' on {self.host}:{self._port} within"
                    f" {timeout:g} s; log {self.log_path}:\n" + self._log_tail(log_offset)
                )
            # Waiting on the process rather than sleeping notices a crash at once.
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=min(0.1, remaining))

    def _log_text(self, offset: int = 0) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode("utf-8", "replace")
        except OSError as e:
            return f"(log unreadable: {e})"

    def _log_tail(self, offset: int = 0, lines: int = 40) -> str:
        return "\n".join(self._log_text(offset).splitlines()[-lines:])

    def _terminate(self, proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()
        _LIVE.discard(self)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s; returns once the process is gone. Idempotent."""
        with self._lock:
            if self._proc is not None:
                self._terminate(self._proc)

    def kill(self) -> None:
        """SIGKILL the server (a crash, for tests) and reap it. Idempotent."""
        with self._lock:
            proc = self._proc
            if proc is None:
                return
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()
            _LIVE.discard(self)

    def __enter__(self) -> EmbeddedZooKeeper:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        return f"EmbeddedZooKeeper({self.host}:{self._port}, {state}, pid={self.pid})"
