"""Client profiles (issue 46 §3) with the real command line against a real cluster: the file
found through HOME, XDG_CONFIG_HOME and BLOBHA_CONFIG, a profile chosen by --profile or
BLOBHA_PROFILE, options over the environment over the profile, and a file that cannot be used
said in one line, exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from blobha.client import Client
from blobha.core.errors import NotAuthorized
from blobha.core.profiles import ProfileError
from blobha.ops.localcluster import LocalCluster

pytestmark = pytest.mark.integration

BLOBHA = str(Path(sys.executable).with_name("blobha"))
DEAD = "127.0.0.1:1"  # refuses every connection: a profile naming it fails fast, exit 11


def clean_env(home: Path, **extra: str) -> dict[str, str]:
    """An environment with no BLOBHA_* setting and a home of the test's own."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("BLOBHA_") and k != "XDG_CONFIG_HOME"}
    return {**env, "HOME": str(home), **extra}


def run(env: dict[str, str], *args: str,
        stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([BLOBHA, *args], input=stdin, capture_output=True, env=env,
                          timeout=120, text=stdin is None)


def write_profiles(path: Path, cluster: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"""\
# the test's profiles
[default]
cluster = "{cluster}"
user = "alice"

[profiles.bob]
user = "bob"

[profiles.dead]
cluster = "{DEAD}"
timeout = 30
""")
    return path


@pytest.fixture
def home(tmp_path: Path, cluster: LocalCluster) -> Path:
    """A home whose ~/.config/blobha/client.toml names the cluster, and a blob only alice
    may read."""
    home = tmp_path / "home"
    write_profiles(home / ".config" / "blobha" / "client.toml", cluster.cluster)
    with Client(cluster.cluster, user="alice", timeout=30) as alice:
        alice.put("profiled", b"for alice", acl="u:alice:rwa")
    return home


def test_the_default_profile_and_one_by_name(home: Path) -> None:
    r = run(clean_env(home), "cat", "profiled")
    assert r.returncode == 0 and r.stdout == "for alice", r.stderr
    # [profiles.bob] over [default]: bob, on the default's cluster.
    r = run(clean_env(home), "--profile", "bob", "cat", "profiled")
    assert r.returncode == 5, r.stderr
    r = run(clean_env(home, BLOBHA_PROFILE="bob"), "cat", "profiled")
    assert r.returncode == 5, r.stderr
    # The flag names the profile over BLOBHA_PROFILE.
    r = run(clean_env(home, BLOBHA_PROFILE="bob"), "cat", "profiled", "--profile", "default")
    assert r.returncode == 0, r.stderr


def test_flags_over_environment_over_profile(home: Path, cluster: LocalCluster) -> None:
    # The profile's user, then BLOBHA_USER over it, then --user over both.
    assert run(clean_env(home), "--profile", "bob", "cat", "profiled").returncode == 5
    r = run(clean_env(home, BLOBHA_USER="alice"), "--profile", "bob", "cat", "profiled")
    assert r.returncode == 0 and r.stdout == "for alice", r.stderr
    r = run(clean_env(home, BLOBHA_USER="bob"), "--user", "alice", "--profile", "bob",
            "cat", "profiled")
    assert r.returncode == 0, r.stderr
    # The profile's cluster (nobody there), then BLOBHA_CLUSTER, then --cluster.
    started = time.monotonic()
    r = run(clean_env(home), "--profile", "dead", "list")
    assert r.returncode == 11 and f"{DEAD}: " in r.stderr, r.stderr
    assert time.monotonic() - started < 10
    r = run(clean_env(home, BLOBHA_CLUSTER=cluster.cluster), "--profile", "dead", "list")
    assert r.returncode == 0 and "profiled" in r.stdout.split(), r.stderr
    r = run(clean_env(home, BLOBHA_CLUSTER=DEAD), "--cluster", cluster.cluster, "list")
    assert r.returncode == 0 and "profiled" in r.stdout.split(), r.stderr


def test_the_profile_timeout_bounds_wait_replication(home: Path, tmp_path: Path) -> None:
    config = tmp_path / "short.toml"
    config.write_text((home / ".config" / "blobha" / "client.toml").read_text()
                      .replace("user = \"alice\"", "user = \"alice\"\ntimeout = 1.5", 1))
    env = clean_env(home, BLOBHA_CONFIG=str(config))
    r = run(env, "wait-replication", "profiled", "--min", "9", "--json")
    assert r.returncode == 12, r.stderr
    assert 1.0 <= json.loads(r.stdout)["waited_secs"] < 10
    # BLOBHA_TIMEOUT over the profile's.
    r = run({**env, "BLOBHA_TIMEOUT": "0.2"}, "wait-replication", "profiled", "--min", "9",
            "--json")
    assert r.returncode == 12 and json.loads(r.stdout)["waited_secs"] < 1.0, r.stdout


def test_xdg_config_home_and_blobha_config(home: Path, tmp_path: Path,
                                           cluster: LocalCluster) -> None:
    xdg = tmp_path / "xdg"
    write_profiles(xdg / "blobha" / "client.toml", DEAD)
    # XDG_CONFIG_HOME over ~/.config: its default names a cluster where nobody answers.
    r = run(clean_env(home, XDG_CONFIG_HOME=str(xdg)), "list")
    assert r.returncode == 11, r.stderr
    # BLOBHA_CONFIG over both.
    elsewhere = write_profiles(tmp_path / "elsewhere.toml", cluster.cluster)
    r = run(clean_env(home, XDG_CONFIG_HOME=str(xdg), BLOBHA_CONFIG=str(elsewhere)), "list")
    assert r.returncode == 0 and "profiled" in r.stdout.split(), r.stderr
    # No file anywhere, none asked for: the built-in defaults (nobody at 127.0.0.1:6627 here
    # would be exit 11 too, so only the absence of a usage error is checked).
    r = run(clean_env(tmp_path / "empty-home"), "--cluster", cluster.cluster, "list")
    assert r.returncode in (0, 5), r.stderr


@pytest.mark.parametrize(("text", "said"), [
    ('[default]\nuser = "alice\n', "not valid TOML: Illegal character '\\n' (at line 2,"),
    ('[default]\nuser = "alice"\n\n[profiles.prod]\nclustr = "h:1"\n',
     ", line 5: [profiles.prod] has no setting 'clustr' (known: cluster, user, ca, cert,"),
    ('[profiles.prod]\ntimeout = "soon"\n',
     ", line 2: [profiles.prod] timeout: expected a number of seconds, not 'soon'"),
    ('[default]\ncluster = "a:b:c"\n[profiles.prod]\n',
     ", line 2: [default] cluster: bad master address"),
    ('[prod]\nuser = "alice"\n', ", line 1: unexpected 'prod': settings go in [default] or"),
])
def test_a_file_that_cannot_be_used_is_one_line_and_exit_2(tmp_path: Path, text: str,
                                                            said: str) -> None:
    config = tmp_path / "client.toml"
    config.write_text(text)
    r = run(clean_env(tmp_path, BLOBHA_CONFIG=str(config), BLOBHA_PROFILE="prod"), "list")
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"blobha: error: {config}"), r.stderr
    assert said in r.stderr, r.stderr


