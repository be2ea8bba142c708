"""The fakes of the node-local cache's unit tests (tests/unit/cache): a cluster keeping blobs in
memory, a client writing downloads the way the real one does (a temporary file renamed into
place), and a clock driving retention and update intervals without sleeping."""

from __future__ import annotations

import io
import os
import stat
import tarfile
import threading
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from blobha.client import BlobInfo, BlobMeta
from blobha.core.digest import digest_bytes
from blobha.core.errors import (
    KeyNotFound,
    NotAuthorized,
)
from blobha.core.keys import key_dirname

T = TypeVar("T")


@dataclass
class _Blob:
    versions: list[bytes]
    created_at: float
    readers: set[str] | None = None  # None = everyone


@dataclass
class FakeCluster:
    blobs: dict[str, _Blob] = field(default_factory=dict)
    meta_calls: int = 0
    downloads: int = 0
    started: int = 0
    #: When set, downloads wait for it (to hold other askers at the lock).
    gate: threading.Event | None = None
    #: Raised by the next download, after writing half the data.
    fail_next: BaseException | None = None
    #: Raised by every get_meta.
    meta_error: BaseException | None = None
    #: get_meta in a thread of one of these names waits for that thread's event (to hold
    #: other askers at the node's check lock).
    meta_gates: dict[str, threading.Event] = field(default_factory=dict)
    #: get_meta calls in progress.
    meta_inside: int = 0
    #: Committed between the metadata answer and the download (a racing update).
    update_during_download: bytes | None = None
    #: key -> the version the master a client asks first shows (one behind, cut off): served
    #: to a client with no newer minimum, as a real master does; one with a newer minimum is
    #: refused there and served the latest by another master.
    behind: dict[str, int] = field(default_factory=dict)
    _created: float = 1000.0

    def put(self, key: str, data: bytes, readers: set[str] | None = None) -> int:
        blob = self.blobs.get(key)
        if blob is None:
            self._created += 1
            self.blobs[key] = _Blob([data], self._created, readers)
            return 1
        blob.versions.append(data)
        if readers is not None:
            blob.readers = readers
        return len(blob.versions)

    def delete(self, key: str) -> None:
        del self.blobs[key]

    def client(self, user: str = "alice") -> FakeClient:
        return FakeClient(self, user)


class FakeClient:
    def __init__(self, cluster: FakeCluster, user: str) -> None:
        self.cluster = cluster
        self.user = user
        self.closed = False
        #: key -> (created_at, version): the client's read minimum (remember_version, reads).
        self.minimums: dict[str, tuple[float, int]] = {}

    def remember_version(self, key: str, version: int, created_at: float) -> None:
        order = (created_at, version)
        self.minimums[key] = max(order, self.minimums.get(key, order))

    def _number(self, key: str, blob: _Blob) -> int:
        """The version this client is answered: the lagging master's, unless its minimum is
        newer (then another master answers)."""
        lag = self.cluster.behind.get(key)
        latest = len(blob.versions)
        if lag is None or self.minimums.get(key, (0.0, 0)) > (blob.created_at, lag):
            number = latest
        else:
            number = lag
        self.remember_version(key, number, blob.created_at)
        return number

    def _blob(self, key: str) -> _Blob:
        blob = self.cluster.blobs.get(key)
        if blob is None:
            raise KeyNotFound(f"no blob with key {key!r}")
        if blob.readers is not None and self.user not in blob.readers:
            raise NotAuthorized(f"{self.user} may not read {key!r}")
        return blob

    def get_meta(self, key: str) -> BlobMeta:
        c = self.cluster
        c.meta_calls += 1
        gate = c.meta_gates.get(threading.current_thread().name)
        if gate is not None:
            c.meta_inside += 1
            try:
                assert gate.wait(30), "the test never opened the gate"
            finally:
                c.meta_inside -= 1
        if c.meta_error is not None:
            raise c.meta_error
        blob = self._blob(key)
        number = self._number(key, blob)
        data = blob.versions[number - 1]
        return BlobMeta(key, number, len(data), digest_bytes(data), (), 3, 1,
                        blob.created_at, blob.created_at, "alice", 3)

    def download(self, key: str, dest: str | os.PathLike[str], version: int = 0,
                 **_: Any) -> BlobInfo:
        c = self.cluster
        c.started += 1
        if c.update_during_download is not None:
            c.put(key, c.update_during_download)
            c.update_during_download = None
        blob = self._blob(key)
        number = version or self._number(key, blob)
        data = blob.versions[number - 1]
        path = Path(dest)
        tmp = path.with_name(f".{path.name}.part")
        with open(tmp, "wb") as f:
            f.write(data[: len(data) // 2])
            if c.fail_next is not None:
                error, c.fail_next = c.fail_next, None
                raise error
            if c.gate is not None:
                assert c.gate.wait(30), "the test never opened the gate"
            f.write(data[len(data) // 2 :])
        os.replace(tmp, path)
        c.downloads += 1
        return BlobInfo(number, len(data), digest_bytes(data))

    def close(self) -> None:
        self.closed = True

    def __enter__(self) -> FakeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, secs: float) -> None:
        self.now += secs


def version_dirs(cache_dir: Path, key: str) -> list[str]:
    d = cache_dir / "blobs" / key_dirname(key)
    return sorted(p.name for p in d.glob("v*")) if d.exists() else []


def scratch_files(cache_dir: Path) -> list[Path]:
    return [p for p in (cache_dir / "tmp").rglob("*") if p.is_file()]


def _tar(files: dict[str, bytes], mode: str = "w") -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode=mode) as tf:  # type: ignore[call-overload]
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o755 if name.endswith(".sh") else 0o644
            tf.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _zip(files: dict[str, bytes], links: dict[str, str] | None = None) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        for name, target in (links or {}).items():
            info = zipfile.ZipInfo(name)
            info.create_system = 3
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            zf.writestr(info, target)
    return out.getvalue()


TREE = {"top.txt": b"top", "dir/a.bin": b"\x00\x01", "dir/sub/run.sh": b"#!/bin/sh\n"}


def _read_tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes()
            for p in root.rglob("*") if p.is_file() and not p.is_symlink()}
