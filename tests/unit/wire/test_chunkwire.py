"""The hand-written DownloadChunk codec agrees with the generated protobuf code byte for byte."""

from __future__ import annotations

import os

import pytest

from blobha.v1 import blobha_pb2 as pb
from blobha.wire.chunks import (
    decode_chunk,
    decode_upload_chunk,
    encode_chunk,
    encode_upload_chunk,
    serialize_response,
)

INFO = pb.BlobInfo(version=7, size=123456789, digest="ab" * 16)


@pytest.mark.parametrize("size", [0, 1, 127, 128, 16383, 16384, 1024 * 1024])
@pytest.mark.parametrize("with_info", [True, False])
def test_encoding_matches_the_generated_code(size: int, with_info: bool) -> None:
    data = os.urandom(size)
    info = INFO if with_info else None
    expected = pb.DownloadChunk(info=info, data=data).SerializeToString()
    assert encode_chunk(data, info) == expected
    decoded = decode_chunk(expected)
    assert bytes(decoded.data) == data
    assert decoded.HasField("info") is with_info
    assert (decoded.info == INFO) if with_info else decoded.info is None


def test_decoding_skips_unknown_fields_and_refuses_malformed_messages() -> None:
    data = b"payload"
    known = pb.DownloadChunk(info=INFO, data=data).SerializeToString()
    # Unknown fields of every wire type a newer server might add: varint 9, fixed64 10,
    # length-delimited 11, fixed32 12.
    extra = bytes([9 << 3 | 0, 0x96, 0x01, 10 << 3 | 1]) + b"\0" * 8 + \
        bytes([11 << 3 | 2, 3]) + b"abc" + bytes([12 << 3 | 5]) + b"\0" * 4
    decoded = decode_chunk(known + extra)
    assert bytes(decoded.data) == data and decoded.info == INFO
    for bad in (known[:-1], bytes([0x12, 0x80]), bytes([0x12, 5]) + b"abc",
                bytes([2 << 3 | 3])):
        with pytest.raises(ValueError):
            decode_chunk(bad)


def test_the_server_serialiser_passes_encoded_chunks_through() -> None:
    encoded = encode_chunk(b"x", INFO)
    assert serialize_response(encoded) is encoded
    message = pb.DownloadChunk(data=b"y")
    assert serialize_response(message) == message.SerializeToString()


@pytest.mark.parametrize("offset", [0, 1, 300, 2**40 + 5])
@pytest.mark.parametrize("size", [0, 1, 1024 * 1024])
def test_upload_chunks_match_the_generated_code(offset: int, size: int) -> None:
    data = os.urandom(size)
    expected = pb.UploadChunk(upload_id="up-ü1", offset=offset, data=data).SerializeToString()
    assert encode_upload_chunk("up-ü1", offset, memoryview(data)) == expected
    piece = decode_upload_chunk(expected)
    assert (piece.upload_id, piece.offset, bytes(piece.data)) == ("up-ü1", offset, data)
    # A later chunk of a stream may leave the upload id out.
    assert decode_upload_chunk(encode_upload_chunk("", offset, data)).upload_id == ""


def test_a_malformed_upload_chunk_is_refused() -> None:
    good = encode_upload_chunk("id", 5, b"abc")
    for bad in (good[:-1], bytes([0x0A, 2, 0xFF, 0xFE]), bytes([0x10])):
        with pytest.raises(ValueError):
            decode_upload_chunk(bad)
