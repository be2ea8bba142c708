"""``blobha://`` through fsspec, with real pandas, pyarrow and dask against a real cluster."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from pathlib import Path

import dask.dataframe as dd
import fsspec
import pandas as pd
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from support.harness import client_for

from blobha.client import Client
from blobha.core.errors import KeyNotFound
from blobha.fs import BlobhaFileSystem
from blobha.ops.localcluster import LocalCluster

pytestmark = pytest.mark.integration


@pytest.fixture
def options(cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    # Each test its own instance: fsspec caches filesystems by their options.
    monkeypatch.setenv("BLOBHA_USER", "alice")
    return {"cluster": cluster.cluster, "user": "alice"}


@pytest.fixture
def fs(options: dict[str, str]) -> Iterator[BlobhaFileSystem]:
    fs = fsspec.filesystem("blobha", **options, skip_instance_cache=True)
    assert isinstance(fs, BlobhaFileSystem)  # through the fsspec.specs entry point
    yield fs
    fs.client.close()


@pytest.fixture
def alice(cluster: LocalCluster) -> Iterator[Client]:
    with client_for(cluster, "alice") as c:
        yield c


def frame() -> pd.DataFrame:
    return pd.DataFrame({"city": ["Oslo", "Lima", "Pune"], "lat": [59.9, -12.0, 18.5]})


def test_pandas_round_trips_parquet_and_csv(options: dict[str, str], alice: Client) -> None:
    df = frame()
    df.to_parquet("blobha://fs-geo.parquet", storage_options=options)
    back = pd.read_parquet("blobha://fs-geo.parquet", storage_options=options)
    pd.testing.assert_frame_equal(back, df)
    # What pandas wrote is an ordinary blob, readable by any client.
    assert pq.read_table(io.BytesIO(alice.read("fs-geo.parquet"))).to_pandas().equals(df)
    df.to_csv("blobha://fs-geo.csv", index=False, storage_options=options)
    pd.testing.assert_frame_equal(
        pd.read_csv("blobha://fs-geo.csv", storage_options=options), df)


def test_the_environment_alone_names_the_cluster(cluster: LocalCluster, alice: Client,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BLOBHA_CLUSTER", cluster.cluster)
    monkeypatch.setenv("BLOBHA_USER", "alice")
    alice.create("fs-env", b"from the environment")
    with fsspec.open("blobha://fs-env") as f:
        assert f.read() == b"from the environment"


def test_pyarrow_dataset_and_dask_read_many_blobs(fs: BlobhaFileSystem,
                                                 options: dict[str, str]) -> None:
    parts = [frame().assign(part=i) for i in range(3)]
    for i, part in enumerate(parts):
        part.to_csv(f"blobha://fs-part-{i}.csv", index=False, storage_options=options)
        part.to_parquet(f"blobha://fs-pq-{i}.parquet", storage_options=options)
    fs.pipe_file("fs-part-notes.txt", b"not csv")  # in the prefix, outside the pattern
    assert fs.glob("blobha://fs-part-*.csv") == [f"fs-part-{i}.csv" for i in range(3)]
    got = dd.read_csv("blobha://fs-part-*.csv", storage_options=options).compute()
    want = pd.concat(parts, ignore_index=True)
    pd.testing.assert_frame_equal(got.sort_values(["part", "city"]).reset_index(drop=True),
                                  want.sort_values(["part", "city"]).reset_index(drop=True),
                                  check_dtype=False)
    dataset = ds.dataset([f"fs-pq-{i}.parquet" for i in range(3)], filesystem=fs,
                         format="parquet")
    table = dataset.to_table(filter=ds.field("part") == 1)
    pd.testing.assert_frame_equal(table.to_pandas(), parts[1], check_dtype=False)


def test_listing_info_and_checksums_come_from_the_store(fs: BlobhaFileSystem,
                                                         alice: Client) -> None:
    meta = alice.create("fs-info", b"0123456789")
    entry = fs.info("blobha://fs-info")
    assert (entry["name"], entry["size"], entry["type"]) == ("fs-info", 10, "file")
    assert entry["version"] == meta.version and entry["digest"] == meta.digest
    assert fs.checksum("fs-info") == int(meta.digest, 16)
    assert fs.ukey("fs-info").startswith(meta.digest)
    assert fs.exists("fs-info") and not fs.exists("fs-no-such-key")
    assert "fs-info" in fs.ls("blobha://", detail=False)
    assert {"name": "fs-info", "size": 10, "type": "file"}.items() <= next(
        e for e in fs.ls("", detail=True) if e["name"] == "fs-info").items()
    assert fs.isdir("blobha://") and not fs.isdir("fs-info")
    with pytest.raises(FileNotFoundError):
        fs.info("fs-no-such-key")
    with pytest.raises(ValueError, match="no '/'"):
        fs.info("blobha://folder/fs-info")


def test_ranged_reads_seek_and_pinned_versions(fs: BlobhaFileSystem, alice: Client) -> None:
    v1 = os.urandom(3 * 1024 * 1024 + 17)
    alice.create("fs-ranges", v1)
    alice.update("fs-ranges", b"second version")
    assert fs.cat_file("fs-ranges") == b"second version"
    assert fs.cat_file("blobha://fs-ranges?version=1", start=5, end=4096) == v1[5:4096]
    assert fs.cat_file("fs-ranges", version=1, start=-10) == v1[-10:]
    assert fs.info("fs-ranges?version=1")["size"] == len(v1)
    with fs.open("blobha://fs-ranges?version=1", block_size=256 * 1024) as f:
        f.seek(2 * 1024 * 1024)
        assert f.read(100) == v1[2 * 1024 * 1024:2 * 1024 * 1024 + 100]
        f.seek(0)
        assert f.read() == v1  # sequential from the start: checked against the digest
    with pytest.raises(ValueError, match="pins version 1"):
        fs.cat_file("fs-ranges?version=1", version=2)


def test_a_write_is_one_version_made_on_close(fs: BlobhaFileSystem, alice: Client) -> None:
    with fs.open("blobha://fs-written", "wb", block_size=5 * 1024 * 1024) as f:
        for _ in range(3):
            f.write(os.urandom(2 * 1024 * 1024))
        with pytest.raises(KeyNotFound):
            alice.get_meta("fs-written")  # nothing visible before close
    assert alice.get_meta("fs-written").size == 6 * 1024 * 1024
    with fs.open("fs-written", "wb") as f:
        f.write(b"replaced")
    meta = alice.get_meta("fs-written")
    assert (meta.version, alice.read("fs-written")) == (2, b"replaced")


def test_a_failed_or_discarded_write_leaves_nothing(fs: BlobhaFileSystem,
                                                     alice: Client) -> None:
    with pytest.raises(RuntimeError), fs.open("fs-aborted", "wb") as f:
        f.write(b"half of it")
        raise RuntimeError("the writer failed")
    f = fs.open("fs-discarded", "wb", autocommit=False)
    f.write(b"never committed")
    f.close()
    f.discard()
    for key in ("fs-aborted", "fs-discarded"):
        with pytest.raises(KeyNotFound):
            alice.get_meta(key)
    with pytest.raises(FileExistsError):
        alice.create("fs-exclusive", b"first")
        with fs.open("fs-exclusive", "xb") as f:
            f.write(b"second")
    assert alice.read("fs-exclusive") == b"first"


def test_put_get_rm_and_errors_as_builtins(fs: BlobhaFileSystem, alice: Client,
                                           tmp_path: Path, cluster: LocalCluster) -> None:
    src = tmp_path / "model.bin"
    src.write_bytes(os.urandom(1024 * 1024 + 3))
    fs.put("" + str(src), "blobha://fs-model.bin")
    dest = tmp_path / "back.bin"
    fs.get("blobha://fs-model.bin", str(dest))
    assert dest.read_bytes() == src.read_bytes()
    fs.rm("blobha://fs-model.bin")
    assert not fs.exists("fs-model.bin")
    with pytest.raises(FileNotFoundError):
        fs.cat_file("fs-model.bin")
    alice.create("fs-private", b"alice only", acl="u:alice:rwa")
    alice.create("fs-dropbox", b"bob writes, alice reads", acl="u:alice:rwa,u:bob:w")
    bob = fsspec.filesystem("blobha", cluster=cluster.cluster, user="bob",
                            skip_instance_cache=True)
    try:
        with pytest.raises(PermissionError):
            bob.cat_file("fs-private")
        # Its metadata is bob's to see, its content is not.
        entry = bob.info("fs-dropbox")
        assert entry["readable"] is False and entry["digest"] == ""
        assert bob.exists("fs-dropbox")
        for read in (bob.cat_file, bob.checksum, bob.open):
            with pytest.raises(PermissionError):
                read("fs-dropbox")
    finally:
        bob.client.close()
