"""ClientLimits: what it accepts, and a client taking new limits for its next calls."""

from __future__ import annotations

import pytest

from blobha.client import PUT_MAX_BYTES, Client, ClientLimits
from blobha.core.errors import InvalidArgument


def test_the_defaults_are_the_production_sizes() -> None:
    limits = ClientLimits()
    assert limits.put_max_bytes == PUT_MAX_BYTES
    assert (limits.upload_segment_bytes, limits.channel_segment_bytes,
            limits.download_segment_bytes) == (16 << 20, 64 << 20, 64 << 20)
    assert limits.refusal_patience_secs == 3.0


@pytest.mark.parametrize("bad", [
    {"put_max_bytes": -2}, {"put_max_bytes": PUT_MAX_BYTES + 1}, {"upload_segment_bytes": 0},
    {"channel_segment_bytes": -1}, {"download_segment_bytes": 0},
    {"refusal_patience_secs": -0.5},
])
def test_a_limit_out_of_range_is_refused_naming_it(bad: dict[str, float]) -> None:
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        ClientLimits(**bad)  # type: ignore[arg-type]


def test_a_client_takes_new_limits_and_refuses_anything_else(client: Client) -> None:
    assert client.limits == ClientLimits()
    client.limits = ClientLimits(put_max_bytes=-1)
    assert client.limits.put_max_bytes == -1
    with pytest.raises(InvalidArgument, match="ClientLimits"):
        client.limits = {"put_max_bytes": -1}  # type: ignore[assignment]
