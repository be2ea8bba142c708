"""A request whose ZooKeeper call is made just as ZooKeeper vanishes, against a real server.

The master checks its connection, then calls; the two are not atomic. kazoo holds a call made
after the connection dropped until a connection is back. Each such call is waited for at most
the session timeout, so the request gets its answer (the last committed state, or
"unreachable") and its thread back, instead of waiting for as long as ZooKeeper stays away.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kazoo.handlers.threading import KazooTimeoutError
from support.outage import Outage, into_outage

from blobha.core.blobstate import BlobState
from blobha.core.consistency import MinVersion, View
from blobha.core.errors import Stale, Unavailable
from blobha.master.channel import Channel
from blobha.master.config import Config
from blobha.master.metadata import Metadata
from blobha.master.reads import Reads
from blobha.master.rules import Authority
from blobha.master.settings import MasterSettings
from blobha.master.status import MasterStatus
from blobha.ops.zkserver import EmbeddedZooKeeper
from blobha.store.local import LocalStore
from blobha.sync import KeyView
from blobha.zk.layout import BLOBSTORE, MASTERS, key_path

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SESSION_SECS = 4.0
#: Less than the session timeout a read meeting the outage waits: past it once that returns.
CUTOFF = 1.0


class _OutageBeforeNextRead(Outage):
    """The next read of a node under ``prefix`` (kazoo's plain calls make the async ones)."""

    prefix = BLOBSTORE

    def _next(self, path: str) -> None:
        if self.armed and path.startswith(self.prefix):
            self.outage_first()

    def get_async(self, path: str, *args: Any, **kwargs: Any) -> Any:
        self._next(path)
        return super().get_async(path, *args, **kwargs)

    def exists_async(self, path: str, *args: Any, **kwargs: Any) -> Any:
        self._next(path)
        return super().exists_async(path, *args, **kwargs)


URLS = {"m1:6627": "http://127.0.0.1:8627/", "m2:6627": "http://127.0.0.1:8628/"}
STATE = BlobState(seq=2, size=1, digest="2" * 32, acl=(), replication_factor=3,
                  creator="alice", created_at=1.0, updated_at=1.0, epoch=1, acked=True)


@pytest.fixture
def master(tmp_path: Path) -> Iterator[tuple[Any, _OutageBeforeNextRead]]:
    """A master's request side on a real ZooKeeper session holding key 'k' at v2; it last saw
    'k' at v2 on m1 and m2."""
    with EmbeddedZooKeeper(tmp_path / "zk", tick_ms=500) as server:
        zk = _OutageBeforeNextRead(hosts=server.connect_string, timeout=SESSION_SECS,
                                   server=server)
        zk.start(timeout=15)
        try:
            zk.create(key_path("k"), STATE.encode(), makepath=True)
            for address, url in URLS.items():
                zk.create(f"{MASTERS}/{address}", json.dumps({"status_url": url}).encode(),
                          makepath=True)
            # The master's read parts, built through their constructors, on the real session.
            view = KeyView(STATE, ("m1:6627", "m2:6627"))
            sync: Any = SimpleNamespace(view=lambda key: view if key == "k" else None)
            election: Any = SimpleNamespace(is_leader=False, leader_address="m2:6627")
            meta = Metadata(zk, election, "m1:6627", SESSION_SECS, threading.Event())
            settings = MasterSettings.from_config(Config.of({
                "blobstore.dir": str(tmp_path / "data"), "blobstore.read.cutoff.secs": CUTOFF}))
            reads = Reads(settings, "m1:6627", "blobha-master", LocalStore(tmp_path / "store"),
                          zk, meta, Authority(frozenset(), "blobha-master"), sync, Channel())
            unused: Any = None  # parts the status page's links do not read
            status = MasterStatus("m1:6627", server.connect_string, SESSION_SECS, zk, election,
                                  unused, unused, unused, sync, unused, None, unused,
                                  Channel(), SimpleNamespace(started=0.0), unused)  # type: ignore[arg-type]
            m = SimpleNamespace(identity="m1:6627", zk=zk, session_timeout=SESSION_SECS,
                                sync=sync, meta=meta, reads=reads, status=status)
            yield m, zk
        finally:
            zk.stop()
            zk.close()


def _during_outage(zk: Outage, request: Callable[[], object]) -> tuple[object, float]:
    return into_outage(zk, request, SESSION_SECS, "the request")


def test_a_read_that_meets_the_outage_serves_the_last_committed_state(
        master: tuple[Any, Outage]) -> None:
    m, zk = master
    result, took = _during_outage(zk, lambda: m.reads.state_for_read("k", None,
                                                                    View.LAST_KNOWN))
    assert result == (STATE, m.sync.view("k")), result
    assert took >= SESSION_SECS - 0.5  # the read was waited for, then given up


def test_a_master_cut_off_past_the_bound_no_longer_calls_its_view_the_latest(
        master: tuple[Any, Outage]) -> None:
    m, zk = master
    assert m.reads.state_for_read("k") == (STATE, None)  # in touch: from ZooKeeper
    _during_outage(zk, lambda: m.reads.state_for_read("k", None, View.LAST_KNOWN))
    assert m.reads.cut_off.seconds() > CUTOFF
    # No minimum: refused as stale, for the client to ask a master in touch with ZooKeeper.
    with pytest.raises(Stale, match=r"cut off from ZooKeeper for \d+ s, so its view of 'k'"
                                    r" \(v2\) may not be the latest"):
        m.reads.state_for_read("k")
    # Asked for as the last known view (every master was cut off), it is served.
    assert m.reads.state_for_read("k", None, View.LAST_KNOWN)[0] == STATE
    # A client that has seen v2 gets what it needs; one that has seen v3 is refused.
    assert m.reads.state_for_read("k", MinVersion(2, STATE.created_at))[0] == STATE
    with pytest.raises(Stale, match="behind what this client has seen"):
        m.reads.state_for_read("k", MinVersion(3, STATE.created_at))
    # A linearizable read needs ZooKeeper to confirm the version.
    with pytest.raises(Unavailable, match="cannot confirm the latest version of 'k'"):
        m.reads.state_for_read("k", None, View.LINEARIZABLE)


def test_a_listing_that_meets_the_outage_is_told_zookeeper_is_unreachable(
        master: tuple[Any, Outage]) -> None:
    m, zk = master
    result, _ = _during_outage(zk, m.meta.sorted_keys)
    # One of the errors the service answers as UNAVAILABLE, "ZooKeeper is unreachable".
    assert isinstance(result, KazooTimeoutError), result


def test_the_status_page_meets_the_outage_with_no_links_and_in_one_timeout(
        master: tuple[Any, _OutageBeforeNextRead]) -> None:
    m, zk = master
    assert m.status.status_urls(list(URLS)) == URLS  # before the outage: each master's link
    zk.prefix = MASTERS
    result, took = _during_outage(zk, lambda: m.status.status_urls(list(URLS)))
    assert result == {}  # the rows still show, without links
    # The reads share one deadline: a page does not wait a session timeout per master.
    assert took < 2 * SESSION_SECS, took
