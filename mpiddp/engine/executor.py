"""Executes the agreed, ordered responses of one cycle: fuses, reduces, unpacks, completes.

Every rank runs this on the identical response list, so every rank makes the identical
sequence of MPI calls. Ranks that have joined take part with zeros.

Each kind of collective is an ``Operation`` with three steps: ``prepare`` (pack inputs into
buffers, allocate outputs), ``communicate`` (the MPI part, on whatever the device backend
hands out: the communicator itself, or host staging for device memory) and ``unpack``. The
device phase around them (wait for the producing stream; after unpacking, make the results
visible) is in one place, ``Executor._execute``; the device transports order each MPI call
after the device work themselves (``transport/staging.py``). Statistics are recorded apart
(``EngineStats.record``).
"""
from __future__ import annotations

import itertools
import logging
import math
import time
from typing import Callable, Optional

from mpi4py import MPI

from ..buffers import backend_for
from ..buffers.dtypes import dtype_named, identity_value
from ..collectives.algorithms import AUTO, AlgorithmChoice, Links
from ..collectives.cost_model import (LinkCosts, describe_threshold, gradient_cycle_bytes,
                                      measure_link_costs, priority_cycle_bytes,
                                      speculation_bytes)
from ..collectives.native import allgatherv, alltoallv, broadcast
from ..collectives.ring import chunk_bounds, ring_reduce_scatter
from ..collectives.topology import node_layout
from ..config import Settings
from ..errors import MpiddpError
from ..reduce_ops import ReduceOp
from ..transport import pacing_for, transport_for
from ..transport.counting import CountedPeers, counted
from .autotune import Knobs
from .fusion import BufferPool, plan_batches
from .operation import Job, Operation, allocate, result_scaling
from .ring_halves import AllgatherHalf, ReducescatterHalf
from .request import (ALLGATHER, ALLREDUCE, ALLTOALL, BARRIER, BROADCAST, REDUCESCATTER,
                      Response, error_for)
from .stats import EngineStats
from .timeline import Timeline
from .transport_choice import open_partner_sockets

log = logging.getLogger("mpiddp")

# complete(entry, info=None, error=None): releases the name and completes the handle.
Complete = Callable[..., None]


class Allreduce(Operation):
    def prepare(self, ex, backend, batch, entries):
        job = super().prepare(ex, backend, batch, entries)
        request, dtype = job.request, job.dtype
        job.counts = [r.request.numel for r in batch]
        total = sum(job.counts)
        if len(batch) == 1 and entries[0] is not None:
            # One tensor: reduce straight in its output memory, no fusion copy.
            job.buf = entries[0].output
            if entries[0].input is not job.buf:
                backend.copy(job.buf, entries[0].input)
        else:
            job.buf = ex.pool.get(backend, request.device, dtype, "fusion", total)
            offset = 0
            for entry, count in zip(entries, job.counts):
                part = job.buf[offset:offset + count]
                if entry is None:
                    # A joined rank contributes the op's identity (zeros for sums).
                    backend.fill(part, identity_value(dtype, request.op))
                else:
                    backend.copy(part, entry.input)
                offset += count
        backend.scale_(job.buf, request.prescale, dtype)
        job.algorithm = ex.algorithms.adasum() if request.op == ReduceOp.ADASUM else \
            ex.algorithms.choose(total * dtype.itemsize, host=backend.device_type == "cpu")
        scratch = job.algorithm.scratch_elements(total, dtype.itemsize, ex.links(backend))
        job.scratch = ex.pool.get(backend, request.device, dtype, "scratch", scratch) \
            if scratch else None
        return job

    def communicate(self, ex, job, comm, backend):
        request, dtype = job.request, job.dtype
        scaling = result_scaling(backend, request, ex.size, dtype)
        if request.op == ReduceOp.ADASUM:
            # Per tensor: the fused tensors' offsets; the dot products travel in host memory.
            bounds = [0, *itertools.accumulate(job.counts)]
            job.segments = job.algorithm.run(ex.links(backend), job.buf, job.scratch, dtype,
                                             bounds, backend, ex.links(backend_for("cpu")),
                                             scaling)
            return
        job.segments = job.algorithm.run(ex.links(backend), job.buf, job.scratch, dtype,
                                         request.op, backend.reduce_into, scaling)

    def unpack(self, ex, job, backend):
        offset = 0
        for entry, count in zip(job.entries, job.counts):
            if entry is not None and entry.output is not job.buf:
                backend.copy(entry.output, job.buf[offset:offset + count])
            offset += count


class Broadcast(Operation):
    def prepare(self, ex, backend, batch, entries):
        job = super().prepare(ex, backend, batch, entries)
        entry = entries[0]
        if ex.rank == job.request.root and entry.input is not entry.output:
            backend.copy(entry.output, entry.input)
        return job

    def communicate(self, ex, job, comm, backend):
        broadcast(comm, job.entries[0].output, job.request.root)


