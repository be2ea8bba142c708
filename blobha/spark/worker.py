"""``blobha-python``: the executor-side hook Spark runs instead of the Python interpreter
(``spark.pyspark.python``), before each Python worker (or the worker daemon) starts.

It lays the job's code out in the executor's working directory, from the node-local cache,
the way Spark would have: every ``--files`` and ``--py-files`` entry and every unpacked
``--archives`` alias appears there under its name (a symbolic link into the cache, which keeps
one verified copy and one read-only unpacked tree per node), which is also where
``SparkFiles.get`` looks in a Python worker on an executor (its root directory is ``.``);
``--py-files`` go first on ``PYTHONPATH``. Then it ``exec``\\ s the interpreter the job asked
for (``$BLOBHA_PYSPARK_PYTHON``, relative to the working directory for ``./env/bin/python``,
else this one): the worker keeps this process's id, and with it the cache references taken
here, for as long as it runs.

Nothing is linked before every blob checks out against the code map's pins: the version the
launcher stored, and the SHA-256 of the launcher's own file (hashed once per node, see
:meth:`BlobCache.has_sha256`). Another version, or other bytes, stop the worker with one line.

Every Python worker start pays for its imports: it loads the cache, and the client (grpc) only
when something must be downloaded.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING

from blobha.core.errors import BlobError, ChecksumMismatch, VersionConflict
from blobha.spark import executor
from blobha.spark.codemap import KIND_ARCHIVE, KIND_PYFILE, CodeSpec
from blobha.spark.conf import ENV_CONF, ENV_PYTHON
from blobha.spark.settings import SparkBlobSettings

if TYPE_CHECKING:
    from blobha.cache import BlobCache

__all__ = ["lay_out", "main", "pinned_path", "real_python"]


def real_python(env: MutableMapping[str, str]) -> str:
    """The interpreter the job asked for, else the one running this hook."""
    chosen = env.get(ENV_PYTHON, "").strip()
    if not chosen:
        return sys.executable
    if "/" in chosen:
        return chosen  # ./env/bin/python: relative to the working directory, as Spark runs it
    import shutil  # only for a bare name: a module most worker starts need not load

    return shutil.which(chosen, path=env.get("PATH", os.defpath)) or chosen


def _link(target: str, link: Path) -> None:
    try:
        if os.readlink(link) == target:
            return  # another worker of this executor laid it out already
    except FileNotFoundError:
        pass
    # A new link beside, renamed over the old one: a worker starting meanwhile sees either.
    tmp = link.with_name(f".{link.name}.blobha-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    os.replace(tmp, link)


def lay_out(env: MutableMapping[str, str], cwd: Path) -> None:
    """Link the job's code into ``cwd`` and put the py-files on ``PYTHONPATH`` in ``env``."""
    text = env.get(ENV_CONF)
    if not text:
        return
    settings = SparkBlobSettings.from_json(text)
    if not settings.code:
        return
    cache = executor.open_cache(settings)
    owner = executor.application_id(settings)
    paths: list[str] = []
    try:
        # One write of the node's counters for the few gets below: this process ends here.
        with cache.batched_counters():
            # Every blob checked before anything is linked: a job runs all its code or none.
            targets = [(spec, pinned_path(cache, settings, spec, owner))
                       for spec in settings.code]
        for spec, target in targets:
            link = cwd / spec.name
            _link(str(target), link)
            if spec.kind == KIND_PYFILE:
                entry = str(cwd) if spec.name.endswith(".py") else str(link)
                if entry not in paths:
                    paths.append(entry)
    finally:
        # The application's references stay: they name this process, whose id the worker
        # exec'd next keeps. Closing removes this instance's scratch space, which every cache
        # opened on the node would otherwise find (and check) until the worker ends, and the
        # client, if a download made one.
        cache.close()
    if paths:
        old = env.get("PYTHONPATH", "")
        env["PYTHONPATH"] = os.pathsep.join([*paths, *([old] if old else [])])


def pinned_path(cache: BlobCache, settings: SparkBlobSettings, spec: CodeSpec,
                owner: str) -> Path:
    """The node's copy of ``spec``'s blob (its unpacked tree for an archive), only if it is
    the version pinned and its bytes have the SHA-256 pinned; else ``VersionConflict`` or
    ``ChecksumMismatch`` saying what to do."""
    executor.require_seen(cache, settings, spec.key)
    blob = cache.get(spec.key, owner=owner)
    if blob.version != spec.version:
        raise VersionConflict(
            f"code blob {spec.key!r} ({spec.name}) is at version {blob.version} here, but the"
            f" job was launched with version {spec.version}: it changed since the launch;"
            " nothing was run, launch the job again")
    if not cache.has_sha256(blob, spec.sha256):
        raise ChecksumMismatch(
            f"code blob {spec.key!r} ({spec.name}) version {blob.version} is not the file the"
            f" job was launched with (its SHA-256 differs from the pinned {spec.sha256[:16]}...);"
            " nothing was run: check who may write the key, then launch the job again")
    if spec.kind != KIND_ARCHIVE:
        return blob.path
    tree = cache.get(spec.key, uncompress=True, owner=owner)
    # The tree of the very version directory whose archive was checked: versions are
    # installed whole by one rename and never changed in place.
    if tree.version != blob.version or tree.path.parent != blob.path.parent.parent:
        raise VersionConflict(
            f"code blob {spec.key!r} ({spec.name}) changed to version {tree.version} while"
            f" version {blob.version} was checked; nothing was run, launch the job again")
    return tree.path


def main() -> None:
    """Lay the code out, then become the real interpreter with the same arguments."""
    env = os.environ
    try:
        lay_out(env, Path.cwd())
    except (BlobError, OSError) as exc:
        # Spark shows the worker's standard error with the failed task.
        print(f"blobha-python: {' '.join(str(exc).split())}", file=sys.stderr)
        sys.exit(1)
    python = real_python(env)
    try:
        os.execve(python, [python, *sys.argv[1:]], env)
    except OSError as exc:
        print(f"blobha-python: cannot run {python}: {exc.strerror or exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
