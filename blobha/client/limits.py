"""The sizes and patience a client works with (:class:`ClientLimits`)."""

from __future__ import annotations

from dataclasses import dataclass

from blobha.core.digest import PUT_MAX_BYTES

__all__ = ["ClientLimits"]

MiB = 1024 * 1024


@dataclass(frozen=True)
class ClientLimits:
    """How a client splits its transfers, and how long it doubts a refusal.

    The defaults suit production; smaller ones make a small blob take the paths of a large
    one (segments, resumption, the resumable upload), for tests and tools. Transfers move in
    segments, one call each: a segment is the unit of resumption (an upload segment is
    acknowledged as a whole, so a source that cannot be read again keeps at most one segment
    in memory), and a per-segment deadline catches a stalled master without capping the whole
    transfer's time."""

    #: Blobs up to this size go whole in one Put call; larger ones (and any, at -1) take the
    #: resumable upload. At most the masters' own limit (PUT_MAX_BYTES).
    put_max_bytes: int = PUT_MAX_BYTES
    #: An upload segment over the gRPC stream, kept in memory for a source that cannot be
    #: read again (a pipe).
    upload_segment_bytes: int = 16 * MiB
    #: An upload segment over the data channel, from a source that keeps nothing in memory
    #: (bytes, a file): it costs a status call and a connection more, so segments are larger.
    channel_segment_bytes: int = 64 * MiB
    #: A download segment: nothing is kept in memory, and each new stream pays a flow-control
    #: ramp-up, so fewer and larger.
    download_segment_bytes: int = 64 * MiB
    #: How long a credential refused by every master is asked about again before the refusal
    #: is final: a master reads its token file again at most once a second, so a token added
    #: just now may be refused for that long (twice that, and some, for a busy master).
    refusal_patience_secs: float = 3.0

    def __post_init__(self) -> None:
        if not -1 <= self.put_max_bytes <= PUT_MAX_BYTES:
            raise ValueError(f"put_max_bytes must be -1 to {PUT_MAX_BYTES}, not"
                             f" {self.put_max_bytes!r}")
        for name in ("upload_segment_bytes", "channel_segment_bytes", "download_segment_bytes"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"{name} must be a positive number of bytes, not"
                                 f" {getattr(self, name)!r}")
        if not self.refusal_patience_secs >= 0:
            raise ValueError(f"refusal_patience_secs must be 0 or more, not"
                             f" {self.refusal_patience_secs!r}")
