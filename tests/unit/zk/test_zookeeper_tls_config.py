"""The master's settings for TLS to ZooKeeper (``zookeeper.ssl.*``) and the start-time mode
checks of its secret files, without processes."""

from __future__ import annotations

import logging
import re
import socket
from pathlib import Path

import pytest

from blobha.core.secretfiles import TOKEN_FILE_MODE_MASK, ExposedSecretFile, refuse_exposed
from blobha.master.config import Config, ConfigError
from blobha.master.settings import MasterSettings
from blobha.ops import certgen
from blobha.zk.lockdown import ZkCredentials, ZooKeeperAuthError
from blobha.zk.tls import PinnedZkTls, ZkTls, ZooKeeperTlsError, diagnose


@pytest.mark.parametrize(("overrides", "message"), [
    ({"zookeeper.ssl.enabled": "maybe"}, "zookeeper.ssl.enabled must be true or false"),
    ({"zookeeper.ssl.verify.hostname": 2}, "zookeeper.ssl.verify.hostname must be true"),
    ({"zookeeper.ssl.enabled": True, "zookeeper.ssl.cert": "c.pem"},
     "zookeeper.ssl.cert and zookeeper.ssl.key go together"),
    ({"zookeeper.ssl.ca": "ca.pem"},
     "zookeeper.ssl.ca is set but zookeeper.ssl.enabled is false"),
    ({"zookeeper.ssl.enabled": True, "zookeeper.ssl.ca": 5}, "must be a file path"),
])
def test_bad_zookeeper_tls_configuration_is_refused_in_one_line(
        overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        Config.of(overrides)
    assert "\n" not in str(e.value)


def test_zookeeper_tls_settings_reach_kazoo() -> None:
    assert MasterSettings.from_config(Config.of()).zk_tls is None
    s = MasterSettings.from_config(Config.of({
        "zookeeper.ssl.enabled": "true", "zookeeper.ssl.ca": "ca.pem",
        "zookeeper.ssl.cert": "c.pem", "zookeeper.ssl.key": "k.pem"}))
    assert s.zk_tls == ZkTls("ca.pem", "c.pem", "k.pem", True)
    assert s.zk_tls.kazoo_args() == {"use_ssl": True, "ca": "ca.pem", "certfile": "c.pem",
                                     "keyfile": "k.pem", "verify_certs": True,
                                     "check_hostname": True}
    assert ZkTls(verify_hostname=False).kazoo_args()["ca"] is None


def test_unusable_zookeeper_tls_files_name_their_setting(tmp_path: Path) -> None:
    with pytest.raises(ZooKeeperTlsError, match=r"cannot use zookeeper\.ssl\.ca"):
        ZkTls(ca=str(tmp_path / "missing.pem")).context()
    ca = certgen.make_ca(tmp_path)
    mine = certgen.issue(ca, tmp_path, "mine", "mine")
    other = certgen.issue(ca, tmp_path, "other", "other")
    with pytest.raises(ZooKeeperTlsError, match=r"cannot use zookeeper\.ssl\.cert"):
        ZkTls(str(ca.cert), str(mine.cert), str(other.key)).context()
    assert ZkTls(str(ca.cert), str(mine.cert), str(mine.key)).context() is not None


def test_nothing_listening_is_no_tls_matter() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: refused
        assert diagnose(address, None, timeout=1) is None
        assert diagnose(address + "/chroot", ZkTls(), timeout=1) is None


@pytest.mark.parametrize(("mode", "refused"), [
    (0o600, False), (0o400, False), (0o640, True), (0o604, True), (0o620, True), (0o644, True),
])
def test_keys_must_be_private(tmp_path: Path, mode: int, refused: bool) -> None:
    key = tmp_path / "key.pem"
    key.write_text("x")
    key.chmod(mode)
    if not refused:
        refuse_exposed(str(key), "tls.key")
        return
    with pytest.raises(ExposedSecretFile) as e:
        refuse_exposed(str(key), "tls.key")
    assert str(e.value).startswith(f"tls.key {key} can be ")
    assert f"(mode {mode:04o}); run 'chmod 600 {key}' and start again" in str(e.value)


@pytest.mark.parametrize(("mode", "refused"), [
    (0o600, False), (0o640, False), (0o660, True), (0o604, True), (0o602, True),
])
def test_the_token_file_may_be_shared_with_a_group_to_read_only(
        tmp_path: Path, mode: int, refused: bool) -> None:
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("x")
    tokens.chmod(mode)
    if not refused:
        refuse_exposed(str(tokens), "auth.token.file", TOKEN_FILE_MODE_MASK)
        return
    with pytest.raises(ExposedSecretFile, match="or 640, to share it with a group"):
        refuse_exposed(str(tokens), "auth.token.file", TOKEN_FILE_MODE_MASK)


def test_a_missing_file_is_left_to_its_reader(tmp_path: Path) -> None:
    refuse_exposed(str(tmp_path / "missing"), "tls.key")


def test_zookeeper_credentials_readable_by_others_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "zk"
    path.write_text("blobha:s3cret\n")
    path.chmod(0o644)
    with pytest.raises(ZooKeeperAuthError, match=re.escape(f"chmod 600 {path}")):
        ZkCredentials.from_file(path)


def test_kazoo_gets_a_copy_of_the_zookeeper_tls_files_renewed_only_when_they_pass(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # kazoo loads zookeeper.ssl.cert and .key at every connection: a key made readable by
    # others (or not matching its certificate) after the start must not come in that way.
    ca = certgen.make_ca(tmp_path / "ca")
    mine = certgen.issue(ca, tmp_path / "mine", "m", "m")
    pinned = PinnedZkTls(ZkTls(str(ca.cert), str(mine.cert), str(mine.key)), tmp_path / "copy")
    try:
        copy = Path(pinned.pinned.cert)
        assert pinned.pinned.key == pinned.pinned.cert and pinned.pinned.ca == str(ca.cert)
        assert copy.stat().st_mode & 0o077 == 0 and (tmp_path / "copy").stat().st_mode & 0o077 == 0
        pinned.pinned.context()  # what kazoo loads: certificate and key, from the one file
        first = copy.read_bytes()
        assert mine.key.read_bytes() in first

        renewed = certgen.issue(ca, tmp_path / "renewed", "m", "m")
        mine.key.chmod(0o644)
        mine.key.write_bytes(renewed.key.read_bytes())
        mine.cert.write_bytes(renewed.cert.read_bytes())
        with caplog.at_level(logging.ERROR, logger="blobha.tls"):
            pinned.refresh()
            pinned.refresh()  # said once per change, not at every connection
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1 and (f"zookeeper.ssl.key {mine.key} can be read by other accounts"
                                   f" (mode 0644); run 'chmod 600 {mine.key}'") in said[0]
        assert "keeping the previous" in said[0]
        assert copy.read_bytes() == first

        mine.key.chmod(0o600)  # the fix: taken at the next connection
        pinned.refresh()
        assert renewed.key.read_bytes() in copy.read_bytes()
        pinned.pinned.context()

        other = certgen.issue(ca, tmp_path / "other", "o", "o")
        mine.key.write_bytes(other.key.read_bytes())  # a renewal half done: not a pair
        pinned.refresh()
        assert renewed.key.read_bytes() in copy.read_bytes()
    finally:
        pinned.close()
    assert not (tmp_path / "copy").exists()
