"""Checks of the modes of a master's secret files, as ssh checks its keys: a file other
accounts can read (or change) is refused, with the ``chmod`` that fixes it, at start and again
whenever a changed file is read again (a reload keeps the previous one)."""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence

__all__ = [
    "KEY_MODE_MASK",
    "TOKEN_FILE_MODE_MASK",
    "ExposedSecretFile",
    "exposed_mode",
    "exposure",
    "file_stamps",
    "refuse_exposed",
]

#: Private keys and passwords: no access at all for the group or others.
KEY_MODE_MASK = 0o077
#: The token file holds only scrypt hashes, which a group may read (ops sharing it on purpose);
#: but whoever may change it adds a token of their own, and others may not even read it (the
#: hashes of short tokens someone chose by hand can be guessed offline).
TOKEN_FILE_MODE_MASK = 0o027


class ExposedSecretFile(ValueError):
    """A secret file other accounts can reach; the message names it and the fix."""


def exposed_mode(path: str, mask: int = KEY_MODE_MASK, owner_only: bool = False) -> int | None:
    """The permission bits of the file ``path`` when it has one of ``mask``; None when it has
    none, or cannot be examined (whoever reads it reports that better), or, with
    ``owner_only``, another account owns it (as ssh's client leaves a file shared with it on
    purpose to its owner)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    mode = stat.S_IMODE(st.st_mode)
    if not mode & mask or (owner_only and st.st_uid != os.geteuid()):
        return None
    return mode


def exposure(path: str, setting: str, mask: int = KEY_MODE_MASK) -> str | None:
    """What is wrong with the mode of the file ``path`` (the value of ``setting``) and the
    ``chmod`` that fixes it, when it has a permission bit of ``mask``; None when it has none."""
    mode = exposed_mode(path, mask)
    if mode is None:
        return None
    others = "read" if mode & mask & 0o044 else "changed"
    allowed = " (or 640, to share it with a group)" if not mask & 0o040 else ""
    return (f"{setting} {path} can be {others} by other accounts (mode {mode:04o}); run"
            f" 'chmod 600 {path}'{allowed}")


def refuse_exposed(path: str, setting: str, mask: int = KEY_MODE_MASK) -> None:
    """Raise :class:`ExposedSecretFile` if the file ``path`` (the value of ``setting``) has a
    permission bit of ``mask``."""
    problem = exposure(path, setting, mask)
    if problem is not None:
        raise ExposedSecretFile(f"{problem} and start again")


def file_stamps(paths: Sequence[str]) -> tuple[tuple[int, int, int], ...]:
    """(mtime_ns, size, mode) of each file, (0, -1, 0) for one that cannot be read: what
    tells a reloading reader that certificate files changed. The mode is in it so that the
    ``chmod`` which fixes a key refused for its mode brings the key in."""
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((st.st_mtime_ns, st.st_size, st.st_mode))
        except OSError:
            out.append((0, -1, 0))
    return tuple(out)
