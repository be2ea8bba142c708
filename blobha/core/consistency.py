"""Read-your-writes: the oldest view of a key a client accepts, and the rule that compares it
with a master's committed view."""

from __future__ import annotations

import enum
from dataclasses import dataclass

#: The version a client remembers for a key it deleted: newer than any version of that
#: incarnation, so a master still showing one of them is behind, and one that shows the key
#: gone, or created again since, is not.
DELETED = 2**63 - 1


@dataclass(frozen=True, slots=True)
class MinVersion:
    """Version ``version`` of the key created at ``created_at``: the newest a client wrote or
    read. Versions count again from 1 when a key is deleted and created again, so the
    creation time tells which incarnation a version number belongs to."""

    version: int
    created_at: float

    def newer_than(self, version: int, created_at: float) -> bool:
        """Whether a view holding ``version`` of the key created at ``created_at`` is older
        than this minimum. Incarnations are ordered by their creation times, which the
        leaders' clocks give: a key created again later is newer whatever its version."""
        if created_at != self.created_at:
            return created_at < self.created_at
        return version < self.version

    def merge(self, other: MinVersion) -> MinVersion:
        """The newer of the two."""
        return other if other.newer_than(self.version, self.created_at) else self

    def describe(self) -> str:
        if self.version == DELETED:
            return "the key deleted"
        return f"v{self.version}"


class View(enum.IntEnum):
    """How fresh a read's view of its key must be (the wire's ``ReadView``)."""

    #: At least the client's minimum; with none, from a master that is in touch with
    #: ZooKeeper or has been cut off for no longer than ``blobstore.read.cutoff.secs``.
    SESSION = 0
    #: The latest committed version, confirmed with ZooKeeper before it is served.
    LINEARIZABLE = 1
    #: The last committed view the master knows (still at least the minimum), however long it
    #: has been cut off: the fallback once every master reached was cut off.
    LAST_KNOWN = 2
