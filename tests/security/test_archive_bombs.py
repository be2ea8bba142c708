"""Archives built to exhaust a node's memory before any limit on their contents is reached:
a tar extension header (a GNU long name, a pax record) that tarfile would read whole, and a
zip whose end record zipfile and the size check would find in different places. Each is
refused before any big allocation, through the node cache of a real cluster too."""

from __future__ import annotations

import gzip
import io
import json
import os
import struct
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from support.harness import client_for

from blobha.cache import BlobCache
from blobha.core.errors import InvalidArgument
from blobha.ops.localcluster import LocalCluster

MiB = 1024 * 1024
#: What the header claims: tarfile would hold it in memory twice (bytes, then the name).
CLAIM = 300 * MiB


def _extension_bomb(path: Path, kind: bytes, claim: int = CLAIM) -> None:
    """A .tgz of about a megabyte whose first header is an extension header of ``claim``
    bytes (GNU long name ``L``, or a pax record set ``x``), then one small file."""
    head = tarfile.TarInfo("././@LongLink" if kind == tarfile.GNUTYPE_LONGNAME else "pax")
    head.type = kind
    head.size = claim
    with gzip.open(path, "wb", compresslevel=1) as gz:
        gz.write(head.tobuf(format=tarfile.GNU_FORMAT))
        if kind == tarfile.XHDTYPE:
            record = b"%d path=" % (claim)  # one record as long as the whole header
            gz.write(record)
            left = claim - len(record)
        else:
            left = claim
        block = b"a" * MiB
        while left:
            gz.write(block[:min(left, MiB)])
            left -= min(left, MiB)
        gz.write(b"\0" * (-claim % 512))
        small = tarfile.TarInfo("small.txt")
        small.size = 2
        gz.write(small.tobuf(format=tarfile.GNU_FORMAT) + b"ok".ljust(512, b"\0"))
        gz.write(b"\0" * 1024)


