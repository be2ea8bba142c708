"""The synchroniser's settings: those the master's configuration sets, and the tunables."""

from __future__ import annotations

from dataclasses import dataclass

#: A listing follows the last no sooner than this many times its duration after it: listings
#: then take at most 1/(1+KEY_LIST_PACING) of the time.
KEY_LIST_PACING = 4.0
#: Keys a worker takes at once: their ZooKeeper reads are pipelined (one round trip for the
#: batch instead of two per key) and their replica nodes registered in a few transactions.
BATCH = 200
#: Reads per multiRead request: records are a few hundred bytes (1 MB at most), so an answer
#: stays small while the per-request costs are shared.
MULTI_READS = 50
#: Replica nodes created per ZooKeeper transaction (a multi-op is one request, well under
#: jute.maxbuffer at this size).
REGISTER_BATCH = 100
#: Creates of one replica node before giving up until the next pass (each failed one found
#: another session's node in the way).
REGISTER_ATTEMPTS = 3
#: Blobs up to this size are fetched into memory and installed a batch at a time (two
#: file-system syncs per batch); bigger ones stream to a temp file and install one by one.
SMALL_BLOB = 64 * 1024
#: Versions asked for in one FetchVersions call (a master serves up to 1,000).
FETCH_BATCH = 200
#: The periodic thread's step while it hands out a paced pass or re-reads lists.
PACE_STEP = 0.25
#: Replica lists each master re-reads per second after masters leave (one read per key):
#: 100,000 keys in under a minute, at a fraction of the periodic pass's cost per key.
RECHECK_KEYS_PER_SEC = 2000
#: Bound on waiting for one pipelined ZooKeeper answer; a dead connection fails sooner.
READ_TIMEOUT = 60.0
#: How long the queue holds no batch beyond a short hold after one showed a writer waiting for
#: this master's copy (see WorkQueue.hurry): long enough to span such a writer's gaps.
HURRY_SECS = 2.0
#: At most this many keys' creations are followed from their events (InFlight.born); past it,
#: keys are read with their lists as before.
BORN_MAX = 10_000
#: While ZooKeeper is out of reach, the keys whose sync failed for it are reported in one
#: warning per this many seconds, not one per key and retry (a master syncing many keys
#: flooded its log with such lines in a short outage).
UNREACHABLE_REPORT_SECS = 10.0
#: A reconcile this soon after the leader's commit arms the replica list's watch with its
#: first read (see Synchronizer.registered): the other holders are most likely still fetching
#: then, so the list is due to move. One that comes later (a backlog) reads it plainly, so
#: that no watch is left on a key whose copies were all in place already.
ARM_ON_READ_SECS = 0.25


@dataclass(frozen=True)
class SyncSettings:
    replica_grace_secs: float
    delete_grace_secs: float
    period_secs: float
    versions_retained: int
    threads: int
    #: Pace of the periodic safety-net pass. Kept slow: a fast pass made more ZooKeeper
    #: traffic than the creates themselves and slowed them; watches, not this pass, keep
    #: replicas current.
    periodic_keys_per_sec: float
    #: Follow ``/blobstore`` with one persistent recursive watch (ZooKeeper 3.6 and later)
    #: instead of the change journal and a one-shot watch per key (the masters set it from
    #: ``blobstore.sync.recursive.watch``, on by default).
    recursive_watch: bool = True
    #: How long a key may wait for others to join its batch while another batch is being
    #: handled or a stream of writes goes on (see blobha.sync.workqueue;
    #: ``blobstore.sync.linger.secs``).
    linger_secs: float = 0.0
    # The tunables (see the constants above); tests set them, the masters keep the defaults.
    key_list_pacing: float = KEY_LIST_PACING
    batch: int = BATCH
    multi_reads: int = MULTI_READS
    register_batch: int = REGISTER_BATCH
    register_attempts: int = REGISTER_ATTEMPTS
    small_blob: int = SMALL_BLOB
    fetch_batch: int = FETCH_BATCH
    pace_step: float = PACE_STEP
    recheck_keys_per_sec: int = RECHECK_KEYS_PER_SEC
    read_timeout: float = READ_TIMEOUT
    hurry_secs: float = HURRY_SECS
    born_max: int = BORN_MAX
    unreachable_report_secs: float = UNREACHABLE_REPORT_SECS
    arm_on_read_secs: float = ARM_ON_READ_SECS


__all__ = ["SyncSettings"]
