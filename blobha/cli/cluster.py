"""The commands that look at the cluster: wait-replication, cluster and health."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import TYPE_CHECKING

from blobha.cli.connect import client_for
from blobha.cli.output import (
    describe_statuses,
    error_object,
    human_bytes,
    human_duration,
    print_json,
)
from blobha.core.errors import DeadlineExceeded

if TYPE_CHECKING:
    from blobha.client import ClusterSummary


def cmd_wait_replication(args: argparse.Namespace) -> int:
    with client_for(args) as c:
        result = c.wait_for_replication(args.keys, args.minimum, args.timeout)
    missed = None if result.reached else DeadlineExceeded(
        f"fewer than {args.minimum} replicas after {result.waited_secs:.0f} s:"
        f" {describe_statuses(result.statuses)}"
    )
    if args.json:
        # One object, the counts and any error together: a script sees which keys fell short.
        counts = [{"key": s.key, "version": s.version, "replication": s.replication,
                   "replication_factor": s.replication_factor} for s in result.statuses]
        error = error_object(missed.exit_code, str(missed)) if missed else {}
        print_json({"reached": result.reached, "waited_secs": round(result.waited_secs, 3),
                    "keys": counts, **error})
        return missed.exit_code if missed else 0
    for s in result.statuses:
        print(f"{s.key}\t{s.replication}\tversion {s.version}")
    if missed:
        raise missed
    return 0


def cmd_cluster(args: argparse.Namespace) -> int:
    with client_for(args) as c:
        summary = c.cluster_summary()
    print(json.dumps(_cluster_dict(summary), indent=2) if args.json else format_cluster(summary))
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    with client_for(args) as c:
        status = c.node_status(args.address)
    if args.json:
        print(json.dumps(dataclasses.asdict(status), indent=2))
    else:
        # The epoch is the term this master leads: a follower's would read as 0 (or as the
        # term it last led), which looks like a fault.
        role = f"leader epoch {status.epoch}" if status.is_leader else "follower"
        # Still "ok" (exit 0): the master answers and serves reads of what it holds, and a
        # health check that failed it would have every master restarted during a ZooKeeper
        # outage, which restarting cannot mend. The line says what it cannot do.
        cut_off = (": ZooKeeper unreachable, serving reads of what it holds and no writes"
                   if status.zookeeper_unreachable else "")
        print(f"ok {status.address} {role} blobs {status.blob_count}"
              f" lag {status.lag_blobs} up {status.uptime_secs:.0f}s{cut_off}")
    return 0


def format_cluster(summary: ClusterSummary) -> str:
    header = ("ADDRESS", "ROLE", "UPTIME", "VERSION", "BLOBS", "BYTES", "DISK FREE", "LAG")
    rows: list[tuple[str, ...]] = [header]
    for m in summary.masters:
        if not m.reachable:
            rows.append((m.address, "unreachable", "-", "-", "-", "-", "-", "-"))
            continue
        rows.append(
            (
                m.address,
                "leader" if m.is_leader else "follower",
                human_duration(m.uptime_secs),
                m.version or "-",
                str(m.blob_count),
                human_bytes(m.bytes_stored),
                human_bytes(m.disk_free),
                str(m.lag_blobs),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    ]
    blobs = "unknown" if summary.zookeeper_unreachable else str(summary.blob_count)
    lines.append(
        f"leader: {summary.leader or '(none)'}  epoch: {summary.epoch}"
        f"  blobs: {blobs}  under-replicated: {summary.under_replicated}"
    )
    if summary.zookeeper_unreachable:
        lines.append("ZooKeeper is unreachable from the master that answered: these are the"
                     " masters it last saw; writes wait until ZooKeeper is back")
    return "\n".join(lines)


def _cluster_dict(summary: ClusterSummary) -> dict[str, object]:
    return {
        "leader": summary.leader,
        "epoch": summary.epoch,
        # Unknown without ZooKeeper, not 0.
        "blob_count": None if summary.zookeeper_unreachable else summary.blob_count,
        "under_replicated": summary.under_replicated,
        "zookeeper_unreachable": summary.zookeeper_unreachable,
        "masters": [
            {
                "address": m.address,
                "role": "unreachable"
                if not m.reachable
                else ("leader" if m.is_leader else "follower"),
                "reachable": m.reachable,
                "is_leader": m.is_leader,
                "uptime_secs": m.uptime_secs,
                "version": m.version,
                "blob_count": m.blob_count,
                "bytes_stored": m.bytes_stored,
                "disk_free": m.disk_free,
                "lag_blobs": m.lag_blobs,
                "epoch": m.epoch,
                "zookeeper_unreachable": m.zookeeper_unreachable,
            }
            for m in summary.masters
        ],
    }
