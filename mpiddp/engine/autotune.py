"""Autotune (``MPIDDP_AUTOTUNE=1``): rank 0 searches the engine's settings while the job trains.

What is searched (``Knobs``): the fusion threshold, the cycle time and the ring threshold
(continuous, on a log scale) and the hierarchical all-reduce on or off (a switch). A value set
explicitly in the environment is left alone, and so is a knob that cannot matter here (the
ring threshold when the algorithm is forced, the hierarchical switch where the layout does
not allow it): the engine reports those as ``None``.

How a sample is scored: after each change the engine settles for ``autotune_warmup_windows``
windows, then ``autotune_windows`` windows are measured and the median is the sample's score,
in bytes all-reduced per microsecond of wall time. A window closes when some all-reduce name
has been executed ``autotune_steps_per_window`` times in it: a name repeats once per training
step, so a window is whole steps, and bytes per time is then the inverse of the step time.

How the next settings are chosen: the starting settings first, then a few spread over the
space (a Latin hypercube), then Bayesian optimisation (``bayes.py``) until
``autotune_max_samples``; the best (``bayes.best_sampled``) stays for the rest of the run and
is logged as the ``MPIDDP_*`` values that pin it.

Only rank 0 holds an ``Autotuner``; the engine carries its choice to every rank in rank 0's
plan (``protocol.py``: a ``Retune``), and every rank applies it at the start of the same cycle.
"""
from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from ..buffers.dtypes import dtype_named
from ..config import Settings
from . import bayes
from .request import ALLREDUCE

log = logging.getLogger("mpiddp")


@dataclass(frozen=True)
class Knobs:
    """The settings autotune changes, as every rank applies them. ``None``: not tuned here
    (the rank keeps what it has)."""

    fusion_threshold: int
    cycle_time: float                       # ms
    ring_threshold: Optional[int] = None    # bytes, for the automatic algorithm choice
    hierarchical: Optional[bool] = None     # True: 'auto', False: '0'

    def pin(self) -> str:
        """The environment that pins these settings."""
        parts = [f"MPIDDP_FUSION_THRESHOLD={self.fusion_threshold}",
                 f"MPIDDP_CYCLE_TIME={self.cycle_time:g}"]
        if self.ring_threshold is not None:
            parts.append(f"MPIDDP_RING_THRESHOLD={self.ring_threshold}")
        if self.hierarchical is not None:
            parts.append(f"MPIDDP_HIERARCHICAL_ALLREDUCE={'auto' if self.hierarchical else 0}")
        return " ".join(parts)


@dataclass(frozen=True)
class Retune:
    """Rank 0's decision that travels in its plan: the settings, and which sample they are
    (``final``: the search is over, these stay)."""

    knobs: Knobs
    sample: int
    final: bool = False


@dataclass(frozen=True)
class Range:
    """A continuous knob's search range, searched on a log scale."""

    low: float
    high: float
    integer: bool

    def to_unit(self, value: float) -> float:
        value = min(max(value, self.low), self.high)
        return math.log(value / self.low) / math.log(self.high / self.low)

    def from_unit(self, unit: float):
        value = self.low * (self.high / self.low) ** float(unit)
        return int(round(value / 1024) * 1024) if self.integer else round(value, 1)


KiB, MiB = 1024, 1024 * 1024
# Fusion: from fusing only small tensors to whole models; cycle time: 1 ms heartbeats (many
# idle cycles) to 100 ms; ring threshold: the ring from 16 KiB up to never below 64 MiB.
RANGES = {"fusion_threshold": Range(64 * KiB, 64 * MiB, True),
          "cycle_time": Range(1.0, 100.0, False),
          "ring_threshold": Range(16 * KiB, 64 * MiB, True)}
SWITCHES = {"hierarchical": "hierarchical_allreduce"}    # knob -> its setting
SETTING_OF = {"fusion_threshold": "fusion_threshold", "cycle_time": "cycle_time",
              "ring_threshold": "ring_threshold", **SWITCHES}
# Spread-out samples after the starting one, before the optimisation proper.
INITIAL_SPREAD = 4


def tuned_knobs(start: Knobs, settings: Settings) -> tuple[list, list]:
    """(continuous, switch) knob names to search: applicable here and not set explicitly."""
    def free(name):
        return getattr(start, name) is not None and SETTING_OF[name] not in settings.explicit
    return [n for n in RANGES if free(n)], [n for n in SWITCHES if free(n)]


def allreduce_bytes(responses) -> tuple[list, int]:
    """(names, bytes) of the successful all-reduces in a cycle's agreed list."""
    names, total = [], 0
    for response in responses:
        request = response.request
        if request.kind == ALLREDUCE and response.error is None:
            names.append(response.name)
            total += request.numel * dtype_named(request.dtype).itemsize
    return names, total


class Window:
    """Bytes all-reduced between two points of time that are whole steps apart: from the
    start of the first cycle that reduces something to the start of the cycle that reduces
    a name for the ``steps + 1``-th time."""

    def __init__(self):
        self.start, self.bytes, self.counts = None, 0, {}

    def add(self, names: list, nbytes: int, steps: int, now: float) -> Optional[float]:
        """Count a cycle's all-reduces (seen before it runs). When one of its names has run
        ``steps`` times already, the window closes: returns its score (bytes per us) and
        starts over at ``now`` with this cycle."""
        score = None
        if self.start is None:
            self.start = now
        elif any(self.counts.get(name, 0) >= steps for name in names):
            elapsed_us = (now - self.start) * 1e6
            score = self.bytes / elapsed_us if elapsed_us > 0 else 0.0
            self.start, self.bytes, self.counts = now, 0, {}
        for name in names:
            self.counts[name] = self.counts.get(name, 0) + 1
        self.bytes += nbytes
        return score


