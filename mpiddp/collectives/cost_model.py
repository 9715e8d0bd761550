"""What an all-reduce costs, by algorithm: the alpha-beta model the automatic choice and
docs/dev/scaling-model.md use.

For ``N`` ranks in a ring over links of latency ``alpha`` (one message, one way) and
``beta`` seconds per byte, an all-reduce of ``n`` bytes costs

* the ring (``ring.py``): ``2 (N-1)`` steps, each a message of ``n/N`` bytes plus a fixed
  cost in Python (``RING_STEP_OVERHEAD_S``):
  ``2 (N-1) (alpha + delta) + 2 (N-1)/N n beta``;
* recursive halving then doubling (``halving_doubling.py``, Rabenseifner's algorithm, our
  own): ``2 log2 P`` steps (``P`` the largest power of two <= ``N``) carrying the ring's
  bytes, plus, where ``N`` is not a power of two, a fold of whole buffers before and after:
  ``2 log2 P (alpha + delta) + 2 (P-1)/P n beta [+ 2 (alpha + delta + n beta)]``;
* the MPI library's ``MPI_Allreduce`` (MPICH and Open MPI for large buffers: recursive halving
  then doubling, Rabenseifner): the same bytes in ``2 ceil(log2 N)`` steps:
  ``2 ceil(log2 N) alpha + 2 (N-1)/N n beta``; for small buffers (up to
  ``NATIVE_SHORT_BYTES``) recursive doubling, ``ceil(log2 N) (alpha + n beta)``.

With ``G`` ranks on each of ``N`` nodes, the library's all-reduce (``node_aware_native_seconds``)
and the hierarchical one (``hierarchical_seconds``) send each byte across the network once per
node, the node's ranks sharing its interface (``shared_link``), plus ``2 (G-1)/G n`` over the
link inside the node; the engine does not use these (its choice needs only the thresholds),
``scripts/bench/scaling_model.py`` does.

The reduction's arithmetic is the same in both and left out. On these terms the MPI library's
algorithm is never slower; ours earn their place by what the terms leave out: they wait for
the network without busy-polling the core that backward needs (with 16 ranks on 2 cores,
MPI_Allreduce's polling took the CPU the other ranks needed: docs/dev/benchmark-record.md),
they leave transfers in flight (the pipelined hierarchical all-reduce), and over TCP the ring
reached the link rate where ``MPI_Allreduce`` did not (docs/dev/benchmark-record.md, "Across
nodes": 4 nodes, 64 MiB, 1.5x). So our algorithms take a buffer where their extra fixed cost is at
most ``RING_TOLERANCE`` of the transfer time (``halving_doubling_threshold`` where
halving-doubling applies: one rank per node, a power of two from 4; ``ring_threshold``);
halving-doubling up to the ring's threshold, the ring above it (``algorithms.py``). With the
links' measured latency and rate that moves with N and the link: 1 Gbit/s and 30 us, the
ring's threshold is 250 KB at 2 nodes (where the ring was measured to tie), 0.6 MB at 4,
2.9 MB at 16, 12 MB at 64, halving-doubling's 0.33 MB at 4, 0.53 MB at 16, 0.76 MB at 64;
100 Gbit/s and 5 us, 25 MB at 2 nodes, at 16 nodes ring 215 MB, halving-doubling 53 MB: on
fast links the MPI library's all-reduce carries most buffers (docs/dev/scaling-model.md).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
from mpi4py import MPI

from .halving_doubling import power_of_two_below

# Fixed cost of one ring step in Python and MPI beyond the message itself (posting the
# transfers, waiting, the NumPy reduction's call): 4 KiB all-reduces on 2 emulated nodes of a
# core each, ring 130 us against MPI_Allreduce's 35 us over 2 steps (docs/dev/scaling-model.md).
RING_STEP_OVERHEAD_S = 50e-6
# The ring takes a buffer when its extra fixed cost is at most this share of the transfer:
# at 2 nodes that is where the ring and MPI_Allreduce were measured to tie (256 KiB, 1 Gbit/s).
RING_TOLERANCE = 0.05
# MPICH's MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE: recursive doubling up to here.
NATIVE_SHORT_BYTES = 2048
NEVER = 1 << 62          # a threshold no buffer reaches
# A float32 sum of host memory with NumPy, per byte reduced: about 7 GB/s on one core here.
HOST_REDUCE_SECONDS_PER_BYTE = 1 / 7e9
# The engine's own work per cycle beyond the negotiation's messages (the protocol's Python over
# the pending names, fusion, the hand-offs): forward overlap's cycles cost about this much
# wall time and CPU each on 2 nodes at ~12 Gbit/s (docs/dev/benchmark-record.md, "Forward overlap's
# cycle budget").
ENGINE_CYCLE_S = 300e-6
# Forward overlap's cycle budget: a cycle's fixed cost this share of its transfer (before the
# budget is rounded down to a power of two).
# Calibrated on the emulated cluster (docs/dev/benchmark-record.md, "Forward overlap's cycle
# budget"), with the rounding down to a power of two, to the budgets measured best: 1 MiB at 2
# nodes on 200 Mbit/s (4 MiB 9% slower) and on 1 Gbit/s (level with 4 MiB, 2 MiB 6% slower), 4-8
# MiB at 16 nodes on 1 Gbit/s (1 MiB 1.2x slower), 4-16 MiB at 2 nodes on ~12 Gbit/s (1 MiB 1.15x
# slower).
PRIORITY_CYCLE_TOLERANCE = 0.03
# Where nothing was measured (one node), and the least: the best of 0.5 / 1 / 4 / 16 MiB at
# 2 nodes on 1 Gbit/s when forward overlap was built (docs/dev/benchmark-record.md, "Forward
# overlap").
PRIORITY_CYCLE_MIN_BYTES = 1 << 20
PRIORITY_CYCLE_MAX_BYTES = 64 << 20
# Forward overlap's cycles sized for a known step's gradients (``gradient_cycle_bytes``): the
# least. 128 KiB cycles were slower than 256 KiB ones at 8 nodes on 200 Mbit/s (37 cycles a
# step; docs/dev/benchmark-record.md, "Forward overlap's cycles sized for the step's gradients").
GRADIENT_CYCLE_MIN_BYTES = 256 << 10


@dataclass(frozen=True)
class LinkCosts:
    """A link's alpha (s per message) and beta (s per byte), as measured or assumed, and
    the reduction's arithmetic per byte reduced (gamma: about 0.15 ns with NumPy on a host
    core, for float32 sums; on a GPU negligible next to the link). Gamma is the same for
    every algorithm, so the choice ignores it; the step model (scripts/bench/scaling_model.py)
    needs it."""

    latency_s: float
    seconds_per_byte: float
    reduce_seconds_per_byte: float = 0.0

    @classmethod
    def from_rate(cls, gbit_per_s: float, latency_us: float,
                  reduce_gb_per_s: float | None = None) -> "LinkCosts":
        return cls(latency_us * 1e-6, 8.0 / (gbit_per_s * 1e9),
                   1.0 / (reduce_gb_per_s * 1e9) if reduce_gb_per_s else 0.0)

    def describe(self) -> str:
        return (f"latency {self.latency_s * 1e6:.0f} us, "
                f"{8.0 / self.seconds_per_byte / 1e9:.3g} Gbit/s")


def describe_threshold(nbytes: int) -> str:
    return "never" if nbytes >= NEVER else f"{nbytes / 1e6:.3g} MB"


def log2_steps(ranks: int) -> int:
    return max(1, math.ceil(math.log2(ranks))) if ranks > 1 else 0


def ring_seconds(nbytes: int, ranks: int, link: LinkCosts,
                 step_overhead_s: float = RING_STEP_OVERHEAD_S) -> float:
    """Predicted time of ``ring.py``'s all-reduce of ``nbytes`` over ``ranks`` ranks."""
    if ranks < 2:
        return 0.0
    steps = 2 * (ranks - 1)
    return steps * (link.latency_s + step_overhead_s) + \
        steps * nbytes / ranks * link.seconds_per_byte + reduce_seconds(nbytes, ranks, link)


