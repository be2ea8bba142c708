"""Safe archive extraction for the node cache's ``uncompress`` entries (.tar, .tgz, .tar.gz,
.zip, .jar).

A module of its own, imported only when an archive is unpacked: the cache loads in every Python
worker of a Spark job, and tarfile and zipfile would cost each of them time for nothing when
no blob is unpacked.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import re
import stat
import struct
import tarfile
import time
import zipfile
import zlib
from pathlib import Path
from typing import IO, Any

from blobha.cache.archives import ARCHIVE_SUFFIXES
from blobha.core.digest import CHUNK_SIZE
from blobha.core.errors import BlobError, InternalError, InvalidArgument, ResourceExhausted

__all__ = ["MAX_MEMBERS", "MAX_ZIP_DIRECTORY", "unpack"]

#: Members one archive may hold: each costs an inode, and inodes run out before bytes do.
MAX_MEMBERS = 1_000_000
#: Longest symbolic-link target kept (a zip stores it as the member's data).
_MAX_LINK_TARGET = 4096
#: Largest zip central directory read. zipfile reads it whole and makes an object of about
#: 600 bytes of every entry, whatever the count the archive claims, and an entry takes at
#: least 46 bytes: this bounds that memory to under 1 GiB, and still holds a million entries
#: with names of 20 characters.
MAX_ZIP_DIRECTORY = 64 * 1024 * 1024
_EOCD = struct.Struct("<4s4H2LH")  # end of central directory record
_EOCD64_LOCATOR = struct.Struct("<4sLQL")
_EOCD64 = struct.Struct("<4sQ2H2L4Q")

#: Largest tar extension header (a GNU long name or link, or a pax record set) read: tarfile
#: reads each whole into memory, and a few hundred bytes of gzip can claim gigabytes of one.
MAX_TAR_HEADER = 1024 * 1024
#: Extension headers' bytes read over a whole archive (global pax headers pile up).
MAX_TAR_HEADERS = 16 * 1024 * 1024
_TAR_EXTENSIONS = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE,
                   tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE)

_DRIVE = re.compile(r"^[A-Za-z]:")
_TAR_ERRORS: tuple[type[BaseException], ...] = (
    tarfile.TarError,
    zipfile.BadZipFile,
    zlib.error,
    EOFError,
    UnicodeDecodeError,
    NotImplementedError,
    RuntimeError,  # zipfile: encrypted members
    ValueError,  # tarfile: numbers in headers or pax records it cannot read
)


class _HeaderTooLarge(Exception):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(size, limit)
        self.size = size
        self.limit = limit


class _BoundedTarInfo(tarfile.TarInfo):
    """A member header whose extension headers are sized before tarfile reads them whole."""

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type == tarfile.GNUTYPE_SPARSE:
            # Its map runs on in 512-byte blocks that tarfile gathers without a bound.
            raise _HeaderTooLarge(-1, 0)
        if self.type in _TAR_EXTENSIONS:
            if self.size > MAX_TAR_HEADER:
                raise _HeaderTooLarge(self.size, MAX_TAR_HEADER)
            seen = getattr(tarfile_, "_blobha_header_bytes", 0) + self.size
            if seen > MAX_TAR_HEADERS:
                raise _HeaderTooLarge(seen, MAX_TAR_HEADERS)
            tarfile_._blobha_header_bytes = seen  # type: ignore[attr-defined]
        member: tarfile.TarInfo = super()._proc_member(tarfile_)  # type: ignore[misc]
        return member

    # The GNU sparse formats told by pax records: tarfile reads their maps, from the records
    # or from the member's data, without a bound. Nothing here unpacks sparse files.
    def _proc_gnusparse_00(self, *args: object) -> None:
        raise _HeaderTooLarge(-1, 0)

    def _proc_gnusparse_01(self, *args: object) -> None:
        raise _HeaderTooLarge(-1, 0)

    def _proc_gnusparse_10(self, *args: object) -> None:
        raise _HeaderTooLarge(-1, 0)


def _open_tar(path: Path) -> tarfile.TarFile:
    return tarfile.open(path, "r:*", tarinfo=_BoundedTarInfo)


def _is_tar(path: Path) -> bool:
    # tarfile.is_tarfile reads the first member with the unbounded header reader.
    try:
        with _open_tar(path):
            return True
    except tarfile.TarError:
        return False


def _archive_kind(key: str, path: Path) -> str:
    """``"tar"`` or ``"zip"``: by the key's extension, else by content."""
    lower = key.lower()
    for suffix, kind in ARCHIVE_SUFFIXES.items():
        if lower.endswith(suffix):
            ok = zipfile.is_zipfile(path) if kind == "zip" else _is_tar(path)
            if not ok:
                raise InvalidArgument(
                    f"cannot unpack {key!r}: its name ends in {suffix} but its content is not a"
                    f" {kind} archive; fetch it without uncompress"
                )
            return kind
    if zipfile.is_zipfile(path):
        return "zip"
    if _is_tar(path):
        return "tar"
    raise InvalidArgument(
        f"cannot unpack {key!r}: it is neither a tar (.tar, .tgz, .tar.gz) nor a zip (.zip,"
        " .jar) archive; fetch it without uncompress"
    )


