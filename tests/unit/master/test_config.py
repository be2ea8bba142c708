"""Master configuration: defaults, TOML (nested and flat), environment overrides, validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from blobha.master.config import (
    OPTIONS,
    Config,
    ConfigError,
    data_port,
    env_name,
    format_cpu_list,
    load_config,
    parse_cpu_list,
)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "blobha.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults() -> None:
    cfg = load_config(None, env={})
    assert cfg["blobstore.replication.factor"] == 3
    assert cfg["blobstore.write.quorum"] == 1
    assert cfg["blobstore.upload.expiration.secs"] == 600
    assert cfg["zookeeper.servers"] == "127.0.0.1:2181"
    assert cfg["zookeeper.chroot"] == "/blobha"
    assert cfg["zookeeper.session.timeout.ms"] == 20000
    assert cfg["master.listen"] == "0.0.0.0:6627"
    assert cfg.advertise == "127.0.0.1:6627"
    assert cfg.data_dir == Path("blobha-data")
    assert cfg.admins == frozenset()
    assert cfg["log.level"] == "INFO"
    assert set(cfg.values) == {o.key for o in OPTIONS}


def test_every_default_is_valid_and_kept() -> None:
    cfg = Config.of()
    for option in OPTIONS:
        if option.key != "master.advertise":
            assert cfg[option.key] == option.default, option.key


def test_nested_tables(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
admins = ["root", "ops"]
[blobstore]
dir = "/var/lib/blobha"
write.quorum = 2
[blobstore.replication]
factor = 5
[zookeeper]
servers = "zk1:2181,zk2:2181,zk3"
[master]
listen = "10.0.0.5:7000"
""",
    )
    cfg = load_config(path, env={})
    assert cfg.data_dir == Path("/var/lib/blobha")
    assert cfg["blobstore.write.quorum"] == 2
    assert cfg["blobstore.replication.factor"] == 5
    assert cfg["zookeeper.servers"] == "zk1:2181,zk2:2181,zk3"
    assert cfg.advertise == "10.0.0.5:7000"
    assert cfg.admins == frozenset({"root", "ops"})


