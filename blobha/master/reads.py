"""Reads: metadata, downloads, the versions masters fetch from each other, listings and
replication status."""

from __future__ import annotations

import base64
import bisect
import itertools
import logging
from collections.abc import Iterable, Iterator, Sequence

from kazoo.client import KazooClient
from kazoo.exceptions import (
    NoNodeError,
)

from blobha.core import acl as acls
from blobha.core.blobstate import BlobState
from blobha.core.consistency import MinVersion, View
from blobha.core.digest import PUT_MAX_BYTES
from blobha.core.errors import (
    ChecksumMismatch,
    InvalidArgument,
    KeyNotFound,
    NotAuthorized,
    Stale,
    Unavailable,
)
from blobha.core.keys import validate_key
from blobha.master.channel import Channel
from blobha.master.metadata import Metadata
from blobha.master.rules import (
    Authority,
    no_such_key,
    replication_status,
)
from blobha.master.settings import MasterSettings
from blobha.store.local import LocalStore, VersionInfo
from blobha.sync import KeyView, ReplicaSync
from blobha.wire.datachannel import MIN_BYTES, DataOffer
from blobha.wire.status import ReplicationStatus
from blobha.zk.connection import UNREACHABLE
from blobha.zk.contact import CutOffClock
from blobha.zk.layout import key_path

log = logging.getLogger("blobha.master")


DEFAULT_PAGE = 100
MAX_PAGE = 1000
#: Versions one FetchVersions call may name, and the largest that comes whole in it (a sync
#: batch of small blobs; anything bigger goes through Download, resumable).
FETCH_MAX_VERSIONS = 1000
FETCH_WHOLE_MAX_BYTES = PUT_MAX_BYTES


def keys_after(keys: list[str], prefix: str, after: str) -> Iterator[str]:
    """The keys of sorted ``keys`` that start with ``prefix`` and sort after ``after`` (a
    page token; "" for the first page), in order. The start is found by bisection, so each
    page costs its own size and a full listing is linear in the keys, not quadratic."""
    start = bisect.bisect_left(keys, prefix)
    if after:
        start = max(start, bisect.bisect_right(keys, after))
    return itertools.takewhile(lambda k: k.startswith(prefix), itertools.islice(keys, start, None))


def _read_held(store: LocalStore, identity: str, key: str, seq: int, offset: int, length: int
              ) -> Iterator[bytes]:
    """``store.read``, which runs when the stream starts: a version removed since the caller
    found it (a copy dropped beyond its placement, a prune) is then "not held here", as for a
    master that never held it, and the client reads from another replica instead of failing
    the read of a blob that other masters hold."""
    try:
        yield from store.read(key, seq, offset, length)
    except KeyNotFound:
        raise KeyNotFound(
            f"not held here: {identity} no longer holds v{seq} of {key!r}; read from a replica"
            " listed by GetReplication"
        ) from None