def native_seconds(nbytes: int, ranks: int, link: LinkCosts, local_size: int = 1,
                   local_link: Optional[LinkCosts] = None) -> float:
    """Predicted time of the MPI library's all-reduce (MPICH's default algorithms) over
    ``ranks`` ranks, ``local_size`` of them on each node (``local_link`` between them; see
    ``node_aware_native_seconds``)."""
    if local_size > 1:
        return node_aware_native_seconds(nbytes, ranks // local_size, local_size, link,
                                         local_link or link)
    if ranks < 2:
        return 0.0
    rounds = log2_steps(ranks)
    if nbytes <= NATIVE_SHORT_BYTES:
        return rounds * (link.latency_s + nbytes * (link.seconds_per_byte +
                                                    link.reduce_seconds_per_byte))
    extra = 0 if ranks & (ranks - 1) == 0 else 2 * (link.latency_s + nbytes *
                                                     link.seconds_per_byte)
    return 2 * rounds * link.latency_s + 2 * (ranks - 1) / ranks * nbytes * \
        link.seconds_per_byte + extra + reduce_seconds(nbytes, ranks, link)


def shared_link(link: LinkCosts, sharers: int) -> LinkCosts:
    """``link`` as each of ``sharers`` streams that cross it at once sees it: a node's ranks
    all send across nodes together through one network interface."""
    return replace(link, seconds_per_byte=link.seconds_per_byte * max(1, sharers))