def test_flat_quoted_dotted_keys(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
"blobstore.dir" = "/srv/blobs"
"blobstore.write.quorum" = 3
"blobstore.write.timeout.secs" = 2.5
"log.level" = "debug"
""",
    )
    cfg = load_config(path, env={})
    assert cfg.data_dir == Path("/srv/blobs")
    assert cfg["blobstore.write.quorum"] == 3
    assert cfg["blobstore.write.timeout.secs"] == 2.5
    assert cfg["log.level"] == "DEBUG"


def test_environment_overrides_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, '"blobstore.write.quorum" = 3\n')
    env = {
        "BLOBHA_BLOBSTORE_WRITE_QUORUM": "2",
        "BLOBHA_BLOBSTORE_WRITE_TIMEOUT_SECS": "1.5",
        "BLOBHA_ADMINS": "alice, bob,",
        "BLOBHA_MASTER_ADVERTISE": "m1:6627",
        "UNRELATED": "x",
    }
    cfg = load_config(path, env=env)
    assert cfg["blobstore.write.quorum"] == 2
    assert isinstance(cfg["blobstore.write.quorum"], int)
    assert cfg["blobstore.write.timeout.secs"] == 1.5
    assert cfg.admins == frozenset({"alice", "bob"})
    assert cfg.advertise == "m1:6627"


def test_environment_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BLOBHA_BLOBSTORE_SYNC_THREADS", "7")
    assert load_config(None)["blobstore.sync.threads"] == 7


def test_env_name() -> None:
    assert env_name("blobstore.write.quorum") == "BLOBHA_BLOBSTORE_WRITE_QUORUM"


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"blobstore.write.quorum": 0}, "blobstore.write.quorum"),
        ({"blobstore.write.quorum": "two"}, "blobstore.write.quorum"),
        ({"blobstore.write.quorum": 1.5}, "blobstore.write.quorum"),
        ({"blobstore.write.quorum": True}, "blobstore.write.quorum"),
        ({"blobstore.replication.factor": 0}, "blobstore.replication.factor"),
        ({"blobstore.disk.reserved.bytes": -1}, "blobstore.disk.reserved.bytes"),
        ({"blobstore.write.timeout.secs": 0}, "blobstore.write.timeout.secs"),
        ({"blobstore.sync.linger.secs": -0.01}, "blobstore.sync.linger.secs"),
        ({"zookeeper.session.timeout.ms": 10}, "zookeeper.session.timeout.ms"),
        ({"master.listen": "nohost"}, "master.listen"),
        ({"master.listen": "host:0"}, "master.listen"),
        ({"master.listen": "host:70000"}, "master.listen"),
        ({"master.listen": "host:http"}, "master.listen"),
        ({"master.listen": ":6627"}, "master.listen"),
        ({"master.listen": ""}, "master.listen"),
        ({"master.advertise": "0.0.0.0:6627"}, "master.advertise"),
        ({"master.advertise": "m1"}, "master.advertise"),
        ({"zookeeper.servers": "zk1:2181,zk2:x"}, "zookeeper.servers"),
        ({"zookeeper.servers": ""}, "zookeeper.servers"),
        ({"zookeeper.chroot": "blobha"}, "zookeeper.chroot"),
        ({"zookeeper.chroot": "/blobha/"}, "zookeeper.chroot"),
        ({"zookeeper.chroot": 5}, "zookeeper.chroot"),
        ({"admins": "alice"}, "admins"),
        ({"admins": ["alice", ""]}, "admins"),
        ({"auth.mode": "kerberos"}, "auth.mode"),
        ({"log.level": "LOUD"}, "log.level"),
        ({"blobstore.dir": ""}, "blobstore.dir"),
        ({"blobstore.sync.stall.secs": 0.5}, "blobstore.sync.stall.secs"),
        ({"blobstore.sync.stall.secs": "soon"}, "blobstore.sync.stall.secs"),
        ({"no.such.key": 1}, "no.such.key"),
        ({"blobstore.data.port": 70000}, "blobstore.data.port"),
        ({"blobstore.data.port": -2}, "blobstore.data.port"),
        ({"blobstore.data.port": "+0"}, "blobstore.data.port"),
        ({"blobstore.data.port": "+x"}, "blobstore.data.port"),
        ({"blobstore.data.port": "+2000"}, "blobstore.data.port"),
    ],
)
def test_bad_values_name_the_key(overrides: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        Config.of(overrides)


def test_the_data_port_is_the_grpc_port_plus_ten_by_default() -> None:
    assert Config.of({})["blobstore.data.port"] == "+10"
    assert data_port(Config.of({})["blobstore.data.port"], 6627, 6627) == 6637
    # An offset from a port the system picked would land anywhere: any free port then.
    assert data_port("+10", 40123, 0) == 0
    env = load_config(None, env={"BLOBHA_BLOBSTORE_DATA_PORT": " +5"})
    assert env["blobstore.data.port"] == "+5"
    for pinned in (6640, 0, -1):
        assert data_port(Config.of({"blobstore.data.port": pinned})["blobstore.data.port"],
                         6627, 6627) == pinned
    assert load_config(None, env={"BLOBHA_BLOBSTORE_DATA_PORT": "6641"})[
        "blobstore.data.port"] == 6641


def test_bad_environment_value_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"blobstore\.write\.quorum"):
        load_config(None, env={"BLOBHA_BLOBSTORE_WRITE_QUORUM": "0"})


def test_unknown_key_in_a_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "[blobstore]\nwrite_quorum = 2\n")
    with pytest.raises(ConfigError, match=r"blobstore\.write_quorum"):
        load_config(path, env={})


def test_invalid_toml(tmp_path: Path) -> None:
    path = _write(tmp_path, "blobstore.dir = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(path, env={})


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(path, env={})


@pytest.mark.parametrize(
    ("listen", "advertise"),
    [
        ("0.0.0.0:7001", "127.0.0.1:7001"),
        ("[::]:7002", "127.0.0.1:7002"),
        ("master-3:7003", "master-3:7003"),
        ("10.1.2.3:7004", "10.1.2.3:7004"),
    ],
)
def test_advertise_is_derived_from_listen(listen: str, advertise: str) -> None:
    assert Config.of({"master.listen": listen}).advertise == advertise


def test_explicit_advertise_wins_over_listen() -> None:
    cfg = Config.of({"master.listen": "0.0.0.0:7001", "master.advertise": "m9:7001"})
    assert cfg.advertise == "m9:7001"


def test_root_chroot_is_allowed() -> None:
    assert Config.of({"zookeeper.chroot": "/"})["zookeeper.chroot"] == "/"


def test_metrics_listen_is_off_by_default_and_validated() -> None:
    assert Config.of().metrics_listen == ""
    assert Config.of({"metrics.listen": " 0.0.0.0:6727 "}).metrics_listen == "0.0.0.0:6727"
    env = load_config(None, env={"BLOBHA_METRICS_LISTEN": "127.0.0.1:9100"})
    assert env.metrics_listen == "127.0.0.1:9100"
    for bad in ("6727", "host:", "h:0", "h:70000", 6727):
        with pytest.raises(ConfigError, match=r"metrics\.listen"):
            Config.of({"metrics.listen": bad})
    with pytest.raises(ConfigError, match=r"must differ from master\.listen"):
        Config.of({"metrics.listen": "0.0.0.0:6627"})


def test_log_format_is_text_or_json() -> None:
    assert Config.of()["log.format"] == "text"
    assert Config.of({"log.format": "JSON"})["log.format"] == "json"
    with pytest.raises(ConfigError, match=r"log\.format must be 'text' or 'json'"):
        Config.of({"log.format": "xml"})


def test_the_peer_stall_limit_is_a_setting(tmp_path: Path) -> None:
    # It was a constant: a site whose healthy masters can fall silent for longer (a slow link,
    # long disk syncs) had its fetches thrown away every 10 s.
    from blobha.master.facade import Master
    from blobha.wire.peers import STALL_SECS

    assert Config.of()["blobstore.sync.stall.secs"] == STALL_SECS
    cfg = load_config(None, env={"BLOBHA_BLOBSTORE_SYNC_STALL_SECS": "42.5",
                                 "BLOBHA_BLOBSTORE_DIR": str(tmp_path / "data")})
    master = Master(cfg)
    try:
        assert master.peers._stall == 42.5
    finally:
        master.peers.close()
        master.puts.close(10.0)


def test_master_cpus_reads_linux_cpu_lists() -> None:
    assert Config.of()["master.cpus"] == ""
    assert parse_cpu_list("") == frozenset()
    assert parse_cpu_list("3") == {3}
    assert parse_cpu_list("0,2-4, 7") == {0, 2, 3, 4, 7}
    # Written back in the shortest form, so logs and the status page show one spelling.
    assert Config.of({"master.cpus": "3,1,2,0,6"})["master.cpus"] == "0-3,6"
    assert load_config(None, env={"BLOBHA_MASTER_CPUS": "1"})["master.cpus"] == "1"
    # Empty from the environment overrides a file's list: the master runs anywhere.
    assert load_config(None, env={"BLOBHA_MASTER_CPUS": ""})["master.cpus"] == ""
    for bad in ("a", "1-", "-1", "1,,2", "1.5", 1):
        with pytest.raises(ConfigError, match=r"master\.cpus must be a CPU list"):
            Config.of({"master.cpus": bad})
    with pytest.raises(ConfigError, match="runs backwards"):
        Config.of({"master.cpus": "3-1"})


def test_cpu_lists_round_trip() -> None:
    for cpus in ({0}, {0, 1}, {0, 2}, {1, 2, 3, 8, 9, 11}, set(range(64))):
        text = format_cpu_list(cpus)
        assert parse_cpu_list(text) == cpus, text
    assert format_cpu_list({1, 2, 3, 8, 9, 11}) == "1-3,8-9,11"
