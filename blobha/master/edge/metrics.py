"""Prometheus metrics of one master process.

Two kinds, in one registry per master:

* per-call RPC figures, counted by :mod:`blobha.master.edge.interceptor` as calls happen
  (names as in go-grpc-prometheus, so existing dashboards work): ``grpc_server_started_total``,
  ``grpc_server_handled_total{grpc_code}``, ``grpc_server_handling_seconds{grpc_code}``, plus
  payload bytes in and out;
* the master's state (leadership, ZooKeeper session, blobs, replication, sync, scrub), read
  lazily at scrape time by :class:`MasterCollector`, so the hot paths pay nothing for them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from blobha.core.version import __version__

if TYPE_CHECKING:
    from blobha.master.status import StatusSource

log = logging.getLogger("blobha.metrics")

#: Seconds; from sub-millisecond metadata calls to multi-second uploads and replication waits.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0, 30.0, 60.0, 300.0)

ZK_STATES = ("CONNECTED", "SUSPENDED", "LOST")

#: The background scrubber's figures (``StatusSource.scrub``) exported as counters.
SCRUB_COUNTERS = (
    ("files_verified", "blobha_scrub_files_verified",
     "Stored blob files whose digest the scrubber verified."),
    ("bytes_verified", "blobha_scrub_bytes_verified", "Bytes the scrubber read and verified."),
    ("corrupt_found", "blobha_scrub_corrupt_found",
     "Stored blob files the scrubber found corrupt."),
    ("passes", "blobha_scrub_passes", "Complete scrub passes over the local store."),
)


#: The data channel's figures (``StatusSource.data_channel``) exported as counters.
DATA_CHANNEL_COUNTERS = (
    ("transfers", "blobha_data_channel_transfers", "Downloads served over the data channel."),
    ("bytes_sent", "blobha_data_channel_bytes", "Bytes sent over the data channel."),
    ("uploads", "blobha_data_channel_uploads",
     "Upload segments received over the data channel."),
    ("bytes_received", "blobha_data_channel_received_bytes",
     "Upload bytes received over the data channel."),
    ("refused", "blobha_data_channel_refused",
     "Data channel connections with an unknown or expired ticket."),
    ("links", "blobha_data_channel_stage_links",
     "Stage links a leader opened on the data channel to forward small writes."),
)


class RpcMetrics:
    """Per-call figures; the label values come from the method table, never from callers."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["grpc_service", "grpc_method"]
        self.started = Counter(
            "grpc_server_started", "RPCs started on the server.", labels, registry=registry,
        )
        self.handled = Counter(
            "grpc_server_handled", "RPCs completed on the server, by status code.",
            [*labels, "grpc_code"], registry=registry,
        )
        self.latency = Histogram(
            "grpc_server_handling_seconds", "Time from the start of an RPC to its status.",
            [*labels, "grpc_code"], buckets=LATENCY_BUCKETS, registry=registry,
        )
        self.received_bytes = Counter(
            "blobha_rpc_received_bytes", "Request message bytes received (uploads are most).",
            labels, registry=registry,
        )
        self.sent_bytes = Counter(
            "blobha_rpc_sent_bytes", "Response message bytes sent (downloads are most).",
            labels, registry=registry,
        )
        self.in_progress = Gauge(
            "blobha_rpc_in_progress", "RPCs whose handler runs now (each holds a call thread).",
            labels, registry=registry,
        )
        self.awaiting_request = Gauge(
            "blobha_rpc_awaiting_request",
            "RPCs admitted and waiting for their request message (master.request.receive.secs).",
            registry=registry,
        )


