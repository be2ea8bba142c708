"""A blob master: the operations of the blob store, wired to ZooKeeper, the local store, the
election and the synchroniser. The gRPC servicer (:mod:`blobha.master.edge.service`) is a thin
edge over it.

Write path (ha-rule 13)::

    temp file -> append chunks -> fsync -> verify size and digest -> rename into place
    -> fsync directory -> fenced ZooKeeper commit -> register replica node
    -> wait until W masters hold the version -> mark it acknowledged -> answer the client

Guarantee: a create or update that returned success is held durably (fsynced, digest-verified)
by at least W masters, and is the committed version of its key at that moment. A later version
may replace it, a delete may remove it, but no failure rolls it back: roll-back only ever applies
to a version that was never acknowledged and that no live master holds.
"""

from __future__ import annotations

import base64
import bisect
import contextlib
import itertools
import json
import logging
import math
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import (
    BadVersionError,
    ConnectionLoss,
    KazooException,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
    SessionExpiredError,
)
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.protocol.states import WatchedEvent
from kazoo.retry import KazooRetry

from blobha.core import acl as acls
from blobha.core import logs
from blobha.core.acl import AccessControl
from blobha.core.addresses import host_of
from blobha.core.auth import ServerAuthentication, make_authenticator, new_cluster_secret
from blobha.core.digest import PUT_MAX_BYTES, is_digest
from blobha.core.errors import (
    BlobError,
    ChecksumMismatch,
    DeadlineExceeded,
    InvalidArgument,
    KeyAlreadyExists,
    KeyNotFound,
    NotAuthorized,
    NotLeader,
    Unavailable,
    VersionConflict,
)
from blobha.core.keys import validate_key
from blobha.core.version import __version__
from blobha.leader import Deposed, LeaderElection, LeaderHistory, is_failure
from blobha.master.config import Config, ConfigError, format_cpu_list, load_config, parse_cpu_list
from blobha.master.edge.health import MasterHealth
from blobha.master.edge.metrics import MasterMetrics
from blobha.master.edge.statuspage import StatusServer, status_url
from blobha.master.groupcommit import GroupCommitter, Later
from blobha.master.scrub import Scrubber
from blobha.master.uploads import Upload, UploadManager
from blobha.store.local import LocalStore, VersionInfo, libc_function
from blobha.sync import (
    IdentityInUse,
    KeyView,
    Membership,
    SessionRecord,
    Synchronizer,
    SyncSettings,
)
from blobha.sync.peers import Peers
from blobha.wire.credentials import Credentials
from blobha.wire.dataplane import MIN_BYTES, DataOffer, DataPlane
from blobha.wire.status import MasterSummary, ReplicationStatus
from blobha.wire.tls import ReloadingServerCredentials
from blobha.zk import layout as zkstate
from blobha.zk.connection import UNREACHABLE, PollHandler, on_session_timeout
from blobha.zk.layout import (
    BLOBSTORE,
    EPOCH,
    MASTER_SECRET,
    BlobState,
    EpochRecord,
    PastVersion,
    key_path,
    replica_path,
    write_tag,
)
from blobha.zk.lockdown import ZkCredentials, ZooKeeperAuthError, ensure_locked_chroot

log = logging.getLogger("blobha.master")

DEFAULT_PAGE = 100
#: How long a cluster summary waits for its ZooKeeper reads.
SUMMARY_ZK_TIMEOUT = 2.0
MAX_PAGE = 1000
#: Versions one FetchVersions call may name, and the largest that comes whole in it (a sync
#: batch of small blobs; anything bigger goes through Download, resumable).
FETCH_MAX_VERSIONS = 1000
FETCH_WHOLE_MAX_BYTES = PUT_MAX_BYTES
#: Bytes of blob data one group commit installs at most: a batch is acknowledged only once
#: all of it is durable, so this bounds what one writer waits for on behalf of the others.
PUT_BATCH_BYTES = 8 * 1024 * 1024
#: A roll-back's fetch of a past version from one peer: this long, plus a second per
#: ROLLBACK_MIN_RATE bytes (a fixed minute never restored a large version over TLS). A peer
#: that stops sending is left sooner, at the fetch's stall limit.
ROLLBACK_FETCH_SECS = 60.0
ROLLBACK_MIN_RATE = 8 * 1024 * 1024
#: Keys whose reads a replication wait has in flight at once (two reads per key).
_WAIT_READ_BATCH = 256


def _no_such_key(key: str) -> KeyNotFound:
    return KeyNotFound(f"no blob with key {key!r}; 'blobha list' shows the keys")


def _status(key: str, state: BlobState, holders: Sequence[str]) -> ReplicationStatus:
    return ReplicationStatus(key, state.seq, len(holders), state.replication_factor,
                             tuple(holders))


@dataclass(frozen=True)
class _Put:
    """A whole small blob waiting for its group commit (see :meth:`Master.put`)."""

    user: str
    key: str
    create: bool
    acl: tuple[AccessControl, ...]
    #: Requested for a create; an update keeps the key's own.
    replication_factor: int
    write_quorum: int
    expected_version: int
    data: bytes
    digest: str
    write_tag: str = ""


def keys_after(keys: list[str], prefix: str, after: str) -> Iterator[str]:
    """The keys of sorted ``keys`` that start with ``prefix`` and sort after ``after`` (a
    page token; "" for the first page), in order. The start is found by bisection, so each
    page costs its own size and a full listing is linear in the keys, not quadratic."""
    start = bisect.bisect_left(keys, prefix)
    if after:
        start = max(start, bisect.bisect_right(keys, after))
    return itertools.takewhile(lambda k: k.startswith(prefix), itertools.islice(keys, start, None))


@dataclass(frozen=True)
class ClusterView:
    masters: tuple[MasterSummary, ...]
    leader: str
    epoch: int
    blob_count: int
    under_replicated: int
    #: Answered without ZooKeeper: the masters last seen, and the blob count unknown (0).
    zookeeper_unreachable: bool = False


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


