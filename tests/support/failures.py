"""Whether a test's call phase failed, for fixtures that show logs when (and only when) the
test failed. The root conftest records it; cluster fixtures read it at teardown."""

from __future__ import annotations

import pytest

FAILED = pytest.StashKey[bool]()


def failed(node: pytest.Item) -> bool:
    return node.stash.get(FAILED, False)
