"""ZooKeeper lock-down: blobha's znodes carry a digest ACL that only the masters' credentials
satisfy, so nobody else who reaches ZooKeeper can read the cluster secret, forge replica nodes,
bump versions or delete keys.

With ``zookeeper.auth.scheme = "digest"`` every master session authenticates with the
credentials in ``zookeeper.auth.file`` and every znode it creates (the chroot included) gets
``digest:<user>:<hash>:cdrwa`` and nothing else. An existing open tree is migrated at start:
:func:`lock_down` sets the ACL on every node, the chroot last, so an interrupted migration is
resumed by the next start; then the cluster secret, which anyone could read until then, is
replaced. A marker node made before the first ACL changes and removed with that rotation makes
the rotation survive a crash in between: the next master to start does it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError, NodeExistsError, NoNodeError
from kazoo.security import ACL, make_digest_acl

from blobha.core.auth import new_cluster_secret
from blobha.core.secretfiles import ExposedSecretFile, refuse_exposed
from blobha.zk.layout import MASTER_SECRET, SECRET_EXPOSED
from blobha.zk.tls import ZkTls, start_explained

log = logging.getLogger("blobha.zkauth")


class ZooKeeperAuthError(Exception):
    """ZooKeeper refused the masters' credentials or the tree is locked by other ones."""


@dataclass(frozen=True)
class ZkCredentials:
    """Digest credentials of the masters (``user:password``)."""

    user: str
    password: str

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ZkCredentials:
        p = Path(path)
        try:
            # Refused, not warned about: whoever reads it can do anything to blobha's znodes.
            refuse_exposed(os.fspath(path), "zookeeper.auth.file")
        except ExposedSecretFile as e:
            raise ZooKeeperAuthError(str(e)) from None
        try:
            text = p.read_text().strip()
        except OSError as e:
            raise ZooKeeperAuthError(
                f"cannot read zookeeper.auth.file {os.fspath(path)!r}: {e.strerror}"
            ) from None
        user, sep, password = text.partition(":")
        if not sep or not user or not password or "\n" in text:
            raise ZooKeeperAuthError(
                f"zookeeper.auth.file {os.fspath(path)!r} must hold one 'user:password' line"
            )
        return cls(user, password)

    @property
    def acl(self) -> list[ACL]:
        return [make_digest_acl(self.user, self.password, all=True)]

    def kazoo_args(self) -> dict[str, Any]:
        """Keyword arguments for KazooClient: authenticate, and lock every created node."""
        return {"auth_data": [("digest", f"{self.user}:{self.password}")],
                "default_acl": self.acl}


def is_locked(acls: list[ACL], wanted: list[ACL]) -> bool:
    return sorted(map(str, acls)) == sorted(map(str, wanted))


def lock_down(zk: KazooClient, path: str, wanted: list[ACL]) -> int:
    """Give ``path`` and everything below it the ACL ``wanted`` (children first, so the top
    node, once locked, proves the whole tree is). Returns how many nodes changed."""
    changed = 0
    try:
        children = zk.get_children(path)
    except NoNodeError:
        return 0
    except NoAuthError:
        raise ZooKeeperAuthError(
            f"ZooKeeper refused to list {path}: it is locked by other credentials; check"
            " zookeeper.auth.file"
        ) from None
    for child in children:
        changed += lock_down(zk, f"{path.rstrip('/')}/{child}", wanted)
    try:
        acls, _ = zk.get_acls(path)
        if not is_locked(acls, wanted):
            zk.set_acls(path, wanted)
            changed += 1
    except NoNodeError:
        pass  # an ephemeral node went away meanwhile
    except NoAuthError:
        raise ZooKeeperAuthError(
            f"ZooKeeper refused to change the ACL of {path}: it is locked by other credentials;"
            " check zookeeper.auth.file"
        ) from None
    return changed


def ensure_locked_chroot(servers: str, chroot: str, creds: ZkCredentials | None,
                         timeout: float, tls: ZkTls | None = None) -> None:
    """Create the chroot if missing; with credentials, lock the tree below it (migrating an
    open tree once). Without credentials, fail clearly if the tree is already locked. A TLS
    mismatch with the server (``tls``) raises :class:`blobha.zk.tls.ZooKeeperTlsError`."""
    kwargs = {**(creds.kazoo_args() if creds else {}), **(tls.kazoo_args() if tls else {})}
    root = KazooClient(hosts=servers, timeout=timeout, **kwargs)
    # The first connection of a master's start: where a TLS mismatch shows, and is explained.
    start_explained(root, servers, tls, timeout)
    try:
        try:
            root.ensure_path(chroot)
            acls, _ = root.get_acls(chroot)
            if creds is None:
                # A locked tree refuses to be listed without the masters' credentials.
                root.get_children(chroot)
                return
        except NoAuthError:
            raise ZooKeeperAuthError(
                f"ZooKeeper refused access to {chroot}: blobha's znodes there are locked down;"
                " set zookeeper.auth.scheme = 'digest' and zookeeper.auth.file to the masters'"
                " credentials"
            ) from None
        if not is_locked(acls, creds.acl):
            lock_down_tree(root, chroot, creds)
        # Every start, not only the one that locked the tree: a lock-down cut short by a crash
        # left its marker, and the secret anyone could read is still the cluster's.
        rotate_exposed_secret(root, chroot)
    finally:
        root.stop()
        root.close()


def lock_down_tree(zk: KazooClient, chroot: str, creds: ZkCredentials) -> int:
    """Lock-down's first step: the masters-only ACL on every node of the open tree below
    ``chroot`` (``zk`` has no chroot). Returns how many nodes changed.

    Before any ACL changes, the marker :data:`SECRET_EXPOSED` is made (locked from the
    start): from then on, a crash before :func:`rotate_exposed_secret` leaves it, and the next
    master to start rotates the secret anyone could read while the tree was open."""
    with contextlib.suppress(NodeExistsError):
        zk.create(chroot.rstrip("/") + SECRET_EXPOSED, b"", acl=creds.acl)
    changed = lock_down(zk, chroot, creds.acl)
    log.warning("ZooKeeper lock-down: set the masters-only ACL on %d znodes under %s",
                changed, chroot)
    return changed


def rotate_exposed_secret(zk: KazooClient, chroot: str) -> bool:
    """Lock-down's second step, run at every master's start: while the marker of
    :func:`lock_down_tree` exists, whoever read the cluster secret while the tree was open
    could still call as a master. A new secret (running masters learn it through their
    watch) and the marker's removal, in one transaction: a crash leaves both or neither.
    False when there was no marker, or another master starting at the same moment rotated
    first."""
    base = chroot.rstrip("/")
    marker = base + SECRET_EXPOSED
    if zk.exists(marker) is None:
        return False
    txn = zk.transaction()
    if zk.exists(base + MASTER_SECRET) is not None:
        # None yet: the first master makes it, in the locked tree, and nobody else read it.
        txn.set_data(base + MASTER_SECRET, new_cluster_secret().encode())
    txn.delete(marker)
    if any(isinstance(r, Exception) for r in txn.commit()):
        return False  # the marker went meanwhile: another master's rotation
    log.warning("ZooKeeper lock-down: rotated the cluster secret, readable by anyone while the"
                " tree was open")
    return True