class _Extractor:
    """Writes archive members under ``root`` and nowhere else.

    Refused, failing the whole archive: absolute names, ``..`` components, hard links to
    anything but an earlier regular member, symbolic links that are absolute or resolve
    outside the tree, and devices, FIFOs and other special files. Links are created last,
    once every file and directory exists, and no member is ever written through a link, so a
    link in the archive cannot redirect a later write.
    """

    def __init__(self, root: Path, what: str, max_bytes: int | None = None,
                 max_members: int = MAX_MEMBERS) -> None:
        self.root = root
        self.what = what
        self.size = 0
        self.max_bytes = max_bytes
        self.max_members = max_members
        self.members = 0
        #: The member being written, for errors the file system raises.
        self.current = ""
        self._links: list[tuple[str, str]] = []
        self._real_root = os.path.realpath(root)

    def member(self, raw: str) -> str:
        """Count a member (an archive with millions is refused before it takes every inode)
        and return its normalised name."""
        self.members += 1
        self.current = raw
        if self.members > self.max_members:
            raise self.too_many()
        return self.name(raw)

    def too_many(self) -> InvalidArgument:
        return InvalidArgument(
            f"refusing to unpack {self.what!r}: it has more than {self.max_members:,} members;"
            " nothing was unpacked"
        )

    def _grow(self, n: int) -> None:
        self.size += n
        if self.max_bytes is not None and self.size > self.max_bytes:
            # An archive that expands past the room there is (a zip or tar bomb, or a disk
            # nearly full) is refused while unpacking, before it fills the disk.
            raise ResourceExhausted(
                f"refusing to unpack {self.what!r}: it expands to more than the"
                f" {self.max_bytes:,} bytes the cache's disk has room for; nothing was"
                " unpacked (free space there, or fetch it without uncompress)"
            )

    def refuse(self, name: str, why: str) -> InvalidArgument:
        return InvalidArgument(
            f"refusing to unpack {self.what!r}: member {name!r} {why}; nothing was unpacked"
        )

    def name(self, raw: str) -> str:
        """The member's path relative to the root, normalised; '' for the root itself."""
        if "\x00" in raw:
            raise self.refuse(raw, "has a NUL byte in its name")
        text = raw.replace("\\", "/")
        if text.startswith("/") or _DRIVE.match(text):
            raise self.refuse(raw, "has an absolute path")
        parts = [p for p in text.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise self.refuse(raw, "has a '..' component")
        return "/".join(parts)

    def _parents(self, rel: str) -> None:
        # Create the directories above ``rel``; each must be a real directory (lstat), so a
        # write can never pass through a link.
        path = self.root
        for part in rel.split("/")[:-1]:
            path = path / part
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                os.mkdir(path, 0o755)
                continue
            if not stat.S_ISDIR(st.st_mode):
                raise self.refuse(rel, "lies inside a member that is not a directory")

    def _clear(self, path: Path, rel: str, *, links: bool = False) -> None:
        # A later member of the same name replaces an earlier one, as tar does.
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISREG(st.st_mode) or (links and stat.S_ISLNK(st.st_mode)):
            os.unlink(path)
            return
        raise self.refuse(rel, "clashes with an earlier member of another type")

    def directory(self, rel: str) -> None:
        if not rel:
            return
        self._parents(rel)
        path = self.root / rel
        try:
            os.mkdir(path, 0o755)
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                raise self.refuse(rel, "clashes with an earlier member of another type") from None

    def file(self, rel: str, src: IO[bytes], mode: int, mtime: float) -> None:
        if not rel:
            raise self.refuse(rel, "is a file without a name")
        self._parents(rel)
        path = self.root / rel
        self._clear(path, rel)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags, 0o600)
        with os.fdopen(fd, "wb") as out:
            while chunk := src.read(CHUNK_SIZE):
                self._grow(len(chunk))
                out.write(chunk)
            out.flush()
            # Installed by one rename later; the data must be on disk before the name is.
            os.fsync(fd)
            # Read-only: the tree is shared by every job on the node.
            os.fchmod(fd, 0o555 if mode & 0o111 else 0o444)
            with contextlib.suppress(OSError, OverflowError, ValueError):
                os.utime(fd, (mtime, mtime))

    def hardlink(self, rel: str, target: str) -> None:
        if not rel:
            raise self.refuse(rel, "is a link without a name")
        try:
            source = self.name(target)
        except InvalidArgument:
            raise self.refuse(rel, f"is a hard link to {target!r}, outside the archive") from None
        try:
            st = os.lstat(self.root / source) if source else None
        except OSError:
            st = None
        if st is None or not stat.S_ISREG(st.st_mode):
            raise self.refuse(rel, f"is a hard link to {target!r}, which is not an earlier file")
        self._parents(rel)
        path = self.root / rel
        self._clear(path, rel)
        os.link(self.root / source, path, follow_symlinks=False)

    def symlink(self, rel: str, target: str) -> None:
        if not rel:
            raise self.refuse(rel, "is a link without a name")
        text = target.replace("\\", "/")
        if not target or "\x00" in target:
            raise self.refuse(rel, "is a symbolic link without a valid target")
        if text.startswith("/") or _DRIVE.match(text):
            raise self.refuse(rel, f"is a symbolic link to the absolute path {target!r}")
        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(rel), text))
        if resolved == ".." or resolved.startswith("../"):
            raise self.refuse(rel, f"is a symbolic link to {target!r}, outside the archive")
        self._links.append((rel, target))

    def finish(self) -> None:
        for rel, target in self._links:
            self._parents(rel)
            path = self.root / rel
            self._clear(path, rel, links=True)
            os.symlink(target, path)
        # The lexical check above cannot see through chains (``d/l -> ..`` then
        # ``e -> d/l/..``); the real file system can.
        for rel, target in self._links:
            real = os.path.realpath(self.root / rel)
            if real != self._real_root and not real.startswith(self._real_root + os.sep):
                raise self.refuse(rel, f"is a symbolic link to {target!r}, outside the archive")


