"""The launcher's side of the job's code: find the local files spark-submit would ship
(``--py-files``, ``--files``, ``--archives`` and their confs), store each as a
content-addressed blob, and take them out of what Spark ships.

Key scheme: ``code.<user>.<xxh3-128 hex of the content>.<basename>``. Keys may not hold
``/`` (see :mod:`blobha.core.keys`), so the parts are joined with dots; ``<user>`` is
:func:`~blobha.core.keys.code_segment` of the user's name (one-to-one: two users never share
a prefix), and the masters let only that user create, write or administer keys under it. The
basename comes last because the node cache tells an archive's kind by the key's ending.

Each blob goes into the code map with the version the launcher stored or found and the
SHA-256 of the launcher's own file: executors link and import nothing else. Loaded by the
launcher only, never in a Spark worker.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
import sys
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, NamedTuple

from blobha.core.digest import CHUNK_SIZE, Digester, digest_stream
from blobha.core.errors import InvalidArgument, KeyAlreadyExists, KeyNotFound
from blobha.core.keys import MAX_KEY_BYTES, code_segment, validate_key
from blobha.spark.blobmap import check_local_name
from blobha.spark.codemap import KIND_ARCHIVE, KIND_FILE, KIND_PYFILE, CodeSpec
from blobha.spark.conf import CONF_JOB_TOKEN, ENV_CA_PEM, ENV_JOB_TOKEN, ENV_PYTHON
from blobha.spark.submitconf import (
    CONF_DRIVER_PYTHON,
    CONF_PYTHON,
    TAKES_VALUE,
    SubmitArgs,
    is_local_master,
)

if TYPE_CHECKING:
    from blobha.client import Client

__all__ = [
    "CODE_CONFS",
    "CODE_OPTIONS",
    "REDACTION",
    "CodeFile",
    "FileDigests",
    "TakenCode",
    "check_archive",
    "code_confs",
    "code_key",
    "deploy_mode_of",
    "digest_path",
    "driver_pythonpath",
    "hash_path",
    "hook_path",
    "insert_options",
    "redacted",
    "secret_properties",
    "take_code",
    "upload_code",
]

#: spark-submit's options naming code, and the kind of blob each entry becomes.
CODE_OPTIONS = {"--py-files": KIND_PYFILE, "--files": KIND_FILE, "--archives": KIND_ARCHIVE}
#: The confs those options set (an option given on the command line wins over its conf, as in
#: SparkSubmitArguments).
CODE_CONFS = {"--py-files": "spark.submit.pyFiles", "--files": "spark.files",
              "--archives": "spark.archives"}

log = logging.getLogger("blobha.spark")

_UNSAFE = re.compile(r"[^\w.-]")
_TAKES_VALUE_EXTRA = frozenset({"--conf", "-c"})


class CodeFile(NamedTuple):
    """One local file of the job: where it is, what Spark would make of it, its name on an
    executor (the ``#alias``, else the basename)."""

    path: str
    kind: str
    name: str


class TakenCode(NamedTuple):
    """What :func:`take_code` found and what spark-submit gets instead."""

    files: tuple[CodeFile, ...]
    #: spark-submit's arguments without the local code (non-local URIs are kept).
    args: tuple[str, ...]


def _safe(text: str) -> str:
    return _UNSAFE.sub("_", text) or "_"


def code_key(user: str, digest: str, basename: str) -> str:
    """The blob key of content ``digest`` named ``basename``, owned by ``user``.

    >>> code_key("alice", "0123456789abcdef0123456789abcdef", "lib.zip")
    'code.alice.0123456789abcdef0123456789abcdef.lib.zip'
    """
    name = _safe(basename)
    key = f"code.{code_segment(user)}.{digest}.{name}"
    if len(key.encode("utf-8")) > MAX_KEY_BYTES:
        # Keep the name's end: it tells an archive's kind.
        key = key[: MAX_KEY_BYTES - 64] + "." + name[-60:]
    return validate_key(key)


def _local_path(uri: str) -> str | None:
    """The local path of a spark-submit entry, or None for a URI Spark fetches itself
    (hdfs://, s3a://, http://...) or finds on every node (local:)."""
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme == "" or len(parsed.scheme) == 1:  # no scheme (or a drive letter)
        return uri
    if parsed.scheme == "file":
        return urllib.parse.unquote(parsed.path)
    return None


def _split_entries(value: str) -> list[str]:
    return [e.strip() for e in value.split(",") if e.strip()]


def _entry(option: str, entry: str) -> tuple[CodeFile | None, str]:
    # spark-submit takes "#alias" as the entry's name on executors (its URI fragment).
    uri, _, alias = entry.partition("#")
    local = _local_path(uri)
    if local is None:
        return None, entry
    kind = CODE_OPTIONS[option]
    name = alias or os.path.basename(local.rstrip("/"))
    # Before anything is stored: executors would refuse the name at every worker start.
    check_local_name(name, f"{option} {entry!r}", "name")
    return CodeFile(os.path.abspath(local), kind, name), entry


def take_code(args: Sequence[str], conf: Mapping[str, str]) -> TakenCode:
    """Find the local code in spark-submit's ``args`` (its options: what comes before the
    application file) and in the effective ``conf``, and return the arguments without it.

    Non-local entries stay, as ``--conf`` settings of the same confs; the application file and
    its arguments are left alone.
    """
    given: dict[str, list[str]] = {}
    out: list[str] = []
    conf_keys = {v: k for k, v in CODE_CONFS.items()}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("-"):
            out.extend(args[i:])
            break
        name, eq, inline = arg.partition("=")
        if eq and name in CODE_OPTIONS:
            given[name] = _split_entries(inline)
            i += 1
            continue
        if arg in CODE_OPTIONS:
            given[arg] = _split_entries(args[i + 1]) if i + 1 < len(args) else []
            i += 2
            continue
        if arg in _TAKES_VALUE_EXTRA or (eq and name == "--conf"):
            value, step = (inline, 1) if eq else (args[i + 1] if i + 1 < len(args) else "", 2)
            if value.partition("=")[0] in conf_keys:
                i += step  # replaced below by what is left of it
                continue
            out.extend(args[i : i + step])
            i += step
            continue
        out.append(arg)
        if i + 1 < len(args) and arg in TAKES_VALUE:
            out.append(args[i + 1])
            i += 1
        i += 1
    files: list[CodeFile] = []
    extra: list[str] = []
    for option, conf_key in CODE_CONFS.items():
        entries = given.get(option)
        if entries is None:
            if conf.get(conf_key) is None:
                continue
            entries = _split_entries(conf[conf_key])
        kept: list[str] = []
        for entry in entries:
            code, original = _entry(option, entry)
            if code is None:
                kept.append(original)
            else:
                files.append(code)
        # Always set: it overrides a value from a properties file, which may name local code.
        extra += ["--conf", f"{conf_key}={','.join(kept)}"]
    _check_names(files)
    return TakenCode(tuple(files), tuple(extra + out))


def _check_names(files: Iterable[CodeFile]) -> None:
    seen: dict[str, str] = {}
    for f in files:
        if f.name in seen and seen[f.name] != f.path:
            raise InvalidArgument(
                f"{seen[f.name]} and {f.path} would both appear on executors as {f.name!r};"
                " give one an alias (PATH#NAME)"
            )
        seen[f.name] = f.path


@contextlib.contextmanager
def _regular_file(path: str) -> Iterator[BinaryIO]:
    """``path`` open for reading; a missing, unreadable or non-regular file is an
    :class:`InvalidArgument` naming it."""
    try:
        with open(path, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise InvalidArgument(f"{path}: not a regular file (a directory? zip it first)")
            yield f
    except FileNotFoundError:
        raise InvalidArgument(f"{path}: no such file") from None
    except IsADirectoryError:
        raise InvalidArgument(f"{path}: not a regular file (a directory? zip it first)") from None
    except OSError as exc:
        raise InvalidArgument(f"{path}: cannot read it ({exc.strerror or exc})") from None


def digest_path(path: str) -> str:
    """xxh3-128 of a local file's content, the store's own digest; errors as
    :func:`_regular_file`."""
    with _regular_file(path) as f:
        return digest_stream(f)[0]


class FileDigests(NamedTuple):
    """A local file's xxh3-128 (the store's digest, which names its key) and SHA-256 (what
    executors check it by: xxh3 is no cryptographic hash)."""

    digest: str
    sha256: str


def hash_path(path: str) -> FileDigests:
    """Both digests of a local file, in one read; errors as :func:`_regular_file`."""
    import hashlib

    with _regular_file(path) as f:
        xxh3, sha = Digester(), hashlib.sha256()
        while data := f.read(CHUNK_SIZE):
            xxh3.update(data)
            sha.update(data)
        return FileDigests(xxh3.hexdigest(), sha.hexdigest())


def check_archive(path: str, name: str) -> None:
    """Unpack ``path`` into a scratch directory with the node cache's own rules, so an archive
    an executor would refuse fails here, before launch, naming the file."""
    import tempfile

    from blobha.cache.unpack import unpack
    from blobha.core.errors import BlobError

    with tempfile.TemporaryDirectory(prefix="blobha-check-") as scratch:
        try:
            unpack(Path(path), name, Path(scratch))
        except BlobError as exc:
            raise InvalidArgument(f"{path}: {exc}") from None


def upload_code(client: Client, user: str, files: Sequence[CodeFile],
                digests: Mapping[str, FileDigests] | None = None) -> list[CodeSpec]:
    """Store every file as a content-addressed blob owned by ``user`` (readable and writable
    by that user only), uploading only content the store does not hold yet; the code map
    entries, each pinned to the version stored and the SHA-256 of the local file.

    ``digests`` (path to digests) spares reading a file again. An archive is checked against
    the node cache's unpacking rules before it is uploaded: content already stored passed
    that check when it was, so a large environment is neither read nor unpacked again."""
    specs: list[CodeSpec] = []
    done: dict[str, int] = {}
    for f in files:
        hashes = (digests or {}).get(f.path) or hash_path(f.path)
        key = code_key(user, hashes.digest, os.path.basename(f.path))
        if key not in done:
            done[key] = _ensure(client, f, key, hashes.digest, user)
        specs.append(CodeSpec(key, f.kind, f.name, done[key], hashes.sha256))
    return specs


def _ensure(client: Client, f: CodeFile, key: str, digest: str, user: str) -> int:
    """The version of ``key`` holding ``f``'s content, created if absent."""
    path = f.path
    try:
        meta = client.get_meta(key)
        log.info("%s already stored as %s", path, key)
    except KeyNotFound:
        if f.kind == KIND_ARCHIVE:
            check_archive(path, f.name)
        try:
            # Nobody else gets anything: the masters keep the key's writes to ``user``, and
            # its readers are the job's (through ``user``'s own job token).
            meta = client.create(key, Path(path), acl=f"u:{user}:rwa")
            log.info("uploaded %s as %s (%d bytes)", path, key, meta.size)
        except KeyAlreadyExists:
            meta = client.get_meta(key)  # a concurrent launch won: fine if it is the same
    if meta.creator != user:
        # Made by someone else before the masters kept code keys to their owners: the
        # executors' SHA-256 check would catch other bytes, but such a key is no one's to
        # trust. Its owner may delete it (the masters let them).
        raise InvalidArgument(
            f"{path}: blob {key!r} was created by {meta.creator!r}, not by {user!r}; delete it"
            f" (blobha delete {key}) and launch again"
        )
    if meta.digest != digest:
        raise InvalidArgument(
            f"{path}: blob {key!r} holds other content (digest {meta.digest}); delete it"
        )
    return int(meta.version)


# --------------------------------------------------------------------------------------------
# What spark-submit gets instead
# --------------------------------------------------------------------------------------------

#: Spark's default ``spark.redaction.regex``: values of confs whose name matches are hidden
#: from its UI, event log and ``--verbose`` output.
REDACTION = re.compile(r"(?i)secret|password|token")


def deploy_mode_of(submit: SubmitArgs, conf: Mapping[str, str], env: Mapping[str, str]) -> str:
    return (submit.deploy_mode or conf.get("spark.submit.deployMode") or env.get("DEPLOY_MODE")
            or "client").strip()


def hook_path(submit: SubmitArgs, conf: Mapping[str, str], env: Mapping[str, str]) -> str:
    """The ``blobha-python`` executors run: beside this interpreter where the executors run on
    this machine, else the one on each node's ``PATH``."""
    master = submit.master or conf.get("spark.master") or env.get("MASTER") or "local[*]"
    beside = Path(sys.executable).parent / "blobha-python"
    if is_local_master(master) and beside.exists():
        return str(beside)
    return "blobha-python"


def code_confs(
    submit: SubmitArgs, conf: Mapping[str, str], env: Mapping[str, str], hook: str
) -> list[str]:
    """``--conf`` settings that run the worker hook on executors: ``spark.pyspark.python`` is
    the hook, which runs the interpreter the job chose (passed in ``BLOBHA_PYSPARK_PYTHON``);
    the driver keeps the interpreter it would have had (``spark.pyspark.python`` would
    otherwise name the hook for it too)."""
    chosen = (conf.get(CONF_PYTHON, "").strip() or env.get("PYSPARK_PYTHON", "").strip())
    driver = (conf.get(CONF_DRIVER_PYTHON, "").strip()
              or env.get("PYSPARK_DRIVER_PYTHON", "").strip() or chosen or "python3")
    out = ["--conf", f"{CONF_PYTHON}={hook}", "--conf", f"{CONF_DRIVER_PYTHON}={driver}"]
    if chosen:
        out += ["--conf", f"spark.executorEnv.{ENV_PYTHON}={chosen}"]
    return out


def driver_pythonpath(files: Iterable[CodeFile]) -> str:
    """``PYTHONPATH`` entries giving a client-mode driver the py-files at their local paths."""
    entries: list[str] = []
    for f in files:
        if f.kind == KIND_PYFILE:
            entry = os.path.dirname(f.path) if f.path.endswith(".py") else f.path
            if entry not in entries:
                entries.append(entry)
    return os.pathsep.join(entries)


def insert_options(args: Sequence[str], extra: Sequence[str]) -> list[str]:
    """``extra`` options put after spark-submit's own and before the application file, so
    they win over the user's ``--conf`` of the same key (a later one wins)."""
    i = 0
    while i < len(args) and args[i].startswith("-"):
        arg = args[i]
        i += 2 if (arg in TAKES_VALUE or arg in _TAKES_VALUE_EXTRA) else 1
    return [*args[:i], *extra, *args[i:]]


def secret_properties(token: str, ca: str | None, require_tls: bool = False
                      ) -> dict[str, str]:
    """The job token for the driver and the executors, under names Spark redacts, and the CA
    certificate's content when the cluster uses TLS: for a private properties file, never
    spark-submit's command line, which every account on the machine can read in ``ps``
    (executors get ``spark.executorEnv.*`` in their environment, not their command line).
    With ``require_tls`` (the launcher's own requirement), the executors require TLS too."""
    out = {CONF_JOB_TOKEN: token, f"spark.executorEnv.{ENV_JOB_TOKEN}": token}
    if require_tls:
        from blobha.wire.credentials import ENV_REQUIRE_TLS

        out[f"spark.executorEnv.{ENV_REQUIRE_TLS}"] = "1"
    if ca:
        try:
            pem = Path(ca).read_text()
        except OSError as exc:
            raise InvalidArgument(f"cannot read the CA {ca}: {exc.strerror or exc}") from None
        out[f"spark.executorEnv.{ENV_CA_PEM}"] = pem
    return out


def redacted(command: Sequence[str]) -> list[str]:
    """``command`` with the values of secret confs hidden, as Spark shows them."""
    out: list[str] = []
    for arg in command:
        key, eq, _ = arg.partition("=")
        out.append(f"{key}=*********(redacted)" if eq and REDACTION.search(key) else arg)
    return out
