"""The all-reduce algorithms as strategies, and the one place that chooses among them.

Each algorithm says whether it ``applies()`` to a topology, how much ``scratch_elements()`` it
needs for a buffer and how it ``run()``s, over ``Links`` (the transports of one engine for one
kind of buffer memory). ``AlgorithmChoice.choose`` picks one per fused buffer from agreed
inputs only (settings, the buffer's size, the topology), so every rank picks the same.

To add an algorithm: a class with these three methods and a ``name`` (the value of
``MPIDDP_ALLREDUCE_ALGORITHM`` that forces it, and the ``<name>_batches`` counter of
``engine_stats()``), registered in ``AlgorithmChoice``.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import numpy as np

from ..buffers.dtypes import DType
from ..reduce_ops import ReduceOp
from . import adasum, cost_model, halving_doubling
from .cost_model import LinkCosts, halving_doubling_threshold, ring_threshold
from .flat import HALVING_DOUBLING, NATIVE, RECURSIVE_DOUBLING, RING
from .hierarchical import hierarchical_allreduce, pipeline_segments, scratch_elements
from .native import native_allreduce
from .recursive_doubling import recursive_doubling
from .ring import allgather_steps, chunk_bounds, complete, reduce_scatter_steps, ring_allreduce
from .topology import Topology

AUTO, HIERARCHICAL = "auto", "hierarchical"

# Where MPIDDP_RING_THRESHOLD is unset and the links were not measured (``LinkCosts``: the
# thresholds then follow the cost model, ``cost_model.ring_threshold``), ``auto`` takes the
# ring above these sizes. Within a
# node MPI's shared-memory algorithms win up to about 2 MiB. On a communicator with one rank
# per node (one rank per node in the job, or the cross-node part of the hierarchical
# all-reduce) the ring ties native MPI_Allreduce from 256 KiB (docs/dev/benchmark-record.md, "Across
# nodes") and, unlike it, waits for the network without busy-polling the core that backward
# needs (transport/network.py): ResNet-18 on 2 nodes, its 2 MB fc gradient took 48-52 ms
# natively during backward, 20 ms in the ring. Where the hierarchical all-reduce applies, the
# choice on the whole communicator is hierarchical against native, and native stays ahead up
# to 2 MiB (2 nodes x 2 ranks, 1 MiB: 0.71x native hierarchically).
LOCAL_RING_THRESHOLD = 2 * 1024 * 1024
NETWORK_RING_THRESHOLD = 256 * 1024


def default_ring_threshold(flat_across_nodes: bool) -> int:
    """The ring threshold where the user set none: smaller for a communicator whose ring
    runs straight over the network (ranks on several nodes, no hierarchical all-reduce)."""
    return NETWORK_RING_THRESHOLD if flat_across_nodes else LOCAL_RING_THRESHOLD


class Links(NamedTuple):
    """The transports an algorithm runs over (``transport.Transport``): the whole
    communicator, the node-local one and the cross-node one; and, for host buffers where the
    engine's TCP connections carry the transfers across nodes, the connections to every
    rank's recursive-doubling partners (``transport.PeerSockets``; else None)."""

    whole: object
    local: object
    cross: object
    partners: object = None


class RingAllreduce:
    """Reduce-scatter then all-gather around a ring of all the ranks (``ring.py``)."""

    name = RING

    def applies(self, topology: Topology) -> bool:
        return True

    def scratch_elements(self, count: int, itemsize: int, links: Links) -> int:
        return math.ceil(count / links.whole.Get_size())

    def run(self, links: Links, buf, scratch, dtype: DType, op: ReduceOp, reduce_kernel,
            postprocess=None) -> int:
        """All-reduce ``buf`` in place; returns the number of pieces it went in (1)."""
        ring_allreduce(links.whole, buf, scratch,
                       lambda dst, src: reduce_kernel(dst, src, op, dtype), postprocess)
        return 1


class HalvingDoublingAllreduce:
    """Recursive halving then doubling over all the ranks (``halving_doubling.py``): the
    ring's bytes in ``2 log2 N`` steps."""

    name = HALVING_DOUBLING

    def applies(self, topology: Topology) -> bool:
        return True

    def scratch_elements(self, count: int, itemsize: int, links: Links) -> int:
        return halving_doubling.scratch_elements(count, links.whole.Get_size())

    def run(self, links: Links, buf, scratch, dtype: DType, op: ReduceOp, reduce_kernel,
            postprocess=None) -> int:
        halving_doubling.halving_doubling_allreduce(
            links.whole, buf, scratch, lambda dst, src: reduce_kernel(dst, src, op, dtype),
            postprocess)
        return 1


