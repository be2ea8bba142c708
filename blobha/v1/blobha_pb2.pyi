from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReadView(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    READ_VIEW_SESSION: _ClassVar[ReadView]
    READ_VIEW_LINEARIZABLE: _ClassVar[ReadView]
    READ_VIEW_LAST_KNOWN: _ClassVar[ReadView]
READ_VIEW_SESSION: ReadView
READ_VIEW_LINEARIZABLE: ReadView
READ_VIEW_LAST_KNOWN: ReadView

class AccessControl(_message.Message):
    __slots__ = ("type", "name", "access")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ACCESS_FIELD_NUMBER: _ClassVar[int]
    type: str
    name: str
    access: int
    def __init__(self, type: _Optional[str] = ..., name: _Optional[str] = ..., access: _Optional[int] = ...) -> None: ...

class BeginUploadRequest(_message.Message):
    __slots__ = ("key", "create", "acl", "replication_factor", "expected_version", "size_hint", "write_quorum", "write_id")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CREATE_FIELD_NUMBER: _ClassVar[int]
    ACL_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_FACTOR_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    SIZE_HINT_FIELD_NUMBER: _ClassVar[int]
    WRITE_QUORUM_FIELD_NUMBER: _ClassVar[int]
    WRITE_ID_FIELD_NUMBER: _ClassVar[int]
    key: str
    create: bool
    acl: _containers.RepeatedCompositeFieldContainer[AccessControl]
    replication_factor: int
    expected_version: int
    size_hint: int
    write_quorum: int
    write_id: bytes
    def __init__(self, key: _Optional[str] = ..., create: _Optional[bool] = ..., acl: _Optional[_Iterable[_Union[AccessControl, _Mapping]]] = ..., replication_factor: _Optional[int] = ..., expected_version: _Optional[int] = ..., size_hint: _Optional[int] = ..., write_quorum: _Optional[int] = ..., write_id: _Optional[bytes] = ...) -> None: ...

class BeginUploadResponse(_message.Message):
    __slots__ = ("upload_id", "expires_after_secs", "committed")
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AFTER_SECS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    upload_id: str
    expires_after_secs: int
    committed: BlobMeta
    def __init__(self, upload_id: _Optional[str] = ..., expires_after_secs: _Optional[int] = ..., committed: _Optional[_Union[BlobMeta, _Mapping]] = ...) -> None: ...

class UploadChunk(_message.Message):
    __slots__ = ("upload_id", "offset", "data")
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    upload_id: str
    offset: int
    data: bytes
    def __init__(self, upload_id: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class UploadStatusRequest(_message.Message):
    __slots__ = ("upload_id", "data_channel")
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    upload_id: str
    data_channel: bool
    def __init__(self, upload_id: _Optional[str] = ..., data_channel: _Optional[bool] = ...) -> None: ...

class UploadStatus(_message.Message):
    __slots__ = ("upload_id", "received", "data_port", "ticket")
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    upload_id: str
    received: int
    data_port: int
    ticket: bytes
    def __init__(self, upload_id: _Optional[str] = ..., received: _Optional[int] = ..., data_port: _Optional[int] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class CommitUploadRequest(_message.Message):
    __slots__ = ("upload_id", "size", "digest")
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    upload_id: str
    size: int
    digest: str
    def __init__(self, upload_id: _Optional[str] = ..., size: _Optional[int] = ..., digest: _Optional[str] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("begin", "data", "digest")
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    begin: BeginUploadRequest
    data: bytes
    digest: str
    def __init__(self, begin: _Optional[_Union[BeginUploadRequest, _Mapping]] = ..., data: _Optional[bytes] = ..., digest: _Optional[str] = ...) -> None: ...

class AbortUploadRequest(_message.Message):
    __slots__ = ("upload_id",)
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    upload_id: str
    def __init__(self, upload_id: _Optional[str] = ...) -> None: ...

class AbortUploadResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DownloadRequest(_message.Message):
    __slots__ = ("key", "version", "offset", "length", "any_local_version", "data_channel", "min_version", "view")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    ANY_LOCAL_VERSION_FIELD_NUMBER: _ClassVar[int]
    DATA_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    key: str
    version: int
    offset: int
    length: int
    any_local_version: bool
    data_channel: bool
    min_version: MinVersion
    view: ReadView
    def __init__(self, key: _Optional[str] = ..., version: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., any_local_version: _Optional[bool] = ..., data_channel: _Optional[bool] = ..., min_version: _Optional[_Union[MinVersion, _Mapping]] = ..., view: _Optional[_Union[ReadView, str]] = ...) -> None: ...

class MinVersion(_message.Message):
    __slots__ = ("version", "created_at")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    version: int
    created_at: float
    def __init__(self, version: _Optional[int] = ..., created_at: _Optional[float] = ...) -> None: ...

class DownloadChunk(_message.Message):
    __slots__ = ("info", "data", "data_port", "ticket")
    INFO_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    info: BlobInfo
    data: bytes
    data_port: int
    ticket: bytes
    def __init__(self, info: _Optional[_Union[BlobInfo, _Mapping]] = ..., data: _Optional[bytes] = ..., data_port: _Optional[int] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class BlobInfo(_message.Message):
    __slots__ = ("version", "size", "digest", "created_at")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    version: int
    size: int
    digest: str
    created_at: float
    def __init__(self, version: _Optional[int] = ..., size: _Optional[int] = ..., digest: _Optional[str] = ..., created_at: _Optional[float] = ...) -> None: ...

class VersionRef(_message.Message):
    __slots__ = ("key", "version")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    key: str
    version: int
    def __init__(self, key: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class FetchVersionsRequest(_message.Message):
    __slots__ = ("versions",)
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[VersionRef]
    def __init__(self, versions: _Optional[_Iterable[_Union[VersionRef, _Mapping]]] = ...) -> None: ...

class FetchedVersion(_message.Message):
    __slots__ = ("key", "version", "digest", "data", "missing")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    key: str
    version: int
    digest: str
    data: bytes
    missing: bool
    def __init__(self, key: _Optional[str] = ..., version: _Optional[int] = ..., digest: _Optional[str] = ..., data: _Optional[bytes] = ..., missing: _Optional[bool] = ...) -> None: ...

class FetchedVersions(_message.Message):
    __slots__ = ("versions",)
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[FetchedVersion]
    def __init__(self, versions: _Optional[_Iterable[_Union[FetchedVersion, _Mapping]]] = ...) -> None: ...

class StagedVersion(_message.Message):
    __slots__ = ("key", "size", "digest", "data")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    key: str
    size: int
    digest: str
    data: bytes
    def __init__(self, key: _Optional[str] = ..., size: _Optional[int] = ..., digest: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class StageVersionsRequest(_message.Message):
    __slots__ = ("epoch", "versions")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    versions: _containers.RepeatedCompositeFieldContainer[StagedVersion]
    def __init__(self, epoch: _Optional[int] = ..., versions: _Optional[_Iterable[_Union[StagedVersion, _Mapping]]] = ...) -> None: ...

class StageVersionsResponse(_message.Message):
    __slots__ = ("staged",)
    STAGED_FIELD_NUMBER: _ClassVar[int]
    staged: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, staged: _Optional[_Iterable[bool]] = ...) -> None: ...

class BeginStagingRequest(_message.Message):
    __slots__ = ("key", "epoch", "link")
    KEY_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LINK_FIELD_NUMBER: _ClassVar[int]
    key: str
    epoch: int
    link: bool
    def __init__(self, key: _Optional[str] = ..., epoch: _Optional[int] = ..., link: _Optional[bool] = ...) -> None: ...

class FinishStagingRequest(_message.Message):
    __slots__ = ("upload_id", "key", "epoch", "size", "digest")
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    upload_id: str
    key: str
    epoch: int
    size: int
    digest: str
    def __init__(self, upload_id: _Optional[str] = ..., key: _Optional[str] = ..., epoch: _Optional[int] = ..., size: _Optional[int] = ..., digest: _Optional[str] = ...) -> None: ...

class GetMetaRequest(_message.Message):
    __slots__ = ("key", "any_access", "min_version", "view")
    KEY_FIELD_NUMBER: _ClassVar[int]
    ANY_ACCESS_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    key: str
    any_access: bool
    min_version: MinVersion
    view: ReadView
    def __init__(self, key: _Optional[str] = ..., any_access: _Optional[bool] = ..., min_version: _Optional[_Union[MinVersion, _Mapping]] = ..., view: _Optional[_Union[ReadView, str]] = ...) -> None: ...

class BlobMeta(_message.Message):
    __slots__ = ("key", "version", "size", "digest", "acl", "replication_factor", "meta_version", "created_at", "updated_at", "creator", "replication", "acknowledged", "access")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    ACL_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_FACTOR_FIELD_NUMBER: _ClassVar[int]
    META_VERSION_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    CREATOR_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_FIELD_NUMBER: _ClassVar[int]
    ACKNOWLEDGED_FIELD_NUMBER: _ClassVar[int]
    ACCESS_FIELD_NUMBER: _ClassVar[int]
    key: str
    version: int
    size: int
    digest: str
    acl: _containers.RepeatedCompositeFieldContainer[AccessControl]
    replication_factor: int
    meta_version: int
    created_at: float
    updated_at: float
    creator: str
    replication: int
    acknowledged: bool
    access: int
    def __init__(self, key: _Optional[str] = ..., version: _Optional[int] = ..., size: _Optional[int] = ..., digest: _Optional[str] = ..., acl: _Optional[_Iterable[_Union[AccessControl, _Mapping]]] = ..., replication_factor: _Optional[int] = ..., meta_version: _Optional[int] = ..., created_at: _Optional[float] = ..., updated_at: _Optional[float] = ..., creator: _Optional[str] = ..., replication: _Optional[int] = ..., acknowledged: _Optional[bool] = ..., access: _Optional[int] = ...) -> None: ...

class SetMetaRequest(_message.Message):
    __slots__ = ("key", "set_acl", "acl", "replication_factor", "expected_meta_version")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SET_ACL_FIELD_NUMBER: _ClassVar[int]
    ACL_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_FACTOR_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_META_VERSION_FIELD_NUMBER: _ClassVar[int]
    key: str
    set_acl: bool
    acl: _containers.RepeatedCompositeFieldContainer[AccessControl]
    replication_factor: int
    expected_meta_version: int
    def __init__(self, key: _Optional[str] = ..., set_acl: _Optional[bool] = ..., acl: _Optional[_Iterable[_Union[AccessControl, _Mapping]]] = ..., replication_factor: _Optional[int] = ..., expected_meta_version: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("key", "expected_created_at")
    KEY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    key: str
    expected_created_at: float
    def __init__(self, key: _Optional[str] = ..., expected_created_at: _Optional[float] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("prefix", "page_token", "page_size")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    page_token: str
    page_size: int
    def __init__(self, prefix: _Optional[str] = ..., page_token: _Optional[str] = ..., page_size: _Optional[int] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("keys", "next_page_token")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    next_page_token: str
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class GetReplicationRequest(_message.Message):
    __slots__ = ("key", "min_version", "view")
    KEY_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    key: str
    min_version: MinVersion
    view: ReadView
    def __init__(self, key: _Optional[str] = ..., min_version: _Optional[_Union[MinVersion, _Mapping]] = ..., view: _Optional[_Union[ReadView, str]] = ...) -> None: ...

class ReplicationStatus(_message.Message):
    __slots__ = ("key", "version", "replication", "replication_factor", "holders")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_FACTOR_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    key: str
    version: int
    replication: int
    replication_factor: int
    holders: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, key: _Optional[str] = ..., version: _Optional[int] = ..., replication: _Optional[int] = ..., replication_factor: _Optional[int] = ..., holders: _Optional[_Iterable[str]] = ...) -> None: ...

class PeerPlanRequest(_message.Message):
    __slots__ = ("key", "version", "peer_address", "complete", "min_version", "view")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    key: str
    version: int
    peer_address: str
    complete: bool
    min_version: MinVersion
    view: ReadView
    def __init__(self, key: _Optional[str] = ..., version: _Optional[int] = ..., peer_address: _Optional[str] = ..., complete: _Optional[bool] = ..., min_version: _Optional[_Union[MinVersion, _Mapping]] = ..., view: _Optional[_Union[ReadView, str]] = ...) -> None: ...

class PeerPlanResponse(_message.Message):
    __slots__ = ("version", "size", "digest", "created_at", "chunk_size", "chunk_digests", "replicas", "peers", "serve_key", "grant_user", "grant_expires", "ordinal", "chunk_sha256", "grant_requester", "peer_grants")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    SERVE_KEY_FIELD_NUMBER: _ClassVar[int]
    GRANT_USER_FIELD_NUMBER: _ClassVar[int]
    GRANT_EXPIRES_FIELD_NUMBER: _ClassVar[int]
    ORDINAL_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SHA256_FIELD_NUMBER: _ClassVar[int]
    GRANT_REQUESTER_FIELD_NUMBER: _ClassVar[int]
    PEER_GRANTS_FIELD_NUMBER: _ClassVar[int]
    version: int
    size: int
    digest: str
    created_at: float
    chunk_size: int
    chunk_digests: _containers.RepeatedScalarFieldContainer[str]
    replicas: _containers.RepeatedScalarFieldContainer[str]
    peers: _containers.RepeatedScalarFieldContainer[str]
    serve_key: bytes
    grant_user: str
    grant_expires: float
    ordinal: int
    chunk_sha256: _containers.RepeatedScalarFieldContainer[bytes]
    grant_requester: str
    peer_grants: _containers.RepeatedCompositeFieldContainer[PeerGrant]
    def __init__(self, version: _Optional[int] = ..., size: _Optional[int] = ..., digest: _Optional[str] = ..., created_at: _Optional[float] = ..., chunk_size: _Optional[int] = ..., chunk_digests: _Optional[_Iterable[str]] = ..., replicas: _Optional[_Iterable[str]] = ..., peers: _Optional[_Iterable[str]] = ..., serve_key: _Optional[bytes] = ..., grant_user: _Optional[str] = ..., grant_expires: _Optional[float] = ..., ordinal: _Optional[int] = ..., chunk_sha256: _Optional[_Iterable[bytes]] = ..., grant_requester: _Optional[str] = ..., peer_grants: _Optional[_Iterable[_Union[PeerGrant, _Mapping]]] = ...) -> None: ...

class PeerGrant(_message.Message):
    __slots__ = ("address", "mac")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    address: str
    mac: str
    def __init__(self, address: _Optional[str] = ..., mac: _Optional[str] = ...) -> None: ...

class WaitForReplicationRequest(_message.Message):
    __slots__ = ("keys", "min_replication", "timeout_secs")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    MIN_REPLICATION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    min_replication: int
    timeout_secs: float
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., min_replication: _Optional[int] = ..., timeout_secs: _Optional[float] = ...) -> None: ...

class WaitForReplicationResponse(_message.Message):
    __slots__ = ("reached", "status", "waited_secs")
    REACHED_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    WAITED_SECS_FIELD_NUMBER: _ClassVar[int]
    reached: bool
    status: _containers.RepeatedCompositeFieldContainer[ReplicationStatus]
    waited_secs: float
    def __init__(self, reached: _Optional[bool] = ..., status: _Optional[_Iterable[_Union[ReplicationStatus, _Mapping]]] = ..., waited_secs: _Optional[float] = ...) -> None: ...

class ClusterSummaryRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MasterSummary(_message.Message):
    __slots__ = ("address", "is_leader", "uptime_secs", "version", "blob_count", "bytes_stored", "disk_free", "lag_blobs", "reachable", "epoch", "zookeeper_unreachable", "keys_behind", "keys_unread_since_reconnect")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    IS_LEADER_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BLOB_COUNT_FIELD_NUMBER: _ClassVar[int]
    BYTES_STORED_FIELD_NUMBER: _ClassVar[int]
    DISK_FREE_FIELD_NUMBER: _ClassVar[int]
    LAG_BLOBS_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ZOOKEEPER_UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_BEHIND_FIELD_NUMBER: _ClassVar[int]
    KEYS_UNREAD_SINCE_RECONNECT_FIELD_NUMBER: _ClassVar[int]
    address: str
    is_leader: bool
    uptime_secs: float
    version: str
    blob_count: int
    bytes_stored: int
    disk_free: int
    lag_blobs: int
    reachable: bool
    epoch: int
    zookeeper_unreachable: bool
    keys_behind: int
    keys_unread_since_reconnect: int
    def __init__(self, address: _Optional[str] = ..., is_leader: _Optional[bool] = ..., uptime_secs: _Optional[float] = ..., version: _Optional[str] = ..., blob_count: _Optional[int] = ..., bytes_stored: _Optional[int] = ..., disk_free: _Optional[int] = ..., lag_blobs: _Optional[int] = ..., reachable: _Optional[bool] = ..., epoch: _Optional[int] = ..., zookeeper_unreachable: _Optional[bool] = ..., keys_behind: _Optional[int] = ..., keys_unread_since_reconnect: _Optional[int] = ...) -> None: ...

class ClusterSummaryResponse(_message.Message):
    __slots__ = ("masters", "leader", "epoch", "blob_count", "under_replicated", "zookeeper_unreachable")
    MASTERS_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BLOB_COUNT_FIELD_NUMBER: _ClassVar[int]
    UNDER_REPLICATED_FIELD_NUMBER: _ClassVar[int]
    ZOOKEEPER_UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    masters: _containers.RepeatedCompositeFieldContainer[MasterSummary]
    leader: str
    epoch: int
    blob_count: int
    under_replicated: int
    zookeeper_unreachable: bool
    def __init__(self, masters: _Optional[_Iterable[_Union[MasterSummary, _Mapping]]] = ..., leader: _Optional[str] = ..., epoch: _Optional[int] = ..., blob_count: _Optional[int] = ..., under_replicated: _Optional[int] = ..., zookeeper_unreachable: _Optional[bool] = ...) -> None: ...

class NodeStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IssueJobTokenRequest(_message.Message):
    __slots__ = ("keys", "lifetime_secs")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LIFETIME_SECS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    lifetime_secs: int
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., lifetime_secs: _Optional[int] = ...) -> None: ...

class JobToken(_message.Message):
    __slots__ = ("token", "token_id", "expires_at", "keys", "user")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    token: str
    token_id: str
    expires_at: float
    keys: _containers.RepeatedScalarFieldContainer[str]
    user: str
    def __init__(self, token: _Optional[str] = ..., token_id: _Optional[str] = ..., expires_at: _Optional[float] = ..., keys: _Optional[_Iterable[str]] = ..., user: _Optional[str] = ...) -> None: ...

class RevokeJobTokenRequest(_message.Message):
    __slots__ = ("token_or_id",)
    TOKEN_OR_ID_FIELD_NUMBER: _ClassVar[int]
    token_or_id: str
    def __init__(self, token_or_id: _Optional[str] = ...) -> None: ...

class RevokeJobTokenResponse(_message.Message):
    __slots__ = ("token_id",)
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    token_id: str
    def __init__(self, token_id: _Optional[str] = ...) -> None: ...

class RotateClusterSecretRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RotateClusterSecretResponse(_message.Message):
    __slots__ = ("generation", "old_accepted_secs")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    OLD_ACCEPTED_SECS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    old_accepted_secs: float
    def __init__(self, generation: _Optional[int] = ..., old_accepted_secs: _Optional[float] = ...) -> None: ...
