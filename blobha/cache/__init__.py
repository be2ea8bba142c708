"""The node-local blob cache: every blob downloaded once per node and shared by its processes.

Storm calls this the localizer and Flink the ``BlobCache``. :class:`BlobCache` keeps the current
version of each requested key under one directory that any number of processes (and threads)
on the node share. Everything it knows lives in that directory, so a process that starts later,
or a restarted one, sees the same cache:

``blobs/<key dir>/key``
    the key itself (its directory name is :func:`~blobha.core.keys.key_dirname`, maybe a hash)
``blobs/<key dir>/v<N>/``
    version N, installed by one atomic rename of a complete directory: ``meta.json`` (size,
    digest...), ``file/<name>`` (the blob, read-only), ``used`` (its mtime is the last use),
    ``staged`` (set by the first cleanup pass that found it unreferenced), ``verified`` (the
    node checked the file's digest: which file, in which boot) and ``unpacked/`` once someone
    asked for the archive's contents
``blobs/<key dir>/checks/<user>``
    the cluster's last answer to that user about the key (its current version, and so the
    right to read it) and when it came: reused by every process for the update interval
``blobs/<key dir>/asking/<user>``
    ``flock`` held while a process asks the cluster about the key for that user: processes
    that find the user's record aged at the same moment ask once for the node, not once each
``blobs/<key dir>/refs/``
    one file per reference: who holds it (an owner such as a Spark application id, or a
    :class:`BlobCache` instance) from which process (boot id, pid and start time, so the
    references of dead processes are recognised as stale) and for which version
``blobs/<key dir>/deleted``
    the cluster said the key no longer exists: evicted first
``locks/<key dir>.lock``
    ``flock`` per key: one download per node, and no eviction while a process takes a reference
``tmp/<instance>/``
    each instance's scratch space (downloads, extractions, atomic writes); removed at start
    when its process is dead, so a crash never leaves a half file in view
``stats.json``
    download, hit and eviction counters shared by every process
``cleanup.lock``
    ``flock`` held by the process making a cleanup pass; its mtime is when the node's last
    pass began, so a process that starts within the cleanup interval does not make another

Example::

    from blobha.cache import BlobCache

    with BlobCache("/var/cache/blobha", "m1:6627,m2:6627", user="alice") as cache:
        model = cache.get("model.bin", owner="app-42")          # a file
        libs = cache.get("libs.tgz", uncompress=True, owner="app-42")  # a directory
        print(model.path, model.version, libs.path)
        ...
        cache.release("app-42")  # the job ended; its blobs may now be evicted
"""

from __future__ import annotations

# ARCHIVE_SUFFIXES and UNPACK_MARGIN_BYTES: importable from here as before (not in __all__).
from blobha.cache.archives import ARCHIVE_SUFFIXES as ARCHIVE_SUFFIXES
from blobha.cache.blobcache import DEFAULT_CLEANUP_INTERVAL_SECS, BlobCache, default_cache_dir
from blobha.cache.install import UNPACK_MARGIN_BYTES as UNPACK_MARGIN_BYTES
from blobha.cache.stats import CacheStats, CleanupReport
from blobha.cache.values import CachedBlob, CacheEntry

__all__ = [
    "DEFAULT_CLEANUP_INTERVAL_SECS",
    "BlobCache",
    "CacheEntry",
    "CacheStats",
    "CachedBlob",
    "CleanupReport",
    "default_cache_dir",
]
