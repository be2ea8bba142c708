"""A transfer's progress on a terminal, drawn by tqdm: MiB done of the total, the current rate
in MiB/s and the time left, on one line of stderr."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Never, TextIO

from blobha.cli.output import Chatter

if TYPE_CHECKING:
    from tqdm import tqdm

    from blobha.client import ProgressCallback

MIB = 1024 * 1024
# One unit system throughout: tqdm's own scaling would show sizes in binary units but the rate
# in decimal ones, so sizes are counted in MiB here and tqdm does no scaling of its own.
_UNIT = " MiB"
_WITH_TOTAL = ("{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.1f} MiB"
               " [{elapsed}<{remaining}, {rate_noinv_fmt}]")
_WITHOUT_TOTAL = "{desc}: {n:.1f} MiB [{elapsed}, {rate_noinv_fmt}]"
#: Redrawing on every chunk would cost more than the transfer on a fast link.
_REDRAW_SECS = 0.1


class Progress:
    """A :data:`~blobha.client.ProgressCallback` that draws a bar from its first report on (a
    cache hit, which reports nothing, draws nothing). ``total`` < 0: unknown (stdin)."""

    def __init__(self, label: str, stream: TextIO) -> None:
        self._label = label
        self._stream = stream
        self._bar: tqdm[Never] | None = None

    def __call__(self, done: int, total: int) -> None:
        if self._bar is None:
            self._bar = self._open(total)
        elif total > 0 and self._bar.total != total / MIB:
            self._bar.total = total / MIB
        self._bar.update(done / MIB - self._bar.n)

    def _open(self, total: int) -> tqdm[Never]:
        from tqdm import tqdm  # only on a terminal: scripts never load it

        known = total > 0
        return tqdm(
            desc=self._label, total=total / MIB if known else None, file=self._stream,
            unit=_UNIT, bar_format=_WITH_TOTAL if known else _WITHOUT_TOTAL,
            mininterval=_REDRAW_SECS, dynamic_ncols=True, leave=True,
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


@contextlib.contextmanager
def progress_bar(label: str) -> Iterator[ProgressCallback | None]:
    """A progress callback for a transfer when stderr is a terminal and progress is wanted
    (not --no-progress or --quiet), else None."""
    if not Chatter.progress or not sys.stderr.isatty():
        yield None
        return
    bar = Progress(label, sys.stderr)
    try:
        yield bar
    finally:
        bar.close()