class NativeAllreduce:
    """The MPI library's own ``MPI_Allreduce`` (latency-bound sizes: recursive doubling)."""

    name = NATIVE

    def applies(self, topology: Topology) -> bool:
        return True

    def scratch_elements(self, count: int, itemsize: int, links: Links) -> int:
        return 0

    def run(self, links: Links, buf, scratch, dtype: DType, op: ReduceOp, reduce_kernel,
            postprocess=None) -> int:
        native_allreduce(links.whole, buf, dtype, op, reduce_kernel)
        if postprocess is not None:
            postprocess(buf)
        return 1


class RecursiveDoublingAllreduce:
    """The whole buffer to one partner per step, ``log2 N`` steps (``recursive_doubling.py``),
    over the engine's TCP connections (``Links.partners``): the fewest messages in a row,
    each step's receive a blocking wait in the kernel. Where MPI moves messages only while
    it is called (over TCP), this finished a 4 KiB all-reduce in the engine at 16 emulated
    nodes in 2.2 ms against 3.7 ms for ``MPI_Allreduce`` (docs/dev/benchmark-record.md). Without the
    connections (device buffers, or MPI kept for the transfers) ``MPI_Allreduce`` runs."""

    name = RECURSIVE_DOUBLING

    def applies(self, topology: Topology) -> bool:
        return topology.spans_nodes

    def scratch_elements(self, count: int, itemsize: int, links: Links) -> int:
        return count if links.partners is not None else 0

    def run(self, links: Links, buf, scratch, dtype: DType, op: ReduceOp, reduce_kernel,
            postprocess=None) -> int:
        sockets, whole = links.partners, links.whole
        if sockets is None:
            native_allreduce(whole, buf, dtype, op, reduce_kernel)
        elif len(buf):
            recursive_doubling(sockets.exchange, whole.Get_rank(), whole.Get_size(), buf,
                               scratch[:len(buf)],
                               lambda mine, theirs: reduce_kernel(mine, theirs, op, dtype))
        if postprocess is not None:
            postprocess(buf)
        return 1


class HierarchicalAllreduce:
    """Node-local reduce-scatter, cross-node all-reduce, node-local all-gather, pipelined in
    segments for large buffers (``hierarchical.py``). The cross-node part takes the ring or
    native ``MPI_Allreduce`` by the size of its chunk against ``cross_ring_threshold``."""

    name = HIERARCHICAL

    def __init__(self, cross_ring_threshold: int):
        self.cross_ring_threshold = cross_ring_threshold

    def applies(self, topology: Topology) -> bool:
        return topology.hierarchical_usable

    def segments(self, nbytes: int, links: Links) -> int:
        """Into how many pipelined segments a buffer of ``nbytes`` goes (1: none)."""
        return pipeline_segments(nbytes, links.local.Get_size(), links.cross,
                                 self.cross_ring_threshold)

    def scratch_elements(self, count: int, itemsize: int, links: Links) -> int:
        return scratch_elements(count, links.local.Get_size(), links.cross.Get_size(),
                                self.segments(count * itemsize, links))

    def run(self, links: Links, buf, scratch, dtype: DType, op: ReduceOp, reduce_kernel,
            postprocess=None) -> int:
        """All-reduce ``buf`` in place; returns the number of pipelined segments."""
        nbytes = len(buf) * dtype.itemsize
        segments = self.segments(nbytes, links)
        cross_chunk = nbytes // segments // links.local.Get_size()
        cross = RING if cross_chunk > self.cross_ring_threshold else NATIVE
        hierarchical_allreduce(links.local, links.cross, buf, scratch, dtype, op, reduce_kernel,
                               cross, postprocess, segments)
        return segments


