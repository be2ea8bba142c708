"""``/status.json``'s document: one pass over the keys per request, and this master alone
when the cluster summary cannot be had."""

from __future__ import annotations

from typing import Any

from blobha.core.errors import Unavailable
from blobha.master.edge.statuspage import status_document
from blobha.wire.status import ClusterSummary, MasterSummary


def _master(address: str, leader: bool = False) -> MasterSummary:
    return MasterSummary(address=address, is_leader=leader, uptime_secs=1.0, version="t",
                         blob_count=0, bytes_stored=0, disk_free=0, lag_blobs=0,
                         reachable=True, epoch=3)


class _Source:
    """A StatusSource counting the calls that walk every key (node_status, cluster_summary)."""

    identity = "m1:1"
    zk_servers = "zk:2181"

    def __init__(self, summary: ClusterSummary | Exception) -> None:
        self.summary = summary
        self.walks: list[str] = []

    def node_status(self) -> MasterSummary:
        self.walks.append("node_status")
        return _master("m1:1")

    def cluster_summary(self) -> ClusterSummary:
        self.walks.append("cluster_summary")
        if isinstance(self.summary, Exception):
            raise self.summary
        return self.summary

    def leader_address(self) -> str:
        return "m2:1"

    def epoch(self) -> int:
        return 3

    def status_urls(self, addresses: list[str]) -> dict[str, str]:
        return {}

    def known_masters(self) -> int:
        return 2

    def views(self) -> dict[str, Any]:
        return {}

    def zk_state(self) -> str:
        return "CONNECTED"

    def leader_changes(self) -> int:
        return 0

    def terms(self) -> list[Any]:
        return []

    def scrub(self) -> None:
        return None


def test_the_cluster_summary_alone_is_asked_when_it_answers() -> None:
    source = _Source(ClusterSummary((_master("m1:1"), _master("m2:1", True)), "m2:1", 3, 0, 0))
    doc = status_document(source)  # type: ignore[arg-type]
    assert source.walks == ["cluster_summary"]
    assert [m["address"] for m in doc["masters"]] == ["m1:1", "m2:1"] and not doc["errors"]


def test_this_master_alone_is_shown_when_the_summary_fails() -> None:
    source = _Source(Unavailable("ZooKeeper is unreachable"))
    doc = status_document(source)  # type: ignore[arg-type]
    assert source.walks == ["cluster_summary", "node_status"]
    assert [m["address"] for m in doc["masters"]] == ["m1:1"]
    assert (doc["leader"], doc["epoch"]) == ("m2:1", 3)
    assert doc["errors"] == ["cluster summary: ZooKeeper is unreachable"]
