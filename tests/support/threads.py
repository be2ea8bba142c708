"""A test's workers, each on a thread of its own."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_in_threads(work: Callable[[int], None], count: int) -> list[BaseException]:
    """Run ``work(0)`` to ``work(count - 1)`` at once, each on its own thread; once all have
    ended, what they raised (a failed assertion in a worker included)."""
    errors: list[BaseException] = []

    def run(worker: int) -> None:
        try:
            work(worker)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(w,)) for w in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors
