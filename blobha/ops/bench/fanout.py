"""``blobha bench --metrics fanout``: the fan-out harness (blobha.ops.bench.fanout_net) as a
benchmark group: N node caches fetching one blob at once, each host in a network namespace behind a
tc-shaped link. Root only; it needs no cluster (it starts its own, in namespaces)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from blobha.ops.bench.report import Metric, format_json, format_table

__all__ = ["FANOUT_NODES", "FANOUT_RATE_MBIT", "run_fanout_group"]

#: The issue's setting: 3 masters, 200 Mbit/s links; the node count of docs/benchmarks.md.
FANOUT_NODES = 8
FANOUT_RATE_MBIT = 200.0


def run_fanout_group(size_mib: int, as_json: bool, nodes: int = FANOUT_NODES,
                     rate_mbit: float = FANOUT_RATE_MBIT, peers: bool = True) -> int:
    """Run the harness once and print its figures as bench metrics; the exit status."""
    from blobha.ops.bench import fanout_net

    if os.geteuid() != 0:
        print("blobha: error: the fan-out benchmark builds network namespaces and shapes"
              " links with tc: run it as root (sudo blobha bench --metrics fanout)",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="blobha-bench-fanout-") as tmp:
        try:
            r = fanout_net.run_fanout(nodes, size_mib, rate_mbit, Path(tmp), peers=peers)
        except fanout_net.FanoutRefused as e:
            print(f"blobha: error: {e}", file=sys.stderr)
            return 2
    f = r.figures()
    egress = sum(r.master_egress_mib.values())
    metrics = [
        Metric("fanout_all_nodes_s", r.all_nodes_s, "s", "fanout_one_node_s", r.one_node_s),
        Metric("fanout_p50_node_s", f["p50_node_s"], "s", "fanout_one_node_s", r.one_node_s),
        Metric("fanout_max_node_s", f["max_node_s"], "s", "fanout_one_node_s", r.one_node_s),
        Metric("fanout_master_egress_mib", egress, "MiB", "blob_mib", float(size_mib)),
        Metric("fanout_from_peers_mib", r.peer_mib, "MiB", "bytes_fetched_mib",
               float(nodes * size_mib)),
    ]
    metrics += [Metric(f"fanout_egress_{m}_mib", v, "MiB", "blob_mib", float(size_mib))
                for m, v in sorted(r.master_egress_mib.items())]
    if as_json:
        print(format_json(metrics))
    else:
        print(f"blobha bench fanout: {nodes} nodes, {size_mib} MiB, {rate_mbit:g} Mbit/s"
              f" links, 3 masters, peers {'on' if peers else 'off'}")
        print(format_table(metrics))
    return 0
