"""``blobha://KEY`` as an fsspec filesystem, for pandas, pyarrow, dask and ``fsspec.open``.

The store's namespace is flat (a key holds no ``/``): the root lists every key the caller may
see, and each key is a file. Paths may pin a version, ``blobha://geo.parquet?version=3``, or
``open(..., version=3)``; an unpinned file is pinned to the version committed when it is
opened, so every ranged read of one open file sees the same bytes.

Reads are verified: a whole read against the blob's digest, here; a file read from start to
end, sequentially, the same way as it goes; a ranged read by the master, chunk by chunk against
its stored digests (as :meth:`blobha.client.Client.download` does). Writes are spooled and
become one version on ``close`` (through the client's resumable upload): a write that fails
or is discarded leaves nothing visible.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import fnmatch
import io
import re
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from blobha.client import Client
from blobha.wire.credentials import Credentials

__all__ = ["BlobhaFile", "BlobhaFileSystem"]

#: Blobs written at most this large are spooled in memory, larger ones on disk.
_SPOOL_IN_MEMORY = 8 * 1024 * 1024
#: Metadata calls made at once for a detailed listing (one per key).
_LIST_PARALLEL = 8
_VERSION_QUERY = re.compile(r"^(?P<key>[^?]*)\?version=(?P<version>\d+)$")
_MAGIC = re.compile(r"[*?\[]")

def _when(seconds: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)


class BlobhaFileSystem(AbstractFileSystem):  # type: ignore[misc]
    """The blob store as a flat fsspec filesystem.

    ``cluster`` (default ``$BLOBHA_CLUSTER``), ``user`` (default ``$BLOBHA_USER`` or the token's
    owner), ``ca``, ``cert``, ``tls_key`` and ``token_file`` (default: the ``BLOBHA_*``
    environment, as for the command line), ``require_tls`` (default: ``$BLOBHA_REQUIRE_TLS``,
    else the client profile's ``require_tls``: no token is sent without TLS) and ``timeout``
    are the storage options; or pass a ready ``client``.
    """

    protocol = "blobha"
    root_marker = ""

    def __init__(self, cluster: str | None = None, user: str | None = None, *,
                 ca: str | None = None, cert: str | None = None, tls_key: str | None = None,
                 token_file: str | None = None, require_tls: bool | None = None,
                 timeout: float = 60.0, client: Client | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if client is None:
            import os

            addresses = cluster or os.environ.get("BLOBHA_CLUSTER", "").strip()
            if not addresses:
                raise ValueError("no cluster given: pass storage_options={'cluster':"
                                 " 'HOST:PORT,...'} or set BLOBHA_CLUSTER")
            if require_tls is not None and not isinstance(require_tls, bool):
                raise ValueError(f"the require_tls storage option is True or False, not"
                                 f" {require_tls!r}")
            # Not given, whether TLS is required is the environment's or the profile's
            # (Credentials decides that for every client path).
            credentials = Credentials.from_env(require_tls=require_tls)
            if ca or cert or tls_key or token_file:  # given, they stand in for all of BLOBHA_*
                credentials = dataclasses.replace(credentials, ca=ca, cert=cert, key=tls_key,
                                                  token_file=token_file)
            client = Client(addresses, user=user, timeout=timeout, credentials=credentials)
        self.client = client

    # -- paths -----------------------------------------------------------------------------

    @classmethod
    def _strip_protocol(cls, path: str | list[str]) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = str(path)
        if path.startswith("blobha://"):
            path = path[len("blobha://"):]
        elif path.startswith("blobha:"):
            path = path[len("blobha:"):]
        return path.strip("/")

    def _parent(self, path: str) -> str:
        return ""

    @staticmethod
    def split_version(path: str, version: int | None = None) -> tuple[str, int]:
        """(key, version: 0 for the committed one) of ``path``, whose ``?version=N`` and the
        ``version`` given must agree."""
        match = _VERSION_QUERY.match(path)
        key, pinned = (match["key"], int(match["version"])) if match else (path, 0)
        if version is not None:
            if pinned and version != pinned:
                raise ValueError(f"{path!r} pins version {pinned} but version={version} was"
                                 " given; give one")
            pinned = int(version)
        if "?" in key:
            raise ValueError(f"{path!r}: the only query a blobha path takes is ?version=N")
        if "/" in key:
            raise ValueError(f"{key!r} is not a blob key: blobha keys hold no '/' (the"
                             " namespace is flat)")
        return key, pinned

    # -- metadata --------------------------------------------------------------------------

    def info(self, path: str, version: int | None = None, **kwargs: Any) -> dict[str, Any]:
        key, pinned = self.split_version(self._strip_protocol(path), version)
        if not key:
            return {"name": "", "size": 0, "type": "directory"}
        meta = self.client.get_meta(key)
        # A key the user may see but not read is listed, as the store lists it; its
        # content (and digest) is refused when asked for.
        entry = {
            "name": key, "size": meta.size, "type": "file", "version": meta.version,
            "digest": meta.digest, "created": meta.created_at, "mtime": meta.updated_at,
            "replication": meta.replication,
            "replication_factor": meta.replication_factor,
            "acknowledged": meta.acknowledged, "readable": meta.readable,
        }
        if pinned and pinned != meta.version:
            # An earlier version still retained: its own size and digest.
            got = self.client.download(key, io.BytesIO(), version=pinned, length=1)
            entry.update(name=f"{key}?version={pinned}", version=got.version,
                         size=got.size, digest=got.digest)
        return entry

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        key, _ = self.split_version(self._strip_protocol(path))
        if key:
            entry = self.info(path)
            return [entry if detail else entry["name"]]
        names = list(self.client.list(""))
        return self._details(names) if detail else names

    def _details(self, names: list[str]) -> list[dict[str, Any]]:
        """Each key's entry, those deleted meanwhile left out."""

        def one(name: str) -> dict[str, Any] | None:
            try:
                return self.info(name)
            except FileNotFoundError:
                return None

        with ThreadPoolExecutor(_LIST_PARALLEL) as pool:
            return [e for e in pool.map(one, names) if e is not None]

    def find(self, path: str, maxdepth: int | None = None, withdirs: bool = False,
             detail: bool = False, **kwargs: Any) -> Any:
        key, _ = self.split_version(self._strip_protocol(path))
        names = [key] if key and self.exists(key) else [] if key else self.ls("", False)
        if detail:
            return {e["name"]: e for e in self._details(names)}
        return names

    def glob(self, path: str, maxdepth: int | None = None, **kwargs: Any) -> Any:
        """Keys matching ``path``'s pattern, listed from the pattern's literal prefix."""
        pattern = self._strip_protocol(path)
        if not _MAGIC.search(pattern):
            return self.find(pattern, detail=kwargs.get("detail", False))
        if "/" in pattern:
            raise ValueError(f"{pattern!r} matches no blob key: blobha keys hold no '/' (the"
                             " namespace is flat)")
        prefix = _MAGIC.split(pattern, 1)[0]
        names = [k for k in self.client.list(prefix) if fnmatch.fnmatchcase(k, pattern)]
        if kwargs.get("detail"):
            return {e["name"]: e for e in self._details(names)}
        return names

    def exists(self, path: str, **kwargs: Any) -> bool:
        try:
            self.info(path)
        except (FileNotFoundError, PermissionError):
            return False
        return True

    def _readable(self, path: str) -> dict[str, Any]:
        entry = self.info(path)
        if not entry.get("readable", True):
            raise PermissionError(errno.EACCES, f"{self.client.user!r} may not read"
                                  f" {entry['name']!r}", entry["name"])
        return entry

    def checksum(self, path: str) -> int:
        """The blob's xxh3-128 digest, as the integer fsspec compares."""
        return int(self._readable(path)["digest"], 16)

    def ukey(self, path: str) -> str:
        entry = self._readable(path)
        return f"{entry['digest']}-{entry['size']}"

    def created(self, path: str) -> datetime.datetime:
        return _when(self.info(path)["created"])

    def modified(self, path: str) -> datetime.datetime:
        return _when(self.info(path)["mtime"])

    def isdir(self, path: str) -> bool:
        return not self._strip_protocol(path)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        # Writers make the parent of what they write: the root, which always exists.
        if self._strip_protocol(path):
            raise ValueError(f"{path!r}: blobha has no folders (keys hold no '/')")

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self.makedirs(path, exist_ok=True)

    def rmdir(self, path: str) -> None:
        self.makedirs(path)

    # -- data ------------------------------------------------------------------------------

    def cat_file(self, path: str, start: int | None = None, end: int | None = None,
                 version: int | None = None, **kwargs: Any) -> bytes:
        key, pinned = self.split_version(self._strip_protocol(path), version)
        if not key:
            raise IsADirectoryError(errno.EISDIR, "the root is not a blob", path)
        if not start and end is None:
            return self.client.read(key, pinned)  # verified against the whole digest
        if (start or 0) < 0 or (end is not None and end < 0):
            size = self.info(path, version)["size"]
            start = max(0, size + start) if start and start < 0 else start
            end = max(0, size + end) if end is not None and end < 0 else end
        start = start or 0
        if end is not None and end <= start:
            return b""
        out = io.BytesIO()
        self.client.download(key, out, version=pinned, offset=start,
                             length=0 if end is None else end - start)
        return out.getvalue()

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite",
                  **kwargs: Any) -> None:
        key, _ = self._writable(path)
        self.put_blob(key, value, create_only=mode == "create")

    def put_file(self, lpath: str, rpath: str, callback: Any = None, mode: str = "overwrite",
                 **kwargs: Any) -> None:
        if Path(lpath).is_dir():
            return  # the flat namespace holds no folders; fsspec walks their files
        key, _ = self._writable(rpath)
        self.put_blob(key, Path(lpath), create_only=mode == "create")

    def get_file(self, rpath: str, lpath: str, callback: Any = None, outfile: Any = None,
                 **kwargs: Any) -> None:
        key, pinned = self.split_version(self._strip_protocol(rpath))
        # A path is written through a temporary file and renamed once verified.
        self.client.download(key, outfile if outfile is not None else lpath,
                             version=pinned)

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        self.pipe_file(path2, self.cat_file(path1))

    def rm_file(self, path: str) -> None:
        key, _ = self._writable(path)
        self.client.delete(key)

    def _rm(self, path: str) -> None:
        self.rm_file(path)

    def rm(self, path: str | list[str], recursive: bool = False,
           maxdepth: int | None = None) -> None:
        for p in [path] if isinstance(path, str) else path:
            self.rm_file(p)

    def _writable(self, path: str) -> tuple[str, int]:
        key, pinned = self.split_version(self._strip_protocol(path))
        if pinned:
            raise ValueError(f"{path!r}: a write makes the next version; drop ?version=")
        if not key:
            raise IsADirectoryError(errno.EISDIR, "the root is not a blob", path)
        return key, pinned

    def put_blob(self, key: str, data: bytes | Path | BinaryIO,
                 create_only: bool = False) -> None:
        """Make ``data`` the next version of ``key``, creating it if it is missing (two
        writers racing to create it both succeed, one version after the other); with
        ``create_only``, only a new key."""
        if create_only:
            self.client.create(key, data)
        else:
            self.client.put(key, data)

    def _open(self, path: str, mode: str = "rb", block_size: int | None = None,
              autocommit: bool = True, cache_options: dict[str, Any] | None = None,
              version: int | None = None, **kwargs: Any) -> BinaryIO:
        if mode not in ("rb", "wb", "xb"):
            raise ValueError(f"mode {mode!r} is not supported: blobs are read ('rb') or"
                             " written whole ('wb', 'xb')")
        if mode == "rb":
            key, pinned = self.split_version(self._strip_protocol(path), version)
            self._readable(key)
            # Pinned to one version, read in ranges, checked whole when read in order.
            return self.client.open(key, pinned or None)
        key, _ = self._writable(path)
        return BlobhaFile(self, key, mode, block_size=block_size or "default",
                          autocommit=autocommit, **kwargs)


