"""Client profiles: named sets of client settings (cluster, user, credentials, timeout) in one
TOML file, read by the command line and by ``Client.from_profile``.

The file is ``$BLOBHA_CONFIG``, else ``$XDG_CONFIG_HOME/blobha/client.toml`` (``~/.config``
without XDG_CONFIG_HOME). ``[default]`` holds the settings used when no profile is named, and
under every named one; ``[profiles.NAME]`` holds a profile's own::

    [default]
    user = "alice"

    [profiles.prod]
    cluster = "prod-1:6627,prod-2:6627,prod-3:6627"
    ca = "prod-ca.pem"            # relative paths: to this file's directory
    token_file = "~/.blobha/prod.token"
    timeout = 120

A profile's settings stand in for the ``BLOBHA_*`` variables that are not set
(:data:`ENVIRONMENT`): whatever sets one of those, or a command-line option, wins.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from blobha.core import settings
from blobha.core.addresses import parse_cluster
from blobha.core.errors import InvalidArgument

ENV_CONFIG = "BLOBHA_CONFIG"
ENV_PROFILE = "BLOBHA_PROFILE"
DEFAULT = "default"

#: Each setting and the variable it stands in for.
ENVIRONMENT: dict[str, str] = {
    "cluster": "BLOBHA_CLUSTER",
    "user": "BLOBHA_USER",
    "ca": "BLOBHA_CA",
    "cert": "BLOBHA_CERT",
    "tls_key": "BLOBHA_KEY",
    "token_file": "BLOBHA_TOKEN_FILE",
    "timeout": "BLOBHA_TIMEOUT",
    "require_tls": "BLOBHA_REQUIRE_TLS",
}
_PATHS = frozenset({"ca", "cert", "tls_key", "token_file"})


class ProfileError(InvalidArgument):
    """The profile file cannot be used: its syntax, a setting, or a profile it lacks. The
    message names the file and, where it can, the line."""


@dataclass(frozen=True)
class Profile:
    """The settings of one profile (``[default]``'s under its own), as text, by setting
    name; ``path``: the file they came from (None: there was none)."""

    name: str = DEFAULT
    path: Path | None = None
    values: dict[str, str] = field(default_factory=dict)

    def environment(self) -> dict[str, str]:
        """The settings as the ``BLOBHA_*`` variables they stand in for."""
        return {ENVIRONMENT[k]: v for k, v in self.values.items()}


def profile_path(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get(ENV_CONFIG):
        return Path(env[ENV_CONFIG]).expanduser()
    base = env.get("XDG_CONFIG_HOME", "")
    # The XDG spec: a relative XDG_CONFIG_HOME is to be ignored.
    root = Path(base) if base and Path(base).is_absolute() else Path("~/.config").expanduser()
    return root / "blobha" / "client.toml"


def load(name: str | None = None, path: Path | None = None,
         env: Mapping[str, str] | None = None) -> Profile:
    """The profile ``name`` (None: ``$BLOBHA_PROFILE``, else the default one) from ``path``
    (None: :func:`profile_path`). No file is no profile, unless one was asked for by name or
    by ``$BLOBHA_CONFIG``."""
    env = os.environ if env is None else env
    chosen = name or env.get(ENV_PROFILE) or None
    if chosen:
        why = f"profile {chosen!r} asked for"
    elif path is not None:
        why = "the file asked for"
    else:
        why = f"named by ${ENV_CONFIG}" if env.get(ENV_CONFIG) else ""
    path = path or profile_path(env)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if why:
            raise ProfileError(f"{path}: no such file ({why})") from None
        return Profile()
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"{path}: cannot read it: {exc}") from None
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path}: not valid TOML: {exc}") from None
    return _choose(_Document(path, text, document), chosen)


class _Document:
    def __init__(self, path: Path, text: str, data: dict[str, object]) -> None:
        self.path = path
        self.lines = text.splitlines()
        self.data = data

    def error(self, table: str, key: str, message: str) -> ProfileError:
        line = self._line(table, key)
        where = f"{self.path}, line {line}" if line else str(self.path)
        return ProfileError(f"{where}: {message}")

    def _line(self, table: str, key: str) -> int | None:
        """Where ``key`` of ``[table]`` is written (the table's header when key is "")."""
        current = ""
        for n, line in enumerate(self.lines, 1):
            header = _HEADER.match(line)
            if header:
                current = re.sub(r"[\s\"']", "", header.group(1))
                if not key and current == table:
                    return n
                continue
            if key and current == table and re.match(rf"\s*[\"']?{re.escape(key)}[\"']?\s*=",
                                                     line):
                return n
        return None


_HEADER = re.compile(r"\s*\[([^\[\]]+)\]\s*(#.*)?$")


def _choose(doc: _Document, chosen: str | None) -> Profile:
    tables: dict[str, dict[str, object]] = {}
    for key, value in doc.data.items():
        if key == DEFAULT and isinstance(value, dict):
            tables[DEFAULT] = value
        elif key == "profiles" and isinstance(value, dict):
            for name, table in value.items():
                if not isinstance(table, dict):
                    raise doc.error("profiles", name,
                                    f"profiles.{name} must be a table: [profiles.{name}]")
                if name == DEFAULT:
                    raise doc.error(f"profiles.{name}", "",
                                    "the default profile is [default], not [profiles.default]")
                tables[name] = table
        else:
            raise doc.error(key, "", f"unexpected {key!r}: settings go in [default] or"
                            " [profiles.NAME]")
    if chosen is not None and chosen not in tables:
        known = ", ".join(sorted(tables)) or "none"
        raise ProfileError(f"{doc.path}: no profile {chosen!r} (known: {known})")
    values: dict[str, str] = {}
    for name in dict.fromkeys((DEFAULT, chosen or DEFAULT)):
        header = name if name == DEFAULT else f"profiles.{name}"
        for key, value in tables.get(name, {}).items():
            values[key] = _setting(doc, header, key, value)
    return Profile(chosen or DEFAULT, doc.path, values)


def _setting(doc: _Document, table: str, key: str, value: object) -> str:
    if key not in ENVIRONMENT:
        raise doc.error(table, key, f"[{table}] has no setting {key!r} (known: "
                        + ", ".join(ENVIRONMENT) + ")")
    if key == "timeout":
        try:
            if isinstance(value, str):
                raise settings.SettingError("expected a number of seconds")
            return repr(settings.real(value))
        except settings.SettingError:
            raise doc.error(table, key, f"[{table}] timeout: expected a number of seconds,"
                            f" not {value!r}") from None
    if key == "require_tls":
        if not isinstance(value, bool):
            raise doc.error(table, key, f"[{table}] require_tls: expected true or false, not"
                            f" {value!r}")
        return "1" if value else "0"
    if key == "cluster" and isinstance(value, list) and all(isinstance(v, str) for v in value):
        value = ",".join(value)
    if not isinstance(value, str) or not value.strip():
        raise doc.error(table, key, f"[{table}] {key}: expected a non-empty string, not"
                        f" {value!r}")
    if key == "cluster":
        try:
            parse_cluster(value)
        except InvalidArgument as exc:
            raise doc.error(table, key, f"[{table}] cluster: {exc}") from None
    if key in _PATHS:
        # Relative to the file, so a profile works from any directory.
        path = Path(value).expanduser()
        return str(path if path.is_absolute() else doc.path.parent / path)
    return value
