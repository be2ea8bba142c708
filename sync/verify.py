"""The check a master makes of its own replica nodes before they count (ha-rule 6).

Replica nodes are persistent: a master's death removes its ``/masters`` and ``/holders`` nodes
(a few nodes, whatever it held), not one node per key it held, which every other master would
have had to hear of, one event each, before the next leader's first commit (failover grew by
about 0.05 s per 1,000 keys). The nodes stay; what stops counting is the master, at once.

When the master comes back (a restart, or a new session after a long partition), its nodes
may no longer be true: a wiped or replaced disk, a restored backup, a copy lost while no
session could record it. So before it announces ``/holders/<itself>`` it lists its own nodes
and removes each one whose version is not in its store. From then on it keeps them true as
before: it registers a version only once it is installed (ha-rule 7), and removes the node of
a copy it drops.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence

from kazoo.client import KazooClient
from kazoo.exceptions import KazooException, NoNodeError, UnimplementedError, ZookeeperError

from blobha.zk.connection import ReadResult, read_many
from blobha.zk.layout import BLOBSTORE, key_path, parse_replica

log = logging.getLogger("blobha.sync.synchronizer")

#: Replica lists read per multiRead request, and nodes removed per transaction.
READS_PER_REQUEST = 500
DELETES_PER_TXN = 200
#: Most replica nodes removed a second. Every other master hears of each removal through its
#: recursive watch, on the connection its commits and election use: a wiped master removing
#: 100,000s of nodes at ZooKeeper's full speed held up the leader's writes for seconds.
REMOVALS_PER_SEC = 10_000
#: multiRead requests in flight at once: enough to keep ZooKeeper busy, few enough that the
#: answers of 100,000s of keys are not all held in memory at once.
REQUESTS_IN_FLIGHT = 8


def _lists(zk: KazooClient, keys: Sequence[str], timeout: float) -> list[ReadResult]:
    """Each key's replica node names (or the error), in order: multiRead requests, or one
    read per key from a server older than 3.6."""
    try:
        return read_many(zk, [(key_path(k), True) for k in keys], READS_PER_REQUEST, timeout,
                         in_flight=REQUESTS_IN_FLIGHT)
    except UnimplementedError:
        pass
    out: list[ReadResult] = []
    for start in range(0, len(keys), READS_PER_REQUEST):
        reads = [zk.get_children_async(key_path(k))
                 for k in keys[start:start + READS_PER_REQUEST]]
        for r in reads:
            try:
                out.append(list(r.get(timeout=timeout)))
            except NoNodeError as e:
                out.append(e)
    return out


def own_nodes_to_remove(identity: str, keys: Sequence[str], lists: Sequence[ReadResult],
                        holds: Callable[[str, int], bool]) -> list[str]:
    """The paths of ``identity``'s replica nodes, among the replica ``lists`` read for
    ``keys``, whose version ``holds(key, seq)`` says the store lacks."""
    doomed: list[str] = []
    for key, names in zip(keys, lists, strict=True):
        if isinstance(names, NoNodeError):
            continue  # deleted meanwhile, with its replica nodes
        if not isinstance(names, list):
            raise names if isinstance(names, Exception) else ZookeeperError(
                f"unexpected multiRead answer for {key!r}")
        for name in names:
            parsed = parse_replica(name)
            if parsed is not None and parsed[0] == identity and not holds(key, parsed[1]):
                doomed.append(f"{key_path(key)}/{name}")
    return doomed


class CheckInterrupted(Exception):
    """The master stops during its check: its nodes are not all checked, it must not count."""


def _remove(zk: KazooClient, paths: list[str], stopping: threading.Event) -> None:
    started = time.monotonic()
    for start in range(0, len(paths), DELETES_PER_TXN):
        ahead = started + start / REMOVALS_PER_SEC - time.monotonic()
        if (ahead > 0 and stopping.wait(ahead)) or stopping.is_set():
            raise CheckInterrupted(f"stopped after removing {start} of {len(paths)} nodes")
        chunk = paths[start:start + DELETES_PER_TXN]
        txn = zk.transaction()
        for path in chunk:
            txn.delete(path)
        try:
            results = txn.commit()
            # commit() does not raise when an op fails: every element must be checked.
            if all(not isinstance(r, BaseException) for r in results):
                continue
        except KazooException:
            pass  # outcome unknown: one by one below (a node already gone is fine)
        for path in chunk:
            with contextlib.suppress(NoNodeError):
                zk.delete(path)


def check_own_nodes(zk: KazooClient, identity: str, holds: Callable[[str, int], bool],
                    timeout: float, stopping: threading.Event) -> tuple[int, int]:
    """Remove this master's replica nodes whose version its store lacks, at most
    :data:`REMOVALS_PER_SEC` a second: (keys looked at, nodes removed). Raises what ZooKeeper
    raised (the caller tries again), or :class:`CheckInterrupted` once ``stopping`` is set."""
    keys = zk.get_children(BLOBSTORE)
    lists = _lists(zk, keys, timeout)
    doomed = own_nodes_to_remove(identity, keys, lists, holds)
    if doomed:
        log.warning("removing %d replica node(s) of this master whose version is not on its"
                    " disk (a wiped or replaced data directory?); they are fetched again",
                    len(doomed))
        _remove(zk, doomed, stopping)
    return len(keys), len(doomed)


__all__ = ["CheckInterrupted", "check_own_nodes", "own_nodes_to_remove"]
