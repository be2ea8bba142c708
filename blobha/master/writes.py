"""Writes: upload sessions (begin, append, commit, abort) and whole small blobs in one call."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from blobha.core import acl as acls
from blobha.core.acl import AccessControl
from blobha.core.blobstate import BlobState
from blobha.core.digest import PUT_MAX_BYTES
from blobha.core.errors import (
    InvalidArgument,
    KeyAlreadyExists,
    Unavailable,
)
from blobha.core.keys import validate_key
from blobha.master.acks import Acknowledger
from blobha.master.channel import Channel
from blobha.master.committer import Committer
from blobha.master.forward import Forwarder
from blobha.master.groupcommit import GroupCommitter
from blobha.master.metadata import Metadata
from blobha.master.quotas import Quotas
from blobha.master.rules import (
    Authority,
    PutRequest,
    check_digest,
    check_update,
    quorum,
    retried,
    tag_of,
)
from blobha.master.settings import MasterSettings
from blobha.master.streamforward import start_stream
from blobha.master.uploads import UploadManager
from blobha.store.local import LocalStore
from blobha.wire.datachannel import DataOffer

log = logging.getLogger("blobha.master")


class Writes:
    """The write operations of the leader."""

    def __init__(self, settings: MasterSettings, store: LocalStore, uploads: UploadManager,
                 puts: GroupCommitter[PutRequest, BlobState], meta: Metadata,
                 authority: Authority, committer: Committer, acks: Acknowledger,
                 channel: Channel, quotas: Quotas, forwarder: Forwarder | None = None) -> None:
        self.settings = settings
        self.store = store
        self.uploads = uploads
        self.puts = puts
        self.meta = meta
        self.authority = authority
        self.committer = committer
        self.acks = acks
        self.channel = channel
        self.quotas = quotas
        self.forwarder = forwarder

    def _write_settings(self, key: str, acl: Sequence[AccessControl], replication_factor: int,
                        write_quorum: int, create: bool) -> tuple[int, int]:
        """Check a write's arguments; a create's replication factor and write quorum. An
        update keeps the key's own factor: its quorum comes back as asked (0 = the default),
        for :func:`rules.quorum` to check against that factor."""
        self.meta.require_leader()
        validate_key(key)
        # Before anything is written: a user name with ':' or ',' would store an ACL that no
        # master can read back, which breaks the key and every listing.
        acls.check_entries(acl)
        rf = replication_factor or self.settings.replication_factor
        if rf < 1:
            raise InvalidArgument("the replication factor must be at least 1")
        return rf, quorum(write_quorum, rf, self.settings.write_quorum) if create else write_quorum

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
        tag = tag_of(user, write_id)
        state = self.meta.read_state_for_write(key)
        prior = state.written_by(tag) if state is not None else None
        if prior is not None:
            if not prior.acked:
                # Not waited for here: the client gives this call seconds, not the write
                # timeout, and would leave the wait behind and ask again.
                raise Unavailable(
                    f"{key!r} v{prior.seq}, this write's, is committed and waits for its write"
                    " quorum; retry shortly")
            return "", 0, self.acks.acknowledge(key, retried(key, prior, user))
        if create:
            acl = acls.normalize_for_create(acl, user)
            # Before the key's existence is told: a code key of another user's is none of
            # the caller's business to probe for.
            self.authority.require_create(user, key, acl)
            if state is not None:
                raise KeyAlreadyExists(f"key {key!r} already exists")
        else:
            state = check_update(self.authority, user, key, state, expected_version)
            rf = state.replication_factor
            w = quorum(write_quorum, state.replication_factor, self.settings.write_quorum, key)
        self.committer.check_quorum(w)
        if size_hint >= 0:
            self.quotas.check_begin(user, state.creator if state is not None else user,
                                    self.uploads.open_bytes(user), size_hint,
                                    state.size if state is not None else 0)
            self.store.reserve(size_hint)
        # An update's quorum is kept as asked: the commit checks it against the key's factor
        # then (Committer.next_state), which may have changed meanwhile.
        up = self.uploads.begin(user, key, create, acl, rf, expected_version,
                                w if create else write_quorum, tag, generation=generation)
        # Before the session is handed out, so no byte of it goes unforwarded.
        up.forward = (start_stream(self.forwarder, key, rf, w, up.temp.path)
                      if self.forwarder else None)
        return up.upload_id, int(self.uploads.expiration_secs), None

    def append(self, user: str, upload_id: str, offset: int, data: bytes | memoryview) -> int:
        up = self.uploads.get(upload_id, user)
        with up.lock:
            if data:
                self.quotas.check_upload(user, self.uploads.open_bytes(user),
                                         offset + len(data) - up.temp.size)
                self.store.reserve(len(data))
                try:
                    new = up.temp.write_at(offset, data)
                    if new and up.forward is not None:
                        up.forward.advance(up.temp.size)
                except InvalidArgument:  # a ValueError too: a gap, the client's to hear
                    raise
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
        check_digest(digest)
        if create:
            acl = acls.normalize_for_create(acl, user)
            # Before a byte is taken: another user's code key, or an ACL sharing its writes.
            self.authority.require_create(user, key, acl)
            self.committer.check_quorum(w)
        self.store.reserve(len(data))
        tag = tag_of(user, write_id)
        committed = self.committer.commit_once(key, tag, user, lambda: self.puts.submit(
            PutRequest(user, key, create, tuple(acl), rf, w, expected_version, data, digest, tag)))
        return self.acks.acknowledge(key, committed)

    def upload_key(self, upload_id: str) -> str:
        """The key an upload session is for ('' if unknown), for the audit log only."""
        return self.uploads.key_of(upload_id)

    def upload_status(self, user: str, upload_id: str) -> int:
        return self.uploads.get(upload_id, user).temp.size

    def offer_upload(self, user: str, upload_id: str) -> tuple[int, DataOffer | None]:
        """Bytes received so far, and an offer of the data channel for the rest from there
        on (None when this master has none)."""
        received = self.upload_status(user, upload_id)
        datachannel = self.channel.offers
        if datachannel is not None:
            ticket = datachannel.offer_upload(user, upload_id, received)
            if ticket is not None:
                return received, DataOffer(datachannel.port, ticket)
        return received, None

    def offer_stage_link(self, user: str) -> DataOffer | None:
        """An offer of the data channel for a stage link (None when this master has none)."""
        datachannel = self.channel.offers
        if datachannel is not None:
            ticket = datachannel.offer_stage_link(user)
            if ticket is not None:
                return DataOffer(datachannel.port, ticket)
        return None

    def abort(self, user: str, upload_id: str) -> None:
        self.uploads.abort(upload_id, user)

    def commit(self, user: str, upload_id: str, size: int, digest: str
               ) -> tuple[str, BlobState, int]:
        generation = self.uploads.generation  # before the leader check, as in begin_upload
        self.meta.require_leader()
        # Before the session is taken (and its data, gone with it on any error): a malformed
        # digest must not cost a multi-GB upload, only a corrected CommitUpload.
        check_digest(digest)
        up = self.uploads.take(upload_id, user)
        committed = self.committer.commit_once(
            up.key, up.write_tag, user,
            lambda: self.committer.commit_upload(user, up, size, digest, generation))
        return self.acks.acknowledge(up.key, committed)
