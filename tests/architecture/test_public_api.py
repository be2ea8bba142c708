"""The surface users build on, pinned: the public names of each entry package, their lazy
loading, and the logger names operators route."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PUBLIC = {
    "blobha": {
        "AccessControl", "BlobCache", "BlobError", "ChecksumMismatch", "Client", "Credentials",
        "DeadlineExceeded", "InternalError", "InvalidArgument", "KeyAlreadyExists",
        "KeyNotFound", "NotAuthorized", "NotLeader", "ResourceExhausted", "TlsMismatch",
        "Unauthenticated", "Unavailable", "UploadNotFound", "VersionConflict", "__version__",
        "format_acl", "parse_acl",
    },
    "blobha.client": {
        "DEFAULT_CHUNK_SIZE", "DEFAULT_PORT", "BlobInfo", "BlobMeta", "Client", "ClientLimits",
        "ClusterSummary", "JobToken", "MasterSummary", "ReplicationStatus", "Transport",
        "WaitResult",
        "backoff_delay", "default_user", "parse_cluster",
    },
    "blobha.cache": {
        "DEFAULT_CLEANUP_INTERVAL_SECS", "BlobCache", "CacheEntry", "CacheStats", "CachedBlob",
        "CleanupReport", "default_cache_dir",
    },
    "blobha.spark": {
        "CONF_CACHE_DIR", "CONF_CACHE_RETENTION", "CONF_CACHE_SOFT_LIMIT", "CONF_CLIENT_TIMEOUT",
        "CONF_CLUSTER", "CONF_MAP", "CONF_MAX_WAIT", "CONF_MIN_REPLICATION", "CONF_ON_TIMEOUT",
        "CONF_UPDATE_INTERVAL", "CONF_USER", "ENV_CONF", "LOCAL_PROPERTY", "OPTIONS",
        "BlobNotMapped", "BlobSpec", "BlobsNotAccessible", "NotConfigured", "ReplicationReport",
        "ReplicationTimeout", "SparkBlobSettings", "blob_info", "blob_path", "blob_version",
        "build_submit_command", "parse_blob_arg", "parse_blob_map", "prepare", "submit_main",
        "wait_for_replication",
    },
}

#: Loggers operators route by name (the audit log to its own file, say). A module that moves
#: keeps its logger's name.
LOGGERS = {
    "blobha.audit", "blobha.auth", "blobha.bench_spark", "blobha.cache", "blobha.cache.peers",
    "blobha.client",
    "blobha.dataplane",
    "blobha.groupcommit", "blobha.health", "blobha.interceptor", "blobha.leader.election",
    "blobha.master", "blobha.metrics", "blobha.scrub", "blobha.segments", "blobha.service",
    "blobha.spark", "blobha.stallwatch", "blobha.statuspage", "blobha.store",
    "blobha.sync.membership", "blobha.sync.synchronizer", "blobha.tls", "blobha.uploads",
    "blobha.zkauth", "blobha.zkclient",
}


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_public_names(package: str) -> None:
    module = __import__(package, fromlist=["__all__"])
    assert set(module.__all__) == PUBLIC[package]
    for name in module.__all__:
        assert getattr(module, name) is not None, f"{package}.{name}"


def test_the_package_loads_its_public_names_on_first_use() -> None:
    code = ("import sys, blobha; before = 'blobha.client' in sys.modules; blobha.Client; "
            "print(before, 'blobha.client' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd="/")
    assert out.stdout.split() == ["False", "True"]


def _logger_names() -> set[str]:
    names = set()
    for folder in ("blobha", "leader", "sync"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                # logging.getLogger("blobha..."), or a LazyLogger of that name
                # (blobha.core.lazy).
                if (isinstance(node, ast.Call)
                        and (getattr(node.func, "attr", "") == "getLogger"
                             or getattr(node.func, "id", "") == "LazyLogger")
                        and node.args and isinstance(node.args[0], ast.Constant)
                        and str(node.args[0].value).startswith("blobha")):
                    names.add(str(node.args[0].value))
    return names


def test_logger_names_are_unchanged() -> None:
    assert _logger_names() == LOGGERS


def test_no_module_logs_under_its_import_path() -> None:
    # getLogger(__name__) would rename a logger whenever its module moves.
    offenders = [str(p.relative_to(ROOT)) for folder in ("blobha", "leader", "sync")
                 for p in (ROOT / folder).rglob("*.py")
                 if "getLogger(__name__)" in p.read_text()]
    assert not offenders
