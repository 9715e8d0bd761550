"""``overlap_forward="auto"``: try forward overlap and the standard path, keep the faster.

Forward overlap pays when the host is free during the forward (a GPU computes; the network
is the bottleneck). When the forward's compute needs the same CPU cores as communication
(CPU training on few cores), running the reductions during the forward slows both, and the
standard path is faster. Which regime a job is in is measured, not guessed: the first steps
alternate between the two, ``PHASE_STEPS`` steps each (the first steps of a phase are not
timed: they carry the switch), twice, and the ranks agree on the faster one through one
all-reduce of their mean step times, so every rank switches at the same step.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional

log = logging.getLogger("mpiddp")

PHASE_STEPS = 6          # steps per phase
UNTIMED_STEPS = 2        # of which the first ones are not timed
PHASES = (True, False, True, False)   # overlap on / off, in this order


class OverlapTrial:
    """Says, at every ``step()``, whether the next step overlaps the forward; ends with a
    decision agreed across ranks (``agree(on_mean, off_mean) -> (on_mean, off_mean)``
    averages them over the ranks)."""

    def __init__(self, agree: Callable[[float, float], tuple], prefix: str, speaks: bool = True):
        self.agree, self.prefix = agree, prefix
        self.speaks = speaks           # this rank logs the decision (one rank of the set)
        self.steps = 0
        self.last: Optional[float] = None
        self.times: dict[bool, list] = {True: [], False: []}
        self.decision: Optional[bool] = None

    @property
    def overlap(self) -> bool:
        """Whether the step now running overlaps (the decision once made)."""
        if self.decision is not None:
            return self.decision
        return PHASES[min(self.steps // PHASE_STEPS, len(PHASES) - 1)]

    def on_step(self) -> bool:
        """Called at every ``step()``; returns whether the next step overlaps."""
        now = time.perf_counter()
        if self.decision is None:
            phase_step = self.steps % PHASE_STEPS
            if self.last is not None and phase_step >= UNTIMED_STEPS:
                self.times[self.overlap].append(now - self.last)
            self.steps += 1
            if self.steps == PHASE_STEPS * len(PHASES):
                self._decide()
        self.last = now
        return self.overlap

    def _decide(self) -> None:
        on = sum(self.times[True]) / len(self.times[True])
        off = sum(self.times[False]) / len(self.times[False])
        on, off = self.agree(on, off)
        self.decision = on <= off
        if not self.speaks:
            return
        log.info("mpiddp forward overlap (%s, auto): step %.1f ms with it, %.1f ms without "
                    "(mean of the ranks); keeping it %s. Pin the choice with "
                    "overlap_forward=%s.", self.prefix, 1e3 * on, 1e3 * off,
                    "on" if self.decision else "off", self.decision)
