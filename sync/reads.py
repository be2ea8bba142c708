"""Pipelined reads of many keys' metadata and replica lists, for one batch."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError, UnimplementedError, ZookeeperError

from blobha.sync.feed import describe
from blobha.zk.connection import ReadResult, read_many
from blobha.zk.layout import key_path

if TYPE_CHECKING:
    from blobha.sync.feed import ChangeFeed
    from blobha.sync.settings import SyncSettings

log = logging.getLogger("blobha.sync.synchronizer")

#: One key's read: (metadata bytes, stat, replica names), None if the key is gone, or the error.
Read = tuple[bytes, Any, list[str]] | Exception | None


class KeyReader:
    def __init__(self, zk: KazooClient, feed: ChangeFeed, settings: SyncSettings) -> None:
        self.zk = zk
        self.feed = feed
        self.settings = settings
        #: Whether reads of many keys go in multiRead requests (with the recursive watch).
        self.multi_read = True

    def read_many(self, keys: list[str], armed: set[str],
                  listless: frozenset[str] | set[str] = frozenset()) -> dict[str, Read]:
        """Each key's (metadata bytes, stat, replica names), None if the key is gone, or the
        error; pipelined, each arming the watch on the key's metadata, and the keys in
        ``armed`` the one on their replica list too. The keys in ``listless``: their node
        alone, with no names."""
        recursive = self.feed.recursive
        if recursive and self.multi_read and not armed:
            try:
                return self._read_together(keys, listless)
            except UnimplementedError as e:
                # Not before ZooKeeper 3.6, which the recursive watch needs too: only a
                # server replaced by an older one since this master armed its watch.
                log.warning("ZooKeeper refused a multiRead (%s); reading keys one by one",
                            describe(e))
                self.multi_read = False
        pending = []
        # The recursive watch needs no watch set by reads (and arming none saves ZooKeeper a
        # watch per key).
        watcher = self.feed.watcher
        data_watch = None if recursive else watcher
        for key in keys:
            path = key_path(key)
            # Elsewhere the replica list without a watch: ChangeFeed.watch_replicas arms one
            # where it matters.
            pending.append((key, self.zk.get_async(path, watch=data_watch),
                            None if key in listless else self.zk.get_children_async(
                                path, watch=watcher if key in armed else None)))
        timeout = self.settings.read_timeout
        out: dict[str, Read] = {}
        for key, data_result, children_result in pending:
            try:
                data, stat = data_result.get(timeout=timeout)
                names = ([] if children_result is None else children_result.get(timeout=timeout))
                out[key] = (data, stat, names)
            except NoNodeError:
                out[key] = None
            except Exception as e:
                out[key] = e
        return out

    def _read_together(self, keys: list[str], listless: frozenset[str] | set[str]
                       ) -> dict[str, Read]:
        """:meth:`read_many` (no watches) in ``multiRead`` requests of ``multi_reads`` reads
        each, sent all at once: a follower reads every new key, and a request per read cost
        ZooKeeper, and each follower, noticeably more CPU per create."""
        reads: list[tuple[str, bool]] = []
        for key in keys:
            reads.append((key_path(key), False))
            if key not in listless:
                reads.append((key_path(key), True))
        results = read_many(self.zk, reads, self.settings.multi_reads,
                            self.settings.read_timeout)
        out: dict[str, Read] = {}
        at = 0
        for key in keys:
            node = results[at]
            names: ReadResult = [] if key in listless else results[at + 1]
            at += 1 if key in listless else 2
            if isinstance(node, NoNodeError):
                out[key] = None
            elif isinstance(node, Exception):
                out[key] = node
            elif isinstance(names, NoNodeError):
                out[key] = None  # deleted between the two reads
            elif isinstance(names, Exception):
                out[key] = names
            elif isinstance(node, tuple) and isinstance(names, list):
                out[key] = (node[0], node[1], names)
            else:
                out[key] = ZookeeperError(f"unexpected multiRead answer for {key!r}")
        return out


__all__ = ["KeyReader", "Read"]
