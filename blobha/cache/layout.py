"""The cache directory's layout: paths, atomic writes, key locks and installed versions on disk."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

from blobha.cache.archives import ARCHIVE_SUFFIXES
from blobha.core.errors import InvalidArgument
from blobha.core.keys import key_dirname
from blobha.core.locks import lock_file

__all__ = [
    "Held",
    "KeyScan",
    "Layout",
    "Version",
    "file_name",
    "fsync_dir",
    "random_hex",
    "rmtree",
    "touch",
    "unlink",
]

#: What ``LAYOUT`` holds: the format of everything under the cache directory.
LAYOUT = "blobha-cache 1"
_VERSION_DIR = re.compile(r"v([1-9][0-9]{0,18})")
# Longest file name we give a blob; most file systems cap a name at 255 bytes.
_MAX_NAME_BYTES = 200


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def _keep_private(root: Path) -> None:
    """No other OS account may enter the cache: the blobs in it are whatever their users may
    read, and its ``meta.json`` files hold the keys peers' grants verify under. A group may
    (0750), for accounts that share a cache on purpose; others lose access here when this
    account owns the root (a root an earlier release made 0755).

    A root another account owns is refused, as ssh refuses a ``~/.ssh`` it does not own:
    whoever made it (in a shared path such as /tmp, before us) could read and change all
    that is cached there. root may own it (an administrator's shared cache), as long as it
    does not let every account change it."""
    st = os.stat(root)
    me = os.geteuid()
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid not in (me, 0):
        raise InvalidArgument(
            f"the cache directory {root} belongs to another account ({_account(st.st_uid)}),"
            " which can read and change whatever is cached there; use a directory of your own"
            " (--cache-dir, BLOBHA_CACHE_DIR or spark.blobha.cache.dir: a new path, which the"
            " cache makes), or have that one removed")
    if st.st_uid != me and mode & 0o002:
        raise InvalidArgument(
            f"the cache directory {root} can be changed by every account (mode {mode:04o});"
            f" have its owner run 'chmod o-rwx {root}', or use a directory of your own")
    if mode & 0o007 and st.st_uid == me:
        os.chmod(root, mode & ~0o007)


def _account(uid: int) -> str:
    import pwd

    try:
        return f"{pwd.getpwuid(uid).pw_name!r}, uid {uid}"
    except KeyError:
        return f"uid {uid}"


# Every Python worker of a Spark job opens the cache, so what a cache hit runs keeps to light
# modules: no secrets (hashlib, hmac, random), tempfile or shutil (bz2, lzma).


def random_hex(nbytes: int) -> str:
    """Random hex for a unique name (what secrets.token_hex gives)."""
    return os.urandom(nbytes).hex()


def rmtree(path: Path) -> None:
    """Remove a tree, read-only directories (unpacked archives) included."""
    try:
        os.rmdir(path)  # the usual case: an instance's scratch space, empty
        return
    except FileNotFoundError:
        return
    except OSError:
        pass
    import shutil

    for sub, _dirs, _files in os.walk(path):
        with contextlib.suppress(OSError):
            os.chmod(sub, 0o755)
    shutil.rmtree(path, ignore_errors=True)


def fsync_dir(path: Path) -> None:
    # A rename is durable only once its directory is; without this a power cut could undo an
    # install whose data is already on disk (harmless: the blob is fetched again).
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def touch(path: Path, when: float) -> None:
    try:
        os.utime(path, (when, when))
    except FileNotFoundError:
        path.touch()
        os.utime(path, (when, when))


def unlink(path: Path) -> bool:
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def _new_file(folder: Path, prefix: str) -> tuple[int, Path]:
    """A file made for us alone in ``folder``, open for writing: tempfile.mkstemp's exclusive
    creation (mode 0600)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        path = folder / f"{prefix}{random_hex(6)}"
        try:
            return os.open(path, flags, 0o600), path
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no unused file name", str(folder))


def _tree_size(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, name))
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
    return total


