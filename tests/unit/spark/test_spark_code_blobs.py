"""The job's code in ``blobha spark-submit``: key derivation, taking the local code out of
spark-submit's arguments, the checks before launch, upload-if-absent against a fake client,
and the worker hook's layout of the working directory."""

from __future__ import annotations

import errno
import hashlib
import io
import os
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest
from support.waiting import wait_until

from blobha.core.errors import InvalidArgument, KeyAlreadyExists, KeyNotFound
from blobha.core.keys import validate_key
from blobha.spark import jobcode, worker
from blobha.spark.codemap import CodeSpec, code_map_json, parse_code_map
from blobha.spark.conf import ENV_CONF, ENV_PYTHON
from blobha.spark.jobcode import (
    CodeFile,
    code_key,
    digest_path,
    driver_pythonpath,
    insert_options,
    redacted,
    take_code,
    upload_code,
)
from blobha.spark.settings import SparkBlobSettings

DIGEST = "0123456789abcdef0123456789abcdef"


def _sha(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def test_code_keys_are_valid_and_derived_from_user_digest_and_name() -> None:
    assert code_key("alice", DIGEST, "lib.zip") == f"code.alice.{DIGEST}.lib.zip"
    # The user's name is spelled one-to-one (blobha.core.keys.code_segment), so 'a@b' and
    # 'a_b' never share a key; characters a key may not hold become '_' in the file's name.
    odd = code_key("a@b", DIGEST, "my lib:1.tar.gz")
    assert validate_key(odd) == odd
    assert odd.startswith("code.a_40_b.") and odd.endswith(".my_lib_1.tar.gz")
    assert code_key("a_b", DIGEST, "x") != code_key("a@b", DIGEST, "x")
    # A long name keeps its ending, which tells an archive's kind.
    long = code_key("alice", DIGEST, "x" * 600 + ".tgz")
    assert len(long.encode()) <= 512 and long.endswith(".tgz")


def test_local_code_is_taken_out_and_the_rest_is_passed_on(tmp_path: Path) -> None:
    args = [
        "--master", "yarn", "--py-files", f"{tmp_path}/a.zip,hdfs://nn/b.zip,./c.py",
        "--files=file:///etc/f.txt#alias.txt,s3a://bucket/g.txt",
        "--archives", "env.tgz#env,local:/opt/on-every-node.tgz",
        "--conf", "spark.files=ignored-because-the-option-wins.txt",
        "--conf", "spark.executor.memory=1g", "-c", "spark.archives=x.tgz",
        "job.py", "--files", "app-arg.txt",
    ]
    taken = take_code(args, {"spark.files": "ignored-because-the-option-wins.txt"})
    cwd = os.getcwd()
    assert taken.files == (
        CodeFile(f"{tmp_path}/a.zip", "pyfile", "a.zip"),
        CodeFile(f"{cwd}/c.py", "pyfile", "c.py"),
        CodeFile("/etc/f.txt", "file", "alias.txt"),
        CodeFile(f"{cwd}/env.tgz", "archive", "env"),
    )
    assert taken.args == (
        "--conf", "spark.submit.pyFiles=hdfs://nn/b.zip",
        "--conf", "spark.files=s3a://bucket/g.txt",
        "--conf", "spark.archives=local:/opt/on-every-node.tgz",
        "--master", "yarn", "--conf", "spark.executor.memory=1g",
        "job.py", "--files", "app-arg.txt",  # the application's own arguments: untouched
    )


def test_code_named_only_in_the_conf_is_taken_too() -> None:
    taken = take_code(["job.py"], {"spark.submit.pyFiles": "/x/lib.zip", "spark.files": ""})
    assert taken.files == (CodeFile("/x/lib.zip", "pyfile", "lib.zip"),)
    # Set to what is left, over what a properties file said.
    assert taken.args == ("--conf", "spark.submit.pyFiles=", "--conf", "spark.files=",
                          "job.py")


def test_two_files_with_one_name_are_refused() -> None:
    with pytest.raises(InvalidArgument, match=r"both appear on executors as 'f\.txt'"):
        take_code(["--files", "/a/f.txt,/b/f.txt", "job.py"], {})


@pytest.mark.parametrize("entry", ["/a/f.txt#sub/f.txt", "/a/f.txt#..", "/a/f.txt#a\\\\b"])
def test_an_alias_that_is_no_plain_name_is_refused_before_anything_is_stored(
        entry: str) -> None:
    # Executors lay the name out in their working directory and would refuse it at every
    # worker start; the launcher refuses it first, naming the entry.
    with pytest.raises(InvalidArgument, match=r"invalid name .* for --files '/a/f.txt#"):
        take_code(["--files", entry, "job.py"], {})


def test_bad_files_fail_with_one_line_naming_them(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(InvalidArgument, match=f"^{tmp_path}/missing.zip: no such file$"):
        digest_path(str(tmp_path / "missing.zip"))
    with pytest.raises(InvalidArgument, match=f"^{tmp_path}: not a regular file"):
        digest_path(str(tmp_path))
    # A file the launcher may not read (as root every file is readable, so the refusal the
    # kernel would give is given here).
    unreadable = tmp_path / "secret.txt"
    unreadable.write_text("x")
    real_open = open

    def refusing_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path) == str(unreadable):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(jobcode, "open", refusing_open, raising=False)
    with pytest.raises(InvalidArgument, match=f"^{unreadable}: cannot read it"):
        digest_path(str(unreadable))


def test_an_unsafe_archive_fails_before_launch(tmp_path: Path) -> None:
    from blobha.spark.jobcode import check_archive

    evil = tmp_path / "evil.tgz"
    with tarfile.open(evil, "w:gz") as t:
        info = tarfile.TarInfo("../escape.txt")
        info.size = 1
        t.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(InvalidArgument) as e:
        check_archive(str(evil), "evil")
    assert str(e.value).startswith(f"{evil}: ") and "\n" not in str(e.value)
    assert not (tmp_path.parent / "escape.txt").exists()


class _FakeClient:
    def __init__(self, race: bool = False) -> None:
        self.blobs: dict[str, str] = {}
        self.creators: dict[str, str] = {}
        self.created: list[str] = []
        self.race = race

    def get_meta(self, key: str) -> Any:
        if key not in self.blobs:
            raise KeyNotFound(key)
        return type("M", (), {"digest": self.blobs[key], "size": 1, "version": 1,
                              "creator": self.creators.get(key, "bob")})()

    def create(self, key: str, path: str, acl: str) -> Any:
        from blobha.spark.jobcode import digest_path

        self.blobs[key] = digest_path(path)
        if self.race:  # another launch created it between our check and our create
            raise KeyAlreadyExists(key)
        assert acl == "u:bob:rwa"
        self.created.append(key)
        return self.get_meta(key)


def test_content_is_uploaded_once(tmp_path: Path) -> None:
    lib = tmp_path / "lib.zip"
    lib.write_bytes(b"zip bytes")
    copy = tmp_path / "again"
    copy.mkdir()
    (copy / "lib.zip").write_bytes(b"zip bytes")
    client = _FakeClient()
    files = [CodeFile(str(lib), "pyfile", "lib.zip")]
    first = upload_code(client, "bob", files)  # type: ignore[arg-type]
    second = upload_code(client, "bob", [CodeFile(str(copy / "lib.zip"), "file", "x.zip")])  # type: ignore[arg-type]
    assert len(client.created) == 1
    assert first[0].key == second[0].key == code_key("bob", digest_path(str(lib)), "lib.zip")
    # Pinned: the version stored and the SHA-256 of the launcher's own file.
    assert first[0][3:] == second[0][3:] == (1, _sha(b"zip bytes"))
    # A concurrent creator of the same content is a success.
    raced = upload_code(_FakeClient(race=True), "bob", files)  # type: ignore[arg-type]
    assert raced == first


def test_a_key_holding_other_content_is_refused(tmp_path: Path) -> None:
    lib = tmp_path / "lib.zip"
    lib.write_bytes(b"zip bytes")
    client = _FakeClient()
    client.blobs[code_key("bob", digest_path(str(lib)), "lib.zip")] = DIGEST
    with pytest.raises(InvalidArgument, match="holds other content"):
        upload_code(client, "bob", [CodeFile(str(lib), "pyfile", "lib.zip")])  # type: ignore[arg-type]


def test_a_key_someone_else_created_is_not_reused(tmp_path: Path) -> None:
    lib = tmp_path / "lib.zip"
    lib.write_bytes(b"zip bytes")
    key = code_key("bob", digest_path(str(lib)), "lib.zip")
    client = _FakeClient()
    client.blobs[key] = digest_path(str(lib))  # the same content...
    client.creators[key] = "mallory"  # ...made by another (before the masters refused it)
    with pytest.raises(InvalidArgument, match=f"^{lib}: blob '{key}' was created by 'mallory',"
                       " not by 'bob'; delete it"):
        upload_code(client, "bob", [CodeFile(str(lib), "pyfile", "lib.zip")])  # type: ignore[arg-type]


def test_options_go_before_the_application_and_secrets_are_redacted() -> None:
    args = ["--master", "yarn", "--conf", "a=b", "--verbose", "job.py", "--x"]
    assert insert_options(args, ["--conf", "k=v"]) == [
        "--master", "yarn", "--conf", "a=b", "--verbose", "--conf", "k=v", "job.py", "--x"]
    assert redacted(["--conf", "spark.blobha.job.token=bjt1.a.b", "--conf", "x=1"]) == [
        "--conf", "spark.blobha.job.token=*********(redacted)", "--conf", "x=1"]


def test_the_driver_imports_the_py_files_from_their_local_paths() -> None:
    files = [CodeFile("/a/lib.zip", "pyfile", "lib.zip"), CodeFile("/b/mod.py", "pyfile", "m"),
             CodeFile("/c/f.txt", "file", "f.txt")]
    assert driver_pythonpath(files) == os.pathsep.join(["/a/lib.zip", "/b"])


def test_code_maps_round_trip_through_the_settings() -> None:
    specs = (CodeSpec("code.bob.x.lib.zip", "pyfile", "lib.zip", 3, _sha("x")),)
    assert parse_code_map(code_map_json(specs)) == specs
    settings = SparkBlobSettings(cluster="m:1", code=specs)
    assert SparkBlobSettings.from_json(settings.to_json()).code == specs
    pin = f'1, "{_sha("x")}"'
    with pytest.raises(InvalidArgument, match="named 'a'"):
        parse_code_map(f'[["k1", "file", "a", {pin}], ["k2", "archive", "a", {pin}]]')
    with pytest.raises(InvalidArgument, match="plain file name"):
        parse_code_map(f'[["k1", "file", "../a", {pin}]]')


@pytest.mark.parametrize("entry", ['"k1", "file", "a", 0, "{sha}"',
                                   '"k1", "file", "a", true, "{sha}"',
                                   '"k1", "file", "a", 1, "{sha}0"',
                                   '"k1", "file", "a", 1, "ABC"', '"k1", "file", "a", 1'])
def test_a_pin_that_is_no_version_and_sha256_is_refused(entry: str) -> None:
    with pytest.raises(InvalidArgument, match=r"expected \[key, kind, name, version, sha256\]"):
        parse_code_map("[[" + entry.replace("{sha}", _sha("x")) + "]]")


def test_a_code_map_without_pins_is_refused_with_what_to_do() -> None:
    # A launcher before pins: its code could be anyone's, so executors run none of it.
    with pytest.raises(InvalidArgument, match=r"pins no version and SHA-256 .* launch the job"
                       r" again with this blobha's 'blobha spark-submit'"):
        parse_code_map('[["code.bob.x.lib.zip", "pyfile", "lib.zip"]]')


class _FakeCache:
    """The node cache's layout (``<key>/file/<key>``, ``<key>/unpacked``), each blob's
    content its key, at version 1."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def get(self, key: str, *, uncompress: bool = False, owner: str) -> Any:
        from blobha.cache import CachedBlob

        path = self.root / key / ("unpacked" if uncompress else f"file/{key}")
        if uncompress:
            path.mkdir(parents=True, exist_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(key)
        return CachedBlob(key, 1, len(key), "", path)

    def has_sha256(self, blob: Any, sha256: str) -> bool:
        return _sha(blob.path.read_bytes()) == sha256

    def batched_counters(self) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def close(self) -> None:
        pass


def test_the_hook_links_the_code_into_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from blobha.spark import executor

    cache_root = tmp_path / "cache"
    cache_root.mkdir()
    monkeypatch.setattr(executor, "open_cache", lambda settings: _FakeCache(cache_root))
    specs = tuple(CodeSpec(key, kind, name, 1, _sha(key)) for key, kind, name in (
        ("k-lib.zip", "pyfile", "lib.zip"), ("k-mod.py", "pyfile", "m.py"),
        ("k-f.txt", "file", "f.txt"), ("k-env.tgz", "archive", "env")))
    env = {ENV_CONF: SparkBlobSettings(cluster="m:1", code=specs, app_id="app-1").to_json(),
           "PYTHONPATH": "/spark/python"}
    cwd = tmp_path / "work"
    cwd.mkdir()
    (cwd / "f.txt").symlink_to("/stale/copy")  # an older application's link is replaced
    for _ in range(2):  # a second worker of the executor finds it all in place
        run_env = dict(env)
        worker.lay_out(run_env, cwd)
    assert os.readlink(cwd / "lib.zip") == str(cache_root / "k-lib.zip" / "file" / "k-lib.zip")
    assert (cwd / "f.txt").read_text() == "k-f.txt"
    assert (cwd / "env").resolve() == cache_root / "k-env.tgz" / "unpacked"
    assert run_env["PYTHONPATH"] == os.pathsep.join([str(cwd / "lib.zip"), str(cwd),
                                                     "/spark/python"])
    assert not [p for p in os.listdir(cwd) if p.startswith(".")], "no temporary link is left"


def test_the_hook_runs_the_interpreter_the_job_chose(tmp_path: Path) -> None:
    import sys

    assert worker.real_python({}) == sys.executable
    assert worker.real_python({ENV_PYTHON: "./env/bin/python"}) == "./env/bin/python"
    (tmp_path / "py9").write_text("")
    (tmp_path / "py9").chmod(0o755)
    assert worker.real_python({ENV_PYTHON: "py9", "PATH": str(tmp_path)}) == str(tmp_path / "py9")


def test_zip_modules_are_importable_from_a_linked_zip(tmp_path: Path) -> None:
    # The hook puts a linked zip itself on the path: zipimport follows the link.
    real = tmp_path / "real.zip"
    with zipfile.ZipFile(real, "w") as z:
        z.writestr("zmod_for_test.py", "VALUE = 7\n")
    (tmp_path / "lib.zip").symlink_to(real)
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "import zmod_for_test as m; print(m.VALUE)"],
                         env={**os.environ, "PYTHONPATH": str(tmp_path / "lib.zip")},
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "7"


def test_a_missing_file_stops_the_launcher_before_launch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from blobha.spark.submit import submit_main

    fake = tmp_path / "spark-submit"  # never run
    status = submit_main([
        "--cluster", "127.0.0.1:1", "--user", "bob", "--spark-submit", str(fake), "--",
        "--master", "local[1]", "--py-files", str(tmp_path / "gone.zip"), "job.py",
    ])
    assert status == 6
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == [f"{tmp_path}/gone.zip: no such file"]


def test_an_unsafe_archive_is_refused_before_it_is_uploaded(tmp_path: Path) -> None:
    evil = tmp_path / "env.tgz"
    with tarfile.open(evil, "w:gz") as t:
        info = tarfile.TarInfo("/etc/passwd-not-really")
        info.size = 1
        t.addfile(info, io.BytesIO(b"x"))
    client = _FakeClient()
    with pytest.raises(InvalidArgument, match=f"^{evil}: "):
        upload_code(client, "bob", [CodeFile(str(evil), "archive", "env")])  # type: ignore[arg-type]
    assert client.created == []


class _OneUserCluster:
    """A client for the cache that serves fixed blobs to one user (enough to warm a cache)."""

    user = "alice"

    def __init__(self, blobs: dict[str, bytes]) -> None:
        self.blobs = blobs

    def remember_version(self, key: str, version: int, created_at: float) -> None:
        pass  # one master, never behind

    def get_meta(self, key: str) -> Any:
        from blobha.client import BlobMeta
        from blobha.core.digest import digest_bytes

        data = self.blobs[key]
        return BlobMeta(key, 1, len(data), digest_bytes(data), (), 1, 1, 1000.0, 1000.0,
                        self.user, 1)

    def download(self, key: str, dest: str | os.PathLike[str], version: int = 0,
                 **_: Any) -> Any:
        from blobha.client import BlobInfo
        from blobha.core.digest import digest_bytes

        data = self.blobs[key]
        Path(dest).write_bytes(data)
        return BlobInfo(1, len(data), digest_bytes(data))

    def close(self) -> None:
        pass


#: What a worker start served from a warm node cache has no use for: the client and its
#: libraries, the driver's side of blobha.spark, the unpacker, and standard modules the warm
#: path avoids (each costs every Python worker's start milliseconds).
_NOT_ON_THE_WARM_PATH = (
    "grpc", "google.protobuf", "cryptography", "blobha.client", "blobha.wire", "blobha.v1",
    "blobha.spark.driver", "blobha.spark.submit",
    "blobha.cache.unpack", "tarfile", "zipfile", "logging", "tempfile", "shutil", "secrets",
    "hashlib", "xxhash",
)


def test_the_hooks_warm_start_loads_only_what_it_uses(tmp_path: Path) -> None:
    import subprocess
    import sys

    from blobha.cache import BlobCache

    blobs = {"k-lib.zip": _zip_bytes(), "k-f.txt": b"x", "k-env.tgz": _tgz_bytes()}
    specs = tuple(CodeSpec(key, kind, name, 1, _sha(blobs[key])) for key, kind, name in (
        ("k-lib.zip", "pyfile", "lib.zip"), ("k-f.txt", "file", "f.txt"),
        ("k-env.tgz", "archive", "env")))
    cache_dir = tmp_path / "cache"
    with BlobCache(cache_dir, client=_OneUserCluster(blobs),  # type: ignore[arg-type]
                   update_interval_secs=3600) as cache:
        for spec in specs:  # a worker of an earlier application fetched and checked them
            cache.get(spec.key, uncompress=spec.kind == "archive", owner="app-0")
            _check_until_recorded(cache, cache.get(spec.key, owner="app-0"), spec.sha256)
    settings = SparkBlobSettings(cluster="127.0.0.1:1", user="alice", code=specs,
                                 cache_dir=str(cache_dir), app_id="app-1",
                                 update_interval_secs=3600)
    cwd = tmp_path / "work"
    cwd.mkdir()
    code = ("import os, sys; from pathlib import Path; from blobha.spark import worker; "
            "worker.lay_out(os.environ, Path.cwd()); print(' '.join(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=cwd, env={**os.environ, ENV_CONF: settings.to_json()})
    assert sorted(os.listdir(cwd)) == ["env", "f.txt", "lib.zip"]
    loaded = [m for m in out.stdout.split() if m.startswith(_NOT_ON_THE_WARM_PATH)]
    assert not loaded, f"a warm worker start loads {loaded}"
    # The hook closed its cache: its scratch space is gone, its application's references
    # (for the worker it becomes) are not.
    assert os.listdir(cache_dir / "tmp") == []
    for spec in specs:
        refs = os.listdir(cache_dir / "blobs" / spec.key / "refs")
        assert [r for r in refs if r.startswith("o=app-1@")], spec.key


def _check_until_recorded(cache: Any, blob: Any, sha256: str) -> None:
    record = blob.path.parent.parent / "sha256"
    # A record written in the clock tick of the file's install is not trusted (see
    # blobha.cache.verify): each check writes it again until one is.
    wait_until(lambda: cache.has_sha256(blob, sha256)
               and record.stat().st_mtime_ns > blob.path.stat().st_ctime_ns,
               what="a trusted SHA-256 record")


def _zip_bytes() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("m.py", "X = 1\n")
    return buf.getvalue()


def _tgz_bytes() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        info = tarfile.TarInfo("a/b.txt")
        info.size = 1
        t.addfile(info, io.BytesIO(b"x"))
    return buf.getvalue()