class CsvLog:
    """``MPIDDP_AUTOTUNE_LOG``: one line per sample, then the best (rank 0 writes it)."""

    COLUMNS = ("sample", "kind", "fusion_threshold", "cycle_time_ms", "ring_threshold",
               "hierarchical", "score_bytes_per_us", "window_scores")

    def __init__(self, path: str):
        self.path = path
        if path:
            with open(path, "w") as f:
                f.write(",".join(self.COLUMNS) + "\n")

    def write(self, sample: int, kind: str, knobs: Knobs, score: float, windows=()) -> None:
        if not self.path:
            return
        values = (sample, kind, knobs.fusion_threshold, f"{knobs.cycle_time:g}",
                  "" if knobs.ring_threshold is None else knobs.ring_threshold,
                  "" if knobs.hierarchical is None else int(knobs.hierarchical),
                  f"{score:.4f}", ";".join(f"{s:.4f}" for s in windows))
        with open(self.path, "a") as f:
            f.write(",".join(map(str, values)) + "\n")


class Autotuner:
    """Rank 0's search (see the module docstring). The engine calls ``observe`` with each
    cycle's agreed list before running it and ``applied`` when a ``Retune`` takes effect;
    ``observe`` returns the next ``Retune`` to announce, or None."""

    def __init__(self, settings: Settings, start: Knobs, seed: int = 0):
        self.settings = settings
        self.start = start
        self.continuous, self.switches = tuned_knobs(start, settings)
        self.rng = np.random.default_rng(seed)
        self.log = CsvLog(settings.autotune_log)
        self.points: list = []          # unit-cube coordinates of the samples
        self.knobs: list = []           # the samples' settings
        self.scores: list = []          # their scores
        self.current = start
        self.finished = not (self.continuous or self.switches)
        self.waiting = False            # a Retune is announced and not yet applied
        spread = min(INITIAL_SPREAD, settings.autotune_max_samples - 1)
        self._spread = list(bayes.latin_hypercube(spread, len(self.continuous), self.rng)) \
            if spread > 0 else []
        if self.finished:
            log.warning("mpiddp autotune: nothing to tune (every knob is set explicitly or "
                        "does not apply here)")
        # The first sample also settles the engine's start (negotiation, first buffers).
        self._begin(extra_warmup=1)

    def _begin(self, extra_warmup: int = 0) -> None:
        self.window = Window()
        self.warmup = self.settings.autotune_warmup_windows + extra_warmup
        self.window_scores: list = []

    def applied(self, retune: Retune) -> None:
        self.current, self.waiting = retune.knobs, False
        if retune.final:
            self.finished = True
        else:
            self._begin()

    def observe(self, responses, now: float) -> Optional[Retune]:
        if self.finished or self.waiting:
            return None
        names, nbytes = allreduce_bytes(responses)
        if not names:
            return None
        score = self.window.add(names, nbytes, self.settings.autotune_steps_per_window, now)
        if score is None:
            return None
        if self.warmup > 0:
            self.warmup -= 1
            return None
        self.window_scores.append(score)
        if len(self.window_scores) < self.settings.autotune_windows:
            return None
        return self._scored(statistics.median(self.window_scores))

    # ---- the search -----------------------------------------------------------------------
    def _unit(self, knobs: Knobs) -> list:
        point = [RANGES[n].to_unit(getattr(knobs, n)) for n in self.continuous]
        return point + [float(getattr(knobs, n)) for n in self.switches]

    def _knobs(self, point) -> Knobs:
        values = {n: RANGES[n].from_unit(point[i]) for i, n in enumerate(self.continuous)}
        offset = len(self.continuous)
        values.update({n: bool(round(point[offset + i])) for i, n in enumerate(self.switches)})
        return replace(self.start, **values)

    def _scored(self, score: float) -> Retune:
        sample = len(self.scores)
        self.points.append(self._unit(self.current))
        self.knobs.append(self.current)
        self.scores.append(score)
        self.log.write(sample, "start" if sample == 0 else "sample", self.current, score,
                       self.window_scores)
        log.info("mpiddp autotune: sample %d [%s] scored %.4g bytes/us", sample,
                 self.current.pin(), score)
        self.waiting = True
        limit = self.settings.autotune_max_samples
        if not self.continuous:             # only switches: each combination once
            limit = min(limit, 2 ** len(self.switches))
        if len(self.scores) >= limit:
            best = bayes.best_sampled(self.points, self.scores)
            knobs = self.knobs[best]
            self.log.write(best, "best", knobs, self.scores[best])
            log.warning("mpiddp autotune: done after %d samples; the best (sample %d, %.4g "
                        "bytes/us) stays for the rest of the run. To pin it: %s",
                        len(self.scores), best, self.scores[best], knobs.pin())
            return Retune(knobs, best, final=True)
        return Retune(self._next(), len(self.scores))

    def _next(self) -> Knobs:
        index = len(self.scores) - 1            # samples after the starting one
        if index < len(self._spread):
            point = list(self._spread[index])
            # Switches alternate over the spread, starting with the other value.
            point += [float((index + int(getattr(self.start, n)) + 1) % 2)
                      for n in self.switches]
            return self._knobs(point)
        categories = [(0.0, 1.0)] * len(self.switches)
        point = bayes.propose(self.points, self.scores, len(self.continuous), categories,
                              self.rng)
        return self._knobs(point)
