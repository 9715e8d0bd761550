"""Rank 0's watch on the response cache's capacity: is the cache smaller than the job's names?

A cached name costs one bit of each cycle's AND; an uncached one a slow cycle through rank 0
(every rank's requests gathered there, the plan broadcast back), whose cost grows with the
number of ranks. A job that uses more names a step than the cache holds (a model with more
parameter tensors than ``MPIDDP_CACHE_CAPACITY``, or forward overlap's gradient pieces)
evicts its least recently used names for room, and each comes back through rank 0 the next
time it is submitted: then every step pays slow cycles for most of its names (1,500
parameters on 2 ranks: 116-145 ms a step with 1,024 places, 71 ms with 4,096;
docs/benchmarks.md "More names than the response cache holds").

The watch counts the names rank 0 admits to the cache and, of those, the ones it had evicted
for room before. When such returns reach a quarter of a window of 64 admissions (fewer in a
smaller cache), the cache is too small for the names the job keeps using: a
step over the capacity by even a few percent shows it within that step. Names used once
(``allreduce(loss, name=f"loss{step}")``) are evicted too, but never come back, so a job
full of them does not count as one that needs more room; names that do come back stop
coming back once the cache has grown past the distance between their uses.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

WINDOW = 64                     # admissions judged together ...
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
        """(returned, admitted) as soon as a quarter of a window of admissions (``WINDOW``,
        or ``capacity`` if less) were evicted names coming back, and counting starts over;
        else None (and counting starts over once the window is full)."""
        window = min(WINDOW, capacity)
        returned, admitted = self.returned, self.admitted
        if returned * RETURN_SHARE >= window:
            self.returned = self.admitted = 0
            return returned, admitted
        if admitted >= window:
            self.returned = self.admitted = 0
        return None

    def grown(self) -> None:
        """The cache grew: names evicted from the smaller one say nothing about the larger."""
        self._evicted.clear()
        self.returned = self.admitted = 0