class MasterCollector(Collector):
    """Reads a master's state when scraped. Each part is read on its own: a part that fails
    (ZooKeeper down, say) is logged and left out; the scrape still answers."""

    def __init__(self, source: StatusSource) -> None:
        self.source = source

    def describe(self) -> Iterable[Metric]:
        return []  # unchecked collector: the families depend on the state (e.g. a scrubber)

    def collect(self) -> Iterator[Metric]:
        for part in (self._identity, self._leadership, self._zookeeper, self._watches,
                     self._store, self._replication, self._group_commit, self._scrub,
                     self._data_channel):
            try:
                yield from part()
            except Exception:
                log.debug("metrics: %s failed", part.__name__, exc_info=True)

    def _identity(self) -> Iterator[Metric]:
        s = self.source
        info = GaugeMetricFamily("blobha_build_info", "The master's address and blobha version.",
                                 labels=["address", "version"])
        info.add_metric([s.identity, __version__], 1.0)
        yield info
        yield GaugeMetricFamily("blobha_uptime_seconds", "Seconds since this master started.",
                                value=time.monotonic() - s.started)

    def _leadership(self) -> Iterator[Metric]:
        s = self.source
        yield GaugeMetricFamily("blobha_is_leader", "1 if this master is the ready leader.",
                                value=1.0 if s.is_leader() else 0.0)
        yield GaugeMetricFamily(
            "blobha_leader_epoch",
            "The leadership term (fencing epoch) this master last saw: its own while it leads.",
            value=float(s.seen_epoch()),
        )
        yield CounterMetricFamily(
            "blobha_leader_changes", "Leader changes this master has seen since it started.",
            value=float(s.leader_changes()),
        )

    def _zookeeper(self) -> Iterator[Metric]:
        state = self.source.zk_state()
        family = GaugeMetricFamily(
            "blobha_zookeeper_session_state",
            "1 for the current state of this master's ZooKeeper session (kazoo's view).",
            labels=["state"],
        )
        for s in ZK_STATES:
            family.add_metric([s], 1.0 if s == state else 0.0)
        yield family

    def _watches(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "blobha_zookeeper_watch_callbacks",
            "One-shot watch callbacks this master's ZooKeeper client holds. Steady in a healthy"
            " master: it grows only while watched nodes wait to change.",
            value=float(self.source.watch_callbacks()),
        )
        yield GaugeMetricFamily("blobha_replication_waits",
                                "Replication waits (WaitForReplication, write quorums) in"
                                " progress on this master.",
                                value=float(self.source.replication_waits()))

    def _store(self) -> Iterator[Metric]:
        f = self.source.store()
        yield GaugeMetricFamily("blobha_blobs_stored",
                                "Blobs with a version on this master's disk.",
                                value=float(f.blobs))
        yield GaugeMetricFamily(
            "blobha_stored_bytes",
            "Bytes of every retained blob version on this master's disk (a small version's"
            " segment record counts its header and record of a few hundred bytes too).",
            value=float(f.stored_bytes),
        )
        yield GaugeMetricFamily("blobha_segment_files",
                                "Segment files holding this master's small versions.",
                                value=float(f.segment_files))
        yield GaugeMetricFamily(
            "blobha_segment_bytes",
            "Bytes of those segment files, live records and dead ones (deleted or replaced"
            " versions, until compaction copies the live ones out of a sparse segment).",
            value=float(f.segment_bytes))
        yield GaugeMetricFamily("blobha_segment_live_bytes",
                                "Bytes of the live records in those segment files.",
                                value=float(f.segment_live_bytes))
        yield GaugeMetricFamily("blobha_disk_free_bytes", "Free bytes on the store's file system.",
                                value=float(f.disk_free))
        yield GaugeMetricFamily("blobha_uploads_in_progress", "Uploads begun, not yet committed.",
                                value=float(f.uploads_in_progress))

    def _replication(self) -> Iterator[Metric]:
        f = self.source.sync()
        yield GaugeMetricFamily("blobha_cluster_blobs", "Keys in the cluster, as this master sees.",
                                value=float(f.keys))
        yield GaugeMetricFamily(
            "blobha_under_replicated_blobs",
            "Keys whose committed version has fewer live holders than their replication factor.",
            value=float(f.under_replicated),
        )
        yield GaugeMetricFamily(
            "blobha_sync_lag_blobs",
            "Committed versions this master is meant to hold but does not hold yet.",
            value=float(f.lag),
        )
        yield GaugeMetricFamily(
            "blobha_sync_queue_depth", "Keys queued or in progress in this master's synchroniser.",
            value=float(f.queue_depth),
        )
        yield GaugeMetricFamily(
            "blobha_view_keys_behind",
            "Keys whose state this master last read misses a change ZooKeeper announced (read"
            " refused from them while ZooKeeper is out of reach).",
            value=float(f.keys_behind),
        )
        yield CounterMetricFamily(
            "blobha_sync_batches", "Batches of keys this master's synchroniser has reconciled.",
            value=float(f.batches),
        )
        yield CounterMetricFamily("blobha_sync_batch_keys", "Keys those batches carried.",
                                  value=float(f.batched_keys))

    def _group_commit(self) -> Iterator[Metric]:
        f = self.source.group_commit()
        yield CounterMetricFamily(
            "blobha_group_commits", "Group commits of whole small blobs (Put) this master made.",
            value=float(f.batches),
        )
        yield CounterMetricFamily("blobha_group_commit_writes",
                                  "Writes those group commits carried.", value=float(f.writes))
        yield GaugeMetricFamily("blobha_group_commit_largest",
                                "The most writes one group commit has carried.",
                                value=float(f.largest))
        yield CounterMetricFamily(
            "blobha_forwarded_versions",
            "Small writes this leader forwarded to other holders, once per holder.",
            value=float(f.forwarded))
        calls = CounterMetricFamily("blobha_forward_calls",
                                    "Forwarded batches, by how they went to the holder.",
                                    labels=["path"])
        calls.add_metric(["link"], float(f.over_links))
        calls.add_metric(["grpc"], float(f.over_grpc))
        yield calls

    def _scrub(self) -> Iterator[Metric]:
        figures = self.source.scrub()
        if figures is None:
            return
        for attr, name, doc in SCRUB_COUNTERS:
            if attr in figures:
                yield CounterMetricFamily(name, doc, value=float(figures[attr]))

    def _data_channel(self) -> Iterator[Metric]:
        figures = self.source.data_channel()
        if figures is None:
            return
        for attr, name, doc in DATA_CHANNEL_COUNTERS:
            yield CounterMetricFamily(name, doc, value=float(figures[attr]))


class MasterMetrics:
    """The registry of one master: RPC figures plus its state collector."""

    def __init__(self, source: StatusSource | None = None) -> None:
        # The *_created series double the output and no dashboard reads them.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=False)
        self.rpc = RpcMetrics(self.registry)
        if source is not None:
            self.registry.register(MasterCollector(source))

    def render(self) -> bytes:
        """The text exposition format, for ``GET /metrics``."""
        return generate_latest(self.registry)
