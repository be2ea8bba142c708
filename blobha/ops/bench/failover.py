"""The failover groups: from a signal to the leader to the next successful write."""

from __future__ import annotations

import signal
import time

from blobha.ops.bench.context import Bench


def failover(bench: Bench, name: str, sig: int, restart: bool = False) -> None:
    """The leader gets ``sig``; with ``restart``, it is started again on its data
    directory as soon as it is gone, on the clock."""
    lc = bench.lc
    assert lc is not None
    lc.wait_ready(60, expect=len(lc.masters))
    key = f"{bench.prefix}-{name}"
    with bench.client() as c:
        c.create(key, b"before", replication_factor=3)
        c.update(key, b"warm")  # the client now knows the leader: no discovery on the clock
        leader = lc.leader()
        bench.log.say(f"{signal.Signals(sig).name} to the leader {leader.address}"
                      + (", restarted at once" if restart else ""))
        t0 = time.perf_counter()
        leader.signal(sig)
        if restart:
            if not leader.wait(30):
                raise RuntimeError(f"the leader {leader.address} outlived {sig!r} by 30 s")
            lc.start_master(leader)
        while True:
            try:
                c.update(key, b"after")
                secs = time.perf_counter() - t0
                break
            except Exception:
                # The client retries with backoff by itself; this only bounds the attempt.
                if time.perf_counter() - t0 > 300:
                    raise
    if not restart:
        leader.wait(30)
        lc.start_master(leader)
    lc.wait_ready(120, expect=len(lc.masters))
    bench.add(name, secs, "s", "session_timeout_s", bench.opts.session_timeout_ms / 1000)