class Master:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.identity = config.advertise
        self.principal = str(config["master.principal"])
        self.admins = config.admins
        self.started = time.monotonic()
        self.session_timeout = config["zookeeper.session.timeout.ms"] / 1000.0
        self.store = LocalStore(config.data_dir, config["blobstore.disk.reserved.bytes"])
        hosts = config["zookeeper.servers"] + config["zookeeper.chroot"]
        try:
            self.zk_credentials = (
                ZkCredentials.from_file(config["zookeeper.auth.file"])
                if config["zookeeper.auth.scheme"] == "digest" else None
            )
            self.authentication = ServerAuthentication(
                make_authenticator(config["auth.mode"], config["auth.token.file"],
                                   config["auth.mtls.rules"]),
                self.principal, lambda: self._cluster_secret,
            )
            self.server_tls = (
                ReloadingServerCredentials(
                    config["tls.cert"], config["tls.key"], config["tls.ca"],
                    require_client_cert=config["auth.mode"] == "mtls",
                ) if config["tls.cert"] else None
            )
        except (ValueError, ZooKeeperAuthError) as e:
            raise ConfigError(str(e)) from None
        self._cluster_secret = ""
        self._zk_hosts = hosts
        self.zk = KazooClient(
            hosts=hosts,
            timeout=self.session_timeout,
            # Reconnect forever, but never let kazoo retry our *operations* across sessions:
            # a leader write must not land on a fresh session after leadership was lost.
            connection_retry=KazooRetry(max_tries=-1, max_delay=2.0),
            command_retry=KazooRetry(max_tries=0, ignore_expire=False),
            handler=PollHandler(),
            **(self.zk_credentials.kazoo_args() if self.zk_credentials else {}),
        )
        # Masters reach each other with this master's own certificate as client certificate.
        self.peers = Peers(self.principal, Credentials(
            ca=config["tls.ca"] or None, cert=config["tls.cert"] or None,
            key=config["tls.key"] or None,
        ) if config["tls.cert"] else None, stall_secs=config["blobstore.sync.stall.secs"])
        self.uploads = UploadManager(self.store, config["blobstore.upload.expiration.secs"],
                                     config["blobstore.upload.max.per.user"])
        self.puts: GroupCommitter[_Put, BlobState] = GroupCommitter(
            self._commit_puts, key=lambda p: p.key, name="put-commit",
            weight=lambda p: len(p.data), max_weight=PUT_BATCH_BYTES,
        )
        self.election = LeaderElection(
            self.zk, self.identity, self.session_timeout, self._on_elected, self._on_deposed
        )
        on_session_timeout(self.zk, self._session_granted)
        self.history = LeaderHistory()
        self.health = MasterHealth(self.zk)
        self.metrics = MasterMetrics(self)
        self._status_server: StatusServer | None = None
        #: The data channel (blobha.wire.dataplane), started with the gRPC server unless turned off.
        self.dataplane: DataPlane | None = None
        info: dict[str, object] = {"address": self.identity, "version": __version__,
                                   "pid": os.getpid(), "host": socket.gethostname()}
        if config.metrics_listen:
            info["status_url"] = status_url(config.metrics_listen, self.identity)
        self.membership = Membership(
            self.zk, self.identity, config["blobstore.replica.grace.secs"],
            on_change=self._membership_changed, info=info,
            # A predecessor's session (this identity, a master that died) expires within its
            # timeout, one tick late at worst; at once if it was this data directory's.
            claim_secs=2 * self.session_timeout + 2,
            record=SessionRecord(config.data_dir, self._end_session),
            on_leave=self._master_left,
        )
        self.sync = Synchronizer(
            self.zk, self.store, self.identity, self.peers, self.membership,
            SyncSettings(
                replica_grace_secs=config["blobstore.replica.grace.secs"],
                delete_grace_secs=config["blobstore.delete.grace.secs"],
                period_secs=config["blobstore.sync.period.secs"],
                versions_retained=config["blobstore.versions.retained"],
                threads=config["blobstore.sync.threads"],
                periodic_keys_per_sec=config["blobstore.sync.periodic.keys.per.sec"],
                recursive_watch=config["blobstore.sync.recursive.watch"],
                linger_secs=config["blobstore.sync.linger.secs"],
            ),
            duties=self, guard=self,
        )
        self.store.on_corrupt = self.sync.corrupted
        self.scrubber = Scrubber(
            self.store, config["blobstore.scrub.interval.secs"],
            config["blobstore.scrub.rate.bytes.per.sec"],
        )
        self._cluster_id_ok = False
        self._cluster_id = ""
        self._identity_alarm = False
        self._key_list: tuple[int, list[str]] | None = None  # (cversion, sorted keys)
        self._server: grpc.Server | None = None
        self._stopped = threading.Event()
        self._summary_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="summary")
        # The replication waits in progress, per key path, woken by one watch callback
        # (_wake_waiters) for all of them. kazoo keeps a one-shot callback until its node
        # changes, so a callback of each wait's own piled up on a key that never changes: every
        # job launch waits on the same stable keys, and each left two callbacks per key.
        self._waiters: dict[str, set[threading.Event]] = {}
        self._waiters_lock = threading.Lock()

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self, serve: bool = True) -> None:
        from blobha.master.edge.gatekeeper import Gatekeeper
        from blobha.master.edge.service import add_to_server, new_server

        if serve and self.config.metrics_listen:
            # First, so a taken port fails the start before anything registers in ZooKeeper.
            try:
                self._status_server = StatusServer(self, self.config.metrics_listen)
            except OSError as e:
                raise ConfigError(
                    f"cannot listen on metrics.listen {self.config.metrics_listen}: {e}"
                ) from None
        try:
            self._ensure_chroot()
            self.zk.start(timeout=max(15.0, self.session_timeout))
        except ZooKeeperAuthError as e:
            raise ConfigError(str(e)) from None
        except Exception as e:
            raise Unavailable(
                f"cannot reach ZooKeeper at {self.config['zookeeper.servers']} ({e}); check"
                " zookeeper.servers and that the ensemble runs"
            ) from None
        for root in zkstate.ALL_ROOTS:
            self.zk.ensure_path(root)
        self._check_cluster_identity()
        self._load_cluster_secret()
        if self.zk_credentials is None and self.config["auth.mode"] != "simple":
            log.warning("ZooKeeper is not locked down (zookeeper.auth.scheme = 'none'): whoever"
                        " reaches ZooKeeper can read the cluster secret and forge blobha state")
        self.history.watch(self.zk)
        self.health.start()
        self.uploads.start()
        if serve:
            threads = self.config["master.rpc.threads"]
            self.gatekeeper = Gatekeeper(self.authentication,
                                         self.config["master.max.calls.per.client"], threads)
            self._server = new_server(
                [self.gatekeeper],
                [("grpc.max_concurrent_streams",
                  self.config["master.max.streams.per.connection"])],
                metrics=self.metrics.rpc,
                threads=threads,
            )
            add_to_server(self, self._server)
            listen = self.config["master.listen"]
            try:
                if self.server_tls is not None:
                    port = self._server.add_secure_port(listen, self.server_tls.credentials)
                else:
                    port = self._server.add_insecure_port(listen)
            except RuntimeError:  # grpcio's "Failed to bind", the reason only in its log
                port = 0
            if port == 0:
                raise ConfigError(f"cannot listen on master.listen {listen}: the address is in"
                                  " use (another master?) or not this host's")
            self._server.start()
            self._start_dataplane(listen)
        try:
            self.membership.register(wait=True)
        except IdentityInUse as e:
            if self._server is not None:
                self._server.stop(0)
            raise ConfigError(str(e)) from None
        self.sync.start()
        self.election.start()
        self.scrubber.start()
        if self._status_server is not None:
            self._status_server.start()
            log.info("status page and metrics on %s",
                     status_url(self.config.metrics_listen, self.identity))
        log.info("master %s serving (blobha %s, data in %s)", self.identity, __version__,
                 self.store.root)

    def _start_dataplane(self, listen: str) -> None:
        port = int(self.config["blobstore.data.port"])
        if port < 0:
            return
        if self.server_tls is not None:
            log.info("no data channel: with TLS, transfers stay in the encrypted gRPC stream")
            return
        from blobha.master.edge.service import translate_error

        host = host_of(listen)
        dataplane = DataPlane(
            self.store, host, port, append=self.append,
            translate=lambda e: translate_error(self.identity, "an upload on the data channel", e))
        try:
            dataplane.start()
        except OSError as e:
            if self._server is not None:
                self._server.stop(0)
            raise ConfigError(f"cannot listen on blobstore.data.port {port} on {host}: {e}"
                              " (set another port, 0 for any free one, or -1 for none)") from None
        self.dataplane = dataplane
        log.info("data channel on port %d", dataplane.port)

    def _end_session(self, session: int, password: bytes) -> bool:
        """Reconnect to a dead predecessor's session and close it (see SessionRecord); False
        if it had expired (kazoo then got a new session, closed here instead)."""
        zk = KazooClient(
            hosts=self._zk_hosts,
            timeout=self.session_timeout,
            client_id=(session, password),
            connection_retry=KazooRetry(max_tries=2, max_delay=1.0),
            **(self.zk_credentials.kazoo_args() if self.zk_credentials else {}),
        )
        try:
            # Short: ZooKeeper was reached a moment ago, and this comes out of the wait for
            # the session to expire by itself.
            zk.start(timeout=5.0)
            resumed = bool(zk.client_id) and zk.client_id[0] == session
        finally:
            zk.stop()  # closes the session: ZooKeeper deletes its ephemeral nodes
            zk.close()
        return resumed

    def _ensure_chroot(self) -> None:
        # A chrooted client cannot create its own root; do it once without the chroot, and
        # lock the tree down there (migrating an open one) when ZooKeeper auth is on.
        ensure_locked_chroot(self.config["zookeeper.servers"], self.config["zookeeper.chroot"],
                             self.zk_credentials, max(15.0, self.session_timeout))

    def _load_cluster_secret(self) -> None:
        """The secret masters prove themselves to each other with (see blobha.core.auth). The first
        master creates it; under lock-down only masters can read it."""
        with contextlib.suppress(NodeExistsError):
            self.zk.create(MASTER_SECRET, new_cluster_secret().encode())
        self._cluster_secret = self.zk.get(MASTER_SECRET)[0].decode()
        self.peers.set_cluster_secret(self._cluster_secret)

    def stop(self) -> None:
        """Graceful stop: resign leadership at once, abort uploads, drain, disconnect."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        log.info("stopping master %s", self.identity)
        self.health.stop()
        was_leader = self.election.is_leader
        self.election.stop(resign=True)
        if was_leader:
            log.info("leadership handed over")
        self.uploads.stop()
        self.scrubber.stop()
        if self._server is not None:
            self._server.stop(grace=2.0).wait(3.0)
        if self.dataplane is not None:
            self.dataplane.stop()
        self.puts.close(timeout=5.0)
        self.sync.stop()
        if self._status_server is not None:
            self._status_server.stop()
        self.peers.close()
        self._summary_pool.shutdown(wait=False, cancel_futures=True)
        try:
            self.zk.stop()
            self.zk.close()
        except Exception:
            log.debug("ZooKeeper close failed", exc_info=True)
        self.store.close()

    def wait_stopped(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)

    # ---- cluster identity (ha-rule 10) -----------------------------------------------------

    def _check_cluster_identity(self) -> None:
        """Remember which ZooKeeper state this store belongs to. A wiped or foreign ZooKeeper
        must not make this master delete its blobs."""
        local_file = self.store.root / "cluster.json"
        with contextlib.suppress(NodeExistsError):
            self.zk.create(BLOBSTORE + "-id", uuid.uuid4().hex.encode())
        zk_id = self.zk.get(BLOBSTORE + "-id")[0].decode()
        local_id = ""
        if local_file.exists():
            local_id = json.loads(local_file.read_text())["cluster_id"]
        if not local_id:
            local_file.write_text(json.dumps({"cluster_id": zk_id}))
            local_id = zk_id
        self._cluster_id = local_id
        self._cluster_id_ok = local_id == zk_id
        if not self._cluster_id_ok:
            log.error(
                "ALERT: this store belongs to cluster %s but ZooKeeper holds cluster %s (wiped or"
                " foreign ZooKeeper?). Refusing to delete any local blob. Fix zookeeper.servers /"
                " zookeeper.chroot, or move %s aside to join this cluster.",
                local_id, zk_id, local_file,
            )

    def _deletions_allowed(self) -> bool:
        """Whether ZooKeeper still holds this store's cluster, asked again before every local
        delete: a chroot wiped while the masters run (or a connection string pointed at another
        ensemble) reads as "every key was deleted", and the check at start-up cannot see it."""
        if not self._cluster_id_ok:
            return False
        # Both asked at once: one round trip, not two, per delete.
        id_read = self.zk.get_async(BLOBSTORE + "-id")
        root_read = self.zk.exists_async(BLOBSTORE)
        root = self._answer(root_read)
        try:
            data, id_stat = self._answer(id_read)
            zk_id, id_made = data.decode(), id_stat.czxid
        except NoNodeError:
            zk_id, id_made = "", 0
        # The key root is made before the cluster id. One made after it is not the cluster's:
        # its keys were removed with the old one (by hand, or a restore from an old snapshot
        # without them), and a master starting since made it again, empty. Every key would
        # read as deleted.
        root_ours = root is not None and root.czxid <= id_made
        if zk_id == self._cluster_id and root_ours:
            self._identity_alarm = False
            return True
        if not self._identity_alarm:
            self._identity_alarm = True
            state = ("missing" if root is None else "present" if root_ours
                     else "made again after the cluster id, so its keys were removed")
            log.error(
                "ALERT: ZooKeeper no longer holds this store's cluster %s (it holds %s, and %s is"
                " %s): was it wiped or swapped? Refusing to delete any local blob. Restore"
                " ZooKeeper, or fix zookeeper.servers / zookeeper.chroot. If the keys were"
                " removed on purpose, stop every master and move their data directories aside.",
                self._cluster_id, zk_id or "no cluster id", BLOBSTORE, state,
            )
        return False

    # ---- election callbacks ---------------------------------------------------------------

    def _on_elected(self, epoch: int) -> None:
        # ha-rule 4: the election has already sync()ed with ZooKeeper, and every write reads
        # the committed state from ZooKeeper itself, so what remains is cheap: drop uploads of
        # an earlier term and refresh membership. Blobs the leader lacks, and the roll-back of
        # an earlier leader's unacknowledged commits, follow from a full reconcile that runs
        # in the background: scanning every key must not delay taking office.
        self.uploads.abort_all("a new leadership term began")
        # Bounded: this runs under the election's lock (see LeaderElection._answer).
        self.membership.refresh(timeout=self.election.suspension_limit)
        self.sync.request_full_reconcile()

    def _on_deposed(self) -> None:
        self.uploads.abort_all("this master is no longer the leader")
        self.sync.stepped_down()

    def _membership_changed(self) -> None:
        self.sync.membership_changed()

    def _master_left(self, address: str) -> None:
        # Its session ended, and its replica nodes with it. A master paused or cut off would
        # keep this one's fetches from it waiting for their stall limit; their keys are
        # fetched from the remaining holders, or judged without it (rolled back by a leader).
        self.peers.abandon(address, f"master {address} left the cluster (its ZooKeeper session"
                                    " ended)")

    # ---- authorisation -------------------------------------------------------------------

    def privileged(self, user: str) -> bool:
        return user in self.admins or user == self.principal

    def _check(self, user: str, acl: tuple[AccessControl, ...] | list[AccessControl],
               access: int, key: str) -> None:
        if self.privileged(user) or acls.allowed(acl, user, access):
            return
        raise NotAuthorized(
            f"user {user!r} lacks {acls.describe(access)} permission on {key!r}; ask a user"
            " with ADMIN on it to grant access ('blobha set-acl')"
        )

    def _require_leader(self) -> None:
        if self.election.is_leader:
            return
        if self.zk.state != KazooState.CONNECTED:
            raise Unavailable(
                f"master {self.identity} has lost its ZooKeeper connection; retry shortly or use"
                " another master"
            )
        leader = self.election.leader_address
        if leader and leader != self.identity:
            raise NotLeader(f"{self.identity} is not the leader; send this to {leader}", leader)
        raise Unavailable("no leader is ready yet (election in progress); retry in a moment")

    def _require_zk(self) -> None:
        if self.zk.state != KazooState.CONNECTED:
            raise Unavailable(
                f"ZooKeeper is unreachable from master {self.identity}; retry shortly or ask"
                " another master"
            )

    def _read_state(self, key: str) -> BlobState | None:
        self._require_zk()
        try:
            data, stat = self._answer(self.zk.get_async(key_path(key)))
        except NoNodeError:
            return None
        return BlobState.decode(data, stat.version)

    def _answer(self, pending: Any) -> Any:
        """The answer to a ZooKeeper call made for a request, waited for at most the session
        timeout (then KazooTimeoutError: unreachable). The connection check before it and the
        call are not atomic: a call made just after the connection dropped is held by kazoo
        until a connection is back, for ever if ZooKeeper stays away, with the request's
        thread."""
        return pending.get(timeout=self.session_timeout)

    def _session_granted(self, granted: float) -> None:
        """kazoo's connection thread, at each connection: the watchdog that steps a leader
        down when its connection stays suspended must use the timeout ZooKeeper granted,
        which its bounds may make shorter (or longer) than the one configured."""
        previous = self.election.session_timeout
        self.election.session_timeout = granted
        if abs(granted - self.session_timeout) > 0.001 and abs(granted - previous) > 0.001:
            log.warning(
                "ZooKeeper granted a session timeout of %gs, not the %gs of"
                " zookeeper.session.timeout.ms (its minSessionTimeout and maxSessionTimeout"
                " bound it); a leader cut off from ZooKeeper now steps down %gs after kazoo"
                " reports the connection suspended",
                granted, self.session_timeout, self.election.suspension_limit)

    def _state_or_404(self, key: str) -> BlobState:
        state = self._read_state(key)
        if state is None:
            raise _no_such_key(key)
        return state

    # ---- uploads -------------------------------------------------------------------------

    def _write_settings(self, key: str, acl: Sequence[AccessControl], replication_factor: int,
                        write_quorum: int, create: bool) -> tuple[int, int]:
        """Check a write's arguments; a create's replication factor and write quorum. An
        update keeps the key's own factor: its quorum comes back as asked (0 = the default),
        for :meth:`_update_quorum` to check against that factor."""
        self._require_leader()
        validate_key(key)
        # Before anything is written: a user name with ':' or ',' would store an ACL that no
        # master can read back, which breaks the key and every listing.
        acls.check_entries(acl)
        rf = replication_factor or self.config["blobstore.replication.factor"]
        if rf < 1:
            raise InvalidArgument("the replication factor must be at least 1")
        return rf, self._quorum(write_quorum, rf) if create else write_quorum

    def _update_quorum(self, key: str, state: BlobState, write_quorum: int) -> int:
        """An update's write quorum, against the key's own replication factor (not the
        cluster's default: a key of 5 takes W=4)."""
        return self._quorum(write_quorum, state.replication_factor, key)

    def _quorum(self, write_quorum: int, rf: int, key: str = "") -> int:
        """A write's quorum: as asked (0 = the default), which the replication factor ``rf``
        must allow; by default the configured quorum, capped by ``rf``. ``key``: an existing
        key's, whose factor can be raised."""
        if write_quorum > rf:
            what = (f" of {key!r}; lower it, or raise the key's factor first"
                    " ('blobha replication --update -r N')" if key else "; lower it")
            raise InvalidArgument(
                f"write quorum {write_quorum} exceeds the replication factor {rf}{what}")
        return write_quorum or min(self.config["blobstore.write.quorum"], rf)

    def _check_update(self, user: str, key: str, state: BlobState | None,
                      expected_version: int) -> BlobState:
        if state is None:
            raise KeyNotFound(f"no blob with key {key!r}; use 'blobha create' first")
        self._check(user, state.acl, acls.WRITE, key)
        if expected_version and state.seq != expected_version:
            raise VersionConflict(
                f"{key!r} is at version {state.seq}, not {expected_version}; re-read and retry"
            )
        return state

    def _check_quorum(self, w: int) -> None:
        masters = len(self.membership.known() | {self.identity})
        if w > masters:
            # The commit could never be acknowledged: it would time out after committing, and
            # leave an unacknowledged version behind. Refuse before anything is written.
            raise InvalidArgument(
                f"write quorum {w} exceeds the {masters} masters in the cluster; lower it"
                " (--write-quorum, blobstore.write.quorum) or start more masters"
            )

    def begin_upload(
        self, user: str, key: str, create: bool, acl: list[AccessControl], replication_factor: int,
        expected_version: int, size_hint: int, write_quorum: int, write_id: bytes = b"",
    ) -> tuple[str, int, tuple[str, BlobState, int] | None]:
        """Open an upload session (the resumable path, for blobs of any size): (upload id,
        expiry); or, when the write ``write_id`` names was committed already (a retry after
        a lost answer), no session and that write's answer."""
        # Read before leadership is checked: a session begun after this master stopped
        # leading would outlive the abort of every session (see UploadManager.begin).
        generation = self.uploads.generation
        rf, w = self._write_settings(key, acl, replication_factor, write_quorum, create)
        tag = _tag(user, write_id)
        state = self._read_state(key)
        prior = state.written_by(tag) if state is not None else None
        if prior is not None:
            if not prior.acked:
                # Not waited for here: the client gives this call seconds, not the write
                # timeout, and would leave the wait behind and ask again.
                raise Unavailable(
                    f"{key!r} v{prior.seq}, this write's, is committed and waits for its write"
                    " quorum; retry shortly")
            return "", 0, self._acknowledge(key, _retried(key, prior, user))
        if create:
            if state is not None:
                raise KeyAlreadyExists(f"key {key!r} already exists; use 'blobha update'")
            acl = acls.normalize_for_create(acl, user)
        else:
            state = self._check_update(user, key, state, expected_version)
            rf = state.replication_factor
            w = self._update_quorum(key, state, write_quorum)
        self._check_quorum(w)
        if size_hint >= 0:
            self.store.reserve(size_hint)
        # An update's quorum is kept as asked: the commit checks it against the key's factor
        # then (_next_state), which may have changed meanwhile.
        up = self.uploads.begin(user, key, create, acl, rf, expected_version,
                                w if create else write_quorum, tag, generation=generation)
        return up.upload_id, int(self.uploads.expiration_secs), None

    def append(self, user: str, upload_id: str, offset: int, data: bytes | memoryview) -> int:
        up = self.uploads.get(upload_id, user)
        with up.lock:
            if data:
                self.store.reserve(len(data))
                try:
                    up.temp.write_at(offset, data)
                except ValueError:
                    # The file was discarded under us (expiry or lost leadership).
                    from blobha.core.errors import upload_not_found

                    raise upload_not_found(upload_id) from None
            return up.temp.size

    def put(
        self, user: str, key: str, create: bool, acl: list[AccessControl], replication_factor: int,
        expected_version: int, write_quorum: int, data: bytes, digest: str,
        write_id: bytes = b"",
    ) -> tuple[str, BlobState, int]:
        """A whole small blob in one call, committed together with the other writers' that
        arrive meanwhile (:mod:`blobha.master.groupcommit`): the durability and fencing of the
        upload session's commit, without its temp file per call or its early look for the key."""
        if len(data) > PUT_MAX_BYTES:
            raise InvalidArgument(
                f"Put carries at most {PUT_MAX_BYTES} bytes, not {len(data)}; use the resumable"
                " upload (BeginUpload, AppendUpload, CommitUpload) for larger blobs"
            )
        rf, w = self._write_settings(key, acl, replication_factor, write_quorum, create)
        _check_digest(digest)
        if create:
            acl = acls.normalize_for_create(acl, user)
            self._check_quorum(w)
        self.store.reserve(len(data))
        tag = _tag(user, write_id)
        committed = self._commit_once(key, tag, user, lambda: self.puts.submit(
            _Put(user, key, create, tuple(acl), rf, w, expected_version, data, digest, tag)))
        return self._acknowledge(key, committed)

    def upload_key(self, upload_id: str) -> str:
        """The key an upload session is for ('' if unknown), for the audit log only."""
        return self.uploads.key_of(upload_id)

    def upload_status(self, user: str, upload_id: str) -> int:
        return self.uploads.get(upload_id, user).temp.size

    def offer_upload(self, user: str, upload_id: str) -> tuple[int, DataOffer | None]:
        """Bytes received so far, and an offer of the data channel for the rest from there
        on (None when this master has none)."""
        received = self.upload_status(user, upload_id)
        dataplane = self.dataplane
        if dataplane is not None:
            ticket = dataplane.offer_upload(user, upload_id, received)
            if ticket is not None:
                return received, DataOffer(dataplane.port, ticket)
        return received, None

    def abort(self, user: str, upload_id: str) -> None:
        self.uploads.abort(upload_id, user)

    def commit(self, user: str, upload_id: str, size: int, digest: str
               ) -> tuple[str, BlobState, int]:
        generation = self.uploads.generation  # before the leader check, as in begin_upload
        self._require_leader()
        # Before the session is taken (and its data, gone with it on any error): a malformed
        # digest must not cost a multi-GB upload, only a corrected CommitUpload.
        _check_digest(digest)
        up = self.uploads.take(upload_id, user)
        committed = self._commit_once(
            up.key, up.write_tag, user,
            lambda: self._commit_upload(user, up, size, digest, generation))
        return self._acknowledge(up.key, committed)

    def _commit_upload(self, user: str, up: Upload, size: int, digest: str,
                       generation: int) -> BlobState:
        key = up.key
        with up.lock, self.store.key_lock(key):
            try:
                fresh = up.create and self._nothing_here(key)
                state = None if fresh else self._read_state(key)
                new = self._next_state(user, key, up.create, tuple(up.acl), up.replication_factor,
                                       up.write_quorum, up.expected_version, size, digest, state,
                                       time.time(), up.write_tag)
            except (Unavailable, KazooException, KazooTimeoutError):
                # ZooKeeper out of reach before the data was touched: the session goes back,
                # so the client's retry of the commit (it is told to retry) finds its data
                # instead of uploading it all again, or failing if it came from a pipe.
                self.uploads.restore(up, generation)
                raise
            except BaseException:
                up.temp.discard()
                raise
            try:
                self.store.install(key, new.seq, up.temp, size, digest)
            except BaseException:
                up.temp.discard()
                raise
            result: BlobState | BaseException = Unavailable("not committed; retry")
            try:
                result = self._commit_together([(key, up.create, new)],
                                               fresh={key} if fresh else set())[0]
            finally:
                self._drop_uncommitted(key, new.seq, result)
            if isinstance(result, BaseException):
                raise result
        return result

    def _drop_uncommitted(self, key: str, seq: int, result: BlobState | BaseException) -> None:
        """After a commit attempt: delete the installed version ``seq`` unless its commit
        applied, or may have (:class:`CommitOutcomeUnknown`: with W=1 ZooKeeper may already
        call it acknowledged, and this copy would be its only one)."""
        if not isinstance(result, BlobState | CommitOutcomeUnknown):
            self.store.delete_version(key, seq)

    def _nothing_here(self, key: str) -> bool:
        """Nothing of ``key`` on this master (the caller holds its lock, so no copy can arrive
        until its commit is over): a create then clobbers nothing, and its transaction's create
        fails if the key exists, so it needs no ZooKeeper read first."""
        return self.sync.view(key) is None and not self.store.versions(key)

    def _next_state(self, user: str, key: str, create: bool, acl: tuple[AccessControl, ...],
                    replication_factor: int, write_quorum: int, expected_version: int,
                    size: int, digest: str, state: BlobState | None, now: float,
                    tag: str = "") -> BlobState:
        """The state a write commits over ``state`` (the key's current one, None if absent);
        acknowledged at once where the leader's own durable copy is the quorum (W=1).
        ``write_quorum`` is a create's own, or an update's as asked (0 = the default), checked
        here against the key's factor (:meth:`_update_quorum`).
        :class:`_AlreadyWritten` if ``state`` records this write (``tag``) as made already."""
        prior = state.written_by(tag) if state is not None else None
        if prior is not None:
            # Checked before anything else: an update retried after someone else's would
            # otherwise write its data again on top, and a create would find its own key.
            raise _AlreadyWritten(prior)
        epoch = self.election.epoch
        if create:
            if state is not None:
                raise KeyAlreadyExists(f"key {key!r} already exists; use 'blobha update'")
            new = BlobState(
                seq=1, size=size, digest=digest, acl=acl, replication_factor=replication_factor,
                creator=user, created_at=now, updated_at=now, epoch=epoch, acked=False,
                write_quorum=write_quorum, write_tag=tag,
            )
        else:
            state = self._check_update(user, key, state, expected_version)
            new = state.with_new_version(
                state.seq + 1, size, digest, now, epoch,
                self._update_quorum(key, state, write_quorum),
                self.config["blobstore.versions.retained"], tag,
            )
        return _fitting(key, replace(new, acked=new.write_quorum <= 1))

    def _acknowledge(self, key: str, committed: BlobState) -> tuple[str, BlobState, int]:
        """Answer for a committed version once W masters hold it: (key, state, holders)."""
        try:
            if committed.acked:
                return key, committed, 1
            try:
                reached, info = self._await_holders(key, committed, committed.write_quorum)
            except _Superseded as e:
                # A newer version, acknowledged, replaced this one before its quorum: no
                # roll-back can reach below an acknowledged version, so this write stands in
                # the key's history, unless a roll-back already skipped it (a new leader found
                # the newer version held by no live master, and this one on none either). A
                # roll-back is a later epoch's write, and drops the tags of what it skipped:
                # the newer version in this write's epoch means none came between.
                made = e.state.epoch == committed.epoch or bool(
                    committed.write_tag and e.state.written_by(committed.write_tag))
                if not made:
                    raise Unavailable(
                        f"{key!r} v{committed.seq} was replaced before its write quorum and may"
                        " have been rolled back; re-read the metadata before writing it again"
                    ) from None
                log.info("%r v%d superseded by v%d before its write quorum; answered as made",
                         key, committed.seq, e.state.seq)
                return key, replace(committed, acked=True), 0
            if not reached:
                current = self._read_state(key)
                if current is not None and current.seq > committed.seq:
                    raise DeadlineExceeded(
                        f"{key!r} v{committed.seq} was replaced by v{current.seq} before"
                        f" {committed.write_quorum} masters held it, and v{current.seq} is not"
                        " acknowledged yet either: if its leader fails first, the key rolls back"
                        " to an earlier version. 'blobha meta' shows the outcome"
                    )
                raise DeadlineExceeded(
                    f"{key!r} v{committed.seq} is committed but only {info.replication} of the"
                    f" {committed.write_quorum} required masters hold it after"
                    f" {self.config['blobstore.write.timeout.secs']}s, so it is NOT acknowledged"
                    " yet: it will be once enough masters hold it, unless its leader fails first"
                    " (then it is rolled back). Check 'blobha cluster'; 'blobha meta' shows"
                    " whether it was acknowledged, before you write it again"
                )
            return key, self._mark_acked(key, committed), info.replication
        finally:
            # Whatever the outcome, the leader's synchroniser follows the key from here: a
            # version that timed out stays committed and is acknowledged once enough masters
            # hold it (_leader_duty). Nothing else would bring a new key to it before the
            # periodic pass: the leader has no watch on a key it has not reconciled yet, and
            # does not read its own journal. A create acknowledged in its commit needs none
            # (see Synchronizer.follow).
            self.sync.follow(key, committed.seq)

    def _commit_once(self, key: str, tag: str, user: str, commit: Callable[[], BlobState]
                     ) -> BlobState:
        """``commit()``'s new version; or, where the write tagged ``tag`` committed already (a
        retry after a lost answer), that version, not written again. The caller answers
        either through :meth:`_acknowledge`, as the first attempt would have."""
        try:
            return commit()
        except _AlreadyWritten as e:
            return _retried(key, e.state, user)
        except (KeyAlreadyExists, VersionConflict):
            # A create that took the fast path (no read first) found the key, or the key moved
            # during the commit: it may be this very write's own, committed by an attempt
            # whose answer was lost.
            state = self._read_state(key) if tag else None
            prior = state.written_by(tag) if state is not None else None
            if prior is None:
                raise
            return _retried(key, prior, user)

    def _commit_puts(self, batch: Sequence[_Put]) -> list[BlobState | BaseException | Later]:
        """One group commit (:class:`GroupCommitter` handler): the batch's new versions are
        installed together (appended to one segment, one fdatasync) and committed in one fenced
        transaction. A write whose operation fails there (the key appeared, moved or vanished
        meanwhile) leaves the batch with its error, and the others commit without it.

        A write whose key is locked elsewhere (a roll-back's fetch, a large upload's commit)
        waits for it off the committing thread and goes in a later batch: waiting here held
        up every other key's writes for as long (seconds, behind a roll-back)."""
        taken: list[int] = []
        with contextlib.ExitStack() as locks:
            for i, p in enumerate(batch):
                lock = self.store.key_lock(p.key)
                if lock.acquire(blocking=False):
                    locks.callback(lock.release)
                    taken.append(i)
            results = self._commit_locked([batch[i] for i in taken]) if taken else []
        done = dict(zip(taken, results, strict=True))
        return [done[i] if i in done else Later(self._key_free(p.key))
                for i, p in enumerate(batch)]

    def _key_free(self, key: str) -> Callable[[], None]:
        def wait() -> None:
            lock = self.store.key_lock(key)
            if not lock.acquire(timeout=self.config["blobstore.write.timeout.secs"]):
                raise Unavailable(f"{key!r} stayed busy with another change; retry")
            lock.release()
        return wait

    def _commit_locked(self, batch: Sequence[_Put]) -> list[BlobState | BaseException]:
        """:meth:`_commit_puts` of the writes whose keys' locks are held."""
        out: list[BlobState | BaseException] = [
            Unavailable("not committed; retry")] * len(batch)
        try:
            self._require_leader()
        except BlobError as e:
            return [e] * len(batch)
        news: dict[int, BlobState] = {}
        now = time.time()
        fresh = {p.key for p in batch if p.create and self._nothing_here(p.key)}
        for i, (p, state) in enumerate(zip(batch, self._states_for_commit(batch, fresh),
                                           strict=True)):
            try:
                if isinstance(state, BaseException):
                    raise state
                news[i] = new = self._next_state(
                    p.user, p.key, p.create, p.acl, p.replication_factor, p.write_quorum,
                    p.expected_version, len(p.data), p.digest, state, now, p.write_tag)
                if not p.create:
                    self._check_quorum(new.write_quorum)
            except Exception as e:
                out[i] = e
                news.pop(i, None)
        if not news:
            return out
        installed = self.store.install_many(
            [(batch[i].key, new.seq, batch[i].data, len(batch[i].data), batch[i].digest)
             for i, new in news.items()])
        live: list[int] = []
        for i, result in zip(list(news), installed, strict=True):
            if isinstance(result, ChecksumMismatch):
                out[i] = ChecksumMismatch(
                    f"the data received for {batch[i].key!r} does not match its digest"
                    f" {batch[i].digest}: {result}; nothing was stored, upload again")
            else:
                live.append(i)
        try:
            results = self._commit_together(
                [(batch[i].key, batch[i].create, news[i]) for i in live], fresh)
            for i, committed in zip(live, results, strict=True):
                out[i] = committed
        finally:
            for i in live:
                self._drop_uncommitted(batch[i].key, news[i].seq, out[i])
        return out

    def _states_for_commit(self, batch: Sequence[_Put], fresh: AbstractSet[str]
                           ) -> list[BlobState | BaseException | None]:
        """Each write's current key state (the caller holds the keys' locks), read in one
        pipelined round trip; none is read for a create of a ``fresh`` key (one this master
        knows nothing of, :meth:`_nothing_here`)."""
        pending = [None if p.create and p.key in fresh
                   else self.zk.get_async(key_path(p.key)) for p in batch]
        out: list[BlobState | BaseException | None] = []
        for result in pending:
            if result is None:
                out.append(None)
                continue
            try:
                data, stat = self._answer(result)
                out.append(BlobState.decode(data, stat.version))
            except NoNodeError:
                out.append(None)
            except Exception as e:
                out.append(e)
        return out

    def _commit_together(self, writes: Sequence[tuple[str, bool, BlobState]],
                         fresh: AbstractSet[str]) -> list[BlobState | BaseException]:
        """Commit ``writes`` (key, create?, new state) in as few fenced transactions as fit in
        ZooKeeper's request limit (one, unless their records take more than
        :data:`zkstate.MAX_STATE_BYTES` together: a request over it is refused by dropping
        the connection). One result per write: its state, or its error. ``fresh``: the
        created keys this master held nothing of before their install (:meth:`_nothing_here`).
        """
        out: list[BlobState | BaseException] = []
        chunk: list[tuple[str, bool, BlobState]] = []
        size = 0
        for write in writes:
            n = _record_bytes(write[2])
            if chunk and size + n > zkstate.MAX_STATE_BYTES:
                out.extend(self._commit_transaction(chunk, fresh))
                chunk, size = [], 0
            chunk.append(write)
            size += n
        if chunk:
            out.extend(self._commit_transaction(chunk, fresh))
        return out

    def _commit_transaction(self, writes: Sequence[tuple[str, bool, BlobState]],
                            fresh: AbstractSet[str]) -> list[BlobState | BaseException]:
        """Commit ``writes`` in one fenced transaction: each its metadata and this master's
        replica node (installed durably before, so a version never appears without a holder),
        and the created keys in the change journal (no watch tells the other masters of them).
        A write whose own operation fails gets its error and the others are tried again
        without it. One result per write: its state, or its error."""
        out: list[BlobState | BaseException | None] = [None] * len(writes)
        live = list(range(len(writes)))
        session = self.sync.session_id()
        records = [new.encode() for _, _, new in writes]
        # New keys acknowledged in the commit, with no other version here (so nothing for a
        # reconcile to prune): the synchroniser makes their entries from the commit itself. A
        # ``fresh`` key had nothing here before its install, under the lock held since.
        creating = [key for key, create, new in writes
                    if create and new.acked
                    and (key in fresh or self.store.versions(key) == [new.seq])]
        self.sync.creating(creating)
        try:
            return self._commit_records(writes, records, out, live, session)
        finally:
            self.sync.created(creating)

    def _commit_records(self, writes: Sequence[tuple[str, bool, BlobState]],
                        records: list[bytes], out: list[BlobState | BaseException | None],
                        live: list[int], session: int) -> list[BlobState | BaseException]:
        """:meth:`_commit_transaction`'s retries, with each write's encoded ``records``."""
        while live:
            batch = [(*writes[i], records[i]) for i in live]

            def build(txn: Any, batch: list[tuple[str, bool, BlobState, bytes]] = batch
                      ) -> None:
                for key, create, new, record in batch:
                    if create:
                        txn.create(key_path(key), record)
                    else:
                        # The version read under the key's lock: any change since fails it.
                        txn.set_data(key_path(key), record, version=new.meta_version)
                    txn.create(replica_path(key, self.identity, new.seq), b"", ephemeral=True)

            try:
                results = self.election.fenced_results(
                    build, changed=[key for key, create, _, _ in batch if create])
            except Deposed:
                lost = Unavailable("leadership was lost before the commit; nothing was"
                                   " committed, retry (the client finds the new leader)")
                for i in live:
                    out[i] = lost
                break
            except ConnectionLoss:
                # ha-rule: after ConnectionLoss the write may or may not have applied: re-read.
                # A transaction applies whole, so one key's state tells for all of them.
                key, _, new, _ = batch[0]
                try:
                    self._resolve_unknown_commit(key, new)
                except Unavailable as e:
                    for i in live:
                        out[i] = e
                    break
                results = [True] * (2 * len(batch))
            failed = next((n for n, r in enumerate(results) if is_failure(r)), None)
            if failed is None:
                # One line per transaction, not per write: under eight writers a line per
                # write was 4% of the leader's CPU, and the audit log names each write anyway.
                log.info("committed %s in epoch %d", ", ".join(
                    f"{key!r} v{new.seq} ({new.size} bytes)" for key, _, new, _ in batch),
                    batch[0][2].epoch)
                for i in live:
                    key, create, new = writes[i]
                    self.sync.registered(key, new.seq, session, new.replication_factor,
                                         new if create else None, records[i])
                    # meta_version is stale here; _mark_acked re-reads before its write.
                    out[i] = new
                break
            i = live.pop(failed // 2)
            out[i] = _commit_error(writes[i][0], results[failed], metadata=failed % 2 == 0)
        return [r if r is not None else Unavailable("not committed; retry") for r in out]

    def _resolve_unknown_commit(self, key: str, new: BlobState) -> BlobState:
        deadline = time.monotonic() + self.session_timeout
        while time.monotonic() < deadline:
            try:
                # Connected first: while kazoo reconnects it queues requests rather than failing
                # them, so a sync sent now could wait out the whole outage.
                self._require_zk()
                # The session may now be on a server that has not yet seen the transaction
                # (its zxid never reached this client): sync first, or a stale read would say
                # "did not apply" of a commit that did, and its only copy would be deleted.
                self.zk.sync_async(key_path(key)).get(
                    timeout=max(deadline - time.monotonic(), 0.01))
                after = self._read_state(key)
            except (Unavailable, KazooException, KazooTimeoutError):
                self._stopped.wait(0.2)
                continue
            if (after is not None and after.seq == new.seq and after.digest == new.digest
                    and after.epoch == new.epoch):
                return after
            if after is not None and after.seq > new.seq and any(
                    past.seq == new.seq and past.digest == new.digest
                    and past.write_tag == new.write_tag for past in after.history):
                # Applied, then superseded (by a next leader) before this read: the version
                # stays in the key's history, and this master's copy may be its only one.
                return new
            raise Unavailable(f"the commit of {key!r} did not apply (ZooKeeper hiccup); retry")
        raise CommitOutcomeUnknown(
            f"ZooKeeper became unreachable during the commit of {key!r}; its outcome is unknown:"
            " re-read the key's metadata before retrying"
        )

    def _mark_acked(self, key: str, state: BlobState) -> BlobState:
        # Under the key's lock, as every other write of the key's metadata: between a commit's
        # read of the state and its conditional write, this write made the commit fail with a
        # conflict the client had not asked for (an update without expected_version).
        with self.store.key_lock(key):
            return self._mark_acked_locked(key, state)

    def _mark_acked_locked(self, key: str, state: BlobState) -> BlobState:
        for _ in range(5):
            current = self._read_state(key)
            if current is None or current.seq != state.seq or current.digest != state.digest:
                return state  # superseded or deleted meanwhile; nothing to mark
            if current.acked:
                return current
            marked = replace(current, acked=True)
            try:
                self._fenced_set(key, marked, current.meta_version)
            except BadVersionError:
                continue
            except Deposed:
                raise Unavailable(
                    f"leadership was lost while acknowledging {key!r} v{state.seq}; it is"
                    " committed but unacknowledged: re-read the metadata and retry if needed"
                ) from None
            return replace(marked, meta_version=current.meta_version + 1)
        # Never answer success for a version ZooKeeper does not record as acknowledged: a later
        # leader could roll it back. The client re-reads and, finding it unacknowledged,
        # uploads again.
        raise Unavailable(f"{key!r} v{state.seq} is committed but could not be marked"
                          " acknowledged (the key kept changing); retry")

    def _await_holders(self, key: str, state: BlobState, minimum: int
                       ) -> tuple[bool, ReplicationStatus]:
        deadline = time.monotonic() + self.config["blobstore.write.timeout.secs"]
        reached, infos = self._wait(
            [key], minimum, deadline, seq_of={key: state.seq}, require_leader=True
        )
        return reached, infos[0]

    # ---- reads ---------------------------------------------------------------------------

    def _state_for_read(self, key: str) -> tuple[BlobState, KeyView | None]:
        """The committed state of ``key`` for a read: from ZooKeeper, or, when ZooKeeper is
        unreachable, the last committed state this master saw (returned with its view).

        Serving the last known state keeps reads of committed blobs working through a
        ZooKeeper outage, which is when they matter most. It cannot hand out anything that was
        never committed: the synchronizer's view only holds states read from ZooKeeper, versions
        are immutable, and every byte is still checked against its digest. Without quorum no
        newer version can commit, so the view is stale only on a master cut off alone."""
        try:
            return self._state_or_404(key), None
        except (Unavailable, *UNREACHABLE):
            view = self.sync.view(key)
            if view is None:
                raise Unavailable(
                    f"ZooKeeper is unreachable from master {self.identity} and it has no record"
                    f" of {key!r}; retry shortly or read from another master"
                ) from None
            # Debug only: during an outage this runs for every read (health shows the outage).
            log.debug("ZooKeeper unreachable: serving the last committed state of %r (v%d)",
                     key, view.state.seq)
            return view.state, view

    def access(self, user: str, acl: Sequence[AccessControl]) -> int:
        """The permission bits ``user`` holds on a key with ``acl``."""
        return acls.ALL if self.privileged(user) else acls.access_of(acl, user)

    def get_meta(self, user: str, key: str, any_access: bool = False) -> tuple[BlobState, int]:
        """A key's metadata and its live replicas, for a reader; with ``any_access``, for a user
        holding any permission on it (as Storm's getBlobMeta): a writer needs the version to
        update conditionally and to delete only the key it read, an administrator the ACL it
        sets again. The caller's permissions (:meth:`access`) go with the answer."""
        validate_key(key)
        state, view = self._state_for_read(key)
        if not any_access:
            self._check(user, state.acl, acls.READ, key)
        elif not self.access(user, state.acl):
            raise NotAuthorized(
                f"user {user!r} has no permission on {key!r} (any of READ, WRITE or ADMIN shows"
                " its metadata); ask a user with ADMIN on it to grant access ('blobha set-acl')"
            )
        if view is not None:
            return state, len(view.holders)
        return state, self._replication(key, state).replication

    def open_download(
        self, user: str, key: str, version: int, offset: int, length: int,
        data_channel: bool = False,
    ) -> tuple[VersionInfo, Iterator[bytes] | DataOffer]:
        """The version to serve and its bytes from ``offset`` (``length`` 0: to the end): a
        verifying reader, or, when the caller can take the data channel, this master has one
        and the range is not small, an offer of it (a connection of its own costs more than
        the copies it saves on a small range)."""
        info = self._download_version(user, key, version, offset)
        end = info.size if length == 0 else min(info.size, offset + length)
        dataplane = self.dataplane
        if data_channel and dataplane is not None and end - offset >= MIN_BYTES:
            return info, DataOffer(dataplane.port, dataplane.offer(info, offset, end))
        return info, _read_held(self.store, self.identity, key, info.seq, offset, length)

    def _download_version(self, user: str, key: str, version: int, offset: int) -> VersionInfo:
        validate_key(key)
        if user == self.principal and version:
            # Masters syncing from each other may ask for any version this master keeps; the
            # principal is authenticated by the cluster secret (blobha.core.auth), never claimed.
            info = self.store.info(key, version)
            if info is None:
                raise KeyNotFound(f"not held here: {self.identity} has no v{version} of {key!r}")
            if offset > info.size:
                raise InvalidArgument(
                    f"offset {offset} is past the end of {key!r} ({info.size} bytes)")
            return info
        state, _ = self._state_for_read(key)
        self._check(user, state.acl, acls.READ, key)
        seq = version or state.seq
        if seq > state.seq:
            raise KeyNotFound(f"{key!r} has no version {seq}; the latest is {state.seq}")
        kept = self.config["blobstore.versions.retained"]
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
        return info

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
        self._require_zk()
        size = min(page_size or DEFAULT_PAGE, MAX_PAGE)
        after = ""
        if page_token:
            try:
                after = base64.urlsafe_b64decode(page_token.encode()).decode()
            except (ValueError, UnicodeDecodeError):
                raise InvalidArgument("bad page token; start the listing again") from None
        candidates = keys_after(self._sorted_keys(), prefix, after)
        if self.config["blobstore.list.visibility"] == "all" or self.privileged(user):
            page = list(itertools.islice(candidates, size + 1))
            more = len(page) > size
            page = page[:size]
        else:
            page, more = self._readable(user, candidates, size)
        token = ""
        if more and page:
            token = base64.urlsafe_b64encode(page[-1].encode()).decode()
        return page, token

    def _sorted_keys(self) -> list[str]:
        """Every key, sorted; re-read only when the key list changed (ZooKeeper bumps the
        parent's cversion on every create and delete of a child), so the pages of one listing
        cost one small stat each instead of fetching and sorting 100,000s of names."""
        stat = self._answer(self.zk.exists_async(BLOBSTORE))
        cached = self._key_list
        if cached is not None and stat is not None and cached[0] == stat.cversion:
            return cached[1]
        try:
            names, stat = self._answer(self.zk.get_children_async(BLOBSTORE, include_data=True))
        except NoNodeError:
            return []
        keys = sorted(names)
        self._key_list = (stat.cversion, keys)
        return keys

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
                        data, stat = self._answer(result)
                    except NoNodeError:
                        continue  # deleted meanwhile
                    acl = BlobState.decode(data, stat.version).acl
                if acls.allowed(acl, user, acls.READ):
                    page.append(key)
                    if len(page) == size:
                        # More may follow if this chunk or the rest still has keys.
                        return page, i + 1 < len(chunk) or next(it, None) is not None
        return page, False

    def _replication(self, key: str, state: BlobState) -> ReplicationStatus:
        try:
            names = self._answer(self.zk.get_children_async(key_path(key)))
        except NoNodeError:
            names = []
        return _status(key, state, zkstate.holders(names, state.seq))

    def get_replication(self, user: str, key: str) -> ReplicationStatus:
        validate_key(key)
        state, view = self._state_for_read(key)
        self._check(user, state.acl, acls.READ, key)
        if view is not None:
            return _status(key, state, view.holders)
        return self._replication(key, state)

    def wait_for_replication(self, user: str, keys: list[str], minimum: int, timeout: float,
                             abandoned: threading.Event | None = None,
                             ) -> tuple[bool, list[ReplicationStatus], float]:
        """Wait until every key has ``minimum`` up-to-date holders or ``timeout`` passes
        (negative: no limit); ``abandoned``, once set (the caller went away), ends the wait
        within a second, so that no thread is held for a caller that will never read the
        answer."""
        if not keys:
            raise InvalidArgument("name at least one key to wait for")
        if minimum < 1:
            raise InvalidArgument("the minimum replication must be at least 1")
        if math.isnan(timeout):
            raise InvalidArgument("the timeout must be a number of seconds (negative: forever)")
        for key in keys:
            validate_key(key)

        def may_read(key: str, state: BlobState | None) -> None:
            if state is None:
                raise _no_such_key(key)
            self._check(user, state.acl, acls.READ, key)

        started = time.monotonic()
        deadline = float("inf") if timeout < 0 else started + timeout
        reached, infos = self._wait(keys, minimum, deadline, first_read=may_read,
                                    abandoned=abandoned)
        return reached, infos, time.monotonic() - started

    def _wait(
        self, keys: list[str], minimum: int, deadline: float,
        seq_of: dict[str, int] | None = None, require_leader: bool = False,
        first_read: Callable[[str, BlobState | None], None] | None = None,
        abandoned: threading.Event | None = None,
    ) -> tuple[bool, list[ReplicationStatus]]:
        """Wait on ZooKeeper watches until every key has ``minimum`` holders of its committed
        version (or of ``seq_of[key]``), or the deadline passes (ha-rule 11), or ``abandoned``
        is set. ``first_read`` sees each key's state as first read (None: no such key), before
        anything is returned, and may raise."""
        changed = threading.Event()
        paths = {key_path(key) for key in keys}
        with self._waiters_lock:
            for path in paths:
                self._waiters.setdefault(path, set()).add(changed)
        try:
            return self._wait_on(keys, minimum, deadline, changed, seq_of, require_leader,
                                 first_read, abandoned)
        finally:
            with self._waiters_lock:
                for path in paths:
                    waiting = self._waiters.get(path)
                    if waiting is not None:
                        waiting.discard(changed)
                        if not waiting:
                            del self._waiters[path]

    def _wake_waiters(self, event: WatchedEvent) -> None:
        """The one watch callback of every replication wait (kazoo's thread: no blocking)."""
        with self._waiters_lock:
            if event.path is None:
                # A session event: kazoo dropped every watch, so every wait must read again.
                woken = [e for waiting in self._waiters.values() for e in waiting]
            else:
                woken = list(self._waiters.get(event.path, ()))
        for changed in woken:
            changed.set()

    def replication_waits(self) -> int:
        """Replication waits in progress (for the metrics)."""
        with self._waiters_lock:
            return len({id(e) for waiting in self._waiters.values() for e in waiting})

    def _wait_on(
        self, keys: list[str], minimum: int, deadline: float, changed: threading.Event,
        seq_of: dict[str, int] | None, require_leader: bool,
        first_read: Callable[[str, BlobState | None], None] | None,
        abandoned: threading.Event | None,
    ) -> tuple[bool, list[ReplicationStatus]]:
        # One bound method for every read: kazoo keeps a set of callbacks per path, so the
        # same callback armed by many waits, or by many passes of one, is held once.
        watch = self._wake_waiters
        first = True
        while True:
            changed.clear()
            self._require_zk()
            # Every key's state and replica list, both watched, one round trip per batch of
            # keys: a job's pre-launch check of a map of 20 blobs was 60 round trips, one
            # after the other. Batches bound what one call puts on the master's session.
            infos = []
            for start in range(0, len(keys), _WAIT_READ_BATCH):
                pending = [(key, self.zk.get_async(key_path(key), watch=watch),
                            self.zk.get_children_async(key_path(key), watch=watch))
                           for key in keys[start:start + _WAIT_READ_BATCH]]
                for key, state_read, names_read in pending:
                    try:
                        data, stat = state_read.get()
                        state: BlobState | None = BlobState.decode(data, stat.version)
                    except NoNodeError:
                        state = None
                    if first and first_read is not None:
                        first_read(key, state)
                    if state is None:
                        raise KeyNotFound(
                            f"{key!r} was deleted while waiting for its replication")
                    if seq_of is not None and state.seq != seq_of[key]:
                        if state.seq > seq_of[key] and state.acked:
                            # No master fetches a superseded version: waiting for it is vain.
                            # (Until the newer one is acknowledged, a roll-back could still
                            # skip past both: wait for that.)
                            raise _Superseded(state)
                        state = replace(state, seq=seq_of[key])
                    try:
                        names = names_read.get()
                    except NoNodeError:
                        names = []
                    infos.append(_status(key, state, zkstate.holders(names, state.seq)))
            first = False
            if all(i.replication >= minimum for i in infos):
                return True, infos
            remaining = deadline - time.monotonic()
            if (remaining <= 0 or self._stopped.is_set()
                    or (abandoned is not None and abandoned.is_set())):
                return False, infos
            if require_leader and not self.election.is_leader:
                raise Unavailable("leadership was lost while waiting for the write quorum; retry")
            # Watches wake us; the cap only bounds how stale the leadership check can be.
            changed.wait(min(remaining, 1.0))

    # ---- metadata changes ---------------------------------------------------------------

    def set_meta(
        self, user: str, key: str, acl: list[AccessControl] | None, replication_factor: int,
        expected_meta_version: int | None,
    ) -> BlobState:
        """Change the ACL and/or the replication factor; with ``expected_meta_version`` (0
        included: a new key's metadata is at 0) only if the metadata is still that version."""
        self._require_leader()
        validate_key(key)
        if acl is not None:
            acls.check_entries(acl)
        # The commit path holds this lock from read to conditional write; sharing it means a
        # metadata change never makes a concurrent upload fail with a spurious conflict.
        with self.store.key_lock(key):
            return self._set_meta_locked(user, key, acl, replication_factor,
                                         expected_meta_version)

    def _set_meta_locked(
        self, user: str, key: str, acl: list[AccessControl] | None, replication_factor: int,
        expected_meta_version: int | None,
    ) -> BlobState:
        for _ in range(5):
            state = self._state_or_404(key)
            self._check(user, state.acl, acls.ADMIN, key)
            if expected_meta_version is not None and state.meta_version != expected_meta_version:
                raise VersionConflict(
                    f"{key!r} metadata is at version {state.meta_version}, not"
                    f" {expected_meta_version}; re-read and retry"
                )
            new = state
            if acl is not None:
                new = replace(new, acl=tuple(acls.normalize_for_set(acl, user)))
            if replication_factor:
                new = replace(new, replication_factor=replication_factor)
            _fitting(key, new)
            try:
                self._fenced_set(key, new, state.meta_version)
            except BadVersionError:
                continue
            except NoNodeError:
                raise KeyNotFound(f"{key!r} was deleted meanwhile") from None
            except Deposed:
                raise Unavailable("leadership was lost; nothing changed, retry") from None
            log.info("meta of %r changed by %r: acl=%s rf=%d", key, user,
                     acls.format_acl(new.acl), new.replication_factor)
            self.sync.schedule(key)
            return replace(new, meta_version=state.meta_version + 1)
        raise VersionConflict(f"{key!r} kept changing; retry")

    def delete(self, user: str, key: str, expected_created_at: float | None = None) -> None:
        """Delete ``key``; with ``expected_created_at``, only the key created at that time
        (:class:`VersionConflict` if it was deleted and created again since)."""
        self._require_leader()
        validate_key(key)
        with self.store.key_lock(key):
            self._delete_locked(user, key, expected_created_at)

    def _delete_locked(self, user: str, key: str, expected_created_at: float | None) -> None:
        for _ in range(10):
            state = self._state_or_404(key)
            # Before the permission check: the key the caller meant is gone either way, and the
            # new one, which it may not be allowed to touch, is none of its business (a delete
            # retried after a lost answer is told so, not refused). Nothing of the new key
            # is told but that it exists, which a NOT_FOUND tells anyone too.
            if expected_created_at is not None and state.created_at != expected_created_at:
                raise VersionConflict(
                    f"{key!r} was deleted and created again since it was read; nothing was"
                    " deleted"
                )
            self._check(user, state.acl, acls.WRITE, key)
            try:
                self._fenced_delete(key, state.meta_version)
            except (NotEmptyError, BadVersionError, NoNodeError):
                continue  # a replica registered or the meta changed meanwhile: re-read
            except Deposed:
                raise Unavailable("leadership was lost; nothing was deleted, retry") from None
            log.info("deleted %r (was v%d) for %r", key, state.seq, user)
            return
        raise Unavailable(f"{key!r} kept changing while being deleted; retry")

    def _fenced_set(self, key: str, new: BlobState, expected_meta_version: int) -> None:
        def build(txn: Any) -> None:
            txn.set_data(key_path(key), new.encode(), version=expected_meta_version)

        self.election.fenced(build)

    def _fenced_delete(self, key: str, expected_meta_version: int) -> None:
        path = key_path(key)
        names = self._answer(self.zk.get_children_async(path))

        def build(txn: Any) -> None:
            # Replica nodes belong to other sessions; deleting them with the key in one
            # transaction keeps replicas from ever seeing a half-deleted key.
            for n in names:
                txn.delete(f"{path}/{n}")
            txn.delete(path, version=expected_meta_version)

        self.election.fenced(build)

    # ---- what the synchroniser asks of this master (blobha.sync.protocols) -----------------

    def is_leader(self) -> bool:
        return self.election.is_leader

    def deletions_allowed(self) -> bool:
        return self._deletions_allowed()

    def key_lock(self, key: str) -> threading.RLock:
        return self.store.key_lock(key)

    def leader_duty(self, key: str, view: KeyView) -> bool:
        return self._leader_duty(key, view)

    # ---- leader duties --------------------------------------------------------------------

    def _leader_duty(self, key: str, view: KeyView) -> bool:
        """Leader-only upkeep of one key; True if it changed the key's committed state."""
        state = view.state
        holders = view.holders
        if state.acked:
            return False
        if holders and len(holders) >= state.write_quorum:
            self._mark_acked(key, state)
            return True
        if not holders and state.epoch != self.election.epoch:
            # Committed by an earlier leader, which died before anyone copied it.
            return self._roll_back(key, state)
        return False

    def _roll_back(self, key: str, state: BlobState) -> bool:
        """A version committed by an earlier leader, never acknowledged, held by no live master:
        return the key to the newest version still available, so it never stays unreadable."""
        with self.store.key_lock(key):
            for past in state.history:
                source = self._obtain(key, past)
                if source is None:
                    continue
                new = state.with_new_version(
                    state.seq + 1, past.size, past.digest, time.time(), self.election.epoch,
                    state.write_quorum, self.config["blobstore.versions.retained"],
                    undone=True,
                )
                # Every version between the one restored and the one undone was skipped, held
                # by nobody: undone too, so a retry of their writes writes them again.
                new = replace(new, acked=True, history=tuple(
                    replace(h, write_tag="") if h.seq > past.seq else h for h in new.history))
                self.store.install_copy(key, new.seq, source)
                try:
                    self._fenced_set(key, new, state.meta_version)
                except BaseException as e:
                    # Unanswered, it may have applied: then this copy is the restored
                    # version's only one (the synchroniser registers it once a session is
                    # back, or removes it as debris once the key shows it never applied).
                    if not isinstance(e, UNREACHABLE):
                        self.store.delete_version(key, new.seq)
                    raise
                log.warning("ROLL-BACK: %r v%d was never acknowledged and no live master holds"
                            " it; restored the content of v%d as v%d", key, state.seq, past.seq,
                            new.seq)
                self.sync.schedule(key)
                return True
            if state.seq == 1 or not state.history:
                self._fenced_delete(key, state.meta_version)
                log.warning("ROLL-BACK: the create of %r was never acknowledged and no live master"
                            " holds it; removed the key", key)
                return True
        log.error("%r v%d is unacknowledged, unheld and no earlier version is available", key,
                  state.seq)
        return False

    def _obtain(self, key: str, past: PastVersion) -> VersionInfo | None:
        local = self.store.find_by_digest(key, past.digest, past.size)
        if local is not None:
            return local
        self.store.reserve(past.size)
        timeout = ROLLBACK_FETCH_SECS + past.size / ROLLBACK_MIN_RATE
        temp = self.store.new_temp("rollback")
        try:
            for address in self.peers.rank(self.membership.live() - {self.identity}):
                try:
                    self.peers.fetch(address, key, past.seq, past.digest, temp, timeout)
                except BlobError as e:
                    # What arrived stays: the next peer's fetch resumes from there.
                    log.info("roll-back of %r: fetching v%d from %s failed: %s", key, past.seq,
                             address, e)
                    continue
                try:
                    return self.store.install(key, past.seq, temp, past.size, past.digest)
                except ChecksumMismatch:
                    temp = self.store.new_temp("rollback")  # install removed the bad bytes
            return None
        finally:
            # Whatever ended the loop, no temporary file outlives it (after an install, its
            # name is gone already).
            temp.discard()

    # ---- status --------------------------------------------------------------------------

    def node_status(self) -> MasterSummary:
        return self._status(self.sync.figures()[2])

    def _status(self, lag: int) -> MasterSummary:
        """This master's summary, with ``lag`` from the synchroniser's figures."""
        count, stored = self.store.counted_usage()
        return MasterSummary(
            address=self.identity, is_leader=self.election.is_leader,
            uptime_secs=time.monotonic() - self.started, version=__version__, blob_count=count,
            bytes_stored=stored, disk_free=self.store.disk_free(), lag_blobs=lag,
            reachable=True, epoch=self.election.epoch,
            zookeeper_unreachable=self.zk.state != KazooState.CONNECTED,
        )

    def cluster_summary(self) -> ClusterView:
        """The masters as this one sees them, with the leader among them.

        Without a ZooKeeper connection this still answers, from the masters it last saw:
        the command an operator runs to find out what is wrong must not be the one that hangs.
        The leader is still the one that says so (only a leader with its own live session
        does), the blob count is unknown (0), and ``zookeeper_unreachable`` says which view
        this is."""
        members = sorted(self.membership.live() | {self.identity})
        # One pass for both figures: under writes, a second call would make a second pass.
        _, under, lag = self.sync.figures()

        def ask(address: str) -> MasterSummary:
            if address == self.identity:
                return self._status(lag)
            try:
                return self.peers.status(address, timeout=1.5)
            except BlobError:
                return MasterSummary(address, False, 0.0, "", 0, 0, 0, 0, False, 0)

        # Both reads at once, and bounded: a ZooKeeper that lost its quorum may hold a request
        # until the session notices, and clients discover the leader through this call, so it
        # must answer quickly rather than leave them guessing.
        reads = ((self.zk.get_async(EPOCH), self.zk.exists_async(BLOBSTORE))
                 if self.zk.state == KazooState.CONNECTED else None)
        statuses = tuple(self._summary_pool.map(ask, members))
        leader = next((s.address for s in statuses if s.is_leader), "")
        counted = _epoch_and_count(*reads) if reads is not None else None
        if counted is not None:
            return ClusterView(statuses, leader, *counted, under)
        # The leader's own status carries the epoch it leads.
        epoch_led = next((s.epoch for s in statuses if s.is_leader), 0)
        return ClusterView(statuses, leader, epoch_led, 0, under, zookeeper_unreachable=True)


def _epoch_and_count(epoch_read: Any, count_read: Any) -> tuple[int, int] | None:
    """The cluster's epoch and key count from the summary's two reads (the key count is the
    child count of /blobstore, not 100,000s of names); None if ZooKeeper did not answer in
    time."""
    try:
        try:
            epoch = EpochRecord.decode(epoch_read.get(timeout=SUMMARY_ZK_TIMEOUT)[0]).epoch
        except NoNodeError:
            epoch = 0
        stat = count_read.get(timeout=SUMMARY_ZK_TIMEOUT)  # exists: None if absent
    except (KazooTimeoutError, ConnectionLoss, SessionExpiredError):
        return None
    return epoch, stat.numChildren if stat is not None else 0


def _check_digest(digest: str) -> None:
    if not is_digest(digest):
        raise InvalidArgument(
            "the digest must be the xxh3-128 of the content as 32 lower-case hex digits"
        )


def _fitting(key: str, state: BlobState) -> BlobState:
    """``state``, if its record fits in ZooKeeper (:data:`zkstate.MAX_STATE_BYTES`); else
    InvalidArgument, before anything is written. The ACL's own bound (acl.MAX_STORED_BYTES)
    leaves room for the rest; this catches what it cannot: a setter or creator entry added
    to an ACL at that bound, or a long history of retained versions."""
    size = _record_bytes(state)
    if size > zkstate.MAX_STATE_BYTES:
        raise InvalidArgument(
            f"the metadata of {key!r} would take {size:,} bytes, more than the"
            f" {zkstate.MAX_STATE_BYTES:,} ZooKeeper has room for: give access to fewer users"
            " or use shorter names in its ACL"
        )
    return state


def _record_bytes(state: BlobState) -> int:
    """At least the bytes ``state``'s record takes: for a small one its bound, an over-estimate
    (1.4 us, so a sum of them still keeps a transaction under ZooKeeper's limit) that spares
    encoding nearly every write once more to measure it (70 us); for a large one, the exact
    size."""
    bound = state.size_bound()
    return bound if bound <= zkstate.MAX_STATE_BYTES // 64 else len(state.encode())


class CommitOutcomeUnknown(Unavailable):
    """ZooKeeper stayed out of reach after a commit was sent, so it may have applied; with
    W=1 it would then be acknowledged in ZooKeeper, with this master's copy as its only one.
    That copy is kept: the synchroniser re-registers it once a session is back, or removes it
    as debris once the key's committed state shows the commit never happened."""


class _Superseded(Exception):
    """A version waited for (its write quorum) was superseded by a newer commit, acknowledged
    (``state``)."""

    def __init__(self, state: BlobState) -> None:
        super().__init__(f"superseded by v{state.seq}")
        self.state = state


def _retried(key: str, prior: BlobState, user: str) -> BlobState:
    log.info("%r v%d: a retry of the write that committed it (by %r); not written again",
             key, prior.seq, user)
    return prior


class _AlreadyWritten(Exception):
    """A write found its own version committed (a retry after a lost answer)."""

    def __init__(self, state: BlobState) -> None:
        super().__init__(f"v{state.seq} was written by this write already")
        self.state = state


#: Longest write id a client may name a write with.
MAX_WRITE_ID_BYTES = 64


def _tag(user: str, write_id: bytes) -> str:
    if len(write_id) > MAX_WRITE_ID_BYTES:
        raise InvalidArgument(
            f"a write id is at most {MAX_WRITE_ID_BYTES} bytes, not {len(write_id)}")
    return write_tag(user, write_id)


def _commit_error(key: str, error: Exception, metadata: bool) -> BlobError:
    """What a write is told when its operation failed in a commit transaction."""
    if isinstance(error, NodeExistsError) and metadata:
        return KeyAlreadyExists(f"key {key!r} already exists; use 'blobha update'")
    if isinstance(error, BadVersionError | NoNodeError):
        return VersionConflict(f"{key!r} changed during the commit; retry")
    return Unavailable(f"the commit of {key!r} failed ({type(error).__name__}); nothing was"
                       " committed, retry")


def _limit_malloc_arenas(arenas: int = 2) -> None:
    """Cap glibc's malloc arenas (before any thread starts). By default every thread that
    allocates may get an arena of its own, up to eight per core; a master runs dozens of
    threads (gRPC workers, sync fetchers, kazoo), and the memory freed by one thread's blob
    buffers stays fragmented in its arena, which showed as resident memory growing with the
    number of keys. A no-op off glibc."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return  # the operator chose
    mallopt = libc_function("mallopt")
    if mallopt is not None:
        m_arena_max = -8
        mallopt(m_arena_max, arenas)


def confine_to_cpus(text: str) -> frozenset[int]:
    """Run every thread of this process, and each it starts later, on the CPUs of the list
    ``text`` (``master.cpus``). Raises :class:`ConfigError` if the system offers no such
    control or the list names a CPU this process may not use."""
    wanted = parse_cpu_list(text)
    if not wanted:
        raise ConfigError("master.cpus names no CPU; leave it empty to run anywhere")
    if not hasattr(os, "sched_setaffinity"):
        raise ConfigError("master.cpus needs CPU affinity, which this system does not offer;"
                          " leave it empty")
    allowed = os.sched_getaffinity(0)
    if not wanted <= allowed:
        raise ConfigError(
            f"master.cpus {text!r} names CPU {format_cpu_list(wanted - allowed)}, which this"
            f" master may not use (it may use {format_cpu_list(allowed)}); pick from those"
            " or leave it empty")
    # Each thread has its own mask: set it on all that exist (a library may have started
    # one already); those started later inherit it from their starter.
    tasks = Path("/proc/self/task")
    tids = [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [0]
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, wanted)
    return wanted


def serve_main(config_path: str | None) -> int:
    """``blobha serve --config FILE``: run one master until SIGTERM or SIGINT."""
    _limit_malloc_arenas()
    try:
        config = load_config(config_path)
    except ConfigError as e:
        print(f"blobha: configuration error: {e}", flush=True)
        return 2
    logs.configure(config["log.level"], config["log.format"], config.advertise)
    if config["audit.file"]:
        try:
            handler = logging.FileHandler(config["audit.file"])
        except OSError as e:
            log.error("cannot open audit.file %s: %s", config["audit.file"], e.strerror)
            return 1
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        logging.getLogger("blobha.audit").addHandler(handler)
    if config["master.cpus"]:
        try:
            cpus = confine_to_cpus(config["master.cpus"])
        except ConfigError as e:
            log.error("cannot start: %s", e)
            return 1
        log.info("running on CPU %s (master.cpus)", format_cpu_list(cpus))
    try:
        master = Master(config)
        master.start()
    except (ConfigError, BlobError, OSError) as e:
        log.error("cannot start: %s", e)
        return 1
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    parent = os.environ.get("BLOBHA_EXIT_WITH_PARENT")
    if parent and parent.isdigit():
        threading.Thread(target=_exit_with_parent, args=(int(parent), stop), daemon=True).start()
    stop.wait()
    master.stop()
    return 0


def _exit_with_parent(pid: int, stop: threading.Event) -> None:
    """Stop when the process that started us is gone (a local cluster whose runner was
    killed must not leave masters behind)."""
    while not stop.wait(1.0):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            log.warning("parent process %d is gone; stopping", pid)
            stop.set()
        except PermissionError:
            pass
