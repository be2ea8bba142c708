"""Waiting on a condition with a deadline: the one way tests synchronise with the cluster."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")


def wait_until(
    condition: Callable[[], T], timeout: float = 10.0, what: str = "", interval: float = 0.05
) -> T:
    """Poll ``condition`` until it returns something truthy; fail the test at the deadline.

    Exceptions count as "not yet": the cluster may refuse calls while it converges.
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            result = condition()
            if result:
                return result
            last = result
        except Exception as e:
            last = e
        if time.monotonic() >= deadline:
            pytest.fail(
                f"timed out after {timeout}s waiting for {what or condition} (last: {last!r})"
            )
        time.sleep(interval)
