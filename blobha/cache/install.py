"""Installing versions: a download or an unpacked tree, made in scratch space and renamed in."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from blobha.cache.checks import Remote
from blobha.cache.layout import KeyScan, Layout, Version, file_name, fsync_dir, rmtree, touch

if TYPE_CHECKING:
    from blobha.cache.peers import PeerSettings
    from blobha.client import BlobInfo, Client, ProgressCallback

__all__ = ["UNPACK_MARGIN_BYTES", "choose", "download", "unpack_version"]

#: An unpack leaves this much of the cache's disk free (or 5% of it, if that is less): an
#: archive that would expand past it (a zip or tar bomb) is refused while it unpacks, before
#: every other writer on the node runs out of space.
UNPACK_MARGIN_BYTES = 1024**3


def _room_to_unpack(path: Path) -> int:
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    return max(0, free - min(UNPACK_MARGIN_BYTES, st.f_blocks * st.f_frsize // 20))


def choose(scan: KeyScan, meta: Remote) -> Version | None:
    """The installed version to serve for ``meta``, or None to download."""
    current = scan.current()
    if current is None:
        return None
    if current.order > (meta.created_at, meta.version):
        # Another process learnt of a newer version first.
        return current
    exact = scan.versions.get(meta.version)
    if exact is not None and exact.digest == meta.digest:
        return exact
    return None


def download(
    layout: Layout,
    client: Callable[[], Client],
    key: str,
    kd: str,
    meta: Remote,
    now: Callable[[], float],
    progress: ProgressCallback | None = None,
    peers: PeerSettings | None = None,
) -> tuple[Path, str, BlobInfo, int]:
    """With the key's lock held: download ``key``'s current version and install it as
    ``blobs/<kd>/v<N>``; that directory, the blob's file name, what the client fetched and
    how many of its bytes came from other nodes' caches.
    With ``peers`` on, through other nodes' caches and the replicas (blobha.cache.peers),
    else, or when no plan can be had, from one replica at a time."""
    import tempfile  # here: a worker start served from the cache never downloads

    stage = Path(tempfile.mkdtemp(prefix="d-", dir=layout.scratch()))
    try:
        name = file_name(key)
        (stage / "file").mkdir()
        target = stage / "file" / name
        # Version 0 = the current one: a version pruned since get_meta cannot stall us, and an
        # update that landed meanwhile is simply the newer answer.
        fetched = None
        node = None
        if peers is not None and peers.enabled:
            from blobha.cache.peers.node import node as peer_node

            node = peer_node(peers, client())
            if node is not None:
                fetched = node.fetch(client(), key, target, progress)
        served = None
        from_peers = 0
        if fetched is not None:
            info, served, from_peers = fetched
        else:
            info = client().download(key, target, progress=progress)
        target.chmod(0o444)  # shared by every job on the node: nobody may write it
        installed_at = now()
        record: dict[str, object] = {
            "key": key,
            "version": info.version,
            "size": info.size,
            "digest": info.digest,
            "created_at": meta.created_at,
            "installed_at": installed_at,
            "name": name,
        }
        if served is not None:
            # What serving it to peers needs, for the node's later processes that find it
            # here (blobha.cache.peers.node.serve_installed). Not the key grants are checked
            # under: that is per serving address, and a later process gets its own from the
            # masters when it announces the version.
            record["peer"] = {"chunk_size": served.chunk_size}
        with open(stage / "meta.json", "wb") as f:
            f.write(json.dumps(record).encode())
            f.flush()
            os.fsync(f.fileno())
        touch(stage / "used", installed_at)
        stage.chmod(0o755)
        dest = layout.blobs / kd / f"v{info.version}"
        if dest.exists():
            # Another copy of that version number: a key deleted and created again, or a file
            # that failed its check. We hold the key lock; take it out of view first.
            layout.discard(dest)
        os.rename(stage, dest)
        fsync_dir(dest.parent)
        if node is not None:
            node.installed(served, dest / "file" / name, client())
    finally:
        if stage.exists():
            rmtree(stage)
    return dest, name, info, from_peers


def unpack_version(layout: Layout, key: str, kd: str, version: Version) -> Path | None:
    """The tree ``version``'s archive unpacks to, unpacked now if nobody did yet; None if the
    version went meanwhile."""
    target = version.dir / "unpacked"
    if target.is_dir():
        return target
    with layout.key_lock(kd):
        if not version.dir.is_dir():
            return None
        if target.is_dir():
            return target
        # Here, not at the top: most processes never unpack anything (see blobha.cache.unpack).
        import tempfile

        from blobha.cache.unpack import unpack

        stage = Path(tempfile.mkdtemp(prefix="x-", dir=layout.scratch()))
        try:
            size = unpack(version.file, key, stage, max_bytes=_room_to_unpack(stage))
            # Read-only, like its files: the tree is shared by every job on the node, and
            # only the archive's digest is checked on later uses.
            for sub, dirs, _files in os.walk(stage):
                for d in dirs:
                    path = os.path.join(sub, d)
                    if not os.path.islink(path):
                        os.chmod(path, 0o555)
            # Readable by all before it is visible (mkdtemp made it 0700): a crash before
            # the chmod below leaves it usable.
            stage.chmod(0o755)
            os.rename(stage, target)
            # After the rename, which moving a directory needs write permission on it for.
            target.chmod(0o555)
            fsync_dir(version.dir)
        finally:
            if stage.exists():
                rmtree(stage)
        layout.write_atomic(version.dir / "unpacked.size", str(size).encode())
    return target
