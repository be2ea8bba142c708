"""What blobha keeps in ZooKeeper, and how it is encoded. All paths are under the chroot.

::

    /blobstore/<key>                  committed metadata of a key (JSON, see BlobState)
    /blobstore/<key>/<host:port>-<seq> ephemeral: that master holds version <seq> durably
    /election/n_<seq>                 ephemeral sequential candidacies; lowest = leader
    /epoch                            the fencing token, bumped by every new leader
    /masters/<host:port>              ephemeral membership of live masters
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
from dataclasses import dataclass, field, replace
from typing import Any

import xxhash

from blobha.core.acl import AccessControl, format_acl, parse_acl

BLOBSTORE = "/blobstore"
ELECTION = "/election"
EPOCH = "/epoch"
MASTERS = "/masters"
MASTER_SECRET = "/master-secret"
#: Made by lock-down before it locks anything, removed with the rotation that follows it in one
#: transaction: a crash in between leaves it, and the next master to start rotates.
SECRET_EXPOSED = "/master-secret-exposed"
JOURNAL = "/journal"
JOB_TOKENS = "/job-tokens"
ALL_ROOTS = (BLOBSTORE, ELECTION, MASTERS, JOURNAL, JOB_TOKENS)
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
class PastVersion:
    seq: int
    size: int
    digest: str
    #: The write's tag (see BlobState.write_tag), kept so a retry still finds it once superseded.
    write_tag: str = ""


def _past_record(past: PastVersion) -> dict[str, Any]:
    d: dict[str, Any] = {"seq": past.seq, "size": past.size, "digest": past.digest}
    if past.write_tag:
        d["write_tag"] = past.write_tag
    return d


@dataclass(frozen=True)
class BlobState:
    """The committed state of one key, as stored in ``/blobstore/<key>``."""

    seq: int
    size: int
    digest: str
    acl: tuple[AccessControl, ...]
    replication_factor: int
    creator: str
    created_at: float
    updated_at: float
    #: Epoch of the leader that committed ``seq``.
    epoch: int
    #: True once the write quorum held ``seq`` and the client was answered. An unacknowledged
    #: version that no live master holds may be rolled back; an acknowledged one never is.
    acked: bool
    write_quorum: int = 1
    #: Recent earlier versions, newest first, for roll-back.
    history: tuple[PastVersion, ...] = field(default=())
    #: Names the write that made ``seq`` (:func:`write_tag`; "" if none was named): a client
    #: retrying after a lost answer is told of this version instead of writing it again.
    write_tag: str = ""
    #: The other masters that confirmed, before the commit, a staged copy of ``seq`` (synced
    #: and digest-checked; see blobha.master.forward). They install it once they see this
    #: commit; until then it counts for the write quorum, never as a readable replica node.
    confirmed: tuple[str, ...] = field(default=())
    #: The znode version (filled in on read; not stored).
    meta_version: int = 0

    def encode(self) -> bytes:
        # Field by field, not dataclasses.asdict (its deep copy showed in a busy leader's
        # profile); a test checks that every field but meta_version is stored.
        d: dict[str, Any] = {
            "seq": self.seq, "size": self.size, "digest": self.digest,
            "acl": format_acl(self.acl), "replication_factor": self.replication_factor,
            "creator": self.creator, "created_at": self.created_at,
            "updated_at": self.updated_at, "epoch": self.epoch, "acked": self.acked,
            "write_quorum": self.write_quorum,
            "history": [_past_record(h) for h in self.history],
        }
        # Untagged writes store no tag: every byte is paid per key, by ZooKeeper and by every
        # master's view.
        if self.write_tag:
            d["write_tag"] = self.write_tag
        # Stored only when the write was forwarded: readers of an earlier release ignore it.
        if self.confirmed:
            d["confirmed"] = list(self.confirmed)
        # UTF-8 as is, not \u escapes: a name of non-ASCII characters took twice the room in
        # ZooKeeper's 1 MB (MAX_STATE_BYTES), and an ACL within the entry and name limits did
        # not fit. Every reader decodes either form.
        return json.dumps(d, separators=(",", ":"), ensure_ascii=False).encode()

    def size_bound(self) -> int:
        """An upper bound on ``len(self.encode())``, without encoding (much cheaper):
        what a write's record is checked against first, so that only a large one is encoded
        to be measured. Every text counts 6 bytes a character (a ``\\uXXXX`` escape, the
        most any takes), every number 24, and the field names a fixed 400."""
        texts = (sum(len(e.name) + 7 for e in self.acl) + len(self.creator)
                 + len(self.digest) + len(self.write_tag)
                 + sum(len(c) + 3 for c in self.confirmed))
        past = sum(120 + 6 * (len(h.digest) + len(h.write_tag)) for h in self.history)
        return 400 + 6 * texts + past

    @classmethod
    def decode(cls, data: bytes, meta_version: int = 0) -> BlobState:
        d = json.loads(data)
        # Not strict: names stored before the user-name rules applied to ACLs stay readable.
        d["acl"] = tuple(parse_acl(d["acl"], strict=False))
        d["history"] = tuple(PastVersion(**h) for h in d.get("history", ()))
        d["confirmed"] = tuple(str(c) for c in d.get("confirmed", ()))
        d["meta_version"] = meta_version
        return cls(**d)

    def with_new_version(
        self, seq: int, size: int, digest: str, now: float, epoch: int, write_quorum: int,
        keep_history: int, write_tag: str = "", undone: bool = False,
    ) -> BlobState:
        """The state after a new version; ``undone`` when the new version rolls the current
        one back (its write then no longer counts as made: a retry must write it again)."""
        tag = "" if undone else self.write_tag
        past = (PastVersion(self.seq, self.size, self.digest, tag), *self.history)[:keep_history]
        return replace(
            self, seq=seq, size=size, digest=digest, updated_at=now, epoch=epoch, acked=False,
            write_quorum=write_quorum, history=past, write_tag=write_tag, confirmed=(),
        )

    def written_by(self, tag: str) -> BlobState | None:
        """The version the write tagged ``tag`` made, if this state still records it: itself,
        or (superseded since) its entry in the history, as a state of that version."""
        if not tag:
            return None
        if self.write_tag == tag:
            return self
        for past in self.history:
            if past.write_tag == tag:
                # Superseded by a later commit: final once the current version is acknowledged
                # (no roll-back reaches below an acknowledged version); until then a roll-back
                # may still skip it, so it counts as acknowledged no sooner.
                return replace(self, seq=past.seq, size=past.size, digest=past.digest,
                               acked=self.acked, write_tag=tag)
        return None


def write_tag(user: str, write_id: bytes) -> str:
    """The tag stored for a write the client named ``write_id``: bound to the user, so nobody
    learns of another's write by guessing its id. "" for an unnamed write."""
    if not write_id:
        return ""
    return xxhash.xxh3_64_hexdigest(user.encode() + b"\0" + write_id)


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