class BlobhaFile(AbstractBufferedFile):  # type: ignore[misc]
    """A new version of a blob, spooled and made on close (``commit``), or dropped
    (``discard``); reads go through :meth:`blobha.client.Client.open`."""

    def __init__(self, fs: BlobhaFileSystem, path: str, mode: str = "wb",
                 **kwargs: Any) -> None:
        super().__init__(fs, path, mode=mode, **kwargs)
        # Closed by commit or discard, whichever ends the write.
        self._spool: tempfile.SpooledTemporaryFile[bytes] | None = (
            tempfile.SpooledTemporaryFile(max_size=_SPOOL_IN_MEMORY))  # noqa: SIM115

    def _initiate_upload(self) -> None:
        pass

    def _upload_chunk(self, final: bool = False) -> bool:
        assert self._spool is not None
        self.buffer.seek(0)
        self._spool.write(self.buffer.read())
        if final and self.autocommit:
            self.commit()
        return True

    def commit(self) -> None:
        if self._spool is None:
            return
        spool, self._spool = self._spool, None
        try:
            spool.seek(0)
            fs: BlobhaFileSystem = self.fs
            fs.put_blob(self.path, spool, create_only=self.mode == "xb")  # type: ignore[arg-type]
        finally:
            spool.close()

    def discard(self) -> None:
        if self._spool is not None:
            self._spool.close()
            self._spool = None

    def __exit__(self, kind: object, *rest: object) -> None:
        # A ``with`` block that raised wrote part of what it meant to: nothing is made.
        if kind is not None and self.mode != "rb":
            self.discard()
            self.closed = True
            return
        self.close()