def node_aware_native_seconds(nbytes: int, nodes: int, local_size: int, link: LinkCosts,
                              local_link: LinkCosts) -> float:
    """The MPI library's all-reduce over ``nodes`` nodes of ``local_size`` ranks each,
    numbered node by node. Recursive halving pairs ranks at distance 1, 2, 4...: its first
    ``log2 local_size`` steps (the largest messages) stay inside a node over ``local_link``,
    the rest cross the network, where a node's ranks send at once through one interface
    (``shared_link``); doubling mirrors it. So the network carries ``2 (N-1)/N`` of the
    buffer per node, as with one rank per node, and the node's link ``2 (G-1)/G`` of it per
    rank. Small buffers: recursive doubling, the whole buffer in every step."""
    if nodes < 2:
        return native_seconds(nbytes, local_size, local_link)
    if nbytes <= NATIVE_SHORT_BYTES:
        return native_seconds(nbytes, local_size, local_link) + \
            native_seconds(nbytes, nodes, link)
    inside = native_seconds(nbytes, local_size, replace(local_link, reduce_seconds_per_byte=0))
    across = native_seconds(nbytes // local_size, nodes,
                            replace(shared_link(link, local_size), reduce_seconds_per_byte=0))
    return inside + across + reduce_seconds(nbytes, nodes * local_size, link)


def hierarchical_seconds(nbytes: int, nodes: int, local_size: int, link: LinkCosts,
                         local_link: LinkCosts, cross_ring_threshold: int,
                         step_overhead_s: float = RING_STEP_OVERHEAD_S) -> float:
    """Predicted time of ``hierarchical.py``'s all-reduce, unpipelined: a ring reduce-scatter
    and all-gather inside each node over ``local_link``, and between them the all-reduce of
    each rank's ``1/local_size`` of the buffer among the nodes (the ring above
    ``cross_ring_threshold``, else the library's), the node's ``local_size`` such all-reduces
    at once through one network interface (``shared_link``). (Pipelining, where the
    transport leaves transfers in flight and the chunks take the ring, hides the node-local
    phases behind the network; on fast links the chunks take the library's all-reduce and
    it does not apply.)"""
    chunk = nbytes // local_size
    network = shared_link(link, local_size)
    across = ring_seconds(chunk, nodes, network, step_overhead_s) \
        if chunk > cross_ring_threshold else native_seconds(chunk, nodes, network)
    return ring_seconds(nbytes, local_size, local_link, step_overhead_s) + across


def halving_doubling_seconds(nbytes: int, ranks: int, link: LinkCosts,
                             step_overhead_s: float = RING_STEP_OVERHEAD_S) -> float:
    """Predicted time of ``halving_doubling.py``'s all-reduce of ``nbytes`` over ``ranks``."""
    if ranks < 2:
        return 0.0
    pof2 = power_of_two_below(ranks)
    step = link.latency_s + step_overhead_s
    seconds = 2 * log2_steps(pof2) * step + 2 * (pof2 - 1) / pof2 * nbytes * \
        link.seconds_per_byte + reduce_seconds(nbytes, pof2, link)
    if pof2 != ranks:        # the fold: whole buffers to a partner and back, one reduction
        seconds += 2 * (step + nbytes * link.seconds_per_byte) + \
            nbytes * link.reduce_seconds_per_byte
    return seconds


