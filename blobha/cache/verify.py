"""Verification: digest checks of cached files, and the records that spare other processes one."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path

from blobha.cache.layout import Layout, Version
from blobha.cache.stats import Counters
from blobha.core.lazy import LazyLogger
from blobha.core.locks import boot_id

__all__ = ["Verifier"]

log = LazyLogger("blobha.cache")

# Records are trusted only within the boot that wrote them (see below).
_BOOT_ID = boot_id()

# Verification records: ``v<N>/verified`` says that this node's cache checked the digest of
# ``v<N>/file/<name>`` (a download checked by the client end to end, or a re-verification) and
# which file that was: its device, inode, size, modification and change times, and the boot.
# A later process trusts a record that still matches instead of hashing the whole blob again
# (hundreds of MiB for every new Spark application otherwise), because a file cannot change
# without changing what is recorded: it is read-only, a rewrite or chmod moves its change
# time (which no program can set back), a replacement is another inode. Records are trusted
# only within the boot that wrote them: the first use after the node restarts (when a crash
# may have left damage, or the disk was checked or restored meanwhile) verifies the file again,
# as Flink does on a cache's first use of a file. Change times have a coarse clock, so, as git
# does with its index, a record written in the same clock tick as the file's last change
# proves nothing (a change later in that tick would leave the same time) and is not trusted.
_VERIFIED = "verified"
#: ``v<N>/sha256``: the same record for the file's SHA-256, which a caller pinned (the job's
#: code, pinned by its launcher: xxh3 proves no intent).
_SHA256 = "sha256"


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino, a.st_size, a.st_mtime_ns, a.st_ctime_ns) == (
        b.st_dev, b.st_ino, b.st_size, b.st_mtime_ns, b.st_ctime_ns
    )


def _verification_record(st: os.stat_result, digest: str) -> bytes:
    return json.dumps({
        "boot": _BOOT_ID, "dev": st.st_dev, "ino": st.st_ino, "size": st.st_size,
        "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "digest": digest,
    }).encode()


def _verified_on_node(file: Path, record: Path, digest: str, size: int) -> bool:
    """Whether ``record`` vouches for ``file`` holding ``size`` bytes with ``digest``."""
    if not _BOOT_ID:
        return False  # cannot tell a restart: verify every time
    try:
        with open(record, "rb") as f:
            written = os.fstat(f.fileno()).st_mtime_ns
            data = json.loads(f.read())
        st = os.stat(file)
        return bool(
            data["boot"] == _BOOT_ID
            and data["digest"] == digest
            and (data["dev"], data["ino"], data["size"], data["mtime_ns"], data["ctime_ns"])
            == (st.st_dev, st.st_ino, size, st.st_mtime_ns, st.st_ctime_ns)
            and st.st_size == size
            and written > st.st_ctime_ns
        )
    except (OSError, ValueError, TypeError, KeyError):
        return False


def _hash_file(path: Path) -> tuple[str, int, os.stat_result]:
    """(xxh3-128 digest, size, status when opened) of a file."""
    # Here: a worker start finds its files verified already (xxhash loads with the digests).
    from blobha.core.digest import CHUNK_SIZE, digest_stream

    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        digest, size = digest_stream(f, CHUNK_SIZE)
    return digest, size, st


class Verifier:
    """Which cached files this instance knows to be intact, and the check of the others."""

    def __init__(self, layout: Layout, counters: Counters) -> None:
        self._layout = layout
        self._counters = counters
        self._lock = threading.Lock()
        self._verified: set[tuple[str, int, str]] = set()

    def record(self, file: Path, vdir: Path, digest: str,
               st: os.stat_result | None = None) -> None:
        """Write ``vdir``'s verification record for ``file`` as it was (``st``) or is now."""
        try:
            self._layout.write_atomic(vdir / _VERIFIED,
                                      _verification_record(st or os.stat(file), digest))
        except OSError as exc:  # only costs the next process a hash
            log.debug("cannot record the verification of %s: %s", file, exc)

    def has_sha256(self, file: Path, vdir: Path, size: int, sha256: str) -> bool:
        """Whether ``file`` (of version directory ``vdir``) holds ``size`` bytes whose SHA-256
        is ``sha256``: hashed on the node's first use in a boot, then vouched for by a record
        as the digest check is (see _verified_on_node)."""
        if _verified_on_node(file, vdir / _SHA256, sha256, size):
            return True
        import hashlib  # here: a warm worker start finds the record

        from blobha.core.digest import CHUNK_SIZE

        try:
            with open(file, "rb") as f:
                st = os.fstat(f.fileno())
                h = hashlib.sha256()
                while data := f.read(CHUNK_SIZE):
                    h.update(data)
        except FileNotFoundError:
            return False
        if h.hexdigest() != sha256 or st.st_size != size:
            return False
        with contextlib.suppress(OSError):
            if _same_file(os.stat(file), st):
                self._layout.write_atomic(vdir / _SHA256, _verification_record(st, sha256))
        return True

    def downloaded(self, kd: str, vdir: Path, name: str, version: int, digest: str) -> None:
        """A download the client checked end to end: recorded so the node's other processes
        need not hash it again (see _verified_on_node)."""
        self.record(vdir / "file" / name, vdir, digest)
        with self._lock:
            self._verified.add((kd, version, digest))

    def check(self, key: str, kd: str, version: Version) -> bool:
        """Digest check on the node's first use of a file its cache did not download or
        check since the node started (Flink checks on first use too; see _verified_on_node).
        A corrupt file is removed; False then, so the caller fetches again."""
        marker = (kd, version.version, version.digest)
        with self._lock:
            if marker in self._verified:
                return True
        if _verified_on_node(version.file, version.dir / _VERIFIED, version.digest,
                             version.size):
            with self._lock:
                self._verified.add(marker)
            return True
        # Outside the key lock: hashing a large file must not hold up other processes, and
        # our reference already keeps cleanup away from it.
        self._counters.bump(verifications=1)
        try:
            digest, size, st = _hash_file(version.file)
            identity = (st.st_dev, st.st_ino)
        except FileNotFoundError:
            digest, size, identity, st = "", -1, (0, 0), None
        if st is not None and digest == version.digest and size == version.size:
            # Recorded for the node only if the file is still the one opened before hashing
            # (as that status): a change meanwhile leaves the next process to hash it again.
            with contextlib.suppress(OSError):
                if _same_file(os.stat(version.file), st):
                    self.record(version.file, version.dir, digest, st)
            with self._lock:
                self._verified.add(marker)
            return True
        log.warning(
            "cached %r version %d is corrupt (digest %s over %d bytes, expected %s over %d);"
            " fetching it again",
            key, version.version, digest, size, version.digest, version.size,
        )
        with self._layout.key_lock(kd):
            try:
                st = os.stat(version.file)
                now_identity: tuple[int, int] | None = (st.st_dev, st.st_ino)
            except FileNotFoundError:
                now_identity = None
            # Only the file we hashed: another process may have replaced it meanwhile.
            if version.dir.exists() and now_identity in (identity, None):
                self._layout.discard(version.dir)
                self._counters.bump(corrupt=1)
        return False
