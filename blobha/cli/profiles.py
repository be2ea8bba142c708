"""The command line's client profile (``--profile NAME``, else ``$BLOBHA_PROFILE``, else the
file's ``[default]``): its settings stand in, for the length of one command, for the
``BLOBHA_*`` variables that are not set, so options win over the environment and the
environment over the profile (the file: blobha.core.profiles)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from blobha.core.profiles import load

#: Commands that are no client of a cluster: a broken profile file must not stop them.
WITHOUT_PROFILE = frozenset({"serve", "local-cluster", "completion"})


@contextlib.contextmanager
def profile_environment(name: str | None) -> Iterator[None]:
    """Raises blobha.core.profiles.ProfileError for a file that cannot be used."""
    added = {k: v for k, v in load(name).environment().items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        # Restored: main() may run again in this process (tests, an embedding program).
        for variable, value in added.items():
            if os.environ.get(variable) == value:
                del os.environ[variable]