def recursive_doubling_seconds(nbytes: int, ranks: int, link: LinkCosts,
                               step_overhead_s: float = RING_STEP_OVERHEAD_S) -> float:
    """Predicted time of ``recursive_doubling.py``'s all-reduce: the whole buffer sent and
    reduced in each of ``log2 P`` steps (two more, whole, where ranks fold in)."""
    if ranks < 2:
        return 0.0
    pof2 = power_of_two_below(ranks)
    steps = log2_steps(pof2) + (0 if pof2 == ranks else 2)
    return steps * (link.latency_s + step_overhead_s + nbytes * link.seconds_per_byte) + \
        log2_steps(pof2) * nbytes * link.reduce_seconds_per_byte


def recursive_doubling_limit(ranks: int, link: LinkCosts, ceiling: int,
                             step_overhead_s: float = RING_STEP_OVERHEAD_S) -> int:
    """The largest buffer recursive doubling takes, at most ``ceiling``: up to where it
    costs no more than halving-doubling, which moves ``2 (P-1)/P`` of the buffer instead of
    ``log2 P`` times all of it, in twice the steps, and reduces ``(P-1)/P`` of it instead of
    ``log2 P`` times all of it (host buffers: ``HOST_REDUCE_SECONDS_PER_BYTE`` where
    ``link`` has no reduction cost; at 2 ranks the two send the same bytes, and that is
    what stops recursive doubling)."""
    if ranks < 2:
        return 0
    if not link.reduce_seconds_per_byte:
        link = replace(link, reduce_seconds_per_byte=HOST_REDUCE_SECONDS_PER_BYTE)
    low, high = 0, ceiling
    if recursive_doubling_seconds(high, ranks, link, step_overhead_s) <= \
            halving_doubling_seconds(high, ranks, link, step_overhead_s):
        return ceiling
    while high - low > 64:          # the costs are linear in the size: one crossing
        middle = (low + high) // 2
        if recursive_doubling_seconds(middle, ranks, link, step_overhead_s) <= \
                halving_doubling_seconds(middle, ranks, link, step_overhead_s):
            low = middle
        else:
            high = middle
    return low


def reduce_seconds(nbytes: int, ranks: int, link: LinkCosts) -> float:
    """The arithmetic of a bandwidth-optimal all-reduce: (N-1)/N of the buffer reduced."""
    return (ranks - 1) / ranks * nbytes * link.reduce_seconds_per_byte


def tolerated_seconds_per_byte(ranks: int, link: LinkCosts, tolerance: float) -> float:
    """The fixed cost each buffer byte may carry: ``tolerance`` of its wire time in a
    bandwidth-optimal all-reduce across ``ranks`` (each rank sends and receives ``2 (N-1)/N``
    of the buffer). The thresholds below divide a fixed cost by it."""
    return tolerance * 2 * (ranks - 1) / ranks * link.seconds_per_byte


def ring_threshold(ranks: int, link: LinkCosts, tolerance: float = RING_TOLERANCE,
                   step_overhead_s: float = RING_STEP_OVERHEAD_S) -> int:
    """The size from which the ring carries a buffer across ``ranks`` nodes: where its extra
    fixed cost over the MPI library's is at most ``tolerance`` of the transfer time
    (``NEVER`` where that size would exceed any buffer)."""
    if ranks < 2:
        return NEVER
    extra = 2 * (ranks - 1) * (link.latency_s + step_overhead_s) - \
        2 * log2_steps(ranks) * link.latency_s
    per_byte = tolerated_seconds_per_byte(ranks, link, tolerance)
    if per_byte <= 0:
        return NEVER
    threshold = extra / per_byte
    return NEVER if threshold >= NEVER else max(0, int(threshold))


def halving_doubling_threshold(ranks: int, link: LinkCosts, tolerance: float = RING_TOLERANCE,
                               step_overhead_s: float = RING_STEP_OVERHEAD_S) -> int:
    """As ``ring_threshold``, for recursive halving-doubling: its extra fixed cost over the
    MPI library's same algorithm is the Python overhead of its steps."""
    if ranks < 2:
        return NEVER
    pof2 = power_of_two_below(ranks)
    steps = 2 * log2_steps(pof2) + (0 if pof2 == ranks else 2)
    per_byte = tolerated_seconds_per_byte(ranks, link, tolerance)
    if per_byte <= 0:
        return NEVER
    threshold = steps * step_overhead_s / per_byte
    return NEVER if threshold >= NEVER else max(0, int(threshold))