def file_name(key: str) -> str:
    """The name the blob file gets: the key itself (so ``libs.zip`` stays a ``.zip`` for
    tools that look at the name), or a hash keeping the extension when the key is too long."""
    if len(key.encode("utf-8")) <= _MAX_NAME_BYTES:
        return key
    suffix = next((s for s in ARCHIVE_SUFFIXES if key.lower().endswith(s)), "")
    if not suffix:
        ext = os.path.splitext(key)[1]
        suffix = ext if 1 < len(ext) <= 16 and ext.isascii() else ""
    return key_dirname(key) + suffix


class Held:
    """A held key lock; ``remove()`` deletes the lock file before it is released."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.remove_file = False

    def remove(self) -> None:
        self.remove_file = True


# --------------------------------------------------------------------------------------------
# Installed versions, as read from disk
# --------------------------------------------------------------------------------------------


class Version:
    """One installed version as read from disk."""

    __slots__ = ("created_at", "digest", "dir", "key", "last_used", "name", "size", "staged",
                 "unpacked_size", "version")

    def __init__(self, key: str, version: int, dir: Path, size: int, digest: str,
                 created_at: float, name: str, last_used: float, staged: float | None,
                 unpacked_size: int | None) -> None:
        self.key = key
        self.version = version
        self.dir = dir
        self.size = size
        self.digest = digest
        self.created_at = created_at
        self.name = name
        self.last_used = last_used
        self.staged = staged
        self.unpacked_size = unpacked_size  # None: not unpacked

    @property
    def file(self) -> Path:
        return self.dir / "file" / self.name

    @property
    def order(self) -> tuple[float, int]:
        # A key deleted and created again starts over at version 1; its creation time tells the
        # newer incarnation apart.
        return (self.created_at, self.version)

    @property
    def disk_bytes(self) -> int:
        return self.size + (self.unpacked_size or 0)


class KeyScan:
    """A key's directory as read from disk: its versions, damaged entries, deleted marker."""

    __slots__ = ("deleted", "junk", "kd", "key", "versions")

    def __init__(self, key: str, kd: str, deleted: bool = False) -> None:
        self.key = key
        self.kd = kd
        self.versions: dict[int, Version] = {}
        self.junk: list[Path] = []
        self.deleted = deleted

    def current(self) -> Version | None:
        return max(self.versions.values(), key=lambda v: v.order, default=None)


# --------------------------------------------------------------------------------------------
# The directory
# --------------------------------------------------------------------------------------------


