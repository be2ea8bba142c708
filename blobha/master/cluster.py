"""Cluster identity (ha-rule 10): which ZooKeeper state this store belongs to, whether local
deletes are allowed, the chroot and the cluster secret."""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from contextlib import AbstractContextManager
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import (
    NodeExistsError,
    NoNodeError,
)
from kazoo.retry import KazooRetry

from blobha.leader import LeaderElection
from blobha.master.clustersecret import ClusterSecret
from blobha.store.local import LocalStore
from blobha.wire.peers import Peers
from blobha.zk.layout import BLOBSTORE
from blobha.zk.lockdown import ZkCredentials, ensure_locked_chroot
from blobha.zk.tls import ZkTls

log = logging.getLogger("blobha.master")


class ClusterIdentity:
    """What ties this master's store to one cluster in ZooKeeper."""

    def __init__(self, zk: KazooClient, store: LocalStore, peers: Peers, servers: str,
                 chroot: str, credentials: ZkCredentials | None, session_timeout: float,
                 tls: ZkTls | None = None) -> None:
        self.zk = zk
        self.store = store
        self.peers = peers
        self._servers = servers
        self._chroot = chroot
        self.zk_credentials = credentials
        self.zk_tls = tls
        self.session_timeout = session_timeout
        self._zk_hosts = servers + chroot
        self._secret = ClusterSecret(zk, peers.set_cluster_secret, self.old_secret_secs,
                                     read_timeout=session_timeout)
        self._cluster_id_ok = False
        self._cluster_id = ""
        self._identity_alarm = False

    @property
    def secret(self) -> str:
        """The secret this master sends (and signs peers' grants under)."""
        return self._secret.current

    @property
    def accepted_secret(self) -> str:
        """The secret a caller may prove it is a master with: the current one, while this
        master can vouch for it (see blobha.master.clustersecret); "" otherwise."""
        return self._secret.accepted()[0]

    @property
    def previous_secret(self) -> str:
        """The secret a rotation replaced, while masters that have not seen the rotation yet
        may still send it; "" after, and whenever the current one is not accepted."""
        return self._secret.accepted()[1]

    @property
    def old_secret_secs(self) -> float:
        """How long a replaced secret is still accepted: a master that has not seen the
        rotation within twice its session timeout was cut from ZooKeeper long enough to lose
        its session (ha-rule 5 c). Such a master, cut that long, accepts no secret at all
        until it has read the secret again (blobha.master.clustersecret)."""
        return 2 * self.session_timeout

    def _answer(self, pending: Any) -> Any:
        return pending.get(timeout=self.session_timeout)

    def check(self) -> None:
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

    def deletions_allowed(self) -> bool:
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

    def load_secret(self) -> None:
        """The secret masters prove themselves to each other with (see blobha.wire.authn). The
        first master creates it; under lock-down only masters can read it. A rotation
        (blobha admin rotate-secret, or a lock-down of an open tree) reaches every master
        through the watch this sets."""
        self._secret.load()

    def close(self) -> None:
        self._secret.close()

    def ensure_chroot(self) -> None:
        # A chrooted client cannot create its own root; do it once without the chroot, and
        # lock the tree down there (migrating an open one) when ZooKeeper auth is on.
        ensure_locked_chroot(self._servers, self._chroot,
                             self.zk_credentials, max(15.0, self.session_timeout), self.zk_tls)


def end_zk_session(hosts: str, session_timeout: float, credentials: ZkCredentials | None,
                   tls: ZkTls | None, session: int, password: bytes) -> bool:
    """Reconnect to session ``session`` and close it, which removes its ephemeral nodes: True,
    or False if it had expired (kazoo then got a new session, closed here instead). Raises
    if ZooKeeper cannot be reached."""
    zk = KazooClient(
        hosts=hosts,
        timeout=session_timeout,
        client_id=(session, password),
        connection_retry=KazooRetry(max_tries=2, max_delay=1.0),
        **(credentials.kazoo_args() if credentials else {}),
        **(tls.kazoo_args() if tls else {}),
    )
    try:
        # Short: a master that cannot reach ZooKeeper now cannot serve either, and the
        # session then expires by itself.
        zk.start(timeout=5.0)
        resumed = bool(zk.client_id) and zk.client_id[0] == session
    finally:
        zk.stop()  # closes the session: ZooKeeper deletes its ephemeral nodes
        zk.close()
    return resumed


class Guard:
    """What the synchroniser asks before it acts (:class:`blobha.sync.ClusterGuard`)."""

    def __init__(self, election: LeaderElection, cluster: ClusterIdentity, store: LocalStore
                 ) -> None:
        self._election = election
        self._cluster = cluster
        self._store = store

    def is_leader(self) -> bool:
        return self._election.is_leader

    def deletions_allowed(self) -> bool:
        return self._cluster.deletions_allowed()

    def key_lock(self, key: str) -> AbstractContextManager[object]:
        return self._store.key_lock(key)