def power_of_two_between(nbytes: float, least: int, most: int) -> int:
    """``nbytes`` bounded to ``[least, most]`` (powers of two) and rounded down to a power of
    two, so that the links' measured noise moves a size derived from them rarely."""
    return 1 << int(math.log2(min(max(nbytes, least), most)))


def cycle_fixed_seconds(ranks: int, link: LinkCosts) -> float:
    """An engine cycle's fixed cost across ``ranks`` nodes: its own work (``ENGINE_CYCLE_S``)
    and the negotiation, a round trip per level of its recursive doubling."""
    return ENGINE_CYCLE_S + 2 * log2_steps(ranks) * link.latency_s


def priority_cycle_bytes(ranks: int, link: Optional[LinkCosts],
                         tolerance: float = PRIORITY_CYCLE_TOLERANCE) -> int:
    """Forward overlap's cycle budget across ``ranks`` nodes (``MPIDDP_PRIORITY_CYCLE_BYTES``
    unset): the prioritized bytes whose transfer makes a cycle's fixed cost ``tolerance`` of
    the cycle, rounded down to a power of two (so that the links' measured noise moves it
    rarely), from ``PRIORITY_CYCLE_MIN_BYTES`` to
    ``PRIORITY_CYCLE_MAX_BYTES``. The fixed cost: ``ENGINE_CYCLE_S`` and the negotiation, a
    synchronization of every rank, taken as a round trip per level of its recursive
    doubling (``2 log2 N`` latencies; with many ranks on few cores the measured latency
    grows with the scheduler's delays, and so does the cost of every cycle). Smaller
    cycles let an urgent gradient overtake sooner; on fast links, or with many ranks, each
    cycle's fixed cost would outweigh that. No ``link`` (nothing measured: one node): the
    least."""
    if link is None or ranks < 2 or link.seconds_per_byte <= 0:
        return PRIORITY_CYCLE_MIN_BYTES
    budget = cycle_fixed_seconds(ranks, link) / tolerated_seconds_per_byte(ranks, link, tolerance)
    return power_of_two_between(budget, PRIORITY_CYCLE_MIN_BYTES, PRIORITY_CYCLE_MAX_BYTES)


def gradient_cycle_bytes(ranks: int, link: Optional[LinkCosts], gradient_bytes: int) -> int:
    """Forward overlap's cycle budget where it reduces ``gradient_bytes`` of gradients (on
    the wire) each step, across ``ranks`` nodes: the size that minimises what cycles add to
    the step. Each cycle costs a fixed ``ENGINE_CYCLE_S`` and a negotiation (a round trip
    per level of its recursive doubling), ``gradient_bytes / budget`` times a step; and the
    most urgent gradient, the first layer's, ready last, waits for the cycle in flight,
    whose transfer grows with the budget. ``F G / B + B s`` is least at
    ``B = sqrt(G F / s)`` (``s``: a byte's wire time in a bandwidth-optimal all-reduce),
    rounded to the nearest power of two (a factor of 1.4 off costs 6% of the least), from
    ``GRADIENT_CYCLE_MIN_BYTES`` to ``PRIORITY_CYCLE_MAX_BYTES``. Slow links and small models
    get small cycles (on 200 Mbit/s at 8 emulated nodes 256-512 KiB were best for a 5 MB
    model, 1 MiB 1.2x slower), fast links and large models large ones. Nothing measured
    (one node), or no gradients: the links-only budget (``priority_cycle_bytes``)."""
    if link is None or ranks < 2 or link.seconds_per_byte <= 0 or gradient_bytes <= 0:
        return priority_cycle_bytes(ranks, link)
    per_byte = tolerated_seconds_per_byte(ranks, link, 1.0)
    best = math.sqrt(gradient_bytes * cycle_fixed_seconds(ranks, link) / per_byte)
    nearest = 1 << max(0, round(math.log2(best)))
    return min(max(nearest, GRADIENT_CYCLE_MIN_BYTES), PRIORITY_CYCLE_MAX_BYTES)