class Allgather(Operation):
    def prepare(self, ex, backend, batch, entries):
        job = super().prepare(ex, backend, batch, entries)
        request, sizes = job.request, batch[0].sizes
        row = math.prod(request.shape[1:])
        job.counts = [n * row for n in sizes]
        job.output = allocate(backend, entries[0], (sum(sizes),) + tuple(request.shape[1:]))
        return job

    def communicate(self, ex, job, comm, backend):
        allgatherv(comm, job.entries[0].input, job.output, job.counts, job.dtype.itemsize)


class Alltoall(Operation):
    def prepare(self, ex, backend, batch, entries):
        job = super().prepare(ex, backend, batch, entries)
        request, matrix = job.request, batch[0].sizes
        row = math.prod(request.shape[1:])
        received = [matrix[src][ex.rank] for src in range(ex.size)]
        job.counts = ([n * row for n in matrix[ex.rank]], [n * row for n in received])
        job.output = allocate(backend, entries[0],
                              (sum(received),) + tuple(request.shape[1:]))
        job.infos = [tuple(received)]      # the handle reports how many rows came from whom
        return job

    def communicate(self, ex, job, comm, backend):
        sent, received = job.counts
        alltoallv(comm, job.entries[0].input, sent, job.output, received, job.dtype.itemsize)


class Reducescatter(Operation):
    def prepare(self, ex, backend, batch, entries):
        job = super().prepare(ex, backend, batch, entries)
        request, dtype = job.request, job.dtype
        row = math.prod(request.shape[1:])
        job.row_bounds = chunk_bounds(request.shape[0], ex.size)   # rows of rank r's share
        job.bounds = [b * row for b in job.row_bounds]
        job.buf = ex.pool.get(backend, request.device, dtype, "fusion", request.numel)
        backend.copy(job.buf, entries[0].input)
        backend.scale_(job.buf, request.prescale, dtype)
        largest = max(job.bounds[i + 1] - job.bounds[i] for i in range(ex.size))
        job.scratch = ex.pool.get(backend, request.device, dtype, "scratch", largest)
        return job

    def communicate(self, ex, job, comm, backend):
        op, dtype = job.request.op, job.dtype
        ring_reduce_scatter(comm, job.buf, job.scratch, job.bounds,
                            lambda dst, src: backend.reduce_into(dst, src, op, dtype))

    def unpack(self, ex, job, backend):
        request, rank = job.request, ex.rank
        mine = job.buf[job.bounds[rank]:job.bounds[rank + 1]]
        rows = job.row_bounds[rank + 1] - job.row_bounds[rank]
        output = allocate(backend, job.entries[0], (rows,) + tuple(request.shape[1:]))
        backend.copy(output, mine)
        scale = result_scaling(backend, request, ex.size, job.dtype)
        if scale is not None:
            scale(output)


class Barrier(Operation):
    """Agreement itself proves every rank reached the barrier: nothing left to move. Its
    action (an engine reconfiguration) runs here, at the same point of the order everywhere."""

    def prepare(self, ex, backend, batch, entries):
        action = entries[0].action
        if action is not None:
            action()
        return Job(batch[0].request, None, entries)


OPERATIONS = {ALLREDUCE: Allreduce(), BROADCAST: Broadcast(), ALLGATHER: Allgather(),
              ALLTOALL: Alltoall(), REDUCESCATTER: Reducescatter(), BARRIER: Barrier()}
# A sharded optimizer's halves (Request.ring_order), one bucket or several fused.
RING_HALVES = {REDUCESCATTER: ReducescatterHalf(), ALLGATHER: AllgatherHalf()}


