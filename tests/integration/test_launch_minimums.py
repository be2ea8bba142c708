"""Update the model, then launch the job that reads it: against real masters, one cut off from
ZooKeeper (test_read_your_writes.py's cluster) and still serving the model before the update,
which every client here asks first.

The driver's side (the launcher's replication wait) learns the updated version although the
master it asks first answers the one before; the executor's side (blob_path's lookup, through
the node cache) reads at least that version, although the node's record of an earlier job says
the old version and is fresh for an hour, and the master its cache asks first is behind. A
configuration without the versions (from before them) gets the old version there: the case
the versions exist for.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_cache_minimums import (
    ONE,
    TWO,
    cache_client,
    updated_past_the_cut_off_master,
)
from test_read_your_writes import _CutOffCluster, _first_at, cut_off_cluster

import blobha.client
from blobha import spark as blobspark
from blobha.cache import BlobCache
from blobha.spark import executor
from blobha.spark.blobmap import BlobSpec
from blobha.spark.conf import ENV_CONF
from blobha.spark.minimums import SeenVersion

pytestmark = pytest.mark.integration

KEY = "cache-min-model"  # what updated_past_the_cut_off_master writes


@pytest.fixture
def cut_off(tmp_path: Path) -> Iterator[_CutOffCluster]:
    with cut_off_cluster(tmp_path / "cluster") as c:
        yield c


def _behind_first(cluster: _CutOffCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every client made from now on (the driver's wait and the executor's cache make their
    own) knows every master and asks the cut-off one first."""
    behind = cluster.masters[-1].address

    class FirstAtBehind(blobha.client.Client):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.cluster_summary()
            _first_at(self, behind)

    monkeypatch.setattr(blobha.client, "Client", FirstAtBehind)


def test_a_job_launched_after_an_update_reads_the_update_from_a_master_behind(
        cut_off: _CutOffCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    node = tmp_path / "node"
    current = cut_off.masters[0].address

    def earlier_job() -> None:
        # It read version one on this node: the node's record is fresh for an hour.
        with BlobCache(node, client=cache_client(cut_off, current),
                       update_interval_secs=3600) as cache:
            assert cache.get(KEY, owner="app-0").version == 1

    first, second = updated_past_the_cut_off_master(cut_off, earlier_job)
    _behind_first(cut_off, monkeypatch)
    with blobha.client.Client(cut_off.cluster, user="alice") as fresh:
        assert fresh.get_meta(KEY).version == first.version, "the master asked first is behind"

    # The driver's side, as the launcher runs it before spark-submit.
    report = blobspark.wait_for_replication([KEY], 2, 30, cluster=cut_off.cluster,
                                            user="alice")
    assert report.reached
    assert report.seen == (SeenVersion(KEY, second.version, second.created_at),)

    # The executor's side: the configuration the launcher hands the executors.
    settings = blobspark.SparkBlobSettings(
        blobs=(BlobSpec(KEY, "model"),), cluster=cut_off.cluster, user="alice",
        cache_dir=str(node), update_interval_secs=3600, app_id="app-1")
    launched = settings.replace(min_versions=report.seen)
    localizer = executor._Localizer()
    try:
        monkeypatch.setenv(ENV_CONF, settings.to_json())  # from before the versions
        old = localizer.get(executor.current_settings(), "model")
        assert (old.version, old.path.read_bytes()) == (first.version, ONE)

        monkeypatch.setenv(ENV_CONF, launched.to_json())
        blob = localizer.get(executor.current_settings(), "model")
        assert (blob.version, blob.path.read_bytes()) == (second.version, TWO)
    finally:
        localizer.close()