def _peak_rss_mib(archive: Path, key: str, dest: Path) -> tuple[float, str]:
    """Unpack in a process of its own: (its peak resident memory in MiB, the error text)."""
    code = (
        "import json, resource, sys\n"
        "from pathlib import Path\n"
        "from blobha.cache.unpack import unpack\n"
        "from blobha.core.errors import BlobError\n"
        "error = ''\n"
        "try:\n"
        "    unpack(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))\n"
        "except BlobError as e:\n"
        "    error = str(e)\n"
        "print(json.dumps([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, error]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(archive), key, str(dest)],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    peak, error = json.loads(out)
    return float(peak), str(error)


def _baseline_rss_mib() -> float:
    code = ("import json, resource\nimport blobha.cache.unpack\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                timeout=60, check=True).stdout)


@pytest.mark.parametrize("kind", [tarfile.GNUTYPE_LONGNAME, tarfile.XHDTYPE],
                         ids=["gnu-long-name", "pax"])
def test_a_tar_extension_header_bomb_is_refused_before_it_is_read(
        tmp_path: Path, kind: bytes) -> None:
    archive = tmp_path / "bomb.tgz"
    _extension_bomb(archive, kind)
    assert archive.stat().st_size < 4 * MiB  # the attacker's cost
    dest = tmp_path / "out"
    dest.mkdir()
    peak, error = _peak_rss_mib(archive, "bomb.tgz", dest)
    assert "extension headers" in error and "nothing was unpacked" in error, error[:300]
    assert list(dest.iterdir()) == []
    # Well under the claim: the header was never read into memory.
    assert peak - _baseline_rss_mib() < 64, peak


def test_small_extension_headers_still_unpack(tmp_path: Path) -> None:
    archive = tmp_path / "long.tgz"
    name = "d/" + "n" * 200 + "/" + "m" * 200 + ".txt"
    with tarfile.open(archive, "w:gz", format=tarfile.PAX_FORMAT) as tf:
        info = tarfile.TarInfo(name)
        info.size = 3
        info.pax_headers = {"comment": "x" * 4000}
        tf.addfile(info, io.BytesIO(b"abc"))
    from blobha.cache.unpack import unpack

    dest = tmp_path / "out"
    dest.mkdir()
    unpack(archive, "long.tgz", dest)
    assert (dest / name).read_bytes() == b"abc"


def _zip_with_a_decoy_end_record(path: Path, entries: int) -> None:
    """A zip of ``entries`` empty members whose true end record, the one zipfile reads (no
    comment, at the very end), holds the decoy signature in its last fields: a finder that
    takes the last signature in the file finds the decoy, which is cut short."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for i in range(entries):
            zf.writestr(f"{i}", b"")
    data = bytearray(buf.getvalue())
    eocd = data.rfind(b"PK\x05\x06")
    assert eocd == len(data) - 22
    # Move the central directory so that its offset (bytes 16-19 of the record) reads as
    # the signature: pad the file before the directory to offset 0x06054b50 would be huge,
    # so instead the decoy sits in the disk-number fields, which zipfile ignores.
    data[eocd + 4:eocd + 8] = b"PK\x05\x06"
    path.write_bytes(bytes(data))


def test_the_zip_check_reads_the_end_record_zipfile_reads(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    import blobha.cache.unpack as unpack_mod

    archive = tmp_path / "decoy.zip"
    _zip_with_a_decoy_end_record(archive, 50)
    with zipfile.ZipFile(archive) as zf:  # zipfile itself reads it
        assert len(zf.infolist()) == 50
    assert unpack_mod._zip_directory(archive) is not None
    assert unpack_mod._zip_directory(archive)[0] == 50  # type: ignore[index]
    # Both finders agree, with zipfile's own finder and without it.
    monkeypatch.setattr(unpack_mod, "_find_end_record", None)
    assert unpack_mod._zip_directory(archive) == (50, struct.unpack_from(
        "<L", archive.read_bytes(), len(archive.read_bytes()) - 22 + 12)[0])
    dest = tmp_path / "out"
    dest.mkdir()
    monkeypatch.setattr(unpack_mod, "MAX_ZIP_DIRECTORY", 100)
    with pytest.raises(InvalidArgument, match="central directory takes"):
        unpack_mod.unpack(archive, "decoy.zip", dest)
    assert list(dest.iterdir()) == []


@pytest.mark.integration
def test_the_node_cache_refuses_a_tar_bomb_from_the_store(cluster: LocalCluster,
                                                          tmp_path: Path) -> None:
    archive = tmp_path / "bomb.tgz"
    _extension_bomb(archive, tarfile.GNUTYPE_LONGNAME, claim=64 * MiB)
    key = f"bomb-{os.getpid()}.tgz"
    with client_for(cluster, "mallory") as mallory:
        mallory.create(key, archive.read_bytes(), acl="u:mallory:rwa,o::r")
    with BlobCache(tmp_path / "node", cluster.cluster, user="alice") as cache:
        with pytest.raises(InvalidArgument, match="extension headers"):
            cache.get(key, uncompress=True)
        # The archive itself is still there to fetch as it is.
        assert cache.get(key).path.stat().st_size == archive.stat().st_size


def test_a_pax_sparse_map_bomb_is_refused_before_its_map_is_read(tmp_path: Path) -> None:
    """GNU sparse 1.0, told by pax records: tarfile reads the member's data as the sparse map,
    a number a line, with no bound. A few KiB of gzip hold millions of lines."""
    archive = tmp_path / "sparse.tgz"
    lines = 2_000_000
    data = b"%d\n" % lines + b"0\n" * (2 * lines)
    with tarfile.open(archive, "w:gz", format=tarfile.PAX_FORMAT) as tf:
        info = tarfile.TarInfo("sparse.bin")
        info.size = len(data)
        info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0",
                            "GNU.sparse.name": "sparse.bin", "GNU.sparse.realsize": "1"}
        tf.addfile(info, io.BytesIO(data))
    assert archive.stat().st_size < MiB
    dest = tmp_path / "out"
    dest.mkdir()
    from blobha.cache.unpack import unpack

    with pytest.raises(InvalidArgument, match="GNU sparse member"):
        unpack(archive, "sparse.tgz", dest)
    assert list(dest.iterdir()) == []
