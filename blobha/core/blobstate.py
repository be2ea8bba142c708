"""The committed state of a key, as ZooKeeper keeps it in ``/blobstore/<key>`` (see
blobha.zk.layout), and its JSON encoding: a plain value every layer reads, the wire's
conversions included."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

import xxhash

from blobha.core.acl import AccessControl, format_acl, parse_acl

__all__ = ["BlobState", "PastVersion", "write_tag"]


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