class Layout:
    """The cache directory as one instance uses it: ``blobs/``, ``locks/`` and its own scratch
    space ``tmp/<instance>/`` (see the :mod:`blobha.cache` docstring for the whole layout)."""

    def __init__(self, root: Path, instance: str) -> None:
        self.root = root
        self.blobs = root / "blobs"
        self.locks = root / "locks"
        self.tmp_root = root / "tmp"
        self.tmp = self.tmp_root / instance
        self._lock = threading.Lock()
        self._key_locks: dict[str, threading.Lock] = {}

    def open(self) -> None:
        """Check (or write) the format marker and make the top directories."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        _keep_private(self.root)
        layout = self.root / "LAYOUT"
        try:
            found = layout.read_text().strip()
        except FileNotFoundError:
            found = ""
            # The marker is written first, so a process starting at the same moment sees it;
            # a directory holding anything else is not ours to fill (a mistyped --cache-dir).
            others = [n for n in os.listdir(self.root) if not n.startswith(".LAYOUT.")]
            if others and "LAYOUT" not in others:
                raise InvalidArgument(
                    f"{self.root} is not empty and is not a blobha cache (no LAYOUT file);"
                    " give a new or empty directory"
                ) from None
            tmp = self.root / f".LAYOUT.{os.getpid()}.{random_hex(4)}"
            tmp.write_text(LAYOUT + "\n")
            os.replace(tmp, layout)
        if found and found != LAYOUT:
            raise InvalidArgument(
                f"{self.root} holds a cache of another format ({found!r}, expected"
                f" {LAYOUT!r}); use another --cache-dir or empty it"
            )
        for sub in (self.blobs, self.locks, self.tmp_root):
            sub.mkdir(exist_ok=True)

    def scratch(self) -> Path:
        # Recreated if someone emptied tmp/ under us: every atomic step needs it.
        self.tmp.mkdir(mode=0o700, exist_ok=True)
        return self.tmp

    def write_atomic(self, path: Path, data: bytes) -> None:
        # Written in our scratch directory, which a crash leaves to the sweeper.
        fd, tmp = _new_file(self.scratch(), "w-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            unlink(tmp)
            raise

    def discard(self, path: Path) -> None:
        """Take a directory out of view at once (one rename), then delete it."""
        trash = self.scratch() / f"trash-{random_hex(6)}"
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return
        rmtree(trash)

    # -- keys ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def key_lock(self, kd: str, blocking: bool = True) -> Iterator[Held | None]:
        """The key's lock for this thread and process: a thread lock (threads of one process
        would otherwise each open the file) and then the ``flock`` other processes see.
        Yields None when not blocking and busy."""
        with self._lock:
            thread_lock = self._key_locks.setdefault(kd, threading.Lock())
        if not thread_lock.acquire(blocking):
            yield None
            return
        try:
            path = self.locks / f"{kd}.lock"
            fd = lock_file(path, blocking)
            if fd is None:
                yield None
                return
            held = Held(path)
            try:
                yield held
            finally:
                if held.remove_file:
                    unlink(path)
                os.close(fd)
        finally:
            thread_lock.release()

    def ensure_key_dir(self, key: str, kd: str) -> None:
        kdir = self.blobs / kd
        (kdir / "refs").mkdir(parents=True, exist_ok=True)
        if not (kdir / "key").exists():
            self.write_atomic(kdir / "key", key.encode("utf-8"))

    def remove_key_dir(self, kd: str, held: Held) -> None:
        """Remove a key's directory and lock file (its lock held, nothing left in it)."""
        self.discard(self.blobs / kd)
        held.remove()

    def key_dirs(self) -> list[str]:
        try:
            return sorted(os.listdir(self.blobs))
        except FileNotFoundError:
            return []

    def read_version(self, key: str, vdir: Path, number: int) -> Version | None:
        try:
            meta = json.loads((vdir / "meta.json").read_bytes())
            version = Version(
                key=key,
                version=int(meta["version"]),
                dir=vdir,
                size=int(meta["size"]),
                digest=str(meta["digest"]),
                # Absent from a record of an older release: 0, older than any incarnation,
                # and never a read minimum.
                created_at=float(meta.get("created_at") or 0.0),
                name=str(meta["name"]),
                last_used=float(meta["installed_at"]),
                staged=None,
                unpacked_size=None,
            )
        except (OSError, ValueError, TypeError, KeyError):
            return None
        if version.version != number or "/" in version.name or version.name in ("", ".", ".."):
            return None
        with contextlib.suppress(OSError):
            version.last_used = os.stat(vdir / "used").st_mtime
        with contextlib.suppress(OSError, ValueError):
            version.staged = float((vdir / "staged").read_text())
        if (vdir / "unpacked").is_dir():
            try:
                version.unpacked_size = int((vdir / "unpacked.size").read_text())
            except (OSError, ValueError):
                version.unpacked_size = _tree_size(vdir / "unpacked")
        return version

    def scan_key(self, kd: str, key: str | None = None) -> KeyScan:
        kdir = self.blobs / kd
        if key is None:
            try:
                key = (kdir / "key").read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                key = ""
        scan = KeyScan(key, kd, deleted=(kdir / "deleted").exists())
        try:
            names = os.listdir(kdir)
        except OSError:
            return scan
        for name in names:
            m = _VERSION_DIR.fullmatch(name)
            if m is None:
                continue
            version = self.read_version(key, kdir / name, int(m.group(1)))
            if version is None:
                scan.junk.append(kdir / name)
            else:
                scan.versions[version.version] = version
        return scan

    def scan_all(self) -> list[KeyScan]:
        scans = [self.scan_key(kd) for kd in self.key_dirs()]
        return [s for s in scans if s.key]
