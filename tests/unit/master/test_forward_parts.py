"""Forwarded writes, part by part: the holder's staged copies (blobha.store.staged), its
epoch fence (blobha.master.staging), the leader's wait for confirmations
(blobha.master.forward) and what the commit records of them."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

import pytest
from support.waiting import wait_until

from blobha.core.blobstate import BlobState
from blobha.core.digest import Digester
from blobha.core.errors import InvalidArgument, NotAuthorized, NotLeader, Unavailable
from blobha.master.committer import confirmed_by
from blobha.master.forward import Forward
from blobha.master.rules import replication_status
from blobha.master.staging import Staging
from blobha.master.uploads import UploadManager
from blobha.store.local import LocalStore
from blobha.store.staged import StagedCopies


def digest(data: bytes) -> str:
    d = Digester()
    d.update(data)
    return d.hexdigest()


def state(**changes: object) -> BlobState:
    base = BlobState(seq=1, size=3, digest="d", acl=(), replication_factor=3, creator="u",
                     created_at=0.0, updated_at=0.0, epoch=2, acked=False, write_quorum=2)
    return replace(base, **changes)  # type: ignore[arg-type]


# ---- the holder's staged copies ------------------------------------------------------------

def test_a_staged_copy_is_read_back_and_survives_a_restart(tmp_path: Path) -> None:
    staged = StagedCopies(tmp_path)
    a, b = b"alpha" * 100, b"beta"
    assert staged.stage([("k1", len(a), digest(a), a), ("k2", len(b), digest(b), b)]) == [
        True, True]
    assert staged.read("k1", digest(a), len(a)) == a
    again = StagedCopies(tmp_path)  # a restart reads the index back
    assert again.read("k2", digest(b), len(b)) == b
    assert again.read("k2", digest(a), len(b)) is None  # another digest is another copy


def test_a_copy_that_does_not_match_its_digest_is_not_staged(tmp_path: Path) -> None:
    staged = StagedCopies(tmp_path)
    assert staged.stage([("k", 4, digest(b"good"), b"evil")]) == [False]
    assert staged.count() == 0 and not list(tmp_path.iterdir())


def test_forwards_share_a_file_that_goes_once_nothing_in_it_is_wanted(tmp_path: Path) -> None:
    staged = StagedCopies(tmp_path)
    a, b = b"one", b"two"
    staged.stage([("k1", 3, digest(a), a), ("k2", 3, digest(b), b)])
    staged.take("k1", digest(a))
    assert list(tmp_path.iterdir())  # k2 is still in it
    staged.take("k2", digest(b))
    assert list(tmp_path.iterdir())  # appended to still
    staged.stage([("k3", 3, digest(a), a)])
    assert len(list(tmp_path.iterdir())) == 1  # one file, one sync per forward
    staged.take("k3", digest(a))
    staged.expire(600, now=time.time() + 601)  # idle: rolled, and nothing in it is wanted
    assert not list(tmp_path.iterdir())


def test_staged_copies_expire_as_abandoned_uploads(tmp_path: Path) -> None:
    staged = StagedCopies(tmp_path)
    staged.stage([("k", 3, digest(b"old"), b"old")])
    assert staged.expire(600) == 0
    assert staged.expire(600, now=time.time() + 601) == 1
    assert staged.count() == 0 and not list(tmp_path.iterdir())


def test_a_staged_copy_a_commit_names_outlives_the_expiration(tmp_path: Path) -> None:
    # Confirmed to the leader, it may be one of the W copies of an acknowledged version whose
    # install waits (ZooKeeper out): only the sync's install may remove it.
    staged = StagedCopies(tmp_path)
    named, stray = digest(b"named"), digest(b"stray")

    def wanted(key: str, d: str) -> bool:
        return (key, d) == ("k", named)

    staged.stage([("k", 5, named, b"named")])
    assert staged.expire(600, now=time.time() + 601, wanted=wanted) == 0
    staged.stage([("j", 5, stray, b"stray")])  # a file of its own: the other one was rolled
    assert staged.expire(600, now=time.time() + 601, wanted=wanted) == 1
    assert staged.read("k", named, 5) == b"named"
    assert not staged.has("j", stray)


def test_debris_of_a_forward_cut_short_goes_at_start_up(tmp_path: Path) -> None:
    (tmp_path / "abc.part").write_bytes(b"half")  # a batch never synced
    (tmp_path / "def.blob").write_bytes(b"a stream never finished")  # no description
    staged = StagedCopies(tmp_path)
    good = b"kept"
    staged.stage([("k", 4, digest(good), good)])
    only = next(tmp_path.glob("*.staged"))
    with open(only, "ab") as f:
        f.write(b"\x00\x00\x00\x10{\"key\": \"torn")  # a torn record at the end
    again = StagedCopies(tmp_path)
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".staged"]
    assert again.read("k", digest(good), 4) == good and again.count() == 1


def test_a_streamed_copy_is_kept_whole_and_moved_in(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    try:
        data = os.urandom(3 * 1024 * 1024 + 5)
        temp = store.staged.new_part()
        for at in range(0, len(data), 1 << 20):
            temp.write_at(at, data[at:at + (1 << 20)])
        assert store.staged.adopt("big", len(data), digest(data), temp)
        assert store.staged.is_whole("big", digest(data))
        assert store.staged.read("big", digest(data), len(data)) is None  # never in memory
        store.close()
        store = LocalStore(tmp_path / "store")  # a restart keeps it
        assert store.staged.is_whole("big", digest(data))
        assert not store.versions("big")  # staged is not a version
        assert store.install_staged("big", 4, digest(data), len(data))
        assert b"".join(store.read("big", 4)) == data
        assert not list((tmp_path / "store" / "staged").iterdir())
    finally:
        store.close()


def test_a_streamed_copy_that_does_not_match_is_discarded(tmp_path: Path) -> None:
    staged = StagedCopies(tmp_path)
    temp = staged.new_part()
    temp.write_at(0, b"what arrived")
    assert not staged.adopt("k", 12, digest(b"what was sent"), temp)
    assert not list(tmp_path.iterdir())


# ---- the holder's fence ----------------------------------------------------------------------

def test_a_forward_from_an_older_epoch_is_refused(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    try:
        seen = [5]
        staging = Staging("master", store, lambda: seen[0], UploadManager(store, 600),
                          lambda user, upload_id: (0, None))
        ok = [("k", 3, digest(b"abc"), b"abc")]
        with pytest.raises(NotLeader, match=r"epoch 4.*epoch 5"):
            staging.stage("master", 4, ok)
        assert staging.stage("master", 6, ok) == [True]
        seen[0] = 0  # ZooKeeper's record read before: the newest forward still counts
        with pytest.raises(NotLeader):
            staging.stage("master", 5, ok)
        with pytest.raises(NotAuthorized):
            staging.stage("alice", 6, ok)
        with pytest.raises(InvalidArgument, match="carries 3 bytes, not its size 4"):
            staging.stage("master", 6, [("k", 4, digest(b"abc"), b"abc")])
    finally:
        store.close()


# ---- the leader ---------------------------------------------------------------------------

def test_a_commit_is_acknowledged_when_the_confirmations_make_the_quorum() -> None:
    assert confirmed_by(state(write_quorum=2), ("b:1",)).acked
    assert not confirmed_by(state(write_quorum=3), ("b:1",)).acked
    assert confirmed_by(state(write_quorum=3), ("b:1", "c:1")).confirmed == ("b:1", "c:1")
    assert confirmed_by(state(), ()) == state()


def test_confirmed_holders_are_stored_and_an_old_record_has_none() -> None:
    s = state(confirmed=("b:1", "c:1"), acked=True)
    assert BlobState.decode(s.encode()) == s
    old = json.loads(state().encode())
    assert "confirmed" not in old
    assert BlobState.decode(json.dumps(old).encode()).confirmed == ()


def test_a_live_confirmed_holder_counts_as_a_replica() -> None:
    s = state(confirmed=("b:1", "c:1"), acked=True)
    status = replication_status("k", s, ["a:1"], live={"a:1", "b:1"})
    assert status.replication == 2 and status.holders == ("a:1", "b:1")


def _done(value: list[bool] | Exception) -> Future[list[bool]]:
    f: Future[list[bool]] = Future()
    if isinstance(value, Exception):
        f.set_exception(value)
    else:
        f.set_result(value)
    return f


def test_the_wait_keeps_what_confirmed_and_drops_what_failed_or_lags() -> None:
    suspects: list[str] = []
    never: Future[list[bool]] = Future()
    began = time.monotonic()
    forward = Forward({"k1": 1}, [("b:1", ["k1"], _done([True])), ("d:1", ["k1"], never)],
                      time.monotonic(), 30.0, suspects.append)
    assert forward.wait() == {"k1": ("b:1",)}
    assert time.monotonic() - began < 5  # the quorum was there: d:1 is not waited for
    assert suspects == []  # merely slower, not failed
    # k2 never has its quorum, so the lagging holder is waited for up to the bound.
    short = Forward({"k1": 1, "k2": 1},
                    [("b:1", ["k1", "k2"], _done([True, False])),
                     ("c:1", ["k2"], _done(Unavailable("gone"))),
                     ("d:1", ["k1", "k2"], never)],
                    time.monotonic(), 0.2, suspects.append)
    assert short.wait() == {"k1": ("b:1",), "k2": ()}
    assert sorted(suspects) == ["c:1", "d:1"]


def test_a_batch_goes_to_a_holder_in_calls_under_the_message_limit() -> None:
    from blobha.master.forward import CALL_BYTES, _parts

    mib = 1024 * 1024
    items = [(f"k{i}", 3, 2, mib, "d", b"") for i in range(8)] + [
        ("big", 3, 2, CALL_BYTES + 1, "d", b"")]
    parts = _parts(items)
    assert [len(p) for p in parts] == [4, 4, 1]
    assert all(sum(i[3] for i in p) <= CALL_BYTES for p in parts[:-1])


def test_a_holder_with_forwards_stuck_is_passed_over_and_suspected_when_they_fail() -> None:
    import threading

    from blobha.master.forward import HEDGE_SECS, MAX_IN_FLIGHT, Forwarder

    release = threading.Event()
    calls: list[str] = []

    class Peers:
        def stage(self, holder: str, epoch: int, versions: list[object], timeout: float
                  ) -> list[bool]:
            calls.append(holder)
            if holder == "a-stuck:1":
                release.wait(10)
                raise Unavailable("stalled")
            return [True] * len(versions)

    # "a-stuck:1" sorts first: each write's one forward goes to it while it is trusted.
    masters = {"me:1", "ok:1", "a-stuck:1"}
    f = Forwarder("me:1", Peers(), lambda: masters, lambda: masters,  # type: ignore[arg-type]
                  lambda: 3, 5.0, True)
    try:
        for i in range(MAX_IN_FLIGHT + 2):
            began = time.monotonic()
            forward = f.start([(f"k{i}", 3, 2, 1, "d", b"x")])
            assert forward is not None
            # The spare takes over after the hedge, never after the 5 s bound.
            assert forward.wait() == {f"k{i}": ("ok:1",)}
            assert time.monotonic() - began < 5.0 / 2
        # Stuck calls fill its slots: it is passed over, and later writes go straight on.
        assert calls.count("a-stuck:1") == MAX_IN_FLIGHT
        assert f.targets("k", 3, masters, masters, time.monotonic()) == ["ok:1"]
        began = time.monotonic()
        forward = f.start([("later", 3, 2, 1, "d", b"x")])
        assert forward is not None and forward.wait() == {"later": ("ok:1",)}
        assert time.monotonic() - began < HEDGE_SECS
        release.set()
        wait_until(lambda: not f._in_flight.get("a-stuck:1"), 10, "the stuck calls to fail")
        # Its calls failed: it stays passed over for a while.
        assert f.targets("k", 3, masters, masters, time.monotonic()) == ["ok:1"]
    finally:
        release.set()
        f.close()


class _Holders:
    """StageVersions answered at once: True from each holder, an error from ``failing``."""

    def __init__(self, failing: frozenset[str] = frozenset()) -> None:
        self.failing = failing
        self.calls: list[tuple[str, list[str]]] = []

    def stage(self, holder: str, epoch: int, versions: list[tuple[str, int, str, bytes]],
              timeout: float) -> list[bool]:
        self.calls.append((holder, [v[0] for v in versions]))
        if holder in self.failing:
            raise Unavailable("refused")
        return [True] * len(versions)


def test_a_write_is_forwarded_to_w_minus_1_holders_and_the_rest_sync() -> None:
    from blobha.master.forward import Forwarder

    masters = {"me:1", "b:1", "c:1", "d:1"}
    holders = _Holders()
    f = Forwarder("me:1", holders, lambda: masters, lambda: masters,  # type: ignore[arg-type]
                  lambda: 3, 5.0, True)
    try:
        forward = f.start([("w2", 4, 2, 1, "d", b"x"), ("w3", 4, 3, 1, "d", b"x"),
                           ("w1", 4, 1, 1, "d", b"x")])
        assert forward is not None
        assert forward.wait() == {"w2": ("b:1",), "w3": ("b:1", "c:1")}
        # One call per holder for the whole batch; nobody gets the W=1 write, d:1 nothing.
        assert sorted(holders.calls) == [("b:1", ["w2", "w3"]), ("c:1", ["w3"])]
    finally:
        f.close()


def test_a_holder_that_fails_is_replaced_by_a_spare_at_once() -> None:
    from blobha.master.forward import HEDGE_SECS, Forwarder

    masters = {"me:1", "b:1", "c:1", "d:1"}
    holders = _Holders(failing=frozenset({"b:1"}))
    f = Forwarder("me:1", holders, lambda: masters, lambda: masters,  # type: ignore[arg-type]
                  lambda: 3, 5.0, True)
    try:
        began = time.monotonic()
        forward = f.start([("k", 4, 3, 1, "d", b"x")])
        assert forward is not None
        assert forward.wait() == {"k": ("c:1", "d:1")}
        assert time.monotonic() - began < HEDGE_SECS  # replaced on failing, not on the hedge
        assert sorted(h for h, _ in holders.calls) == ["b:1", "c:1", "d:1"]
    finally:
        f.close()
