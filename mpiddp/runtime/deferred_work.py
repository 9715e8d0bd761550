"""Work a layer above has deferred and must finish before the engine stops or this rank
joins: forward overlap's parameter updates (``torch/gradients/forward_overlap.py``), whose reductions
need the engine. The layers above register a function here; the runtime calls them."""
from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger("mpiddp")

_completers: list[Callable[[], None]] = []


def register(complete: Callable[[], None]) -> None:
    """Call ``complete()`` before ``shutdown()`` and ``join()`` (once registered, always)."""
    if complete not in _completers:
        _completers.append(complete)


def complete_all(quiet: bool = False) -> None:
    """Finish every deferred piece of work. ``quiet`` (at shutdown): a failure is logged,
    not raised, so that the engine still stops."""
    for complete in list(_completers):
        try:
            complete()
        except Exception as exc:
            if not quiet:
                raise
            log.error("mpiddp: deferred work could not finish before shutdown: %s", exc)
