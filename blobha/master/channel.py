"""The data channel as the master sees it: where its offers come from, once one is running."""

from __future__ import annotations

from typing import Protocol

from blobha.store.local import VersionInfo


class TransferOffers(Protocol):
    """Tickets of the data channel: for a range of a version, for the rest of an upload
    session, or for a stage link (``None`` when it takes none)."""

    port: int

    def offer(self, info: VersionInfo, offset: int, end: int) -> bytes: ...

    def offer_upload(self, user: str, upload_id: str, offset: int) -> bytes | None: ...

    def offer_stage_link(self, user: str) -> bytes | None: ...


class Channel:
    """The slot the serving process fills with its data channel (``offers``), read by every
    download and upload; empty while none runs (TLS, the channel turned off, no server)."""

    def __init__(self) -> None:
        self.offers: TransferOffers | None = None