def test_an_unknown_profile_lists_the_known_ones(home: Path) -> None:
    r = run(clean_env(home), "--profile", "staging", "list")
    assert r.returncode == 2, r.stderr
    assert "no profile 'staging' (known: bob, dead, default)" in r.stderr
    r = run(clean_env(home), "--profile", "staging", "list", "--json")
    error = json.loads(r.stdout)["error"]
    assert (error["code"], error["exit"]) == ("usage", 2) and "known: bob" in error["message"]
    # A profile asked for where there is no file at all.
    r = run(clean_env(home.parent / "nobody"), "--profile", "prod", "list")
    assert r.returncode == 2 and "no such file (profile 'prod' asked for)" in r.stderr


def test_client_from_profile(home: Path, tmp_path: Path, cluster: LocalCluster,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    config = home / ".config" / "blobha" / "client.toml"
    for variable in ("BLOBHA_CLUSTER", "BLOBHA_USER", "BLOBHA_PROFILE", "BLOBHA_CONFIG"):
        monkeypatch.delenv(variable, raising=False)
    with Client.from_profile(path=config) as c:
        assert c.user == "alice" and c.read("profiled") == b"for alice"
    with Client.from_profile("bob", path=config) as c, pytest.raises(NotAuthorized):
        c.read("profiled")
    with Client.from_profile("bob", path=config, user="alice") as c:
        assert c.read("profiled") == b"for alice"
    monkeypatch.setenv("BLOBHA_USER", "alice")
    with Client.from_profile("bob", path=config) as c:
        assert c.user == "alice"
    with pytest.raises(ProfileError, match="known: bob, dead, default"):
        Client.from_profile("staging", path=config)