class AdasumAllreduce:
    """Adasum instead of a sum (``adasum.py``): across all the ranks, or, ``hierarchical``,
    across nodes of each node's average. The hierarchical form is Horovod's on GPUs: a
    node-local reduce-scatter of the sum, scaled by ``1 / local_size``; Adasum across nodes
    of each chunk, its dot products summed over the node's chunks (so still per tensor);
    a node-local all-gather. The average, not the sum: the ranks of a node then act as one
    worker with a larger batch, whose gradient has the magnitude of one rank's, as Adasum's
    inputs across nodes have in the flat form; a sum would grow it with the ranks per node."""

    name = "adasum"

    def __init__(self, hierarchical: bool):
        self.hierarchical = hierarchical

    def applies(self, topology: Topology) -> bool:
        return topology.hierarchical_usable if self.hierarchical else True

    def scratch_elements(self, count: int, itemsize: int, links: Links) -> int:
        if not self.hierarchical:
            return adasum.scratch_elements(count, links.whole.Get_size())
        chunk = math.ceil(count / links.local.Get_size())
        return max(chunk, adasum.scratch_elements(chunk, links.cross.Get_size()))

    def run(self, links: Links, buf, scratch, dtype: DType, bounds, backend, dots_links: Links,
            postprocess=None) -> int:
        """Adasum-reduce ``buf`` in place (``bounds``: its tensors' offsets); ``dots_links``:
        the host transports the dot products travel over. Returns 1 (one piece)."""
        kernels = backend.adasum_kernels(dtype)
        if not self.hierarchical:
            adasum.adasum_allreduce(links.whole, buf, scratch, bounds, kernels, postprocess,
                                    dots_comm=dots_links.whole)
            return 1
        local, local_dots = links.local, dots_links.local
        size, rank = local.Get_size(), local.Get_rank()
        chunks = chunk_bounds(len(buf), size)
        complete(reduce_scatter_steps(
            local, buf, scratch, chunks,
            lambda dst, src: backend.reduce_into(dst, src, ReduceOp.SUM, dtype), owner_shift=-1))
        lo, hi = chunks[rank], chunks[rank + 1]
        mine = buf[lo:hi]
        backend.scale_(mine, 1.0 / size, dtype, exact=True)          # the node's average
        parts = [min(max(offset - lo, 0), hi - lo) for offset in bounds]

        def node_sum(partial):
            """Every local rank's partial dot products, summed in rank order (the same bits on
            each)."""
            gathered = np.empty((size,) + partial.shape)
            local_dots.Allgatherv(partial, [gathered, [partial.size] * size])
            total = gathered[0].copy()
            for other in gathered[1:]:
                total += other
            return total

        adasum.adasum_allreduce(links.cross, mine, scratch, parts, kernels, postprocess,
                                sum_dots=node_sum, dots_comm=dots_links.cross)
        complete(allgather_steps(local, buf, chunks, owner_shift=-1))
        return 1


