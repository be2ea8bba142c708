"""A master's settings, read once from its configuration into typed fields."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from blobha.core.auth import AuthMode
from blobha.core.secretfiles import TOKEN_FILE_MODE_MASK, refuse_exposed
from blobha.master.config import Config
from blobha.zk.tls import ZkTls


@dataclass(frozen=True)
class MasterSettings:
    """What the master's parts read of the configuration (see docs/configuration.md)."""

    identity: str
    principal: str
    admins: frozenset[str]
    data_dir: Path
    metrics_listen: str
    session_timeout: float
    zk_servers: str
    zk_chroot: str
    zk_auth_scheme: str
    zk_auth_file: str
    #: TLS towards ZooKeeper (zookeeper.ssl.*); None: plaintext.
    zk_tls: ZkTls | None
    auth_mode: AuthMode
    auth_token_file: str
    auth_mtls_rules: tuple[str, ...]
    job_token_max_lifetime_secs: int
    peer_grant_secs: float
    peer_holder_secs: float
    tls_cert: str
    tls_key: str
    tls_ca: str
    disk_reserved_bytes: int
    replication_factor: int
    write_quorum: int
    write_timeout_secs: float
    write_forward: bool
    versions_retained: int
    list_visibility: str
    upload_expiration_secs: float
    upload_max_per_user: int
    #: The cluster's key limit (blobstore.keys.max); 0: none.
    keys_max: int
    #: Per-user quotas (blobstore.quota.user.*, auth.job.token.max.per.user); 0: none.
    quota_keys: int
    quota_bytes: int
    quota_acl_bytes: int
    quota_upload_bytes: int
    quota_job_tokens: int
    replica_grace_secs: float
    delete_grace_secs: float
    sync_period_secs: float
    sync_threads: int
    sync_periodic_keys_per_sec: float
    sync_recursive_watch: bool
    sync_linger_secs: float
    stop_linger_secs: float
    sync_stall_secs: float
    scrub_interval_secs: float
    read_cutoff_secs: float
    scrub_rate_bytes_per_sec: int

    @classmethod
    def from_config(cls, config: Config) -> MasterSettings:
        return cls(
            identity=config.advertise,
            principal=str(config["master.principal"]),
            admins=config.admins,
            data_dir=config.data_dir,
            metrics_listen=config.metrics_listen,
            session_timeout=config["zookeeper.session.timeout.ms"] / 1000.0,
            zk_servers=config["zookeeper.servers"],
            zk_chroot=config["zookeeper.chroot"],
            zk_auth_scheme=config["zookeeper.auth.scheme"],
            zk_auth_file=config["zookeeper.auth.file"],
            zk_tls=ZkTls(config["zookeeper.ssl.ca"], config["zookeeper.ssl.cert"],
                         config["zookeeper.ssl.key"], config["zookeeper.ssl.verify.hostname"])
            if config["zookeeper.ssl.enabled"] else None,
            auth_mode=AuthMode(config["auth.mode"]),
            auth_token_file=config["auth.token.file"],
            auth_mtls_rules=tuple(config["auth.mtls.rules"]),
            job_token_max_lifetime_secs=config["auth.job.token.max.lifetime.secs"],
            peer_grant_secs=config["blobstore.peer.grant.secs"],
            peer_holder_secs=config["blobstore.peer.holder.secs"],
            tls_cert=config["tls.cert"],
            tls_key=config["tls.key"],
            tls_ca=config["tls.ca"],
            disk_reserved_bytes=config["blobstore.disk.reserved.bytes"],
            replication_factor=config["blobstore.replication.factor"],
            write_quorum=config["blobstore.write.quorum"],
            write_timeout_secs=config["blobstore.write.timeout.secs"],
            write_forward=config["blobstore.write.forward"],
            versions_retained=config["blobstore.versions.retained"],
            list_visibility=config["blobstore.list.visibility"],
            upload_expiration_secs=config["blobstore.upload.expiration.secs"],
            upload_max_per_user=config["blobstore.upload.max.per.user"],
            keys_max=config["blobstore.keys.max"],
            quota_keys=config["blobstore.quota.user.keys"],
            quota_bytes=config["blobstore.quota.user.bytes"],
            quota_acl_bytes=config["blobstore.quota.user.acl.bytes"],
            quota_upload_bytes=config["blobstore.quota.user.upload.bytes"],
            quota_job_tokens=config["auth.job.token.max.per.user"],
            replica_grace_secs=config["blobstore.replica.grace.secs"],
            delete_grace_secs=config["blobstore.delete.grace.secs"],
            sync_period_secs=config["blobstore.sync.period.secs"],
            sync_threads=config["blobstore.sync.threads"],
            sync_periodic_keys_per_sec=config["blobstore.sync.periodic.keys.per.sec"],
            sync_recursive_watch=config["blobstore.sync.recursive.watch"],
            sync_linger_secs=config["blobstore.sync.linger.secs"],
            stop_linger_secs=config["master.stop.linger.secs"],
            sync_stall_secs=config["blobstore.sync.stall.secs"],
            scrub_interval_secs=config["blobstore.scrub.interval.secs"],
            read_cutoff_secs=config["blobstore.read.cutoff.secs"],
            scrub_rate_bytes_per_sec=config["blobstore.scrub.rate.bytes.per.sec"],
        )

    def refuse_exposed_secrets(self) -> None:
        """Refuse to start with a key or token file other accounts can read, as ssh does
        (:class:`blobha.core.secretfiles.ExposedSecretFile`); zookeeper.auth.file is checked
        where it is read."""
        if self.tls_key:
            refuse_exposed(self.tls_key, "tls.key")
        if self.zk_tls is not None and self.zk_tls.key:
            refuse_exposed(self.zk_tls.key, "zookeeper.ssl.key")
        if self.auth_mode is AuthMode.TOKEN and self.auth_token_file:
            refuse_exposed(self.auth_token_file, "auth.token.file", TOKEN_FILE_MODE_MASK)
