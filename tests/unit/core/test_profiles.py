"""The client profile file (blobha.core.profiles): where it is, [default] under a named
profile, paths relative to the file, and errors that name the file and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from blobha.core.profiles import Profile, ProfileError, load, profile_path


def test_where_the_file_is(tmp_path: Path) -> None:
    home = Path("~").expanduser()
    assert profile_path({}) == home / ".config" / "blobha" / "client.toml"
    assert profile_path({"XDG_CONFIG_HOME": str(tmp_path)}) == tmp_path / "blobha" / "client.toml"
    # A relative XDG_CONFIG_HOME is ignored, as the XDG spec says.
    assert profile_path({"XDG_CONFIG_HOME": "rel"}) == profile_path({})
    assert profile_path({"XDG_CONFIG_HOME": str(tmp_path), "BLOBHA_CONFIG": "/etc/b.toml"}) \
        == Path("/etc/b.toml")


def test_a_named_profile_over_the_default(tmp_path: Path) -> None:
    path = tmp_path / "client.toml"
    path.write_text('[default]\nuser = "alice"\nca = "ca.pem"\ntimeout = 30\n\n'
                    '[profiles.prod]\ncluster = ["p1:6627", "p2:6627"]\nuser = "svc"\n'
                    'token_file = "/secrets/svc.token"\n')
    assert load(None, path, {}).environment() == {
        "BLOBHA_USER": "alice", "BLOBHA_CA": str(tmp_path / "ca.pem"), "BLOBHA_TIMEOUT": "30.0"}
    prod = load(None, path, {"BLOBHA_PROFILE": "prod"})
    assert prod.name == "prod" and prod.environment() == {
        "BLOBHA_USER": "svc", "BLOBHA_CA": str(tmp_path / "ca.pem"), "BLOBHA_TIMEOUT": "30.0",
        "BLOBHA_CLUSTER": "p1:6627,p2:6627", "BLOBHA_TOKEN_FILE": "/secrets/svc.token"}
    assert load("default", path, {"BLOBHA_PROFILE": "prod"}).values["user"] == "alice"


def test_no_file_is_no_profile_unless_one_is_asked_for(tmp_path: Path) -> None:
    missing = tmp_path / "none.toml"
    assert load(None, None, {"XDG_CONFIG_HOME": str(tmp_path)}) == Profile()
    with pytest.raises(ProfileError, match="no such file \\(profile 'prod' asked for\\)"):
        load("prod", None, {"XDG_CONFIG_HOME": str(tmp_path)})
    with pytest.raises(ProfileError, match="no such file \\(named by \\$BLOBHA_CONFIG\\)"):
        load(None, None, {"BLOBHA_CONFIG": str(missing)})


@pytest.mark.parametrize(("text", "message"), [
    ("[default]\nuser = 'a'\n[profiles.x]\nuser = 3\n",
     ", line 4: [profiles.x] user: expected a non-empty string, not 3"),
    ("[default]\ntimeout = true\n", ", line 2: [default] timeout: expected a number of"),
    ("[profiles]\nx = 1\n", ", line 2: profiles.x must be a table"),
    ("[profiles.default]\nuser = 'a'\n", ", line 1: the default profile is [default]"),
    ("user = 'a'\n", ": unexpected 'user': settings go in [default] or [profiles.NAME]"),
])
def test_errors_name_the_file_and_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "client.toml"
    path.write_text(text)
    with pytest.raises(ProfileError) as info:
        load("x" if "profiles.x" in text else None, path, {})
    assert str(info.value).startswith(str(path)) and message in str(info.value), info.value
