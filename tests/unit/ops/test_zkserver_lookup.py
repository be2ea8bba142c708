"""Locating ZooKeeper and Java (no processes are started here)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from blobha.ops import zkserver
from blobha.ops.zkserver import (
    EmbeddedZooKeeper,
    JavaNotFound,
    ZooKeeperNotFound,
    find_java,
    find_zookeeper_classpath,
)


def _jar(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"PK")
    return path


@pytest.fixture
def nothing_installed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("ZOOKEEPER_HOME", raising=False)
    monkeypatch.setattr(zkserver, "DEBIAN_DIRS", (tmp_path / "no-zk", tmp_path / "no-java"))
    monkeypatch.setattr(zkserver, "_pyspark_jars_dir", lambda: None)


@pytest.mark.usefixtures("nothing_installed")
def test_nothing_found_says_what_to_install() -> None:
    with pytest.raises(ZooKeeperNotFound) as info:
        find_zookeeper_classpath()
    message = str(info.value)
    assert "apt-get install zookeeper" in message
    assert "pip install pyspark" in message
    assert "ZOOKEEPER_HOME" in message
    assert isinstance(info.value, RuntimeError)


@pytest.mark.usefixtures("nothing_installed")
def test_tarball_home_argument(tmp_path: Path) -> None:
    home = tmp_path / "apache-zookeeper-3.9.2-bin"
    _jar(home / "lib" / "zookeeper-3.9.2.jar")
    (home / "conf").mkdir()
    cp = find_zookeeper_classpath(str(home)).split(os.pathsep)
    assert f"{home}/lib/*" in cp
    assert f"{home}/*" in cp
    assert str(home / "conf") in cp


@pytest.mark.usefixtures("nothing_installed")
def test_zookeeper_home_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    home = tmp_path / "zk"
    _jar(home / "lib" / "zookeeper-3.8.4.jar")
    monkeypatch.setenv("ZOOKEEPER_HOME", str(home))
    assert f"{home}/lib/*" in find_zookeeper_classpath().split(os.pathsep)


@pytest.mark.usefixtures("nothing_installed")
def test_argument_wins_over_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    env_home, arg_home = tmp_path / "env", tmp_path / "arg"
    _jar(env_home / "lib" / "zookeeper-3.8.4.jar")
    _jar(arg_home / "lib" / "zookeeper-3.9.0.jar")
    monkeypatch.setenv("ZOOKEEPER_HOME", str(env_home))
    cp = find_zookeeper_classpath(str(arg_home))
    assert str(arg_home) in cp and str(env_home) not in cp


@pytest.mark.usefixtures("nothing_installed")
def test_debian_like_home(tmp_path: Path) -> None:
    home = tmp_path / "usr" / "share" / "zookeeper"
    home.mkdir(parents=True)
    java_dir = tmp_path / "usr" / "share" / "java"
    _jar(java_dir / "zookeeper.jar")
    _jar(java_dir / "slf4j-simple.jar")
    cp = find_zookeeper_classpath(str(home)).split(os.pathsep)
    # The simple logger is named first so it wins over the other SLF4J bindings.
    assert cp[0] == str(java_dir / "slf4j-simple.jar")
    assert f"{java_dir}/*" in cp


@pytest.mark.usefixtures("nothing_installed")
def test_a_home_without_zookeeper_is_an_error(tmp_path: Path) -> None:
    home = tmp_path / "empty"
    _jar(home / "lib" / "zookeeper-jute-3.9.2.jar")  # not the server jar
    with pytest.raises(ZooKeeperNotFound, match="holds no zookeeper jar"):
        find_zookeeper_classpath(str(home))


def test_debian_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("ZOOKEEPER_HOME", raising=False)
    zk_dir, java_dir = tmp_path / "zookeeper", tmp_path / "java"
    zk_dir.mkdir()
    _jar(java_dir / "zookeeper-3.8.0.jar")
    monkeypatch.setattr(zkserver, "DEBIAN_DIRS", (zk_dir, java_dir))
    monkeypatch.setattr(zkserver, "_pyspark_jars_dir", lambda: tmp_path / "never-used")
    assert find_zookeeper_classpath().split(os.pathsep) == [f"{zk_dir}/*", f"{java_dir}/*"]


@pytest.mark.usefixtures("nothing_installed")
def test_pyspark_jars(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    jars = tmp_path / "site-packages" / "pyspark" / "jars"
    _jar(jars / "zookeeper-3.9.3.jar")
    monkeypatch.setattr(zkserver, "_pyspark_jars_dir", lambda: jars)
    assert find_zookeeper_classpath() == f"{jars}/*"


@pytest.mark.usefixtures("nothing_installed")
def test_pyspark_without_zookeeper_jar_is_not_enough(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    jars = tmp_path / "pyspark" / "jars"
    _jar(jars / "spark-core.jar")
    monkeypatch.setattr(zkserver, "_pyspark_jars_dir", lambda: jars)
    with pytest.raises(ZooKeeperNotFound):
        find_zookeeper_classpath()


def test_java_from_java_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    java = tmp_path / "jdk" / "bin" / "java"
    java.parent.mkdir(parents=True)
    java.write_text("#!/bin/sh\n")
    java.chmod(java.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "jdk"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert find_java() == str(java)


def test_java_missing_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "no-jdk"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(JavaNotFound, match="apt-get install openjdk-17-jre-headless"):
        find_java()


def test_session_timeout_bounds_follow_the_tick(tmp_path: Path) -> None:
    fast = EmbeddedZooKeeper(tmp_path, tick_ms=500)
    assert fast.min_session_timeout_ms == 1000
    assert fast.max_session_timeout_ms >= 20_000
    slow = EmbeddedZooKeeper(tmp_path, tick_ms=5000)
    assert slow.max_session_timeout_ms == 100_000


def test_not_started(tmp_path: Path) -> None:
    zk = EmbeddedZooKeeper(tmp_path)
    assert zk.pid is None
    assert not zk.is_running()
    with pytest.raises(RuntimeError, match="start"):
        _ = zk.connect_string
    zk.stop()
    zk.kill()
    assert EmbeddedZooKeeper(tmp_path, port=2999).connect_string == "127.0.0.1:2999"
    with pytest.raises(ValueError, match="tick_ms"):
        EmbeddedZooKeeper(tmp_path, tick_ms=0)


@pytest.mark.usefixtures("nothing_installed")
def test_start_without_zookeeper_launches_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(zkserver, "find_java", lambda: "/nonexistent/java")
    zk = EmbeddedZooKeeper(tmp_path / "zk")
    with pytest.raises(ZooKeeperNotFound):
        zk.start()
    assert zk.pid is None
    assert not (tmp_path / "zk").exists()