class Reads:
    """The read operations; any master serves them."""

    def __init__(self, settings: MasterSettings, identity: str, principal: str,
                 store: LocalStore, zk: KazooClient, meta: Metadata, authority: Authority,
                 sync: ReplicaSync, channel: Channel, cut_off: CutOffClock | None = None
                 ) -> None:
        self.settings = settings
        self.identity = identity
        self.principal = principal
        self.store = store
        self.zk = zk
        self.meta = meta
        self.authority = authority
        self.sync = sync
        self.channel = channel
        self.cut_off = cut_off or CutOffClock(zk, settings.session_timeout)

    def state_for_read(self, key: str, minimum: MinVersion | None = None,
                       view: View = View.SESSION) -> tuple[BlobState, KeyView | None]:
        """The committed state of ``key`` for a read: from ZooKeeper, or, when ZooKeeper is
        unreachable, the last committed state this master saw (returned with its view).

        Serving the last known state keeps reads of committed blobs working through a
        ZooKeeper outage, which is when they matter most. It cannot hand out anything that was
        never committed: the synchronizer's view only holds states read from ZooKeeper, versions
        are immutable, and every byte is still checked against its digest. Without quorum no
        newer version can commit, and a view with a change announced but not read (or not read
        since a reconnect) is refused, so the view is stale only on a master cut off alone.

        ``minimum`` is the oldest view the client accepts (read-your-writes): a view older than
        it raises :class:`Stale`, and the client asks another master, so a master cut off
        from ZooKeeper still serves every client that has not seen a newer version.

        ``view``: LINEARIZABLE reads only what ZooKeeper confirms, after a ``sync``, as the
        latest committed state (UNAVAILABLE when it cannot); SESSION and LAST_KNOWN differ in a
        read with no minimum on a master cut off longer than ``read_cutoff_secs``, which
        SESSION refuses as :class:`Stale` (see :meth:`_last_seen`)."""
        if view == View.LINEARIZABLE:
            return self._at_least(key, self._confirmed(key), minimum), None
        try:
            if minimum is None:
                return self.meta.state_or_404(key), None
            state = self.meta.read_state(key)
            if state is None or minimum.newer_than(state.seq, state.created_at):
                # Older than what the client saw committed: this master's ZooKeeper server may
                # trail. A synced read is the latest committed state.
                state = self.meta.read_state_synced(key)
        except (Unavailable, *UNREACHABLE):
            return self._last_seen(key, minimum, view)
        if state is None:
            raise no_such_key(key)
        return self._at_least(key, state, minimum), None

    def _at_least(self, key: str, state: BlobState, minimum: MinVersion | None) -> BlobState:
        """``state`` if it is not older than ``minimum``. Older, it was read after a ``sync``
        (see the callers), so this ZooKeeper server lost or skipped a change the client saw
        committed: the guarantee is never to answer older, whatever the source, so the client
        asks another master. Checked outside the callers' ``try``: a Stale raised there would
        be taken for ZooKeeper out of reach and answered from the last view."""
        if minimum is None or not minimum.newer_than(state.seq, state.created_at):
            return state
        log.warning("ZooKeeper shows v%d of %r after a sync, older than %s a client has seen"
                    " committed; refused the read", state.seq, key, minimum.describe())
        raise Stale(
            f"master {self.identity}'s ZooKeeper server shows v{state.seq} of {key!r} even after"
            f" a sync, older than what this client has seen ({minimum.describe()}); retry at"
            " another master"
        )

    def _confirmed(self, key: str) -> BlobState:
        """The latest committed state of ``key``: read after a ``sync``, which brings this
        master's ZooKeeper server up to every write committed before it began."""
        try:
            state = self.meta.read_state_synced(key)
        except (Unavailable, *UNREACHABLE):
            raise Unavailable(
                f"master {self.identity} cannot confirm the latest version of {key!r} with"
                " ZooKeeper (unreachable from it); retry, at another master or later"
            ) from None
        if state is None:
            raise no_such_key(key)
        return state

    def _last_seen(self, key: str, minimum: MinVersion | None, view: View
                   ) -> tuple[BlobState, KeyView]:
        """The state of ``key`` this master last saw, ZooKeeper being unreachable."""
        seen = self.sync.view(key)
        if seen is None:
            raise Unavailable(
                f"ZooKeeper is unreachable from master {self.identity} and it has no record"
                f" of {key!r}; retry shortly or read from another master"
            ) from None
        state = seen.state
        if seen.behind:
            # ZooKeeper announced a change this master had not read when it went out of reach
            # (or the view predates a reconnect and was not read again): a newer version may
            # have been acknowledged meanwhile, and an outage is no excuse to answer older.
            # Another master that read the change serves it.
            raise Stale(
                f"master {self.identity}'s view of {key!r} (v{state.seq}) misses a change"
                " ZooKeeper announced before it went out of reach; retry at another master"
            ) from None
        if minimum is not None and minimum.newer_than(state.seq, state.created_at):
            raise Stale(
                f"master {self.identity}'s view of {key!r} (v{state.seq}) is behind what this"
                f" client has seen ({minimum.describe()}): ZooKeeper is unreachable from it;"
                " retry at another master"
            ) from None
        cut_off = self.cut_off.seconds()
        if minimum is None and view == View.SESSION and cut_off > self.settings.read_cutoff_secs:
            # Others may have committed since: "latest" would be a guess. A client that has
            # seen a version still gets its guarantee above; one with none asks elsewhere, or
            # asks for this view as the last known when no master is in touch.
            raise Stale(
                f"master {self.identity} has been cut off from ZooKeeper for {cut_off:.0f} s,"
                f" so its view of {key!r} (v{state.seq}) may not be the latest; retry at"
                " another master"
            )
        # Debug only: during an outage this runs for every read (health shows the outage).
        log.debug("ZooKeeper unreachable: serving the last committed state of %r (v%d)",
                  key, state.seq)
        return state, seen

    def get_meta(self, user: str, key: str, any_access: bool = False,
                 minimum: MinVersion | None = None, view: View = View.SESSION
                 ) -> tuple[BlobState, int]:
        """A key's metadata and its live replicas, for a reader; with ``any_access``, for a user
        holding any permission on it (as Storm's getBlobMeta): a writer needs the version to
        update conditionally and to delete only the key it read, an administrator the ACL it
        sets again. The caller's permissions (:meth:`access`) go with the answer."""
        validate_key(key)
        state, seen = self.state_for_read(key, minimum, view)
        if not any_access:
            self.authority.require(user, state.acl, acls.READ, key)
        elif not self.authority.access(user, state.acl, key):
            raise NotAuthorized(
                f"user {user!r} has no permission on {key!r} (any of READ, WRITE or ADMIN shows"
                " its metadata); ask a user with ADMIN on it to grant access"
            )
        live = self.sync.membership.live()
        if seen is not None:
            # The view's holders are those that count already.
            return state, replication_status(key, state, seen.holders, live).replication
        return state, self.meta.replication(key, state, live,
                                            self.sync.membership.holding()).replication

    def open_download(
        self, user: str, key: str, version: int, offset: int, length: int,
        data_channel: bool = False, minimum: MinVersion | None = None,
        view: View = View.SESSION,
    ) -> tuple[VersionInfo, float, Iterator[bytes] | DataOffer]:
        """The version to serve and its bytes from ``offset`` (``length`` 0: to the end): a
        verifying reader, or, when the caller can take the data channel, this master has one
        and the range is not small, an offer of it (a connection of its own costs more than
        the copies it saves on a small range). The key's creation time goes with them (0 to a
        master syncing), for the client to remember with the version."""
        info, created_at = self._download_version(user, key, version, offset, minimum, view)
        end = info.size if length == 0 else min(info.size, offset + length)
        server = self.channel.offers
        if data_channel and server is not None and end - offset >= MIN_BYTES:
            return info, created_at, DataOffer(server.port, server.offer(info, offset, end))
        return info, created_at, _read_held(self.store, self.identity, key, info.seq, offset,
                                            length)

    def version_for_read(self, user: str, key: str, version: int,
                         minimum: MinVersion | None, view: View) -> tuple[VersionInfo, float]:
        """The version ``user`` may read (READ checked; 0: the committed one) as this master
        holds it, and the key's creation time; "not held here" when it does not."""
        if user == self.principal:
            # A plan is for node caches; a master reads from its peers as it always did.
            raise InvalidArgument("masters do not plan peer fetches")
        return self._download_version(user, key, version, 0, minimum, view)

    def _download_version(self, user: str, key: str, version: int, offset: int,
                          minimum: MinVersion | None, view: View
                          ) -> tuple[VersionInfo, float]:
        validate_key(key)
        if user == self.principal and version:
            # Masters syncing from each other may ask for any version this master keeps; the
            # principal is authenticated by the cluster secret (blobha.wire.authn), never claimed.
            info = self.store.info(key, version)
            if info is None:
                raise KeyNotFound(f"not held here: {self.identity} has no v{version} of {key!r}")
            if offset > info.size:
                raise InvalidArgument(
                    f"offset {offset} is past the end of {key!r} ({info.size} bytes)")
            return info, 0.0
        state, _ = self.state_for_read(key, minimum, view)
        self.authority.require(user, state.acl, acls.READ, key)
        seq = version or state.seq
        if seq > state.seq:
            raise KeyNotFound(f"{key!r} has no version {seq}; the latest is {state.seq}")
        kept = self.settings.versions_retained
        if seq <= state.seq - kept:
            # No master keeps it (each keeps the newest ``kept``): said as such, so the client
            # stops instead of asking every replica until its deadline.
            raise KeyNotFound(
                f"{key!r} v{seq} is no longer kept: the masters keep the newest {kept} versions"
                f" (v{state.seq - kept + 1} to v{state.seq}, blobstore.versions.retained)"
            )
        # The version's digest as ZooKeeper records it: a file of an earlier incarnation of the
        # key (deleted and created again while this master was away) may sit under the same
        # version number, and must never be served as this one.
        expected = next((p.digest for p in state.history if p.seq == seq),
                        state.digest if seq == state.seq else None)
        info = self.store.info(key, seq)
        if info is None or info.digest != expected:
            raise KeyNotFound(
                f"not held here: {self.identity} does not hold v{seq} of {key!r}; read from a"
                " replica listed by GetReplication"
            )
        if offset > info.size:
            raise InvalidArgument(f"offset {offset} is past the end of {key!r} ({info.size} bytes)")
        return info, state.created_at

    def fetch_versions(self, user: str, refs: Sequence[tuple[str, int]]
                       ) -> Iterator[tuple[str, int, VersionInfo | None, bytes]]:
        """For a master syncing: each named version whole, verified against its stored digests
        as it is read, as (key, seq, info, data); info None where this master does not hold it
        (or it is too big to come whole, or it failed its digest and was removed). A version
        installed lately comes from memory (:meth:`LocalStore.recent`): the bytes whose digest
        its install checked, which the fetching master checks again."""
        if user != self.principal:
            raise NotAuthorized(
                f"{user!r} may not call FetchVersions: it is for masters syncing from each"
                " other; read blobs with Download"
            )
        if len(refs) > FETCH_MAX_VERSIONS:
            raise InvalidArgument(
                f"{len(refs)} versions asked for in one call; ask for at most"
                f" {FETCH_MAX_VERSIONS}"
            )
        for key, _ in refs:
            validate_key(key)
        return self._fetch_versions(refs)

    def _fetch_versions(self, refs: Sequence[tuple[str, int]]
                        ) -> Iterator[tuple[str, int, VersionInfo | None, bytes]]:
        for key, seq in refs:
            recent = self.store.recent(key, seq) if seq else None
            if recent is not None:
                yield key, seq, *recent
                continue
            info = self.store.info(key, seq) if seq else None
            if info is None or info.size > FETCH_WHOLE_MAX_BYTES:
                yield key, seq, None, b""
                continue
            try:
                data = b"".join(self.store.read(key, seq))
            except (KeyNotFound, ChecksumMismatch):
                # Deleted meanwhile, or corrupt here (then removed by the store): the caller
                # takes it from another replica.
                yield key, seq, None, b""
                continue
            yield key, seq, info, data

    def list_keys(self, user: str, prefix: str, page_token: str, page_size: int
                  ) -> tuple[list[str], str]:
        self.meta.require_zk()
        size = min(page_size or DEFAULT_PAGE, MAX_PAGE)
        after = ""
        if page_token:
            try:
                after = base64.urlsafe_b64decode(page_token.encode()).decode()
            except (ValueError, UnicodeDecodeError):
                raise InvalidArgument("bad page token; start the listing again") from None
        candidates = keys_after(self.meta.sorted_keys(), prefix, after)
        if self.settings.list_visibility == "all" or self.authority.privileged(user):
            page = list(itertools.islice(candidates, size + 1))
            more = len(page) > size
            page = page[:size]
        else:
            page, more = self._readable(user, candidates, size)
        token = ""
        if more and page:
            token = base64.urlsafe_b64encode(page[-1].encode()).decode()
        return page, token

    def _readable(self, user: str, keys: Iterable[str], size: int) -> tuple[list[str], bool]:
        """Up to ``size`` of ``keys`` that ``user`` may READ, and whether more may follow."""
        page: list[str] = []
        batch = 256  # pipelined reads: one round trip per batch, not per key
        it = iter(keys)
        while chunk := list(itertools.islice(it, batch)):
            # The ACL comes from the synchroniser's watched view when it has the key (it
            # trails ZooKeeper by a watch event, and a listing shows names, never content);
            # only keys it has not seen yet are read from ZooKeeper, pipelined.
            views = [self.sync.view(k) for k in chunk]
            pending = [self.zk.get_async(key_path(k)) if v is None else None
                       for k, v in zip(chunk, views, strict=True)]
            for i, (key, view, result) in enumerate(zip(chunk, views, pending, strict=True)):
                if view is not None:
                    acl = view.state.acl
                else:
                    assert result is not None
                    try:
                        data, stat = self.meta.answer(result)
                    except NoNodeError:
                        continue  # deleted meanwhile
                    acl = BlobState.decode(data, stat.version).acl
                if acls.allowed(acl, user, acls.READ):
                    page.append(key)
                    if len(page) == size:
                        # More may follow if this chunk or the rest still has keys.
                        return page, i + 1 < len(chunk) or next(it, None) is not None
        return page, False

    def get_replication(self, user: str, key: str, minimum: MinVersion | None = None,
                        view: View = View.SESSION) -> ReplicationStatus:
        validate_key(key)
        state, seen = self.state_for_read(key, minimum, view)
        self.authority.require(user, state.acl, acls.READ, key)
        if seen is not None:
            return replication_status(key, state, seen.holders,
                                      self.sync.membership.live())
        return self.meta.replication(key, state, self.sync.membership.live(),
                                     self.sync.membership.holding())