def _unpack_tar(archive: Path, ex: _Extractor) -> None:
    with _open_tar(archive) as tf:
        while (member := tf.next()) is not None:
            # tarfile keeps every member read (about 450 bytes each): forgotten here, an archive
            # of a million members costs no more memory than one of ten.
            tf.members.clear()  # type: ignore[attr-defined]
            rel = ex.member(member.name)
            if member.isdir():
                ex.directory(rel)
            elif member.isreg():
                src = tf.extractfile(member)
                if src is None:  # pragma: no cover - isreg() members always have data
                    raise ex.refuse(member.name, "has no data")
                with src:
                    ex.file(rel, src, member.mode, member.mtime)
            elif member.issym():
                ex.symlink(rel, member.linkname)
            elif member.islnk():
                ex.hardlink(rel, member.linkname)
            else:
                kind = "a FIFO" if member.isfifo() else "a device" if member.isdev() else None
                raise ex.refuse(
                    member.name,
                    f"is {kind or 'a special file'} (only files, directories and links are kept)",
                )


#: zipfile's own finder of the end record (private, but what ZipFile will read).
_find_end_record: Any = getattr(zipfile, "_EndRecData", None)


def _zip_directory(archive: Path) -> tuple[int, int] | None:
    """(entries, bytes) of the zip's central directory, from the very end record zipfile will
    use (its own finder, so the two cannot disagree); None when there is none (zipfile then
    says what is wrong)."""
    with open(archive, "rb") as f:
        if _find_end_record is not None:
            endrec = _find_end_record(f)
            if endrec is None:
                return None
            # _ECD_ENTRIES_TOTAL and _ECD_SIZE of zipfile's list
            return int(endrec[4]), int(endrec[5])
        return _zip_directory_of(f)


