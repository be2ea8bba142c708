"""A blob master: the operations of the blob store as one facade over its parts (metadata,
writes, committer, acknowledgements, waits, reads, admin, repairs, job tokens, cluster
identity, status),
which it wires to ZooKeeper, the local store, the election and the synchroniser. The gRPC
servicer (:mod:`blobha.master.edge.service`) is a thin edge over it.

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

import functools
import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from blobha.core.acl import AccessControl
from blobha.core.addresses import status_url
from blobha.core.auth import AuthMode
from blobha.core.blobstate import BlobState
from blobha.core.consistency import MinVersion, View
from blobha.core.errors import Unavailable
from blobha.core.version import __version__
from blobha.leader import LeaderElection, LeaderHistory
from blobha.master.acks import Acknowledger
from blobha.master.admin import Admin
from blobha.master.channel import Channel
from blobha.master.cluster import ClusterIdentity, Guard, end_zk_session
from blobha.master.committer import Committer
from blobha.master.config import Config, ConfigError
from blobha.master.forward import Forwarder
from blobha.master.groupcommit import GroupCommitter
from blobha.master.holders import Holders
from blobha.master.jobtokens import JobTokens
from blobha.master.metadata import Metadata
from blobha.master.peerplans import PeerPlans
from blobha.master.quotas import QuotaLimits, Quotas
from blobha.master.reads import Reads
from blobha.master.repairs import Repairs
from blobha.master.rules import Authority, CommitOutcomeUnknown, PutRequest
from blobha.master.scrub import Scrubber
from blobha.master.secretrotation import SecretRotation
from blobha.master.settings import MasterSettings
from blobha.master.staging import Staging
from blobha.master.status import MasterStatus
from blobha.master.summary import StatusSummary
from blobha.master.uploads import UploadManager
from blobha.master.waits import ReplicationWaits
from blobha.master.writes import Writes
from blobha.store.local import LocalStore, VersionInfo
from blobha.sync import (
    IdentityInUse,
    KeyView,
    Membership,
    SessionRecord,
    Synchronizer,
    SyncSettings,
)
from blobha.wire.authn import ServerAuthentication, make_authenticator
from blobha.wire.credentials import Credentials
from blobha.wire.datachannel import DataOffer
from blobha.wire.peers import Peers
from blobha.wire.status import (
    ClusterSummary,
    JobToken,
    MasterSummary,
    PeerPlan,
    ReplicationStatus,
)
from blobha.wire.tls import ReloadingServerCredentials
from blobha.zk import layout
from blobha.zk.connection import before_each_connection, master_client, on_session_timeout
from blobha.zk.lockdown import ZkCredentials, ZooKeeperAuthError
from blobha.zk.tls import PinnedZkTls, ZooKeeperTlsError

__all__ = ["CommitOutcomeUnknown", "Master"]

log = logging.getLogger("blobha.master")

#: Bytes of blob data one group commit installs at most: a batch is acknowledged only once
#: all of it is durable, so this bounds what one writer waits for on behalf of the others.
PUT_BATCH_BYTES = 8 * 1024 * 1024


class Master:
    """One master: its collaborators and parts, their start and stop, and the operations the
    gRPC servicer calls, each handed to the part that does it."""

    def __init__(self, config: Config) -> None:
        self.config = config
        s = self.settings = MasterSettings.from_config(config)
        self.identity = s.identity
        self.principal = s.principal
        self.session_timeout = s.session_timeout
        try:
            s.refuse_exposed_secrets()
            self.zk_credentials = (ZkCredentials.from_file(s.zk_auth_file)
                                   if s.zk_auth_scheme == "digest" else None)
            if s.zk_tls is not None:
                s.zk_tls.context()  # unusable files fail here, naming their setting
            # kazoo reads its TLS files at every connection: it gets a copy, taken again only
            # when the files pass these checks again.
            self.zk_tls_files = (
                PinnedZkTls(s.zk_tls, Path(tempfile.mkdtemp(prefix="blobha-zk-tls-")))
                if s.zk_tls is not None and s.zk_tls.cert else None)
            zk_tls = self.zk_tls_files.pinned if self.zk_tls_files is not None else s.zk_tls
            self.authentication = ServerAuthentication(
                make_authenticator(s.auth_mode, s.auth_token_file, s.auth_mtls_rules),
                self.principal, lambda: self.cluster.accepted_secret,
                previous_secret=lambda: self.cluster.previous_secret,
            )
            self.server_tls = (
                ReloadingServerCredentials(s.tls_cert, s.tls_key, s.tls_ca,
                                           require_client_cert=s.auth_mode is AuthMode.MTLS)
                if s.tls_cert else None
            )
        except (ValueError, ZooKeeperAuthError, ZooKeeperTlsError) as e:
            raise ConfigError(str(e)) from None
        # After the checks above: a master refused for its settings leaves no data directory.
        # The predecessor on this directory (see SessionRecord) is ended as soon as its lock
        # is ours, before the store loads: a leader restarted at once hands over at once.
        self.session_record: SessionRecord | None = None

        def locked() -> None:
            self.session_record = SessionRecord(s.data_dir, functools.partial(
                end_zk_session, s.zk_servers + s.zk_chroot, self.session_timeout,
                self.zk_credentials, zk_tls))
            self.session_record.end_predecessor()

        opening = time.monotonic()
        self.store = LocalStore(s.data_dir, s.disk_reserved_bytes, on_locked=locked)
        log.info("store %s open in %.1f s", s.data_dir, time.monotonic() - opening)
        self.zk = master_client(s.zk_servers + s.zk_chroot, self.session_timeout,
                                self.zk_credentials, zk_tls)
        if self.zk_tls_files is not None:
            before_each_connection(self.zk, self.zk_tls_files.refresh)
        # Masters reach each other with this master's own certificate as client certificate.
        # Whether that is TLS is tls.*, never a client's BLOBHA_REQUIRE_TLS (or profile) that
        # the environment a master was started from may hold.
        self.peers = Peers(self.principal, Credentials(
            ca=s.tls_ca or None, cert=s.tls_cert or None, key=s.tls_key or None,
            require_tls=False,
        ), stall_secs=s.sync_stall_secs)
        self.cluster = ClusterIdentity(self.zk, self.store, self.peers, s.zk_servers,
                                       s.zk_chroot, self.zk_credentials, self.session_timeout,
                                       zk_tls)
        self.uploads = UploadManager(self.store, s.upload_expiration_secs, s.upload_max_per_user)
        self.election = LeaderElection(
            self.zk, self.identity, self.session_timeout, self._on_elected, self._on_deposed
        )
        on_session_timeout(self.zk, self.election.session_granted)
        self.history = LeaderHistory()
        self.channel = Channel()
        info: dict[str, object] = {"address": self.identity, "version": __version__,
                                   "pid": os.getpid(), "host": socket.gethostname()}
        if s.metrics_listen:
            info["status_url"] = status_url(s.metrics_listen, self.identity)
        self.membership = Membership(
            self.zk, self.identity, s.replica_grace_secs,
            on_change=self._membership_changed, info=info,
            # A predecessor's session (this identity, a master that died) expires within its
            # timeout, one tick late at worst; at once if it was this data directory's.
            claim_secs=2 * self.session_timeout + 2,
            record=self.session_record,
            on_leave=self._master_left,
        )
        self.sync = Synchronizer(
            self.zk, self.store, self.identity, self.peers, self.membership,
            SyncSettings(
                replica_grace_secs=s.replica_grace_secs,
                delete_grace_secs=s.delete_grace_secs,
                period_secs=s.sync_period_secs,
                versions_retained=s.versions_retained,
                threads=s.sync_threads,
                periodic_keys_per_sec=s.sync_periodic_keys_per_sec,
                recursive_watch=s.sync_recursive_watch,
                linger_secs=s.sync_linger_secs,
            ),
            duties=self, guard=Guard(self.election, self.cluster, self.store),
        )
        self.uploads.staged_wanted = self._staged_wanted
        self.store.on_corrupt = self.sync.corrupted
        self.scrubber = Scrubber(self.store, s.scrub_interval_secs, s.scrub_rate_bytes_per_sec)
        self._stopped = threading.Event()
        self._closed = False
        self._handed_over = False  # this master led when it resigned
        # The parts, each given what it works with.
        self.authority = Authority(s.admins, self.principal)
        self.meta = Metadata(self.zk, self.election, self.identity, self.session_timeout,
                             self._stopped)
        self.waits = ReplicationWaits(self.zk, self.election, self.meta, self.authority,
                                      self._stopped, self.membership.holding)
        self.acks = Acknowledger(s, self.store, self.meta, self.waits, self.sync)
        self.forwarder = Forwarder(
            self.identity, self.peers, self.membership.live, self.membership.known,
            lambda: self.election.epoch,
            # A stalled holder is given up at the stall limit, never later than a write's
            # own timeout: a forward must not make a write that could have failed in time
            # fail late.
            min(s.sync_stall_secs, s.write_timeout_secs), s.write_forward)
        self.quotas = Quotas(QuotaLimits.of(s), self.authority, self.sync.usage,
                             self.sync.seen, self.sync.key_count)
        self.committer = Committer(s, self.identity, self.store, self.election, self.meta,
                                   self.authority, self.sync, self.membership, self.uploads,
                                   self.quotas, self.forwarder)
        self.puts: GroupCommitter[PutRequest, BlobState] = GroupCommitter(
            self.committer.commit_puts, key=lambda p: p.key, name="put-commit",
            weight=lambda p: len(p.data), max_weight=PUT_BATCH_BYTES,
        )
        self.writes = Writes(s, self.store, self.uploads, self.puts, self.meta, self.authority,
                             self.committer, self.acks, self.channel, self.quotas,
                             self.forwarder)
        self.staging = Staging(self.principal, self.store, self._epoch_seen, self.uploads,
                               self.writes.offer_upload, self.writes.offer_stage_link)
        self.reads = Reads(s, self.identity, self.principal, self.store, self.zk, self.meta,
                           self.authority, self.sync, self.channel)
        self.admin = Admin(self.store, self.meta, self.authority, self.sync, self.quotas)
        self.peer_plans = PeerPlans(self.identity, self.reads, lambda: self.cluster.secret,
                                    s.peer_grant_secs, Holders(s.peer_holder_secs))
        self.jobtokens = JobTokens(self.zk, self.election, self.meta, self.authority,
                                   s.auth_mode, s.job_token_max_lifetime_secs, self.quotas)
        if s.auth_mode is not AuthMode.SIMPLE:  # simple mode: no secrets, so no job tokens
            self.authentication.job_tokens = self.jobtokens
        self.rotation = SecretRotation(self.zk, self.election, self.meta, self.authority)
        self.repairs = Repairs(s, self.identity, self.store, self.election, self.meta,
                               self.acks, self.membership, self.peers, self.sync)
        self.summary = StatusSummary(self.identity, self.store, self.zk, self.election,
                                     self.sync, self.membership, self.peers)
        self.status = MasterStatus(
            self.identity, s.zk_servers, self.session_timeout, self.zk, self.election,
            self.history, self.store, self.uploads, self.sync, self.puts, self.scrubber,
            self.membership, self.channel, self.summary, self.waits, self.forwarder)

    # ---- lifecycle -----------------------------------------------------------------------

    def connect(self) -> None:
        """Reach ZooKeeper and check that it holds this store's cluster."""
        try:
            self.cluster.ensure_chroot()
            self.zk.start(timeout=max(15.0, self.session_timeout))
        except (ZooKeeperAuthError, ZooKeeperTlsError) as e:
            raise ConfigError(str(e)) from None
        except Exception as e:
            raise Unavailable(
                f"cannot reach ZooKeeper at {self.settings.zk_servers} ({e}); check"
                " zookeeper.servers and that the ensemble runs"
            ) from None
        for root in layout.ALL_ROOTS:
            self.zk.ensure_path(root)
        self.cluster.check()
        self.cluster.load_secret()
        if self.zk_credentials is None and self.settings.auth_mode is not AuthMode.SIMPLE:
            log.warning("ZooKeeper is not locked down (zookeeper.auth.scheme = 'none'): whoever"
                        " reaches ZooKeeper can read the cluster secret and forge blobha state")
        self.history.watch(self.zk)
        self.uploads.start()

    def join(self) -> None:
        """Register as a replica holder, then sync, stand for election and scrub."""
        try:
            self.membership.register(wait=True)
        except IdentityInUse as e:
            raise ConfigError(str(e)) from None
        self.sync.start()
        self.election.start()
        self.scrubber.start()
        log.info("master %s serving (blobha %s, data in %s)", self.identity, __version__,
                 self.store.root)

    def resign(self) -> None:
        """The first half of a graceful stop: hand leadership over at once and abort uploads.
        Whoever serves this master stops serving after this, then calls :meth:`stop`."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.waits.stop_waits()
        log.info("stopping master %s", self.identity)
        was_leader = self.election.is_leader
        self.election.stop(resign=True)
        if was_leader:
            log.info("leadership handed over")
            self._handed_over = True
        self.uploads.stop()
        self.scrubber.stop()

    def stop(self) -> None:
        """Graceful stop: resign leadership at once, abort uploads, drain, disconnect."""
        self.resign()
        if self._closed:
            return
        self._closed = True
        self.puts.close(timeout=5.0)
        self.forwarder.close()
        self.sync.stop()
        self.peers.close()
        self.summary.close()
        if self._handed_over and self.settings.stop_linger_secs > 0:
            # A former leader keeps its session a moment (when told to), so the successor's
            # first writes come before the session's end reaches the other masters.
            log.info("keeping the ZooKeeper session %.1f s (master.stop.linger.secs)",
                     self.settings.stop_linger_secs)
            time.sleep(self.settings.stop_linger_secs)
        self.cluster.close()
        try:
            self.zk.stop()
            self.zk.close()
        except Exception:
            log.debug("ZooKeeper close failed", exc_info=True)
        if self.zk_tls_files is not None:
            self.zk_tls_files.close()
        self.store.close()

    # ---- election and membership callbacks -------------------------------------------------

    def _on_elected(self, epoch: int) -> None:
        # ha-rule 4: the election has already sync()ed with ZooKeeper, and every write reads
        # the committed state from ZooKeeper itself, so what remains is cheap: drop uploads of
        # an earlier term and refresh membership. The roll-back of an earlier leader's
        # unacknowledged commits, and blobs the leader lacks, follow from a pass that runs in
        # the background: scanning every key must not delay taking office, nor its first
        # writes (see Synchronizer.request_leader_pass).
        self.uploads.abort_all("a new leadership term began")
        # Bounded: this runs under the election's lock (see LeaderElection._answer).
        self.membership.refresh(timeout=self.election.suspension_limit)
        self.sync.request_leader_pass()

    def _staged_wanted(self, key: str, digest: str) -> bool:
        # The committed version as this master last read it, not installed here yet: its
        # staged copy waits for the sync to install it, never for the reaper.
        view = self.sync.view(key)
        return (view is not None and view.state.digest == digest
                and view.state.seq not in self.store.versions(key))

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

    # ---- operations, each handed to its part ---------------------------------------------

    def privileged(self, user: str) -> bool:
        return self.authority.privileged(user)

    def access(self, user: str, acl: Sequence[AccessControl], key: str = "") -> int:
        return self.authority.access(user, acl, key)

    def begin_upload(
        self, user: str, key: str, create: bool, acl: list[AccessControl], replication_factor: int,
        expected_version: int, size_hint: int, write_quorum: int, write_id: bytes = b"",
    ) -> tuple[str, int, tuple[str, BlobState, int] | None]:
        return self.writes.begin_upload(user, key, create, acl, replication_factor,
                                        expected_version, size_hint, write_quorum, write_id)

    def append(self, user: str, upload_id: str, offset: int, data: bytes | memoryview) -> int:
        return self.writes.append(user, upload_id, offset, data)

    def put(
        self, user: str, key: str, create: bool, acl: list[AccessControl], replication_factor: int,
        expected_version: int, write_quorum: int, data: bytes, digest: str,
        write_id: bytes = b"",
    ) -> tuple[str, BlobState, int]:
        return self.writes.put(user, key, create, acl, replication_factor, expected_version,
                               write_quorum, data, digest, write_id)

    def upload_key(self, upload_id: str) -> str:
        return self.writes.upload_key(upload_id)

    def upload_status(self, user: str, upload_id: str) -> int:
        return self.writes.upload_status(user, upload_id)

    def offer_upload(self, user: str, upload_id: str) -> tuple[int, DataOffer | None]:
        return self.writes.offer_upload(user, upload_id)

    def abort(self, user: str, upload_id: str) -> None:
        self.writes.abort(user, upload_id)

    def commit(self, user: str, upload_id: str, size: int, digest: str
               ) -> tuple[str, BlobState, int]:
        return self.writes.commit(user, upload_id, size, digest)

    def get_meta(self, user: str, key: str, any_access: bool = False,
                 minimum: MinVersion | None = None, view: View = View.SESSION
                 ) -> tuple[BlobState, int]:
        return self.reads.get_meta(user, key, any_access, minimum, view)

    def open_download(
        self, user: str, key: str, version: int, offset: int, length: int,
        data_channel: bool = False, minimum: MinVersion | None = None,
        view: View = View.SESSION,
    ) -> tuple[VersionInfo, float, Iterator[bytes] | DataOffer]:
        return self.reads.open_download(user, key, version, offset, length, data_channel,
                                        minimum, view)

    def fetch_versions(self, user: str, refs: Sequence[tuple[str, int]]
                       ) -> Iterator[tuple[str, int, VersionInfo | None, bytes]]:
        return self.reads.fetch_versions(user, refs)

    def stage_versions(self, user: str, epoch: int,
                       versions: Sequence[tuple[str, int, str, bytes]]) -> list[bool]:
        return self.staging.stage(user, epoch, versions)

    def begin_staging(self, user: str, key: str, epoch: int) -> tuple[str, DataOffer | None]:
        return self.staging.begin_stream(user, key, epoch)

    def begin_stage_link(self, user: str, epoch: int) -> DataOffer | None:
        return self.staging.begin_link(user, epoch)

    def finish_staging(self, user: str, upload_id: str, key: str, epoch: int, size: int,
                       digest: str) -> bool:
        return self.staging.finish_stream(user, upload_id, key, epoch, size, digest)

    def _epoch_seen(self) -> int:
        term = self.history.current
        return term.epoch if term is not None else 0

    def list_keys(self, user: str, prefix: str, page_token: str, page_size: int
                  ) -> tuple[list[str], str]:
        return self.reads.list_keys(user, prefix, page_token, page_size)

    def get_replication(self, user: str, key: str, minimum: MinVersion | None = None,
                        view: View = View.SESSION) -> ReplicationStatus:
        return self.reads.get_replication(user, key, minimum, view)

    def wait_for_replication(self, user: str, keys: list[str], minimum: int, timeout: float,
                             abandoned: threading.Event | None = None,
                             ) -> tuple[bool, list[ReplicationStatus], float]:
        return self.waits.wait_for_replication(user, keys, minimum, timeout, abandoned)

    def peer_plan(self, user: str, key: str, version: int, address: str, complete: bool,
                  minimum: MinVersion | None = None, view: View = View.SESSION,
                  caller: str = "") -> PeerPlan:
        return self.peer_plans.plan(user, key, version, address, complete, minimum, view,
                                    caller)

    def set_meta(
        self, user: str, key: str, acl: list[AccessControl] | None, replication_factor: int,
        expected_meta_version: int | None,
    ) -> BlobState:
        return self.admin.set_meta(user, key, acl, replication_factor, expected_meta_version)

    def delete(self, user: str, key: str, expected_created_at: float | None = None) -> None:
        self.admin.delete(user, key, expected_created_at)

    def issue_job_token(self, user: str, keys: Sequence[str], lifetime_secs: int) -> JobToken:
        return self.jobtokens.issue(user, keys, lifetime_secs)

    def revoke_job_token(self, user: str, token_or_id: str) -> str:
        return self.jobtokens.revoke(user, token_or_id)

    def rotate_cluster_secret(self, user: str) -> tuple[int, float]:
        """A new cluster secret (admins only): its generation, and the seconds the old one
        is still accepted."""
        return self.rotation.rotate(user), self.cluster.old_secret_secs

    def node_status(self) -> MasterSummary:
        return self.summary.node_status()

    def cluster_summary(self) -> ClusterSummary:
        return self.summary.cluster_summary()

    def leader_duty(self, key: str, view: KeyView) -> bool:
        """The synchroniser's call for a key it reconciles while leading (LeaderDuties)."""
        return self.repairs.leader_duty(key, view)