def device_priority_cycle_bytes(cycle_s: float, seconds_per_byte: float,
                                tolerance: float = PRIORITY_CYCLE_TOLERANCE) -> int:
    """Forward overlap's cycle budget for gradients in device memory, from the engine's
    device all-reduce as measured on the job itself (``torch/gradients/cycle_budget.py``): a cycle's
    fixed cost ``cycle_s`` (one element, end to end) ``tolerance`` of the transfer of the
    budget at ``seconds_per_byte`` (end to end), rounded down to a power of two, from
    ``PRIORITY_CYCLE_MIN_BYTES`` to ``PRIORITY_CYCLE_MAX_BYTES``. The device's own fixed costs
    (the kernels, the staging copies, the waits for them) are in the measurement where the
    host rule's modelled cost has none: on an H200 shared by two ranks, ~0.7 ms a cycle
    against ~0.1 ms for host memory (docs/dev/gpu.md, "Forward overlap on GPUs")."""
    if seconds_per_byte <= 0:
        return PRIORITY_CYCLE_MAX_BYTES
    return power_of_two_between(cycle_s / (tolerance * seconds_per_byte),
                                PRIORITY_CYCLE_MIN_BYTES, PRIORITY_CYCLE_MAX_BYTES)


# Small all-reduces carried beside the negotiation (engine/speculation.py): the buffer's wire
# time at most one latency, so a cycle with nothing to carry takes at most about one latency
# per level longer; a power of two between these bounds.
SPECULATION_MIN_BYTES = 4 << 10
SPECULATION_MAX_BYTES = 64 << 10


def speculation_bytes(link: Optional[LinkCosts]) -> int:
    """How many bytes of small all-reduces every cycle's negotiation carries where it travels
    over the engine's TCP connections (``MPIDDP_SPECULATION_BYTES`` unset): the bytes a link
    moves in one latency, rounded down to a power of two, ``SPECULATION_MIN_BYTES`` to
    ``SPECULATION_MAX_BYTES`` (4 KiB at 1 Gbit/s and 30 us; 16 KiB at 10 Gbit/s and 20 us;
    32 KiB at 100 Gbit/s and 5 us); ``SPECULATION_MIN_BYTES`` where nothing was measured."""
    if link is None or link.seconds_per_byte <= 0:
        return SPECULATION_MIN_BYTES
    return power_of_two_between(link.latency_s / link.seconds_per_byte,
                                SPECULATION_MIN_BYTES, SPECULATION_MAX_BYTES)


# ---- measuring a link ------------------------------------------------------------------------
PROBE_SMALL_BYTES = 8
PROBE_LARGE_BYTES = 1 << 20     # above tc's burst on the emulated links; 8 ms at 1 Gbit/s
PROBE_REPEATS = 3


def measure_link_costs(pairs: MPI.Comm, agree: MPI.Comm) -> LinkCosts:
    """Alpha and beta of the links between the ranks of ``pairs`` (one rank per node: each
    exchanges with its ring neighbours, small messages then large ones, best of
    ``PROBE_REPEATS``), agreed over ``agree`` (collective on both; the slowest link's values
    on every rank, so that every rank derives the same choice). A ``pairs`` of one rank
    measures nothing and takes the others' values. Every rank of ``agree`` starts each
    exchange at once: where a node holds several ranks, each in its own ``pairs``, their
    exchanges share the node's network interface as the hierarchical all-reduce's
    cross-node steps do, so each measures its share. (Started apart, the pairs overlapped
    by chance: 2 emulated nodes of 2 ranks on 1 Gbit/s measured 0.48 or 0.66 Gbit/s from
    one launch to the next.)"""
    size, rank = pairs.Get_size(), pairs.Get_rank()
    right, left = (rank + 1) % size, (rank - 1) % size
    times = []
    for nbytes in (PROBE_SMALL_BYTES, PROBE_LARGE_BYTES):
        send, recv = np.zeros(nbytes, np.uint8), np.empty(nbytes, np.uint8)
        best = math.inf
        for _ in range(PROBE_REPEATS):
            agree.Barrier()             # every rank of ``agree``, alone in its pairs or not
            if size > 1:
                start = time.perf_counter()
                pairs.Sendrecv(send, right, 77, recv, left, 77)
                best = min(best, time.perf_counter() - start)
        times.append(best)
    measured = np.zeros(2)
    if size > 1:
        small, large = times
        measured[:] = small, max(large - small, 1e-12) / (PROBE_LARGE_BYTES - PROBE_SMALL_BYTES)
    agreed = np.empty(2)
    agree.Allreduce(measured, agreed, op=MPI.MAX)
    return LinkCosts(float(agreed[0]), float(agreed[1]))