def _zip_directory_of(f: IO[bytes]) -> tuple[int, int] | None:
    """The same as zipfile finds it (an interpreter without its finder): a record that ends
    the file with no comment first, else the last signature within a comment's reach."""
    end = f.seek(0, os.SEEK_END)
    start = max(0, end - _EOCD.size - 0xFFFF)  # the record ends with a comment of < 64 KiB
    f.seek(start)
    tail = f.read(end - start)
    at = len(tail) - _EOCD.size
    if not (at >= 0 and tail[at:at + 4] == b"PK\x05\x06" and tail[-2:] == b"\0\0"):
        at = tail.rfind(b"PK\x05\x06")
    if at < 0 or at + _EOCD.size > len(tail):
        return None
    _, _, _, _, entries, size, _, _ = _EOCD.unpack_from(tail, at)
    if entries != 0xFFFF and size != 0xFFFFFFFF:
        return entries, size
    # Zip64: the locator just before the record points at the 64-bit record.
    if at < _EOCD64_LOCATOR.size:
        return None
    sig, _, offset, _ = _EOCD64_LOCATOR.unpack_from(tail, at - _EOCD64_LOCATOR.size)
    if sig != b"PK\x06\x07" or offset + _EOCD64.size > end:
        return None
    f.seek(offset)
    record = f.read(_EOCD64.size)
    if len(record) < _EOCD64.size or record[:4] != b"PK\x06\x06":
        return None
    fields = _EOCD64.unpack(record)
    return fields[7], fields[8]


def _unpack_zip(archive: Path, ex: _Extractor) -> None:
    # zipfile reads the whole central directory into memory on opening: its size is checked
    # first, so a directory of millions of entries cannot exhaust an executor's memory.
    directory = _zip_directory(archive)
    if directory is not None:
        entries, size = directory
        if entries > ex.max_members:
            raise ex.too_many()
        if size > MAX_ZIP_DIRECTORY:
            raise InvalidArgument(
                f"refusing to unpack {ex.what!r}: its central directory takes {size:,} bytes,"
                f" more than the {MAX_ZIP_DIRECTORY:,} read; nothing was unpacked"
            )
    with zipfile.ZipFile(archive) as zf:
        if len(zf.infolist()) > ex.max_members:
            raise ex.too_many()  # before anything is written
        for info in zf.infolist():
            mode = info.external_attr >> 16
            kind = stat.S_IFMT(mode)
            rel = ex.member(info.filename)
            if info.is_dir() or kind == stat.S_IFDIR:
                ex.directory(rel)
            elif kind == stat.S_IFLNK:
                if info.file_size > _MAX_LINK_TARGET:
                    # Checked before reading: the "target" would be read whole into memory.
                    raise ex.refuse(info.filename, f"is a symbolic link with a target of"
                                    f" {info.file_size:,} bytes")
                ex.symlink(rel, zf.read(info).decode("utf-8"))
            elif kind in (0, stat.S_IFREG):
                mtime = time.mktime((*info.date_time, 0, 0, -1))
                with zf.open(info) as src:
                    ex.file(rel, src, mode, mtime)
            else:
                raise ex.refuse(
                    info.filename, "is a special file (only files, directories and links)"
                )


def unpack(archive: Path, key: str, dest: Path, max_bytes: int | None = None,
           max_members: int = MAX_MEMBERS) -> int:
    """Unpack ``archive`` into the existing empty directory ``dest``; the bytes written. At
    most ``max_bytes`` (None: no limit) in at most ``max_members`` members. Every failure is
    a :class:`BlobError` naming the key (the caller removes ``dest``)."""
    ex = _Extractor(dest, key, max_bytes, max_members)
    kind = "tar"
    try:
        kind = _archive_kind(key, archive)
        if kind == "zip":
            _unpack_zip(archive, ex)
        else:
            _unpack_tar(archive, ex)
        ex.finish()
    except BlobError:
        raise
    except _HeaderTooLarge as exc:
        if exc.size < 0:
            raise InvalidArgument(
                f"refusing to unpack {key!r}: it has a GNU sparse member, which is not"
                " unpacked; nothing was unpacked (make the archive without --sparse, or fetch"
                " it without uncompress)") from None
        raise InvalidArgument(
            f"refusing to unpack {key!r}: it has tar extension headers (long names or pax"
            f" records) of {exc.size:,} bytes, more than the {exc.limit:,} read; nothing was"
            " unpacked (fetch it without uncompress)") from None
    except _TAR_ERRORS as exc:
        raise InvalidArgument(f"cannot unpack {key!r}: broken {kind} archive ({exc})") from None
    except OSError as exc:
        raise _unpack_error(key, ex.current, exc) from None
    return ex.size


def _unpack_error(key: str, member: str, exc: OSError) -> BlobError:
    """What the file system refused, said of the key and the member, not of scratch paths."""
    where = f"cannot unpack {key!r} at member {member!r}"
    if exc.errno == errno.ENAMETOOLONG:
        return InvalidArgument(f"{where}: its name is too long for this file system; nothing was"
                               " unpacked (fetch it without uncompress)")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ResourceExhausted(f"{where}: the cache's disk is full ({exc.strerror}); nothing"
                                 " was unpacked")
    return InternalError(f"{where}: {exc.strerror or exc}; nothing was unpacked")
