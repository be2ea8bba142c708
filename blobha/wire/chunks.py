"""``DownloadChunk`` and ``UploadChunk`` messages encoded and decoded by hand, without copying
the data.

Uploads and downloads move gigabytes in 1 MiB messages. Through the generated protobuf code
each message costs two extra copies of its data on each side: the sender copies the bytes into
a message and serialises that into another buffer, and the receiver parses a message and copies
its ``data`` field out again. The wire format of these two messages is simple and fixed by
``blobha.proto``, so these functions write it with a single copy and read it as views into the
received buffer. Anything else (the info, unknown fields) goes through the generated code or is
skipped, and the bytes on the wire are the same, so either side may use the generated code.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc.experimental

from blobha.v1 import blobha_pb2 as pb

_INFO_TAG = 0x0A  # DownloadChunk field 1, length-delimited
_DATA_TAG = 0x12  # DownloadChunk field 2, length-delimited
_UPLOAD_ID_TAG = 0x0A  # UploadChunk field 1, length-delimited
_OFFSET_TAG = 0x10  # UploadChunk field 2, varint
_UPLOAD_DATA_TAG = 0x1A  # UploadChunk field 3, length-delimited

#: A channel option: a server stream (a download, a master's fetch) is read on the caller's
#: own thread. By default gRPC reads it on the channel's thread, which it starts again for a
#: call made while no other is running and which then wakes the caller for each message: a
#: small read costs the client much more CPU that way than this way. Cancelling from another
#: thread (the stall watch) works as before.
CALLER_THREAD_STREAMS: tuple[str, int] = (
    grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)

#: The fully qualified method names, for calls made with these (de)serialisers.
DOWNLOAD_METHOD = "/blobha.v1.BlobStore/Download"
APPEND_METHOD = "/blobha.v1.BlobStore/AppendUpload"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated or overlong varint in a DownloadChunk")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def encode_chunk(data: bytes, info: pb.BlobInfo | None = None) -> bytes:
    """A serialised ``DownloadChunk``: the same bytes as ``DownloadChunk(...).SerializeToString()``
    but with one copy of ``data``."""
    parts = []
    if info is not None:
        raw = info.SerializeToString()
        parts += [bytes([_INFO_TAG]), _varint(len(raw)), raw]
    if data:
        parts += [bytes([_DATA_TAG]), _varint(len(data)), data]
    return b"".join(parts)


def serialize_response(message: pb.DownloadChunk | bytes) -> bytes:
    """The server's response serialiser: pre-encoded chunks pass through."""
    if isinstance(message, bytes):
        return message
    return message.SerializeToString()


class Chunk:
    """A decoded ``DownloadChunk``: ``info`` when present, ``data`` a view (never a copy);
    ``data_port`` and ``ticket`` set when it offers the data channel."""

    __slots__ = ("data", "data_port", "info", "ticket")

    def __init__(self, info: pb.BlobInfo | None, data: memoryview, data_port: int = 0,
                 ticket: bytes = b"") -> None:
        self.info = info
        self.data = data
        self.data_port = data_port
        self.ticket = ticket

    def HasField(self, name: str) -> bool:  # the protobuf message method this stands in for
        return name == "info" and self.info is not None


def _fields(raw: bytes, what: str) -> Iterator[tuple[int, int | memoryview]]:
    """(field number, value) of each length-delimited (a view) or varint (an int) field;
    fixed-size fields are skipped. Raises ValueError if the message is malformed."""
    buf = memoryview(raw)
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 2:
            n, pos = _read_varint(buf, pos)
            if pos + n > len(buf):
                raise ValueError(f"a field runs past the end of the {what}")
            yield field, buf[pos:pos + n]
            pos += n
        elif wire == 0:
            value, pos = _read_varint(buf, pos)
            yield field, value
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise ValueError(f"unexpected wire type {wire} in a {what}")
    if pos != len(buf):
        raise ValueError(f"a field runs past the end of the {what}")


def decode_chunk(raw: bytes) -> Chunk:
    """Parse a serialised ``DownloadChunk``; raises ValueError if it is malformed."""
    info: pb.BlobInfo | None = None
    data = memoryview(b"")
    port, ticket = 0, b""
    for field, value in _fields(raw, "DownloadChunk"):
        if isinstance(value, memoryview):
            if field == 1:
                info = pb.BlobInfo.FromString(bytes(value))
            elif field == 2:
                data = value
            elif field == 4:
                ticket = bytes(value)
        elif field == 3:
            port = value
    return Chunk(info, data, port, ticket)


def encode_upload_chunk(upload_id: str, offset: int, data: bytes | memoryview) -> bytes:
    """A serialised ``UploadChunk`` (what the generated code would send), one copy of ``data``."""
    parts: list[bytes | memoryview] = []
    if upload_id:
        raw = upload_id.encode("utf-8")
        parts += [bytes([_UPLOAD_ID_TAG]), _varint(len(raw)), raw]
    if offset:
        parts += [bytes([_OFFSET_TAG]), _varint(offset)]
    if data:
        parts += [bytes([_UPLOAD_DATA_TAG]), _varint(len(data)), data]
    return b"".join(parts)


class UploadPiece:
    """A decoded ``UploadChunk``; ``data`` is a view into the received message."""

    __slots__ = ("data", "offset", "upload_id")

    def __init__(self, upload_id: str, offset: int, data: memoryview) -> None:
        self.upload_id = upload_id
        self.offset = offset
        self.data = data


def decode_upload_chunk(raw: bytes) -> UploadPiece:
    """Parse a serialised ``UploadChunk``; raises ValueError if it is malformed."""
    upload_id = ""
    offset = 0
    data = memoryview(b"")
    for field, value in _fields(raw, "UploadChunk"):
        if field == 1 and isinstance(value, memoryview):
            upload_id = bytes(value).decode("utf-8")  # UnicodeDecodeError is a ValueError
        elif field == 2 and isinstance(value, int):
            offset = value
        elif field == 3 and isinstance(value, memoryview):
            data = value
    return UploadPiece(upload_id, offset, data)


def encode_piece(piece: UploadPiece) -> bytes:
    return encode_upload_chunk(piece.upload_id, piece.offset, piece.data)


def stub(channel: Any) -> Any:
    """The generated ``BlobStore`` stub on ``channel``, with ``Download`` and
    ``AppendUpload`` going through these functions: chunks arrive as :class:`Chunk` (views of
    the received data), and ``AppendUpload`` takes :class:`UploadPiece` requests."""
    from blobha.v1 import blobha_pb2_grpc as pb_grpc  # grpc: not for the executors' imports

    s = pb_grpc.BlobStoreStub(channel)  # type: ignore[no-untyped-call]
    s.Download = channel.unary_stream(
        DOWNLOAD_METHOD,
        request_serializer=pb.DownloadRequest.SerializeToString,
        response_deserializer=decode_chunk,
    )
    s.AppendUpload = channel.stream_unary(
        APPEND_METHOD,
        request_serializer=encode_piece,
        response_deserializer=pb.UploadStatus.FromString,
    )
    return s
