"""The scrubber against a real on-disk store: rot is found, removed and reported; the rate
limit holds."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from support.waiting import wait_until

from blobha.core.digest import CHUNK_SIZE, digest_bytes
from blobha.core.keys import key_dirname
from blobha.master.scrub import Scrubber, _RateLimit
from blobha.store.local import LocalStore


def _put(store: LocalStore, key: str, seq: int, data: bytes) -> None:
    temp = store.new_temp("test")
    temp.write_at(0, data)
    store.install(key, seq, temp, len(data), digest_bytes(data))


def _flip(store: LocalStore, key: str, seq: int, at: int) -> None:
    path = store.keys_dir / key_dirname(key) / f"v{seq}.blob"
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x01
    path.write_bytes(bytes(raw))


def test_a_clean_store_passes(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    _put(store, "a", 1, os.urandom(CHUNK_SIZE + 10))
    _put(store, "b", 3, b"")
    scrubber = Scrubber(store, interval_secs=60, rate_bytes_per_sec=0)
    assert scrubber.scrub_pass() == 0
    assert (scrubber.passes, scrubber.files_verified, scrubber.corrupt_found) == (1, 2, 0)
    assert scrubber.bytes_verified == CHUNK_SIZE + 10


def test_a_flipped_bit_is_found_removed_and_reported(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    good = os.urandom(2 * CHUNK_SIZE)
    _put(store, "good", 1, good)
    _put(store, "rotten", 1, os.urandom(3 * CHUNK_SIZE))
    _flip(store, "rotten", 1, 2 * CHUNK_SIZE + 7)
    reported: list[tuple[str, int]] = []
    store.on_corrupt = lambda key, seq: reported.append((key, seq))
    scrubber = Scrubber(store, interval_secs=60, rate_bytes_per_sec=0)
    assert scrubber.scrub_pass() == 1
    assert reported == [("rotten", 1)]
    assert scrubber.corrupt_found == 1
    assert store.info("rotten", 1) is None  # never served again
    assert b"".join(store.read("good", 1)) == good
    # A second pass finds nothing more: the bad copy is gone, not re-counted.
    assert scrubber.scrub_pass() == 0


def test_background_thread_runs_passes_until_stopped(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    _put(store, "k", 1, b"x" * 1000)
    scrubber = Scrubber(store, interval_secs=3600, rate_bytes_per_sec=0)
    scrubber.start()
    try:
        scrubber.run_now()  # the first pass starts at once; this asks for a second one
        wait_until(lambda: scrubber.passes >= 2, 10, "two scrub passes")
    finally:
        scrubber.stop()


def test_disabled_scrubber_starts_no_thread(tmp_path: Path) -> None:
    scrubber = Scrubber(LocalStore(tmp_path), interval_secs=0, rate_bytes_per_sec=0)
    scrubber.start()
    assert scrubber._thread is None


class _FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.waits: list[float] = []

    def clock(self) -> float:
        return self.now


class _RecordingStop(threading.Event):
    def __init__(self, t: _FakeTime) -> None:
        super().__init__()
        self.t = t

    def wait(self, timeout: float | None = None) -> bool:
        assert timeout is not None
        self.t.waits.append(timeout)
        self.t.now += timeout  # the wait passes the time it asked for
        return False


def test_rate_limit_spreads_reads_over_time() -> None:
    t = _FakeTime()
    limit = _RateLimit(100, t.clock, _RecordingStop(t))
    for _ in range(10):
        limit.spend(50)  # 500 bytes at 100 B/s must take 5 s
    assert abs(t.now - 5.0) < 1e-9
    # Unlimited never waits.
    t2 = _FakeTime()
    unlimited = _RateLimit(0, t2.clock, _RecordingStop(t2))
    unlimited.spend(10**9)
    assert t2.waits == []
