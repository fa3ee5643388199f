"""Progress of long work (evaluation, model builds, loading): a ``rich`` bar on a terminal, periodic
log lines otherwise, so a job's log still shows that it moves and how fast."""

from __future__ import annotations

import contextlib
import logging
import sys
import time

log = logging.getLogger("driftrl.progress")


@contextlib.contextmanager
def progress(description: str, total: int, every_s: float = 10.0):
    """Yield ``advance(n)``; a bar on stderr when it is a TTY, else a log line every ``every_s``."""
    if sys.stderr.isatty():
        from rich.progress import Progress

        with Progress(transient=False) as bar:
            task = bar.add_task(description, total=total)
            yield lambda n=1: bar.advance(task, n)
        return
    state = {"done": 0, "t0": time.time(), "last": 0.0}

    def advance(n: int = 1) -> None:
        state["done"] += n
        now = time.time()
        if now - state["last"] >= every_s or state["done"] >= total:
            state["last"] = now
            log.info("%s: %d/%d (%.0fs)", description, state["done"], total, now - state["t0"])

    yield advance