class AlgorithmChoice:
    """Which algorithm all-reduces a fused buffer, from the settings every rank agreed on
    (``MPIDDP_ALLREDUCE_ALGORITHM``, ``MPIDDP_RING_THRESHOLD``,
    ``MPIDDP_HIERARCHICAL_ALLREDUCE``) and the communicator's topology.

    ``auto``: native ``MPI_Allreduce`` up to the ring threshold, above it the ring or
    recursive halving-doubling (``own_algorithm``); where the engine's TCP connections carry
    the transfers of host buffers (``over_sockets``, one rank per node), recursive doubling
    over them instead of native up to ``recursive_doubling_limit``, and, where
    halving-doubling fits, halving-doubling above it (``sockets_native_limit``: native
    takes no host buffer there); where the
    hierarchical all-reduce applies, it replaces the ring (``hierarchical=auto``) or every
    algorithm (``hierarchical=1``). A forced algorithm wins, except one that cannot apply
    (hierarchical on one node): the ring then, never a wrong result."""

    def __init__(self, setting: str, ring_threshold: Optional[int], hierarchical: str,
                 topology: Topology, link: Optional[LinkCosts] = None,
                 step_overhead_s: float = cost_model.RING_STEP_OVERHEAD_S,
                 over_sockets: bool = False):
        """``step_overhead_s``: our algorithms' Python cost per step, as the cost model
        charges it (the engine: the measured default; the scaling model: its setting).
        ``over_sockets``: the engine's TCP connections carry the transfers across nodes (the
        same on every rank)."""
        self.setting = setting
        self.hierarchical_setting = hierarchical
        self.topology = topology
        self.link = link
        # The threshold for the whole communicator, and for the cross-node part of the
        # hierarchical all-reduce (one rank per node: a network ring). An explicit one wins.
        whole, cross = self.default_thresholds(topology, link, step_overhead_s)
        self.ring_threshold = ring_threshold if ring_threshold is not None else whole
        # Up to here halving-doubling, above it the ring (``own_algorithm``).
        self.halving_doubling_limit = \
            cost_model.ring_threshold(topology.size, link, step_overhead_s=step_overhead_s) \
            if link is not None and self.halving_doubling_fits(topology) else 0
        self._step_overhead_s = step_overhead_s
        self.over_sockets = over_sockets
        self.recursive_doubling_limit = self._recursive_doubling_limit()
        self.sockets_native_limit = self._sockets_native_limit(ring_threshold is None)
        self.ring = RingAllreduce()
        self.halving_doubling = HalvingDoublingAllreduce()
        self.recursive_doubling = RecursiveDoublingAllreduce()
        self.native = NativeAllreduce()
        self.hierarchical = HierarchicalAllreduce(
            ring_threshold if ring_threshold is not None else cross)
        self._by_name = {a.name: a for a in (self.ring, self.halving_doubling, self.native,
                                             self.recursive_doubling, self.hierarchical)}
        self._adasum = {False: AdasumAllreduce(False), True: AdasumAllreduce(True)}

    def _recursive_doubling_limit(self) -> int:
        """Up to where recursive doubling over the sockets replaces ``MPI_Allreduce``: the
        sizes native would take (the ring threshold) where the model puts it no slower than
        halving-doubling. Over TCP, MPI moves a message only while it is called, which the
        alpha-beta terms leave out; the sockets move it in the kernel. Only with one rank
        per node (several would send their first steps over one node's link, and partners
        on one node would talk TCP instead of shared memory) and the links measured. At 2
        ranks it is the library's own single exchange, as fast (2 emulated nodes, 1 Gbit/s,
        8-128 KiB: 82-1,101 us against 90-1,103 us for ``MPI_Allreduce`` in the engine)
        without the library's polling for the whole transfer: 2.5-5.8 CPU s per GB from
        48 KiB against 7.4-8.4 (docs/dev/benchmark-record.md, "Two nodes: recursive doubling
        instead of MPI_Allreduce")."""
        topology = self.topology
        if not (self.over_sockets and self.link is not None and topology.spans_nodes
                and topology.local_size == 1 and topology.uniform):
            return 0
        return cost_model.recursive_doubling_limit(topology.size, self.link,
                                                   self.ring_threshold,
                                                   step_overhead_s=self._step_overhead_s)

    def _sockets_native_limit(self, from_links: bool) -> int:
        """Up to where native ``MPI_Allreduce`` takes host buffers whose transfers go over
        the engine's sockets: nowhere above recursive doubling's limit where halving-doubling
        fits and the links (not the user) set the thresholds. The alpha-beta terms give the
        library's recursive halving-doubling the same steps as ours and none of our Python,
        so our threshold against it is where that Python is 5% of the transfer; but over TCP
        the library moves a message only while called, and in the engine each of its calls
        follows the cycle's negotiation over the sockets: synchronous 128 KiB all-reduces
        through the engine took 2.5-2.8 ms by native against 1.8-2.0 by halving-doubling over
        the sockets at 4 emulated nodes, 3.3-3.4 against 2.8-2.9 at 8, 8.2-9.1 against 6.9
        at 16 (docs/dev/benchmark-record.md)."""
        if from_links and self.recursive_doubling_limit and \
                self.halving_doubling_fits(self.topology):
            return min(self.ring_threshold, self.recursive_doubling_limit)
        return self.ring_threshold

    @staticmethod
    def default_thresholds(topology: Topology, link: Optional[LinkCosts],
                           step_overhead_s: float = cost_model.RING_STEP_OVERHEAD_S
                           ) -> tuple[int, int]:
        """(whole communicator, cross-node part) ring thresholds without a user setting.
        Across nodes with measured links they come from the cost model for the number of
        ranks in the network ring; the whole communicator's choice where the hierarchical
        all-reduce applies (hierarchical against native) keeps at least the node-local
        threshold, below which native stayed ahead (2x2, 1 MiB)."""
        if not topology.spans_nodes or link is None:
            return (default_ring_threshold(topology.spans_nodes and
                                           not topology.hierarchical_usable),
                    NETWORK_RING_THRESHOLD)
        overhead = {"step_overhead_s": step_overhead_s}
        cross = ring_threshold(topology.cross_size, link, **overhead)
        if topology.hierarchical_usable:
            return max(LOCAL_RING_THRESHOLD, cross), cross
        if AlgorithmChoice.halving_doubling_fits(topology):
            return halving_doubling_threshold(topology.size, link, **overhead), cross
        return ring_threshold(topology.size, link, **overhead), cross

    @property
    def cross_ring_threshold(self) -> int:
        return self.hierarchical.cross_ring_threshold

    @property
    def hierarchical_allowed(self) -> bool:
        """Whether the hierarchical all-reduce may carry buffers: its setting is not off and
        the layout suits it (several nodes, the same number of ranks, more than one, each)."""
        return self.hierarchical_setting != "0" and self.hierarchical.applies(self.topology)

    def configure(self, setting: str, ring_threshold: Optional[int] = None,
                  hierarchical: Optional[str] = None) -> None:
        """Switch at run time (``set_allreduce_algorithm``, autotune; at an agreed point of the
        order). None: keep the current value."""
        self.setting = setting
        if hierarchical is not None:
            self.hierarchical_setting = hierarchical
        if ring_threshold is not None:
            self.ring_threshold = self.hierarchical.cross_ring_threshold = int(ring_threshold)
            self.recursive_doubling_limit = self._recursive_doubling_limit()
            self.sockets_native_limit = self.ring_threshold    # the caller's threshold

    def choose(self, nbytes: int, host: bool = True):
        """The algorithm for one fused buffer of ``nbytes`` (``host``: in host memory, which
        the engine's sockets can carry; device buffers keep the library's all-reduce below
        the ring threshold)."""
        if self.setting != AUTO:
            chosen = self._by_name[self.setting]
            if chosen is self.hierarchical and self.hierarchical_setting == "0":
                return self.ring
            return chosen if chosen.applies(self.topology) else self.ring
        if self.recursive_doubling_limit and nbytes <= self.recursive_doubling_limit:
            # One rank per node: nothing hierarchical. (An empty buffer too: nothing moves,
            # where the library would still be called.)
            return self.recursive_doubling
        native_limit = self.sockets_native_limit if host else self.ring_threshold
        by_size = self.native if nbytes <= native_limit else self.own_algorithm(nbytes)
        if self.hierarchical_allowed and \
                (self.hierarchical_setting == "1" or by_size is not self.native):
            return self.hierarchical
        return by_size

    def adasum(self) -> AdasumAllreduce:
        """How ``op=Adasum`` buffers reduce: hierarchically where the hierarchical all-reduce
        is asked for (``MPIDDP_HIERARCHICAL_ALLREDUCE=1``) and the layout suits it; else across
        all the ranks. Never by ``auto``: the two compute different results (the node's
        average first), so only the user chooses."""
        return self._adasum[self.hierarchical_setting == "1" and
                            self.hierarchical.applies(self.topology)]

    def own_algorithm(self, nbytes: int):
        """Which of our algorithms takes a buffer above the threshold. Halving-doubling has
        the ring's bytes in fewer steps; it takes a buffer up to where the ring's extra steps
        cost at most ``RING_TOLERANCE`` of the transfer (the ring's threshold against the
        MPI library's algorithm), the ring above: on the emulated cluster (16 nodes, 1
        Gbit/s) halving-doubling was ahead at 1 MiB, level at 4 MiB and behind at 16-64 MiB
        (docs/dev/benchmark-record.md, "Halving-doubling at 16 nodes"), which the model,
        blind to what the CPU does per byte, cannot tell. Only where the links were measured, with
        one rank per node at a power of two from 4 (``halving_doubling_fits``): other rank counts
        would fold whole buffers; with several ranks per node its first steps would all cross the
        network at once (the hierarchical all-reduce is the answer there)."""
        return self.halving_doubling if nbytes <= self.halving_doubling_limit else self.ring

    @staticmethod
    def halving_doubling_fits(topology: Topology) -> bool:
        """One rank per node, a power of two from 4 ranks: where halving-doubling applies,
        the threshold against the MPI library's algorithm is its own."""
        size = topology.size
        return topology.spans_nodes and topology.uniform and topology.local_size == 1 and \
            size >= 4 and halving_doubling.power_of_two_below(size) == size
