"""A run's results and how they read: metrics, statistics, table, JSON, progress lines."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Metric:
    name: str
    value: float
    unit: str
    baseline_name: str
    baseline_value: float

    @property
    def ratio(self) -> float:
        if not self.baseline_value or not math.isfinite(self.baseline_value):
            return float("nan")
        return self.value / self.baseline_value

    def as_dict(self) -> dict[str, object]:
        ratio = self.ratio
        return {
            "name": self.name,
            "value": self.value,
            "unit": self.unit,
            "baseline_name": self.baseline_name,
            "baseline_value": self.baseline_value,
            # NaN is not JSON: no baseline means no ratio.
            "ratio": round(ratio, 4) if math.isfinite(ratio) else None,
        }


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of a non-empty sequence."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def format_number(value: float) -> str:
    """A figure with as many decimals as its size deserves: 12,345 / 123.4 / 1.234."""
    if not math.isfinite(value):
        return "-"
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    return f"{value:.3f}"


def format_table(metrics: Sequence[Metric]) -> str:
    header = ("metric", "value", "unit", "baseline", "baseline value", "ratio")
    rows = [
        (m.name, format_number(m.value), m.unit, m.baseline_name or "-",
         format_number(m.baseline_value) if m.baseline_name else "-",
         f"{m.ratio:.2f}x" if math.isfinite(m.ratio) else "-")
        for m in metrics
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    right = {1, 4, 5}  # numbers line up on the right

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def format_json(metrics: Sequence[Metric]) -> str:
    return json.dumps([m.as_dict() for m in metrics], indent=2)


def mb_per_s(nbytes: int, secs: float) -> float:
    """Throughput in MB/s (10^6 bytes, as dd reports it)."""
    return nbytes / 1e6 / secs if secs > 0 else float("inf")


class Log:
    """Progress lines on stderr, stamped with the time since the run began."""

    def __init__(self, stream: Any = None) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._t0 = time.monotonic()
        self.notes: list[str] = []

    def say(self, message: str) -> None:
        print(f"[{time.monotonic() - self._t0:7.1f}s] {message}", file=self._stream, flush=True)

    def note(self, message: str) -> None:
        """Something a reader of the results must know; repeated under the table."""
        self.notes.append(message)
        self.say(f"note: {message}")
