"""blobha:// paths: the key, a pinned version, and what is refused."""

from __future__ import annotations

import pytest

from blobha.fs import BlobhaFileSystem


@pytest.mark.parametrize(("path", "want"), [
    ("blobha://geo.parquet", ("geo.parquet", 0)),
    ("blobha:geo.parquet", ("geo.parquet", 0)),
    ("/geo.parquet", ("geo.parquet", 0)),
    ("blobha://geo.parquet?version=3", ("geo.parquet", 3)),
    ("blobha://", ("", 0)),
])
def test_a_path_names_a_key_and_maybe_a_version(path: str, want: tuple[str, int]) -> None:
    assert BlobhaFileSystem.split_version(BlobhaFileSystem._strip_protocol(path)) == want


def test_a_version_given_twice_must_agree() -> None:
    assert BlobhaFileSystem.split_version("k?version=3", 3) == ("k", 3)
    assert BlobhaFileSystem.split_version("k", 4) == ("k", 4)
    with pytest.raises(ValueError, match="pins version 3"):
        BlobhaFileSystem.split_version("k?version=3", 4)


@pytest.mark.parametrize(("path", "why"), [
    ("folder/k", "no '/'"),
    ("k?v=3", r"only query a blobha path takes is \?version=N"),
])
def test_what_is_not_a_blob_path_is_refused(path: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        BlobhaFileSystem.split_version(path)


def test_no_cluster_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BLOBHA_CLUSTER", raising=False)
    with pytest.raises(ValueError, match="set BLOBHA_CLUSTER"):
        BlobhaFileSystem(skip_instance_cache=True)
