"""The metrics registry of a master, read through its status source over stand-ins (no
ZooKeeper needed)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from blobha.core.addresses import status_url
from blobha.leader import LeaderHistory
from blobha.master.channel import Channel
from blobha.master.edge.metrics import MasterMetrics
from blobha.master.status import MasterStatus


def fake_master(**overrides: Any) -> MasterStatus:
    """A master's status source over stand-ins for its collaborators."""
    history = LeaderHistory()
    history.observe(3, "m1:6627")
    history.observe(4, "m2:6627")
    parts: dict[str, Any] = dict(
        election=SimpleNamespace(is_leader=True, epoch=4, leader_address="m2:6627"),
        zk=SimpleNamespace(state="CONNECTED", _data_watchers={}, _child_watchers={}),
        store=SimpleNamespace(counted_usage=lambda: (7, 7000), disk_free=lambda: 123456,
                              segments=SimpleNamespace(stats=lambda: (2, 9000, 6500))),
        uploads=SimpleNamespace(count=lambda: 2),
        sync=SimpleNamespace(figures=lambda: (9, 1, 3), keys_behind=lambda: (4, 1),
                             queue=SimpleNamespace(depth=lambda: 5, batches=0, batched_keys=0)),
        puts=SimpleNamespace(batches=4, writes=11, largest=6),
        scrubber=None,
    )
    parts.update(overrides)
    return MasterStatus(
        "m2:6627", "127.0.0.1:2181", 4.0, parts["zk"], parts["election"], history,
        parts["store"], parts["uploads"], parts["sync"], parts["puts"], parts["scrubber"],
        SimpleNamespace(known=set, live=set, holding=frozenset), Channel(),  # type: ignore[arg-type]
        SimpleNamespace(started=time.monotonic() - 5),  # type: ignore[arg-type]
        SimpleNamespace(replication_waits=lambda: 0))  # type: ignore[arg-type]


def samples(metrics: MasterMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_state_is_read_at_scrape_time() -> None:
    s = samples(MasterMetrics(fake_master()))  # type: ignore[arg-type]
    assert s[("blobha_is_leader", ())] == 1
    assert s[("blobha_leader_epoch", ())] == 4
    assert s[("blobha_leader_changes_total", ())] == 1
    assert s[("blobha_zookeeper_session_state", (("state", "CONNECTED"),))] == 1
    assert s[("blobha_zookeeper_session_state", (("state", "LOST"),))] == 0
    assert s[("blobha_blobs_stored", ())] == 7
    assert s[("blobha_stored_bytes", ())] == 7000
    assert s[("blobha_segment_files", ())] == 2
    assert s[("blobha_segment_bytes", ())] == 9000
    assert s[("blobha_segment_live_bytes", ())] == 6500
    assert s[("blobha_disk_free_bytes", ())] == 123456
    assert s[("blobha_uploads_in_progress", ())] == 2
    assert s[("blobha_cluster_blobs", ())] == 9
    assert s[("blobha_under_replicated_blobs", ())] == 1
    assert s[("blobha_sync_lag_blobs", ())] == 3
    assert s[("blobha_sync_queue_depth", ())] == 5
    assert s[("blobha_view_keys_behind", ())] == 4
    assert s[("blobha_group_commits_total", ())] == 4
    assert s[("blobha_group_commit_writes_total", ())] == 11
    assert s[("blobha_group_commit_largest", ())] == 6
    assert s[("blobha_uptime_seconds", ())] >= 5
    assert not any(name.startswith("blobha_scrub") for name, _ in s)
    assert not any(name.endswith("_created") for name, _ in s)


def test_a_follower_reports_the_term_it_last_saw() -> None:
    m = fake_master(election=SimpleNamespace(is_leader=False, epoch=0, leader_address=""),
                    zk=SimpleNamespace(state="SUSPENDED", _data_watchers={},
                                       _child_watchers={}))
    s = samples(MasterMetrics(m))  # type: ignore[arg-type]
    assert s[("blobha_is_leader", ())] == 0
    assert s[("blobha_leader_epoch", ())] == 4
    assert s[("blobha_zookeeper_session_state", (("state", "SUSPENDED"),))] == 1


def test_scrub_counters_appear_once_a_scrubber_exists() -> None:
    scrubber = SimpleNamespace(files_verified=10, bytes_verified=4096, corrupt_found=1, passes=2)
    s = samples(MasterMetrics(fake_master(scrubber=scrubber)))  # type: ignore[arg-type]
    assert s[("blobha_scrub_files_verified_total", ())] == 10
    assert s[("blobha_scrub_bytes_verified_total", ())] == 4096
    assert s[("blobha_scrub_corrupt_found_total", ())] == 1
    assert s[("blobha_scrub_passes_total", ())] == 2


def test_a_failing_part_leaves_the_rest_of_the_scrape_intact() -> None:
    def broken() -> tuple[int, int]:
        raise OSError("disk gone")

    m = fake_master(store=SimpleNamespace(usage=broken, disk_free=lambda: 1))
    s = samples(MasterMetrics(m))  # type: ignore[arg-type]
    assert ("blobha_blobs_stored", ()) not in s
    assert s[("blobha_is_leader", ())] == 1 and s[("blobha_sync_queue_depth", ())] == 5


def test_status_url_uses_the_advertised_host_for_a_wildcard_listen() -> None:
    assert status_url("0.0.0.0:6727", "10.1.2.3:6627") == "http://10.1.2.3:6727/"
    assert status_url("192.168.0.9:9100", "10.1.2.3:6627") == "http://192.168.0.9:9100/"
