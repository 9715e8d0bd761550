"""Small all-reduces carried beside the cycle's negotiation.

A cached all-reduce costs two synchronizations of every rank: the cycle's bit-vector
all-reduce finds it ready everywhere, then its own all-reduce moves the data. For a small
buffer both are nothing but latency (at 16 emulated nodes a synchronous 4 KiB all-reduce
took 3x the MPI library's). So in every cycle each rank also sums, in a second nonblocking
all-reduce started together with the bit vector, a small buffer laid out from the response
cache, which is identical on every rank: each eligible cached name has its place, which this
rank fills with its (prescaled) input when the name is ready here, and with zeros otherwise
(a rank that has joined: zeros, the sum's identity, as the executor's joined ranks give).
Where the bit vector then says that the name is ready on every rank, every rank filled its
place, so the sum there is the result, the same on every rank: the all-reduce is over in
the negotiation. Otherwise the place's sum is discarded and the name waits, as before.

Eligible: cached all-reduces of host memory, Sum or Average, of a type MPI sums natively, of
at most ``budget`` bytes, the most recently cached first until the buffers hold ``budget``
bytes (names cached long ago and never used since give way to the job's current ones; the engine
sizes it from the measured links: ``cost_model.speculation_bytes``). Everything here is
local arithmetic on state every rank holds alike; the channel does the MPI.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from ..buffers.dtypes import dtype_named
from ..buffers.host_reduce import scale_
from ..reduce_ops import ReduceOp
from .request import ALLREDUCE

SUMS = (ReduceOp.SUM, ReduceOp.AVERAGE)


class Place(NamedTuple):
    """Where one cached name's data goes in the cycle's buffers."""

    response: object            # the cached Response (identity: the slot was not reused)
    buffer: int                 # index into Layout.buffers
    start: int                  # element offsets in that buffer
    stop: int


class Layout(NamedTuple):
    buffers: list               # one NumPy array per element type, summed every cycle
    places: dict                # name -> Place


def eligible(request, budget: int) -> bool:
    if request.kind != ALLREDUCE or request.op not in SUMS or request.device_type != "cpu":
        return False
    dtype = dtype_named(request.dtype)
    return dtype.native_reduce and dtype.kind in ("float", "int") and \
        request.numel * dtype.itemsize <= budget


def build_layout(cache, budget: int) -> Optional[Layout]:
    """The places of the eligible cached names, the most recently cached first, up to
    ``budget`` bytes in all (None: nothing eligible). Depends on the cache only (its slots
    in the order they were filled, the same on every rank), so every rank builds the same."""
    places, sizes, by_dtype = {}, [], {}
    used = 0
    for slot in reversed(list(cache.slots())):
        response = cache.response(slot)
        request = response.request
        if response.error is not None or not eligible(request, budget):
            continue
        dtype = dtype_named(request.dtype)
        nbytes = request.numel * dtype.itemsize
        if used + nbytes > budget:
            continue
        used += nbytes
        index = by_dtype.setdefault(dtype.name, len(sizes))
        if index == len(sizes):
            sizes.append([dtype, 0])
        start = sizes[index][1]
        sizes[index][1] += request.numel
        places[response.name] = Place(response, index, start, start + request.numel)
    if not places:
        return None
    return Layout([np.zeros(count, dtype.storage) for dtype, count in sizes], places)


class Speculation:
    """One engine's speculative sums: ``begin`` before the cycle's negotiation, ``finish``
    after it (see the module docstring)."""

    def __init__(self, budget: int):
        self.budget = budget
        self._version = None
        self._layout: Optional[Layout] = None
        self._active: Optional[Layout] = None

    def begin(self, cache, pending: dict) -> list:
        """Fill this cycle's buffers from the pending entries; the arrays to sum across ranks
        (empty where nothing cached is eligible: every rank has the same cache, so all skip
        the sum together)."""
        if self.budget <= 0:
            return []
        if cache.version != self._version:
            self._version = cache.version
            self._layout = build_layout(cache, self.budget)
        layout = self._active = self._layout
        if layout is None:
            return []
        for buffer in layout.buffers:
            buffer.fill(0)
        places, buffers = layout.places, layout.buffers
        for name, entry in pending.items():
            place = places.get(name)
            if place is None or entry.request != place.response.request:
                continue
            part = buffers[place.buffer][place.start:place.stop]
            np.copyto(part, entry.input)
            scale_(part, entry.request.prescale, dtype_named(entry.request.dtype))
        return buffers

    def finish(self, ready: list, pending: dict) -> tuple[list, list]:
        """Split the cycle's agreed ready responses into those whose sum is done here,
        ``[(entry or None for a joined rank, response, summed part)]``, taken out of
        ``pending``, and the rest, which run as before."""
        layout, self._active = self._active, None
        if layout is None or not ready:
            return [], ready
        done, rest = [], []
        places, buffers = layout.places, layout.buffers
        for response in ready:
            place = places.get(response.name)
            if place is None or place.response is not response:
                rest.append(response)
                continue
            done.append((pending.pop(response.name, None), response,
                         buffers[place.buffer][place.start:place.stop]))
        return done, rest
