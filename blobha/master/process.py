"""The master process: ``blobha serve --config FILE`` runs one master until SIGTERM or SIGINT,
with its memory arenas and CPUs set as configured."""

from __future__ import annotations

import logging
import os
import signal
import threading

from blobha.core import logs
from blobha.core.affinity import pin_threads
from blobha.core.errors import BlobError
from blobha.master.assembly import MasterServer
from blobha.master.config import ConfigError, format_cpu_list, load_config, parse_cpu_list
from blobha.store.local import libc_function

log = logging.getLogger("blobha.master")


def _limit_malloc_arenas(arenas: int = 2) -> None:
    """Cap glibc's malloc arenas (before any thread starts). By default every thread that
    allocates may get an arena of its own, up to eight per core; a master runs dozens of
    threads (gRPC workers, sync fetchers, kazoo), and the memory freed by one thread's blob
    buffers stays fragmented in its arena, which showed as resident memory growing with the
    number of keys. A no-op off glibc."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return  # the operator chose
    mallopt = libc_function("mallopt")
    if mallopt is not None:
        m_arena_max = -8
        mallopt(m_arena_max, arenas)


def confine_to_cpus(text: str) -> frozenset[int]:
    """Run every thread of this process, and each it starts later, on the CPUs of the list
    ``text`` (``master.cpus``). Raises :class:`ConfigError` if the system offers no such
    control or the list names a CPU this process may not use."""
    wanted = parse_cpu_list(text)
    if not wanted:
        raise ConfigError("master.cpus names no CPU; leave it empty to run anywhere")
    if not hasattr(os, "sched_setaffinity"):
        raise ConfigError("master.cpus needs CPU affinity, which this system does not offer;"
                          " leave it empty")
    allowed = os.sched_getaffinity(0)
    if not wanted <= allowed:
        raise ConfigError(
            f"master.cpus {text!r} names CPU {format_cpu_list(wanted - allowed)}, which this"
            f" master may not use (it may use {format_cpu_list(allowed)}); pick from those"
            " or leave it empty")
    # A library may have started a thread already: every one is set.
    pin_threads(os.getpid(), wanted)
    return wanted


def serve_main(config_path: str | None) -> int:
    """``blobha serve --config FILE``: run one master until SIGTERM or SIGINT."""
    _limit_malloc_arenas()
    try:
        config = load_config(config_path)
    except ConfigError as e:
        print(f"blobha: configuration error: {e}", flush=True)
        return 2
    logs.configure(config["log.level"], config["log.format"], config.advertise)
    if config["audit.file"]:
        try:
            handler = logging.FileHandler(config["audit.file"])
        except OSError as e:
            log.error("cannot open audit.file %s: %s", config["audit.file"], e.strerror)
            return 1
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        logging.getLogger("blobha.audit").addHandler(handler)
    if config["master.cpus"]:
        try:
            cpus = confine_to_cpus(config["master.cpus"])
        except ConfigError as e:
            log.error("cannot start: %s", e)
            return 1
        log.info("running on CPU %s (master.cpus)", format_cpu_list(cpus))
    try:
        master = MasterServer(config)
        master.start()
    except (ConfigError, BlobError, OSError) as e:
        log.error("cannot start: %s", e)
        return 1
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    parent = os.environ.get("BLOBHA_EXIT_WITH_PARENT")
    if parent and parent.isdigit():
        threading.Thread(target=_exit_with_parent, args=(int(parent), stop), daemon=True).start()
    stop.wait()
    master.stop()
    return 0


def _exit_with_parent(pid: int, stop: threading.Event) -> None:
    """Stop when the process that started us is gone (a local cluster whose runner was
    killed must not leave masters behind)."""
    while not stop.wait(1.0):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            log.warning("parent process %d is gone; stopping", pid)
            stop.set()
        except PermissionError:
            pass
