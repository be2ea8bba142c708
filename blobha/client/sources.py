"""Upload sources (bytes, a file, a stream) and download sinks (a buffer, a file, a path).

A path is replaced only once its download is complete and verified."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from blobha.client.arguments import KiB
from blobha.client.values import BlobInfo, UploadData, check_body
from blobha.core.errors import InternalError, InvalidArgument


class Source:
    """Upload input, readable at any offset from the last acknowledged one onwards."""

    #: Total bytes when known in advance, else -1.
    size: int = -1
    #: Whether it keeps the bytes not yet acknowledged in memory (a stream), which bounds
    #: how much one segment may carry.
    buffers: bool = False

    def read_at(self, offset: int, n: int) -> bytes:
        raise NotImplementedError

    def view_at(self, offset: int, n: int) -> bytes | memoryview:
        """As :meth:`read_at`, for a caller done with the bytes before it reads again: a
        source in memory answers with a view of its own, not a copy."""
        return self.read_at(offset, n)

    def ack(self, offset: int) -> None:
        """Bytes below ``offset`` are safe on the leader and will not be asked for again."""

    def can_restart(self) -> bool:
        """Whether reading can start over at offset 0 (needed when the leader changes)."""
        return True

    def close(self) -> None:
        pass


class BytesSource(Source):
    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self._view = memoryview(data).cast("B")
        self.size = len(self._view)

    def read_at(self, offset: int, n: int) -> bytes:
        return bytes(self._view[offset : offset + n])

    def view_at(self, offset: int, n: int) -> memoryview:
        return self._view[offset : offset + n]


class FileSource(Source):
    """A seekable file; offsets are relative to where it was positioned when handed over."""

    def __init__(self, f: BinaryIO, owned: bool) -> None:
        self._f = f
        self._owned = owned
        self._start = f.tell()
        end = f.seek(0, io.SEEK_END)
        f.seek(self._start)
        self.size = max(0, end - self._start)

    def read_at(self, offset: int, n: int) -> bytes:
        self._f.seek(self._start + offset)
        return _read_up_to(self._f, n)

    def close(self) -> None:
        if self._owned:
            self._f.close()


class StreamSource(Source):
    """A non-seekable stream (a pipe, stdin). Keeps what the leader has not acknowledged yet,
    so a broken segment can be re-sent; once bytes are dropped it can no longer restart."""

    buffers = True

    def __init__(self, f: BinaryIO, owned: bool = False) -> None:
        self._f = f
        self._owned = owned
        self._buf = bytearray()
        self._base = 0
        self._eof = False

    def close(self) -> None:
        if self._owned:
            self._f.close()

    def read_at(self, offset: int, n: int) -> bytes:
        if offset < self._base:
            raise InternalError(
                f"cannot re-send bytes from offset {offset}: the input is a stream that was"
                " already consumed past it"
            )
        while not self._eof and self._base + len(self._buf) < offset + n:
            data = self._f.read(max(n, 64 * KiB))
            if not data:
                self._eof = True
            else:
                self._buf += data
        start = offset - self._base
        return bytes(self._buf[start : start + n])

    def ack(self, offset: int) -> None:
        if offset > self._base:
            del self._buf[: offset - self._base]
            self._base = offset

    def can_restart(self) -> bool:
        return self._base == 0


def _read_up_to(f: BinaryIO, n: int) -> bytes:
    # A raw file object may return short reads before the end; only b"" means end of file.
    parts: list[bytes] = []
    want = n
    while want > 0:
        data = f.read(want)
        if not data:
            break
        parts.append(data)
        want -= len(data)
    return b"".join(parts)


def open_source(data: UploadData) -> Source:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return BytesSource(data)
    check_body(data)
    if isinstance(data, os.PathLike):
        f = open(data, "rb")  # noqa: SIM115 - the source owns it, and closes it
        # A named pipe, /dev/stdin or a shell's <(command) is a path too, but cannot seek.
        if stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return FileSource(f, owned=True)
        return StreamSource(f, owned=True)
    if not hasattr(data, "read"):
        raise InvalidArgument(
            f"cannot upload a {type(data).__name__}: give bytes, a binary file object or a"
            " pathlib.Path naming a file"
        )
    seekable = False
    with contextlib.suppress(AttributeError, OSError, ValueError):
        seekable = bool(data.seekable())
    return FileSource(data, owned=False) if seekable else StreamSource(data)


class Sink:
    """Where a download goes. What ``write`` gets is valid only during the call (the data
    channel reuses its buffer): a sink that keeps it keeps a copy."""

    def write(self, data: bytes | memoryview) -> None:
        raise NotImplementedError

    def restart(self) -> bool:
        """Discard what was written, if possible, so the download can start over."""
        return False


class BufferSink(Sink):
    def __init__(self) -> None:
        # A list joined once at the end: growing one buffer would copy the blob repeatedly.
        self.parts: list[bytes | memoryview] = []

    def write(self, data: bytes | memoryview) -> None:
        # Read-only views are of a received message, which nobody reuses: kept as they are.
        if isinstance(data, memoryview) and not data.readonly:
            data = bytes(data)
        self.parts.append(data)

    def restart(self) -> bool:
        self.parts.clear()
        return True


class FileSink(Sink):
    """A file object; it can start over only when it is seekable."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._start: int | None = None
        with contextlib.suppress(AttributeError, OSError, ValueError):
            if f.seekable():
                self._start = f.tell()

    def write(self, data: bytes | memoryview) -> None:
        self._f.write(data)

    def restart(self) -> bool:
        if self._start is None:
            return False
        try:
            self._f.seek(self._start)
            self._f.truncate()
        except (OSError, ValueError):
            return False
        return True


def download_into(dest: str | os.PathLike[str] | BinaryIO,
                  download: Callable[[Sink], BlobInfo]) -> BlobInfo:
    """Run ``download`` into ``dest``: a binary file object, or a path. A path is written
    through a temporary file next to it and renamed into place only once ``download`` returns;
    through a symbolic link, the file it points to is replaced. A path that is not a regular
    file (a device, a named pipe, ``/dev/fd/N``) is written into directly."""
    if not isinstance(dest, (str, os.PathLike)):
        return download(FileSink(dest))
    path = Path(dest)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        mode = 0
    # Checked first so the error names the user's path, not our temporary file.
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory", str(path))
    if mode and not stat.S_ISREG(mode):
        # A device, a pipe or a shell's /dev/fd/N: written into, as any program would.
        # Renaming a file over it would replace /dev/null or a reader's pipe with a file.
        with open(path, "wb") as f:
            return download(FileSink(f))
    if path.is_symlink():
        # The file it points to is the one to replace, not the link.
        path = Path(os.path.realpath(path))
    if not path.parent.is_dir():
        raise FileNotFoundError(errno.ENOENT, "no such directory", str(path.parent))
    # The name is cut so the temporary's stays under the usual 255-byte limit.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name[:64]}.", suffix=".part",
                                    dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as f:
            info = download(FileSink(f))
            f.flush()
            os.fsync(f.fileno())
        _copy_mode(path, tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return info


def _copy_mode(dest: Path, tmp: Path) -> None:
    # mkstemp creates 0600 files; keep the mode of the file being replaced, else give the 0644
    # a plain write would usually get, so a download is as readable as any other file.
    try:
        mode = stat.S_IMODE(dest.stat().st_mode)
    except OSError:
        mode = 0o644
    tmp.chmod(mode)
