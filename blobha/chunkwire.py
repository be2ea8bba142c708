"""``DownloadChunk`` messages encoded and decoded by hand, without copying the data.

A download moves gigabytes in 1 MiB messages. Through the generated protobuf code each message
costs two extra copies of its data on each side: the server copies the bytes into a message and
serialises that into another buffer, and the client parses a message and copies its ``data``
field out again. The wire format of this one message is simple and fixed by ``blobha.proto``
(field 1 ``info``, a ``BlobInfo``; field 2 ``data``, bytes), so these functions write it with a
single copy and read it as views into the received buffer. Anything else (the info, unknown
fields) goes through the generated code, and the result is the same bytes on the wire, so
either side may use the generated code instead.
"""

from __future__ import annotations

from blobha.v1 import blobha_pb2 as pb

_INFO_TAG = 0x0A  # field 1, length-delimited
_DATA_TAG = 0x12  # field 2, length-delimited

#: The fully qualified method name, for calls made with these (de)serialisers.
DOWNLOAD_METHOD = "/blobha.v1.BlobStore/Download"


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
    """A decoded ``DownloadChunk``: ``info`` when present, ``data`` a view (never a copy)."""

    __slots__ = ("data", "info")

    def __init__(self, info: pb.BlobInfo | None, data: memoryview) -> None:
        self.info = info
        self.data = data

    def HasField(self, name: str) -> bool:  # the protobuf message method this stands in for
        return name == "info" and self.info is not None


def decode_chunk(raw: bytes) -> Chunk:
    """Parse a serialised ``DownloadChunk``; raises ValueError if it is malformed."""
    buf = memoryview(raw)
    pos = 0
    info: pb.BlobInfo | None = None
    data = buf[0:0]
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 2:
            n, pos = _read_varint(buf, pos)
            if pos + n > len(buf):
                raise ValueError("a DownloadChunk field runs past the end of the message")
            value = buf[pos:pos + n]
            pos += n
            if field == 1:
                info = pb.BlobInfo.FromString(bytes(value))
            elif field == 2:
                data = value
        elif wire == 0:
            _, pos = _read_varint(buf, pos)
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise ValueError(f"unexpected wire type {wire} in a DownloadChunk")
    if pos != len(buf):
        raise ValueError("a DownloadChunk field runs past the end of the message")
    return Chunk(info, data)