class Executor:
    def __init__(self, comm: MPI.Comm, settings: Settings, stats: EngineStats,
                 timeline: Timeline, complete: Complete):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.settings = settings
        self.stats = stats
        self.timeline = timeline
        self.complete = complete
        self.pool = BufferPool()
        self.fusion_threshold = settings.fusion_threshold     # autotune changes it
        # Node-local and cross-node communicators (collective: every rank builds its engine).
        self.local, self.cross, self.topology = node_layout(comm)
        # The network's latency and rate, measured (collectively) where ranks span nodes:
        # for the automatic choice and for how transfers across nodes wait.
        self.link = link = measure_link_costs(self.cross, self.comm) \
            if self.topology.spans_nodes else None
        self.pacing = pacing_for(link.seconds_per_byte if link else None,
                                 settings.transfer_sleep_us)
        # TCP connections for the exchanges across nodes (transport/sockets.py), per
        # communicator: {} where MPI carries them.
        self.partner_sockets = open_partner_sockets(self.comm, self.local, self.cross,
                                                    settings) \
            if self.topology.spans_nodes else {}
        # Forward overlap's cycle budget (the engine's protocol takes it from here): the
        # user's, else sized from the links (the least where nothing was measured).
        self.priority_cycle_bytes = settings.priority_cycle_bytes \
            if settings.priority_cycle_bytes is not None else \
            priority_cycle_bytes(self.topology.cross_size, link)
        # Small all-reduces carried beside the negotiation (engine/speculation.py): the
        # user's bytes, else, where the bit vector travels over the engine's TCP
        # connections (each step a wait in the kernel), what the links move in one latency;
        # none over MPI, whose polite waiting fell into a lasting oscillation with it
        # (docs/dev/benchmark-record.md, "Small all-reduces inside the negotiation").
        over_sockets = "control" in self.partner_sockets
        self.speculation_bytes = settings.speculation_bytes \
            if settings.speculation_bytes is not None else \
            speculation_bytes(link) if over_sockets else 0
        # Adjustable at run time (set_allreduce_algorithm); start from the settings. A ring
        # threshold or an algorithm the user set leaves the links out of the choice.
        chooses = settings.ring_threshold is None and settings.allreduce_algorithm == AUTO
        self.algorithms = AlgorithmChoice(settings.allreduce_algorithm, settings.ring_threshold,
                                          settings.hierarchical_allreduce, self.topology,
                                          link if chooses else None,
                                          over_sockets=over_sockets)
        if self.rank == 0 and link is not None:
            self._log_links(link)
        self._links: dict = {}

    def gradient_cycle_bytes(self, gradient_bytes: int) -> int:
        """Forward overlap's cycle budget for ``gradient_bytes`` of gradients a step across
        these nodes (``cost_model.gradient_cycle_bytes``)."""
        return gradient_cycle_bytes(self.topology.cross_size, self.link, gradient_bytes)

    def _log_links(self, link: LinkCosts) -> None:
        """Rank 0: the measured links, how transfers wait on them, and the thresholds the
        automatic choice took from them."""
        choice = self.algorithms
        local_size = self.topology.local_size
        # With several ranks per node each measured its share of the node's interface.
        sharing = f" ({local_size} ranks per node exchanging at once), each" \
            if local_size > 1 else ""
        log.info("mpiddp: links between the %d nodes%s: %s; %s; forward overlap's cycles "
                 "carry up to %s", self.topology.cross_size, sharing, link.describe(),
                 self.pacing.describe(), describe_threshold(self.priority_cycle_bytes))
        if choice.link is None:
            return
        own = "the ring"
        if choice.hierarchical_allowed:
            own = "the hierarchical all-reduce"
        elif choice.halving_doubling_limit:
            own = (f"halving-doubling (the ring from "
                   f"{describe_threshold(choice.halving_doubling_limit)})")
        small = "MPI_Allreduce"
        if choice.recursive_doubling_limit:
            small = (f"recursive doubling over the TCP connections up to "
                     f"{describe_threshold(choice.recursive_doubling_limit)}")
            # At 2 nodes recursive doubling reaches the ring's threshold: nothing between.
            if choice.recursive_doubling_limit < choice.ring_threshold:
                small += ", then " + (
                    "halving-doubling for host buffers and MPI_Allreduce for device ones"
                    if choice.sockets_native_limit < choice.ring_threshold else "MPI_Allreduce")
        log.info("mpiddp: automatic all-reduce takes %s, %s from %s (whole communicator) and "
                 "the ring from %s (across nodes%s)", small, own,
                 describe_threshold(choice.ring_threshold),
                 describe_threshold(choice.cross_ring_threshold),
                 ": the hierarchical all-reduce's chunks" if local_size > 1 else "")

    def links(self, backend) -> Links:
        """The transports for buffers of ``backend``: the whole, node-local and cross-node
        communicators. Where ranks span nodes, transfers wait without spinning
        (``transport/network.py``, as ``self.pacing`` says). Each counts the bytes it moves
        into the stats (``transport/counting.py``: the one place wire bytes are counted)."""
        links = self._links.get(backend.device_type)
        if links is None:
            stats = self.stats
            partners = self.partner_sockets.get("control") \
                if backend.device_type == "cpu" else None
            links = self._links[backend.device_type] = Links(
                counted(transport_for(self.comm, backend, self.topology.spans_nodes,
                                      self.pacing, self.partner_sockets.get("whole")), stats),
                counted(transport_for(self.local, backend), stats),
                counted(transport_for(self.cross, backend, across_nodes=True,
                                      pacing=self.pacing,
                                      sockets=self.partner_sockets.get("cross")), stats),
                CountedPeers(partners, stats) if partners is not None else None)
        return links

    def close(self) -> None:
        """Free the node-local and cross-node communicators (the engine has stopped: every
        rank at the same point). Without it every engine a job starts and stops (process
        sets added and removed, init after shutdown) would keep two of the MPI library's
        few thousand communicators."""
        self._links.clear()
        for sockets in self.partner_sockets.values():
            sockets.close()
        self.partner_sockets = {}
        for comm in (self.local, self.cross):
            if comm != MPI.COMM_NULL:
                comm.Free()

    def configure(self, algorithm: str, ring_threshold: Optional[int] = None) -> None:
        """Switch the fused all-reduce algorithm (run it at an agreed point: a barrier's
        action, so that every rank switches between the same two batches)."""
        self.algorithms.configure(algorithm, ring_threshold)

    def knobs(self) -> Knobs:
        """The settings autotune may change, as they are now; None where one cannot matter
        (the ring threshold when an algorithm is forced, the hierarchical switch where the
        layout does not allow it)."""
        algorithms = self.algorithms
        auto = algorithms.setting == AUTO
        return Knobs(self.fusion_threshold, self.settings.cycle_time,
                     algorithms.ring_threshold if auto else None,
                     algorithms.hierarchical_setting != "0"
                     if auto and self.topology.hierarchical_usable else None)

    def retune(self, knobs: Knobs) -> None:
        """Apply autotune's settings (at an agreed point: the start of the same cycle on every
        rank); the cycle time is the coordinator's."""
        self.fusion_threshold = knobs.fusion_threshold
        self.algorithms.configure(self.algorithms.setting, knobs.ring_threshold,
                                  None if knobs.hierarchical is None else
                                  "auto" if knobs.hierarchical else "0")

    def run(self, responses: list[Response], entries: dict) -> None:
        """Execute ``responses`` in order; ``entries`` maps names to this rank's entries
        (absent for a rank that has joined)."""
        for batch in plan_batches(responses, self.fusion_threshold):
            first = batch[0]
            if first.error is not None:
                entry = entries.get(first.name)
                if entry is not None:
                    self.complete(entry, error=error_for(first, entry.rejected))
                self.stats.record_error()
                continue
            members = [entries.get(r.name) for r in batch]
            kind = first.request.kind
            if kind != ALLREDUCE and None in members:
                missing = batch[members.index(None)].name
                raise MpiddpError(f"rank {self.rank} has no local request for agreed "
                                  f"{kind} '{missing}'")
            operation = RING_HALVES[kind] if first.request.ring_order else OPERATIONS[kind]
            job = self._execute(operation, batch, members)
            self.stats.record(kind, len(batch), job)

    def complete_speculated(self, done: list) -> None:
        """Finish the all-reduces summed beside the negotiation (engine/speculation.py):
        ``done`` holds (entry, or None on a joined rank; response; the summed part). The
        result goes to the output, scaled as the executor scales every all-reduce."""
        backend = backend_for("cpu")
        timeline = self.timeline if self.timeline.enabled else None
        for entry, response, part in done:
            self.stats.record_speculated(part.nbytes)
            if entry is None:
                continue
            self.stats.record_speculated_tensor(part.nbytes)
            request = response.request
            if timeline:
                timeline.record(request.name, "start")
                timeline.record_bytes(request.name, part.nbytes)
            backend.copy(entry.output, part)
            scale = result_scaling(backend, request, self.size, dtype_named(request.dtype))
            if scale is not None:
                scale(entry.output)
            if timeline:
                timeline.record(request.name, "end")
            self.complete(entry)

    def _execute(self, operation: Operation, batch: list, members: list) -> Job:
        """The device phase, the same for every kind: order the engine's device work after
        the producers', prepare, communicate (the transport orders MPI after the device
        work), unpack, make the results visible, complete the handles."""
        device = batch[0].request.device
        backend = backend_for(device)
        present = [entry for entry in members if entry is not None]
        timeline = self.timeline if self.timeline.enabled else None   # the hot path skips it
        for entry in present:
            backend.wait_ready(entry)
            if timeline:
                timeline.record(entry.request.name, "start")
                if entry.input is not None:         # a barrier hands nothing over
                    timeline.record_bytes(entry.request.name, entry.input.nbytes)
        job = operation.prepare(self, backend, batch, members)
        operation.communicate(self, job, self.links(backend).whole, backend)
        operation.unpack(self, job, backend)
        done = backend.after_unpack(device)
        if done is not None:        # the caller's stream waits for it (torch/streams.py)
            for entry in present:
                entry.handle.done_event = done
        if timeline:
            end = time.perf_counter()
            for entry in present:
                timeline.record(entry.request.name, "end", end)
        complete, infos = self.complete, job.infos
        if infos is None:
            for entry in present:
                complete(entry)
        else:
            for entry, info in zip(present, infos):
                complete(entry, info=info)
        return job
