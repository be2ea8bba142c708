"""What blobha keeps in ZooKeeper, and how it is encoded. All paths are under the chroot.

::

    /blobstore/<key>                  committed metadata of a key (JSON, see blobha.core.blobstate)
    /blobstore/<key>/<host:port>-<seq> that master holds version <seq> durably (persistent:
                                      it counts only while /holders/<host:port> exists)
    /election/n_<seq>                 ephemeral sequential candidacies; lowest = leader
    /epoch                            the fencing token, bumped by every new leader
    /masters/<host:port>              ephemeral membership of live masters
    /holders/<host:port>              ephemeral: that master checked its replica nodes against
                                      its disk in this session, and they count
    /master-secret                    the cluster secret masters prove themselves with
    /master-secret-exposed            while it exists, the secret was readable by anyone (an
                                      open tree being locked down): the next start rotates it
    /blobstore-id                     the cluster id (a wiped ZooKeeper is not this cluster)
    /journal                          the last keys the leader created (JSON, see JournalRecord)
    /job-tokens/<id>                  a job token's hashed record (JSON, see JobTokenRecord)

The metadata znode's own ZooKeeper version is the key's ``meta_version``: every change (new
version, ACL, replication factor) is a version-conditional ``set_data``, so concurrent writers
cannot lose each other's updates.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

BLOBSTORE = "/blobstore"
ELECTION = "/election"
EPOCH = "/epoch"
MASTERS = "/masters"
#: Masters whose replica nodes count (see blobha.sync.verify): a master's death ends its
#: session, which removes this one node, not one node per key it held.
HOLDERS = "/holders"
MASTER_SECRET = "/master-secret"
#: Made by lock-down before it locks anything, removed with the rotation that follows it in one
#: transaction: a crash in between leaves it, and the next master to start rotates.
SECRET_EXPOSED = "/master-secret-exposed"
JOURNAL = "/journal"
JOB_TOKENS = "/job-tokens"
ALL_ROOTS = (BLOBSTORE, ELECTION, MASTERS, HOLDERS, JOURNAL, JOB_TOKENS)
#: Most bytes a key's record may take. ZooKeeper refuses a request larger than its
#: jute.maxbuffer (1 MB by default) by dropping the connection, again at each retry; a
#: commit's transaction carries the record with its replica node, fences and the change
#: journal's record (8 KiB at most), and a group commit's transactions stay under this too.
MAX_STATE_BYTES = 1_000_000


def job_token_path(token_id: str) -> str:
    return f"{JOB_TOKENS}/{token_id}"


def key_path(key: str) -> str:
    return f"{BLOBSTORE}/{key}"


def replica_name(address: str, seq: int) -> str:
    return f"{address}-{seq}"


def replica_path(key: str, address: str, seq: int) -> str:
    return f"{BLOBSTORE}/{key}/{replica_name(address, seq)}"


def parse_replica(name: str) -> tuple[str, int] | None:
    """``nimbus-1:7800-12`` -> (``nimbus-1:7800``, 12); None for anything else.

    The sequence is after the LAST dash, so host names with dashes parse correctly.
    """
    address, sep, seq = name.rpartition("-")
    # isascii(): str.isdigit() also accepts digits such as '²' that int() refuses.
    if not sep or not (seq.isascii() and seq.isdigit()) or ":" not in address:
        return None
    return address, int(seq)


def latest_seq(names: list[str]) -> int:
    """The highest sequence among replica node names (0 if none)."""
    seqs = [p[1] for p in map(parse_replica, names) if p is not None]
    return max(seqs, default=0)


def holders(names: list[str], seq: int) -> list[str]:
    """Addresses of replicas holding exactly ``seq``: stale replicas never count."""
    out = []
    for name in names:
        p = parse_replica(name)
        if p is not None and p[1] == seq:
            out.append(p[0])
    return sorted(set(out))


@dataclass(frozen=True)
class EpochRecord:
    epoch: int
    leader: str

    def encode(self) -> bytes:
        return json.dumps({"epoch": self.epoch, "leader": self.leader}).encode()

    @classmethod
    def decode(cls, data: bytes) -> EpochRecord:
        if not data:
            return cls(0, "")
        d = json.loads(data)
        return cls(int(d["epoch"]), str(d["leader"]))


@dataclass(frozen=True)
class JournalRecord:
    """The change journal: the keys of the leader's last creates, numbered.

    Every leader transaction that creates a key also rewrites ``/journal`` with the newest
    entries, so a master watching that one znode learns of new keys without listing
    ``/blobstore`` (linear in the number of keys) after every create; every other change of a
    key fires the watch each master keeps on that key's metadata. Entry ``i`` of
    ``keys`` has number ``last - len(keys) + 1 + i``. An entry is a hint to look at a key,
    never a state: a number that was skipped, or a key whose transaction failed, only costs a
    re-read.
    """

    last: int
    keys: tuple[str, ...]

    @property
    def first(self) -> int:
        return self.last - len(self.keys) + 1

    def encode(self) -> bytes:
        return json.dumps({"last": self.last, "keys": list(self.keys)},
                          separators=(",", ":"), ensure_ascii=False).encode()

    @classmethod
    def decode(cls, data: bytes) -> JournalRecord:
        """The record, or an empty one for an empty or unreadable znode (a reader then
        finds a gap and lists the keys, which is always safe)."""
        try:
            raw = json.loads(data) if data else {}
            keys = raw.get("keys", [])
            last = raw.get("last", 0)
            if (not isinstance(last, int) or not isinstance(keys, list)
                    or not all(isinstance(k, str) for k in keys)):
                raise ValueError("malformed journal")
            return cls(last, tuple(keys))
        except (ValueError, AttributeError, TypeError):
            return cls(0, ())

    def since(self, seen: int) -> tuple[str, ...] | None:
        """The keys changed after entry ``seen``; None if some are no longer in the record
        (or the journal restarted), so the caller must look at every key instead."""
        if self.last < seen or self.first > seen + 1:
            return None
        return self.keys[len(self.keys) - (self.last - seen):] if self.last > seen else ()


@dataclass(frozen=True)
class JobTokenRecord:
    """A job token as stored in ``/job-tokens/<id>``: never the token, only its hash
    (:func:`blobha.core.auth.job_token_hash`), and what it grants: READ on ``keys``, as
    ``user``, until ``expires_at`` (wall-clock seconds since the epoch)."""

    user: str
    keys: tuple[str, ...]
    issued_at: float
    expires_at: float
    digest: str

    def encode(self) -> bytes:
        return json.dumps({"user": self.user, "keys": list(self.keys),
                           "issued_at": self.issued_at, "expires_at": self.expires_at,
                           "digest": self.digest},
                          separators=(",", ":"), ensure_ascii=False).encode()

    @classmethod
    def decode(cls, data: bytes) -> JobTokenRecord:
        """The record; ValueError if it is not one (a reader then refuses the token)."""
        try:
            d = json.loads(data)
            keys = d["keys"]
            if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
                raise ValueError("keys")
            return cls(str(d["user"]), tuple(keys), float(d["issued_at"]),
                       float(d["expires_at"]), str(d["digest"]))
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
            raise ValueError(f"not a job token record: {e}") from None
