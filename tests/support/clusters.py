"""Local clusters for the test tiers: settings that make failures show up fast enough for
tests (the real defaults are slower), and a cluster that prints its masters' last log lines
when the test using it fails."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from blobha.ops.localcluster import LocalCluster

SESSION_TIMEOUT_MS = 4000
FAST: dict[str, Any] = {
    "zookeeper.session.timeout.ms": SESSION_TIMEOUT_MS,
    "blobstore.upload.expiration.secs": 3,
    "blobstore.delete.grace.secs": 0.5,
    "blobstore.replica.grace.secs": 2.0,
    "blobstore.sync.period.secs": 5.0,
    "blobstore.disk.reserved.bytes": 0,
    # A stopping leader keeps its session 1 s by default, for its successor's first writes
    # at 100,000s of keys; test clusters hold a few, and stop 100s of leaders. The tests of
    # the linger set it.
    "master.stop.linger.secs": 0,
    "admins": ["admin"],
}


@contextmanager
def running_cluster(root: Path, nodes: int = 3, *, tls: bool = False, log_lines: int = 30,
                    **overrides: Any) -> Iterator[LocalCluster]:
    cluster = LocalCluster(root, nodes=nodes, base_port=0, overrides={**FAST, **overrides},
                           tls=tls)
    try:
        cluster.start()
        yield cluster
    except BaseException:
        for m in cluster.masters:
            try:
                tail = m.log_path.read_text(errors="replace").splitlines()[-log_lines:]
            except OSError:
                continue
            print(f"\n----- {m.address} -----\n" + "\n".join(tail))
        raise
    finally:
        cluster.stop()
