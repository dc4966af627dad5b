"""Workers in threads, as the in-process stand-ins run replicas and stages side by side."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_in_threads(count: int, work: Callable[[int], None]) -> None:
    """``work(i)`` for i < count, each in its own thread; the first error is raised after all have ended."""
    errors: list[BaseException] = []

    def guarded(index: int) -> None:
        try:
            work(index)
        except BaseException as e:  # surfaced after the join
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
