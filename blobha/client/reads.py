"""The reads of :class:`~blobha.client.facade.Client` beyond one download: whether a key
exists, its metadata, listings with metadata, a blob as a read-only file object, and a blob in
pieces. Functions of the router the facade delegates to."""

from __future__ import annotations

import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from blobha.client.download import DownloadJob
from blobha.client.routing import Router
from blobha.client.sources import BufferSink
from blobha.client.values import BlobMeta
from blobha.core.digest import Digester
from blobha.core.errors import ChecksumMismatch, InvalidArgument, KeyNotFound
from blobha.core.keys import validate_key
from blobha.v1 import blobha_pb2 as pb
from blobha.wire.convert import meta_from_pb

#: Metadata calls a detailed listing keeps in flight at once: enough to hide the round trips,
#: few enough not to crowd out other callers' calls at the masters.
LIST_PARALLELISM = 8


def meta(router: Router, key: str) -> BlobMeta:
    validate_key(key)
    return meta_from_pb(router.read_meta(key, None))


def exists(router: Router, key: str) -> bool:
    """Whether ``key`` has a committed version (a user with no permission on it is refused,
    as for its metadata)."""
    try:
        meta(router, key)
    except KeyNotFound:
        return False
    return True


def list_keys(router: Router, prefix: str, page_size: int) -> Iterator[list[str]]:
    """The keys starting with ``prefix``, a page at a time."""
    token = ""
    while True:
        request = pb.ListRequest(prefix=prefix, page_token=token, page_size=page_size)
        page = router.read_call("list keys", "List", request)
        yield list(page.keys)
        token = page.next_page_token
        if not token:
            return


def list_detail(router: Router, prefix: str, page_size: int) -> Iterator[BlobMeta]:
    """The metadata of every key starting with ``prefix``, in listing order; a key deleted
    between its listing and its metadata is left out."""
    pool = ThreadPoolExecutor(LIST_PARALLELISM, thread_name_prefix="blobha-list")
    try:
        for keys in list_keys(router, prefix, page_size):
            for found in pool.map(lambda k: _meta_or_none(router, k), keys):
                if found is not None:
                    yield found
    finally:
        # A caller that stops early does not wait for the rest of the page's calls.
        pool.shutdown(wait=False, cancel_futures=True)


def _meta_or_none(router: Router, key: str) -> BlobMeta | None:
    try:
        return meta(router, key)
    except KeyNotFound:
        return None


def fetch_range(router: Router, key: str, version: int, offset: int, length: int) -> bytes:
    """Bytes ``[offset, offset + length)`` of ``version`` of ``key`` (``length`` > 0)."""
    sink = BufferSink()
    DownloadJob(router, key, sink, version, offset, length, None).run()
    return b"".join(sink.parts)


def pinned(router: Router, key: str, version: int | None) -> BlobMeta:
    """The metadata of the version a reader keeps to: ``version``, or the one committed now
    (None or 0). The digest and size come from the committed version's metadata: a named
    older version is checked against the digest its download reports."""
    validate_key(key)
    if version is not None and version < 0:
        raise InvalidArgument(f"version must be positive, not {version!r}")
    current = meta(router, key)
    if not version or version == current.version:
        return current
    sink = BufferSink()
    # A one-byte read names the older version's size and digest without fetching it whole.
    info = DownloadJob(router, key, sink, version, 0, 1, None).run()
    return BlobMeta(key, info.version, info.size, info.digest, current.acl,
                    current.replication_factor, current.meta_version, current.created_at,
                    current.updated_at, current.creator, current.replication)


class _Verifier:
    """The whole-blob digest of bytes read from the start in order; checked at the end."""

    def __init__(self, meta: BlobMeta) -> None:
        self.meta = meta
        self._digester: Digester | None = Digester()
        self.checked = False

    def saw(self, offset: int, data: bytes) -> None:
        if offset == 0 and not self.checked:
            self._digester = Digester()  # a read from the start: checked anew
        d = self._digester
        if d is None or offset != d.size:
            # Not the next bytes in order: a seek or a gap; whole-blob checking stops.
            self._digester = None
            return
        d.update(data)
        if d.size == self.meta.size:
            self.check()

    def check(self) -> None:
        d = self._digester
        if d is None or self.checked or d.size != self.meta.size:
            return
        self.checked = True
        if self.meta.digest and d.hexdigest() != self.meta.digest:
            raise ChecksumMismatch(
                f"{self.meta.key!r} v{self.meta.version} read whole has digest"
                f" {d.hexdigest()}, not its recorded {self.meta.digest}")


class BlobReader(io.RawIOBase):
    """One version of a blob as a seekable, read-only raw file, read through ranged
    downloads. Reading it from the start to the end in order checks the whole-blob digest
    (:class:`ChecksumMismatch` otherwise); other reads rely on the servers' chunk checks."""

    def __init__(self, router: Router, meta: BlobMeta) -> None:
        super().__init__()
        self._router = router
        self.meta = meta
        self._pos = 0
        self._verifier = _Verifier(meta)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        self._check_open()
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._check_open()
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.meta.size}.get(whence)
        if base is None:
            raise ValueError(f"invalid whence {whence!r}")
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        self._check_open()
        view = memoryview(buffer).cast("B")
        want = min(len(view), self.meta.size - self._pos)
        if want <= 0:
            self._verifier.check()  # an empty blob is read whole by its first read
            return 0
        data = fetch_range(self._router, self.meta.key, self.meta.version, self._pos, want)
        view[:len(data)] = data
        self._verifier.saw(self._pos, data)
        self._pos += len(data)
        return len(data)

    def readall(self) -> bytes:
        # The rest in one ranged download, not in RawIOBase's pieces of a few KiB each.
        self._check_open()
        want = self.meta.size - self._pos
        if want <= 0:
            self._verifier.check()
            return b""
        data = fetch_range(self._router, self.meta.key, self.meta.version, self._pos, want)
        self._verifier.saw(self._pos, data)
        self._pos += len(data)
        return data

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("I/O operation on closed file")


def open_blob(router: Router, key: str, version: int | None, buffer_size: int
              ) -> io.BufferedReader:
    meta = pinned(router, key, version)
    return io.BufferedReader(BlobReader(router, meta), buffer_size=buffer_size)


def iter_chunks(router: Router, key: str, chunk_size: int, version: int) -> Iterator[bytes]:
    meta = pinned(router, key, version)
    verifier = _Verifier(meta)
    offset = 0
    while offset < meta.size:
        data = fetch_range(router, key, meta.version, offset,
                           min(chunk_size, meta.size - offset))
        # Checked before the last piece is handed out: a mismatch ends the iteration with
        # ChecksumMismatch instead of a last piece.
        verifier.saw(offset, data)
        offset += len(data)
        yield data
    verifier.check()
