"""Rank 0's watch on the response cache's capacity: is the cache smaller than the job's names?

A cached name costs three bits of each cycle's AND; an uncached one a slow cycle through rank 0
(every rank's requests gathered there, the plan broadcast back), whose cost grows with the
number of ranks. A job that uses more names a step than the cache holds (a model with more
parameter tensors than ``MPIDDP_CACHE_CAPACITY``, or forward overlap's gradient pieces)
evicts its least recently used names for room, and each comes back through rank 0 the next
time it is submitted: then every step pays slow cycles for most of its names, for ever
(1,500 parameters: 1.19x the step time at 2 ranks, 1.32x at 16 nodes; docs/dev/benchmark-record.md,
"More names than the response cache holds").

The watch counts the names rank 0 admits to the cache and, of those, the ones it had evicted
for room before ("returns"), in windows of an eighth of the capacity (at least 8): the cache
is too small when returns are a quarter or more of a window. A step over the capacity by
half shows it within the next step; by 4% (1,065 names a step in 1,024 places), after about
3 steps. Names used once (``allreduce(loss, name=f"loss{step}")``) are evicted but never
come back. Names that come back rarely (metrics every few hundred steps among names used
once) are a small share of a window (fewer than a 32nd of the capacity at once), so they
grow nothing: a slow cycle once in a while costs less than a larger message every cycle.
After a growth the names evicted from the smaller cache no longer count.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

WINDOW_SHARE = 8                # admissions judged together: an eighth of the capacity ...
MIN_WINDOW = 8
RETURN_SHARE = 4                # ... too small when a quarter of them are returns ...
CACHE_CAPACITY_LIMIT = 1 << 14  # ... and growth stops here (a 6 KiB cycle message)


class CapacityWatch:
    """Counts, on rank 0, admissions to the response cache and returns of evicted names."""

    def __init__(self):
        self._evicted: OrderedDict[str, None] = OrderedDict()   # evicted for room, oldest first
        self.admitted = 0
        self.returned = 0

    def evicted_for_room(self, name: str, capacity: int) -> None:
        """``name`` lost its place to a new one (the cache was full). Remembers the last
        ``capacity`` such names."""
        self._evicted[name] = None
        self._evicted.move_to_end(name)
        while len(self._evicted) > capacity:
            self._evicted.popitem(last=False)

    def admit(self, name: str) -> None:
        """``name`` is being given a place in the cache."""
        self.admitted += 1
        if name in self._evicted:
            del self._evicted[name]
            self.returned += 1

    def too_small(self, capacity: int) -> Optional[tuple[int, int]]:
        """Once a window of admissions has been counted (an eighth of ``capacity``, at least
        8): (returned, admitted) when a quarter or more of them were evicted names coming
        back, else None; counting starts over. None before the window is full."""
        if self.admitted < max(MIN_WINDOW, capacity // WINDOW_SHARE):
            return None
        returned, admitted = self.returned, self.admitted
        self.returned = self.admitted = 0
        return (returned, admitted) if returned * RETURN_SHARE >= admitted else None

    def grown(self) -> None:
        """The cache grew: names evicted from the smaller one say nothing about the larger."""
        self._evicted.clear()
        self.returned = self.admitted = 0
