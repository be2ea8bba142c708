"""The leader's side of the change journal (``/journal``, see :class:`JournalRecord`).

The leader keeps the newest entries in memory and adds a ``set_data`` of the whole record to
each fenced transaction that creates keys. Transactions are submitted in journal order while
holding the journal's lock (ZooKeeper applies one session's requests in order), so every
record written contains the entries of the transactions submitted before it; a transaction
that fails leaves its entry in later records, which costs readers one needless re-read.

A new leader continues from the record in ZooKeeper, so numbers keep growing across leaders
(readers treat a number going backwards as a gap and list every key).
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Iterable

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from blobha.zk.layout import JOURNAL, JournalRecord

#: Entries kept in the record. Readers fetch the record as soon as its watch fires, so they
#: fall behind by more than this only when cut off, and then they list every key once.
JOURNAL_ENTRIES = 128
#: Bound on the record's size (keys may be up to 512 bytes): it is rewritten by every commit.
JOURNAL_MAX_BYTES = 8 * 1024


class ChangeJournal:
    def __init__(self, zk: KazooClient) -> None:
        self.zk = zk
        #: Held while adding to the journal and submitting the transaction that writes it.
        self.lock = threading.Lock()
        self._term: int | None = None
        self._last = 0
        self._keys: deque[str] = deque()
        self._bytes = 0

    def record_for(self, term: int, keys: Iterable[str], timeout: float | None = None
                   ) -> bytes:
        """Append ``keys`` and return the record to write (caller holds :attr:`lock`).

        The first call of a leadership ``term`` loads the record a previous leader left,
        waiting at most ``timeout`` for it (then KazooTimeoutError): a read made just as the
        connection dropped is held by kazoo until ZooKeeper is back, and with it the commit
        and the lock."""
        if self._term != term:
            try:
                data, _ = self.zk.get_async(JOURNAL).get(timeout=timeout)
            except NoNodeError:
                data = b""
            loaded = JournalRecord.decode(data)
            self._term = term
            self._last = loaded.last
            self._keys = deque()
            self._bytes = 0
            for k in loaded.keys:
                self._push(k)
        for k in keys:
            self._last += 1
            self._push(k)
        return JournalRecord(self._last, tuple(self._keys)).encode()

    def _push(self, key: str) -> None:
        self._keys.append(key)
        self._bytes += _encoded_size(key)
        while len(self._keys) > JOURNAL_ENTRIES or (
            self._bytes > JOURNAL_MAX_BYTES and len(self._keys) > 1
        ):
            self._bytes -= _encoded_size(self._keys.popleft())


def _encoded_size(key: str) -> int:
    """Bytes ``key`` takes in the encoded record (quoted, escaped, and a comma)."""
    return len(json.dumps(key, ensure_ascii=False).encode()) + 1
