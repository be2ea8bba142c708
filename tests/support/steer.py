"""Steering a client's random choices in tests."""

from __future__ import annotations

import random
from collections.abc import MutableSequence, Sequence
from typing import Any


class Steer(random.Random):
    """The client's random picks, steered so that ``first`` is always tried first."""

    def __init__(self, first: str) -> None:
        super().__init__(0)
        self.first = first

    def choice(self, seq: Sequence[Any]) -> Any:
        return self.first if self.first in seq else seq[0]

    def shuffle(self, x: MutableSequence[Any]) -> None:  # type: ignore[override]
        x[:] = sorted(x, key=lambda a: a != self.first)
