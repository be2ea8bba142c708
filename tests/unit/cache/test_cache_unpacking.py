"""Unpacking archives in the node-local cache (scenario 18) and its safety: malicious
archives, the room to unpack, zip directories and member names."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path
from typing import Any

import pytest
from support.cache_fakes import (
    TREE,
    FakeCluster,
    _read_tree,
    _tar,
    _zip,
    scratch_files,
)

from blobha.cache import install as install_mod
from blobha.core.errors import (
    InvalidArgument,
    ResourceExhausted,
)


def _tar_members(*members: tuple[str, bytes, str, str]) -> bytes:
    """Members as (name, data, type, linkname) with type one of f, d, sym, hard, chr, fifo."""
    types = {"f": tarfile.REGTYPE, "d": tarfile.DIRTYPE, "sym": tarfile.SYMTYPE,
             "hard": tarfile.LNKTYPE, "chr": tarfile.CHRTYPE, "fifo": tarfile.FIFOTYPE}
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tf:
        for name, data, kind, link in members:
            info = tarfile.TarInfo(name)
            info.type = types[kind]
            info.linkname = link
            info.size = len(data) if kind == "f" else 0
            tf.addfile(info, io.BytesIO(data) if kind == "f" else None)
    return out.getvalue()


@pytest.mark.parametrize("key, data", [
    ("lib.tgz", _tar(TREE, "w:gz")),
    ("lib.tar.gz", _tar(TREE, "w:gz")),
    ("lib.tar", _tar(TREE)),
    ("lib.zip", _zip(TREE)),
    ("lib.jar", _zip(TREE)),
    ("no-extension-tar", _tar(TREE, "w:gz")),
    ("no-extension-zip", _zip(TREE)),
])
def test_archives_unpack_to_the_expected_tree(fake: FakeCluster, make: Any, key: str,
                                             data: bytes) -> None:
    fake.put(key, data)
    cache = make()
    blob = cache.get(key, uncompress=True)
    assert blob.path.is_dir() and blob.path.name == "unpacked"
    assert _read_tree(blob.path) == TREE
    if key.endswith(("tgz", "gz", "tar")):
        assert (blob.path / "dir/sub/run.sh").stat().st_mode & 0o111
    assert cache.get(key).path.read_bytes() == data, "the archive itself stays available"
    assert cache.get(key, uncompress=True).path == blob.path
    [entry] = cache.entries()
    assert entry.unpacked == blob.path and entry.size == len(data) + sum(map(len, TREE.values()))


def test_links_inside_the_tree_are_kept(fake: FakeCluster, make: Any) -> None:
    fake.put("links.tar", _tar_members(
        ("d/file", b"content", "f", ""),
        ("d/hard", b"", "hard", "d/file"),
        ("d/rel", b"", "sym", "file"),
        ("up", b"", "sym", "d/../d/file"),
        ("sub/dirlink", b"", "sym", "../d"),
    ))
    root = make().get("links.tar", uncompress=True).path
    assert (root / "d/hard").read_bytes() == b"content"
    assert os.readlink(root / "d/rel") == "file" and (root / "d/rel").read_bytes() == b"content"
    assert (root / "up").read_bytes() == b"content"
    assert (root / "sub/dirlink/file").read_bytes() == b"content"


def _outside(tmp_path: Path) -> Path:
    return tmp_path / "outside"


# Extraction happens in cache/tmp/<instance>/x-*/: four levels below tmp_path.
ESCAPE = "../../../../outside/evil"


MALICIOUS_TARS = {
    "dotdot": lambda out: _tar_members(("ok", b"1", "f", ""), (ESCAPE, b"evil", "f", "")),
    "dotdot-inside": lambda out: _tar_members(("a/../../evil", b"evil", "f", "")),
    "absolute": lambda out: _tar_members((str(out / "evil"), b"evil", "f", "")),
    "symlink-to-etc-passwd": lambda out: _tar_members(("passwd", b"", "sym", "/etc/passwd")),
    "symlink-relative-escape": lambda out: _tar_members(("up", b"", "sym", "../../../../..")),
    "symlink-chain-escape": lambda out: _tar_members(
        ("d/l", b"", "sym", ".."), ("e", b"", "sym", "d/l/../../../../outside")),
    # Lexically inside ("d/l/.." is "d"), really the parent of the tree: only the file system
    # can tell.
    "symlink-chain-escape-hidden": lambda out: _tar_members(
        ("d/l", b"", "sym", ".."), ("e", b"", "sym", "d/l/..")),
    "write-through-symlink": lambda out: _tar_members(
        ("link", b"", "sym", "."), ("link/evil", b"evil", "f", "")),
    "hardlink-outside": lambda out: _tar_members(("h", b"", "hard", "/etc/passwd")),
    "hardlink-dotdot": lambda out: _tar_members(("h", b"", "hard", ESCAPE)),
    "hardlink-to-symlink": lambda out: _tar_members(
        ("s", b"", "sym", "x"), ("h", b"", "hard", "s")),
    "device": lambda out: _tar_members(("null", b"", "chr", "")),
    "fifo": lambda out: _tar_members(("pipe", b"", "fifo", "")),
}


MALICIOUS_ZIPS = {
    "dotdot": lambda out: _zip({ESCAPE: b"evil"}),
    "backslash-dotdot": lambda out: _zip({"..\\..\\..\\..\\outside\\evil": b"evil"}),
    "absolute": lambda out: _zip({str(out / "evil"): b"evil"}),
    "symlink-to-etc-passwd": lambda out: _zip({}, {"passwd": "/etc/passwd"}),
    "symlink-escape": lambda out: _zip({}, {"up": "../../../../outside"}),
}


@pytest.mark.parametrize("kind, name", [("tar", n) for n in MALICIOUS_TARS]
                         + [("zip", n) for n in MALICIOUS_ZIPS])
def test_malicious_archives_are_refused_and_nothing_is_written_outside(
    fake: FakeCluster, make: Any, tmp_path: Path, cache_dir: Path, kind: str, name: str
) -> None:
    outside = _outside(tmp_path)
    outside.mkdir()
    build = MALICIOUS_TARS[name] if kind == "tar" else MALICIOUS_ZIPS[name]
    key = f"evil-{name}.{kind}"
    fake.put(key, build(outside))
    cache = make()
    with pytest.raises(InvalidArgument, match="refusing to unpack"):
        cache.get(key, uncompress=True)
    assert list(outside.iterdir()) == []
    assert not (cache_dir / "blobs" / key / "v1" / "unpacked").exists()
    assert scratch_files(cache_dir) == [] and not any(
        p.is_symlink() for p in (cache_dir / "tmp").rglob("*"))
    assert cache.get(key).path.is_file(), "the blob itself is still served"


def test_non_archives_cannot_be_unpacked(fake: FakeCluster, make: Any) -> None:
    fake.put("plain.bin", b"not an archive")
    fake.put("liar.zip", _tar(TREE))
    cache = make()
    with pytest.raises(InvalidArgument, match="neither a tar"):
        cache.get("plain.bin", uncompress=True)
    with pytest.raises(InvalidArgument, match="not a zip archive"):
        cache.get("liar.zip", uncompress=True)


def test_a_truncated_archive_is_refused(fake: FakeCluster, make: Any) -> None:
    data = _tar({"f": os.urandom(50_000)}, "w:gz")
    fake.put("cut.tgz", data[: len(data) // 2])
    with pytest.raises(InvalidArgument, match=r"cut\.tgz"):
        make().get("cut.tgz", uncompress=True)


def test_an_archive_that_expands_past_the_room_on_disk_is_refused_while_unpacking(
    fake: FakeCluster, make: Any, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 64 MiB of zeros in about 64 KiB: with 8 MiB of room, unpacking stops at 8 MiB instead of
    # filling the disk (a 1 MiB archive unpacked to 1 GiB before).
    bomb = _tar({"zeros.bin": bytes(64 * 1024 * 1024)}, "w:gz")
    assert len(bomb) < 1024 * 1024
    fake.put("bomb.tgz", bomb)
    monkeypatch.setattr(install_mod, "_room_to_unpack", lambda path: 8 * 1024 * 1024)
    cache = make()
    with pytest.raises(ResourceExhausted, match="expands to more than the 8,388,608 bytes"):
        cache.get("bomb.tgz", uncompress=True)
    assert not (cache_dir / "blobs" / "bomb.tgz" / "v1" / "unpacked").exists()
    assert scratch_files(cache_dir) == []
    assert cache.get("bomb.tgz").path.read_bytes() == bomb, "the blob itself is still served"


def test_the_room_to_unpack_leaves_a_margin_of_the_disk_free(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    margin = min(install_mod.UNPACK_MARGIN_BYTES, total // 20)
    # Other writers may move the free space between the two looks.
    assert abs(install_mod._room_to_unpack(tmp_path) - max(0, free - margin)) < 64 * 1024 * 1024


@pytest.mark.parametrize("name, build", [("many.tar", _tar), ("many.zip", _zip)])
def test_an_archive_with_too_many_members_is_refused(tmp_path: Path, name: str,
                                                     build: Any) -> None:
    from blobha.cache.unpack import unpack

    archive = tmp_path / name
    archive.write_bytes(build({f"f{i}": b"x" for i in range(11)}))
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(InvalidArgument, match="more than 10 members"):
        unpack(archive, name, dest, max_members=10)
    if name.endswith(".zip"):
        assert list(dest.iterdir()) == []  # a zip's count is known before anything is written


def _no_zipfile(*args: object, **kw: object) -> None:
    raise AssertionError("zipfile read the central directory")


@pytest.mark.parametrize("members, limit, match", [(10, 10**9, "more than 10 members"),
                                                   (100, 200, "central directory takes")])
def test_a_zips_directory_is_judged_before_zipfile_reads_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, members: int, limit: int, match: str
) -> None:
    # zipfile reads the whole directory into memory (about 600 bytes per entry) on opening:
    # a zip of millions of tiny entries would exhaust an executor before any count.
    import blobha.cache.unpack as unpack_mod

    archive = tmp_path / "many.zip"
    archive.write_bytes(_zip({f"f{i}": b"" for i in range(11)}))
    monkeypatch.setattr(unpack_mod, "MAX_ZIP_DIRECTORY", limit)
    monkeypatch.setattr(unpack_mod.zipfile, "ZipFile", _no_zipfile)
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(InvalidArgument, match=match):
        unpack_mod.unpack(archive, "many.zip", dest, max_members=members)
    assert list(dest.iterdir()) == []


def test_the_directory_of_a_zip64_archive_is_read_from_its_64_bit_record(
        tmp_path: Path) -> None:
    import zipfile

    from blobha.cache.unpack import _zip_directory

    archive = tmp_path / "big.zip"
    count = 0x10000 + 5  # past the 16-bit count: zipfile writes the zip64 records
    with zipfile.ZipFile(archive, "w") as zf:
        for i in range(count):
            zf.writestr(f"{i}", b"")
    with zipfile.ZipFile(archive) as zf:
        start = zf.start_dir
    eocd64 = archive.read_bytes().rfind(b"PK\x06\x06")
    assert eocd64 > 0  # a zip64 archive indeed
    assert _zip_directory(archive) == (count, eocd64 - start)
    small = tmp_path / "small.zip"
    small.write_bytes(_zip({"a": b"1", "b": b"2"}))
    directory = _zip_directory(small)
    assert directory is not None and directory[0] == 2
    (tmp_path / "junk.zip").write_bytes(b"not a zip")
    assert _zip_directory(tmp_path / "junk.zip") is None


def test_a_zip_link_with_a_huge_target_is_refused_before_it_is_read(tmp_path: Path) -> None:
    from blobha.cache.unpack import unpack

    archive = tmp_path / "link.zip"
    archive.write_bytes(_zip({}, {"l": "a" * 5000}))
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(InvalidArgument, match="symbolic link with a target of 5,000 bytes"):
        unpack(archive, "link.zip", dest)


def test_a_member_name_too_long_for_the_file_system_is_a_clear_error(tmp_path: Path) -> None:
    from blobha.cache.unpack import unpack

    archive = tmp_path / "long.tar"
    name = "a" * 300
    archive.write_bytes(_tar({name: b"x"}))
    dest = tmp_path / "out"
    dest.mkdir()
    with pytest.raises(InvalidArgument, match=r"cannot unpack 'long.tar' at member 'a+': its"
                       " name is too long"):
        unpack(archive, "long.tar", dest)
