"""The commands that run more than a client: serve, local-cluster, spark-submit and bench.

Their work lives in the master, in blobha.spark and in blobha.ops, found by name when a command
runs (:data:`IMPLEMENTATIONS`).
"""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Callable
from typing import Any

from blobha.cli.output import EXIT_USAGE
from blobha.core.errors import InternalError

#: Where each command's work lives, ``module:function``, and what it does (for the error when
#: it cannot be loaded). Looked up by name when the command runs: the client commands must work
#: where the master's dependencies (or the master itself) are absent, and must not pay for
#: importing them; and blobha.ops sits above the command line, which must never import it.
IMPLEMENTATIONS: dict[str, tuple[str, str]] = {
    "serve": ("blobha.master.process:serve_main", "start a master"),
    "local-cluster": ("blobha.ops.localcluster:main", "start a local cluster"),
    "spark-submit": ("blobha.spark:submit_main", "launch spark-submit (install 'blobha[spark]')"),
    "bench": ("blobha.ops.bench:main", "run the benchmark"),
}


def implementation(command: str) -> Any:
    """The function that does ``command``'s work, imported now; InternalError if it cannot be."""
    target, purpose = IMPLEMENTATIONS[command]
    module, _, name = target.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise InternalError(f"cannot {purpose}: {exc}") from None


def cmd_serve(args: argparse.Namespace) -> int:
    serve_main: Callable[[str], int] = implementation("serve")
    return int(serve_main(args.config))


def cmd_local_cluster(args: argparse.Namespace) -> int:
    run: Callable[..., int] = implementation("local-cluster")
    return int(run(args.nodes, args.data_dir, args.base_port, args.zookeeper_home,
                   tls=args.tls, auth=args.auth))


def run_spark_submit(argv: list[str]) -> int:
    """``blobha spark-submit ARGS``: the launcher parses its arguments (ours, then
    spark-submit's after "--") itself; argparse would read spark-submit's options as blobha's."""
    submit: Callable[[list[str]], int] = implementation("spark-submit")
    return int(submit(argv))


def cmd_spark_submit(args: argparse.Namespace) -> int:
    # Reached only when global options came first; the launcher takes its own --cluster/--user.
    args.parser.error("put 'spark-submit' first: blobha spark-submit [--cluster ...] ... -- ...")
    return EXIT_USAGE


def cmd_bench(args: argparse.Namespace) -> int:
    run: Callable[..., int] = implementation("bench")
    cluster = None if args.local else (args.cluster or os.environ.get("BLOBHA_CLUSTER"))
    return int(run(
        cluster, args.local, args.json, count=args.count, size_mb=args.size_mb,
        small_ops_seconds=args.small_ops_seconds, scale_keys=args.scale_keys,
        repeat=args.repeat, metrics="fanout" if args.fanout else args.metrics,
        zookeeper=args.zookeeper, baseline_dir=args.baseline_dir,
        spark_size_mb=args.spark_size_mb, spark_env_size_mb=args.spark_env_size_mb,
        tls=args.tls, fanout_nodes=args.nodes, fanout_rate_mbit=args.rate_mbit,
        fanout_peers=not args.no_peers, session_timeout_ms=args.session_timeout_ms,
        spark_java_options=args.spark_java_options,
    ))
