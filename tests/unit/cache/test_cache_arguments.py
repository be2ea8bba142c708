"""The node-local cache's names, arguments and directory, and ``blobha fetch``."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.cache_fakes import (
    FakeClient,
    FakeCluster,
    _zip,
)

from blobha import cli
from blobha.cache import BlobCache, default_cache_dir
from blobha.cli import connect
from blobha.core.errors import (
    InvalidArgument,
    KeyNotFound,
    NotAuthorized,
)


def test_unusual_keys_get_safe_names(fake: FakeCluster, make: Any) -> None:
    long_key = "x" * 300 + ".tar.gz"
    for key in ("données 2024.csv", long_key, ".hidden", "-dash"):
        fake.put(key, key.encode())
    cache = make()
    for key in ("données 2024.csv", ".hidden", "-dash"):
        assert cache.get(key).path.name == key
    path = cache.get(long_key).path
    assert path.name.startswith("h-") and path.name.endswith(".tar.gz")
    assert path.read_bytes() == long_key.encode()
    assert {e.key for e in cache.entries()} == {"données 2024.csv", long_key, ".hidden", "-dash"}


@pytest.mark.parametrize("kw", [{"soft_limit_bytes": -1}, {"retention_secs": -1.0},
                                {"update_interval_secs": float("nan")}])
def test_bad_settings_are_refused(fake: FakeCluster, cache_dir: Path, kw: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument):
        BlobCache(cache_dir, client=fake.client(), **kw)  # type: ignore[arg-type]


def test_cluster_and_user_arguments(fake: FakeCluster, cache_dir: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BLOBHA_CLUSTER", raising=False)
    with pytest.raises(InvalidArgument, match="BLOBHA_CLUSTER"):
        BlobCache(cache_dir)
    with pytest.raises(InvalidArgument, match="differs"):
        BlobCache(cache_dir, client=fake.client("alice"), user="bob")  # type: ignore[arg-type]
    monkeypatch.setenv("BLOBHA_CLUSTER", "127.0.0.1:1")
    with BlobCache(cache_dir, user="carol") as c:
        assert c.user == "carol"


def test_a_foreign_directory_is_not_adopted(fake: FakeCluster, tmp_path: Path) -> None:
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("mine")
    with pytest.raises(InvalidArgument, match="not a blobha cache"):
        BlobCache(tmp_path / "home", client=fake.client())  # type: ignore[arg-type]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "LAYOUT").write_text("blobha-cache 99\n")
    with pytest.raises(InvalidArgument, match="another format"):
        BlobCache(tmp_path / "other", client=fake.client())  # type: ignore[arg-type]


def test_a_cache_root_another_account_owns_is_refused(
        fake: FakeCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Made by someone else before us (a shared path under /tmp): whoever owns it reads and
    # changes what we cache there, so it is refused before anything in it is looked at.
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    (root / "LAYOUT").write_text("blobha-cache 1\n")  # planted: looks like a cache
    if os.geteuid() == 0:
        os.chown(root, 65534, 65534)  # nobody
    else:
        # Our own directory seen by another account: the same check, from its side.
        me = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: me + 1)
    with pytest.raises(InvalidArgument) as refused:
        BlobCache(root, client=fake.client())  # type: ignore[arg-type]
    message = str(refused.value)
    assert f"{root} belongs to another account" in message and "--cache-dir" in message
    assert sorted(os.listdir(root)) == ["LAYOUT"]  # nothing made in it


def test_a_root_owned_shared_cache_root_is_used_unless_everyone_may_change_it(
        fake: FakeCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if os.geteuid() != 0:
        pytest.skip("a directory that root owns needs root to make")
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o770)  # an administrator's cache for a group, owned by root
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # seen by a member of the group
    with BlobCache(root, client=fake.client()):  # type: ignore[arg-type]
        pass
    root.chmod(0o777)
    with pytest.raises(InvalidArgument, match=r"changed by every account \(mode 0777\)"):
        BlobCache(root, client=fake.client())  # type: ignore[arg-type]


def test_bad_keys_and_owners_are_refused(fake: FakeCluster, make: Any) -> None:
    cache = make()
    with pytest.raises(InvalidArgument):
        cache.get("a/b")
    with pytest.raises(InvalidArgument):
        cache.get("k", owner="")


def test_an_instance_refuses_to_work_in_a_forked_child(fake: FakeCluster, make: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    fake.put("k", b"data")
    cache = make()
    parent = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: parent + 1)
    with pytest.raises(InvalidArgument, match="forked child"):
        cache.get("k")
    assert fake.meta_calls == 0


def test_connect_makes_the_client_when_first_needed_and_the_cache_owns_it(
    fake: FakeCluster, cache_dir: Path
) -> None:
    fake.put("k", b"data")
    made: list[FakeClient] = []

    def connect() -> FakeClient:
        made.append(fake.client("alice"))
        return made[-1]

    with BlobCache(cache_dir, user="alice", connect=connect) as cache:  # type: ignore[arg-type]
        assert made == [] and cache.user == "alice"
        cache.get("k")
        cache.get("k")
        assert len(made) == 1
    assert made[0].closed, "a client made through connect belongs to the cache"
    with BlobCache(cache_dir, connect=connect) as cache:  # type: ignore[arg-type]
        assert len(made) == 2, "without a user, only the client can tell who we are"
        assert cache.user == "alice"
    with pytest.raises(InvalidArgument, match="not both"):
        BlobCache(cache_dir, client=fake.client(), connect=connect)  # type: ignore[arg-type]
    bob = BlobCache(cache_dir, user="bob", connect=connect)  # type: ignore[arg-type]
    with bob, pytest.raises(InvalidArgument, match="serves 'bob'"):
        bob.get("k")


def test_an_injected_client_is_left_open(fake: FakeCluster,
                                                        cache_dir: Path) -> None:
    client = fake.client()
    with BlobCache(cache_dir, client=client):  # type: ignore[arg-type]
        pass
    assert not client.closed, "an injected client belongs to the caller"


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BLOBHA_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("BLOBHA_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "blobha"


@pytest.fixture
def fetch(fake: FakeCluster, monkeypatch: pytest.MonkeyPatch,
          capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    monkeypatch.setattr(connect, "client_factory",
                        lambda cluster, user: fake.client(user or "alice"))

    def run(*argv: str) -> tuple[int, str, str]:
        code = cli.main(["fetch", *argv])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def test_fetch_prints_key_version_path(fake: FakeCluster, fetch: Any, cache_dir: Path) -> None:
    fake.put("a", b"A")
    fake.put("b.zip", _zip({"f": b"F"}))
    code, out, err = fetch("a", "b.zip", "--cache-dir", str(cache_dir))
    assert (code, err) == (0, "")
    lines = [line.split("\t") for line in out.splitlines()]
    assert [(k, v) for k, v, _ in lines] == [("a", "1"), ("b.zip", "1")]
    assert Path(lines[0][2]).read_bytes() == b"A"
    code, out, _ = fetch("b.zip", "--cache-dir", str(cache_dir), "--uncompress", "--json")
    assert code == 0
    [item] = json.loads(out)
    assert item["key"] == "b.zip" and item["version"] == 1
    assert (Path(item["path"]) / "f").read_bytes() == b"F"
    assert fake.downloads == 2


def test_fetch_uses_blobha_cache_dir(fake: FakeCluster, fetch: Any, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    fake.put("a", b"A")
    monkeypatch.setenv("BLOBHA_CACHE_DIR", str(tmp_path / "env-cache"))
    code, out, _ = fetch("a")
    assert code == 0 and out.split("\t")[2].strip().startswith(str(tmp_path / "env-cache"))


def test_fetch_errors_are_one_line_with_the_usual_exit_codes(fake: FakeCluster, fetch: Any,
                                                            cache_dir: Path) -> None:
    fake.put("secret", b"s", readers={"alice"})
    fake.put("plain", b"p")
    code, out, err = fetch("missing", "--cache-dir", str(cache_dir))
    assert code == KeyNotFound.exit_code and out == ""
    assert err.startswith("blobha: error:") and err.count("\n") == 1
    code, _, err = fetch("secret", "--cache-dir", str(cache_dir), "--user", "bob")
    assert code == NotAuthorized.exit_code and "bob" in err
    code, _, err = fetch("plain", "--cache-dir", str(cache_dir), "--uncompress")
    assert code == InvalidArgument.exit_code and err.count("\n") == 1
    code, _, _ = fetch("--cache-dir", str(cache_dir))
    assert code == 2
