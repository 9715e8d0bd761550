"""The runtime's public calls: start and stop, where this rank sits, engine controls."""
from __future__ import annotations

import atexit
import functools
import logging
from typing import Sequence

from mpi4py import MPI

from ..config import ALGORITHMS
from ..docstrings import shared_doc
from ..transport.cuda_aware import mpi_cuda_aware as _mpi_cuda_aware
from . import current, deferred_work
from .lifecycle import Runtime, check_mpi_here
from .process_set_table import ProcessSet

log = logging.getLogger("mpiddp")

_atexit_registered = False


def init(comm: MPI.Comm | None = None, process_sets: Sequence | str | None = None) -> None:
    """Start mpiddp on this rank: check the launch, read and agree on the ``MPIDDP_*``
    settings, build the node-local and cross-node communicators, pick this rank's GPU (if
    any) and start the engine's coordinator thread.

    A collective: every rank of ``comm`` must call it. Calling it again while the engine runs
    is a no-op; after ``shutdown()`` it starts a new engine. Unless
    ``MPIDDP_ABORT_ON_EXCEPTION=0``, an uncaught exception on any thread of this rank from
    now on aborts the whole MPI job (the other ranks would otherwise wait forever).

    Args:
        comm: the communicator whose ranks train together. Default None:
            ``MPI.COMM_WORLD``. The engine works on a private duplicate of it.
        process_sets: ``ProcessSet`` objects (or rank lists) to add right away, as
            Horovod's static process sets (``add_process_set`` adds more later); None or
            ``"dynamic"`` adds none.

    Raises:
        LaunchError: the launcher started several tasks but MPI sees one process per task
            (e.g. ``srun`` without ``--mpi=pmi2``/``pmix``); or this process is not a rank:
            a rank started it (a DataLoader worker that 'spawn' or 'forkserver' started; an
            unguarded script calls ``init()`` there as the worker imports it).
        RuntimeError: MPI was initialised with less than ``MPI_THREAD_SERIALIZED``.
        ValueError: an ``MPIDDP_*`` setting is invalid on some rank, or a setting that must
            agree (fusion threshold, cache capacity, all-reduce algorithm, ring threshold)
            differs between ranks. Raised on every rank, naming the ranks and values.
        EngineShutdownError: the engine of an earlier ``init()`` stopped on its own (stall,
            failure) and ``shutdown()`` has not been called since.
    """
    global _atexit_registered
    running = current.get()
    if running is not None:
        running.check_running()
        return
    runtime = Runtime.start(MPI.COMM_WORLD if comm is None else comm)
    current.install(runtime)
    if not _atexit_registered:
        atexit.register(_shutdown_at_exit)
        _atexit_registered = True
    if process_sets is not None and process_sets != "dynamic":
        for process_set in process_sets:      # Horovod's static process sets
            runtime.process_sets.add(process_set if isinstance(process_set, ProcessSet)
                                     else ProcessSet(process_set))


def shutdown() -> None:
    """Stop the engine, on every rank: a shutdown on one rank is agreed by all ranks in the
    next engine cycle, so the other ranks' engines stop too.

    Blocks until this rank's coordinator thread has ended. Requests still in flight on any
    rank fail with ``EngineShutdownError`` naming the cause. Idempotent, and a no-op before
    ``init()``; it also runs at interpreter exit. Later calls that need the engine raise
    ``EngineShutdownError`` until ``init()`` is called again.
    """
    runtime = current.get()
    if runtime is None:
        return
    if runtime.engine.running:          # e.g. forward overlap's deferred parameter updates
        deferred_work.complete_all(quiet=True)
    runtime.stop()
    current.clear()


def _shutdown_at_exit() -> None:
    if current.get() is not None and not MPI.Is_finalized():
        shutdown()


def is_initialized() -> bool:
    """Whether ``init()`` has been called and ``shutdown()`` has not been called since.

    Stays True when the engine stopped on its own (stall timeout, a shutdown agreed from
    another rank); collectives then raise ``EngineShutdownError``.

    Returns:
        True between ``init()`` and ``shutdown()`` on this rank.
    """
    return current.get() is not None


@shared_doc()
def rank() -> int:
    """This process's rank in the communicator given to ``init()``.

    Returns:
        The rank, ``0 <= rank() < size()``.

    Raises:
        {needs_init}
    """
    return current.require("rank()").topology.rank


@shared_doc()
def size() -> int:
    """The number of ranks in the communicator given to ``init()``.

    Returns:
        The number of ranks (``>= 1``).

    Raises:
        {needs_init}
    """
    return current.require("size()").topology.size


@shared_doc()
def local_rank() -> int:
    """This process's rank among the ranks on its node (those sharing memory with it:
    ``MPI_COMM_TYPE_SHARED``), in the launcher's order of them where it gives one (its
    local rank variable, which chose the GPU at import), else by global rank. Selects the
    GPU: see docs/gpu.md.

    Returns:
        The node-local rank, ``0 <= local_rank() < local_size()``.

    Raises:
        {needs_init}
    """
    return current.require("local_rank()").topology.local_rank


@shared_doc()
def local_size() -> int:
    """The number of ranks on this process's node.

    Returns:
        The number of ranks sharing this node (``>= 1``).

    Raises:
        {needs_init}
    """
    return current.require("local_size()").topology.local_size


@shared_doc()
def cross_rank() -> int:
    """This process's rank among the ranks with the same ``local_rank()`` on all nodes; with
    the same number of ranks on every node, the index of this node.

    Returns:
        The cross-node rank, ``0 <= cross_rank() < cross_size()``.

    Raises:
        {needs_init}
    """
    return current.require("cross_rank()").topology.cross_rank


@shared_doc()
def cross_size() -> int:
    """The number of ranks with the same ``local_rank()`` as this process; with the same
    number of ranks on every node, the number of nodes.

    Returns:
        The size of this rank's cross-node group (``>= 1``).

    Raises:
        {needs_init}
    """
    return current.require("cross_size()").topology.cross_size


def mpi_threads_supported() -> bool:
    """Whether MPI provides ``MPI_THREAD_MULTIPLE``, i.e. whether your own MPI calls may run
    while mpiddp collectives are in flight. Does not need ``init()``.

    Returns:
        True with ``MPI_THREAD_MULTIPLE``; False otherwise (mpiddp itself needs only
        ``MPI_THREAD_SERIALIZED``).

    Raises:
        LaunchError: in a process that a rank started (a DataLoader worker), where MPI is
            not initialised.
    """
    check_mpi_here("mpi_threads_supported()")
    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE


@functools.wraps(_mpi_cuda_aware)
def mpi_cuda_aware() -> bool:
    check_mpi_here("mpi_cuda_aware()")     # its probe asks MPI: not in a DataLoader worker
    return _mpi_cuda_aware()


@shared_doc()
def engine_stats(process_set: ProcessSet | None = None) -> dict[str, int | float]:
    """Counters of what an engine did on this rank since ``init()`` (or since the set was
    added) or the last ``reset_engine_stats()``: its cycles, batches and traffic. Each
    process set has an engine, and counters, of its own. docs/tuning.md ("How to see the
    traffic") shows how to read them.

    Args:
        process_set: the set whose engine to read. Default None: the global set.

    Returns:
        A new dict. The traffic: ``collectives`` (collectives completed on this rank,
        barriers not counted), ``tensor_bytes`` (bytes of this rank's tensors handed to
        them: after compression, e.g. fp16's halves or PowerSGD's factors),
        ``sent_bytes`` and ``received_bytes`` (bytes this rank sent and received on the
        wire for them, counted where every algorithm hands them to MPI or mpiddp's TCP
        connections: a ring all-reduce of B bytes over N ranks sends and receives
        2 (N-1)/N B; MPI's own collectives count the payload that leaves and reaches this
        rank; the engine's negotiation is not counted), ``wait_seconds`` (time user threads
        spent blocked waiting for this engine's collectives: ``synchronize``, handle waits,
        the end of ``backward()`` waiting for averaged gradients), ``cycles``.
        The engine's work: ``cached_cycles`` (cycles that needed only the
        bit-vector all-reduce), ``slow_cycles`` (cycles that went through rank 0),
        ``tensors`` (requests completed, errors and barriers included), ``errors``,
        ``cache_hits``, ``allreduce_batches``, ``fused_batches``, ``fused_tensors``,
        ``max_batch_tensors``, ``allreduce_bytes``, ``ring_batches``,
        ``halving_doubling_batches``, ``recursive_doubling_batches``, ``native_batches``,
        ``hierarchical_batches``, ``adasum_batches``, ``pipelined_batches`` (hierarchical
        batches cut into pipelined segments), ``reducescatter_bytes``,
        ``speculated_tensors`` (small all-reduces finished in the negotiation, without a
        batch of their own). Every value is an int except ``wait_seconds``.

    Raises:
        {needs_init}
        ValueError: this rank is not in ``process_set``, or it was never added or was
            removed.
        TypeError: ``process_set`` is not a ``ProcessSet``.
    """
    return _engine_of(process_set, "engine_stats()").stats.snapshot()


@shared_doc()
def reset_engine_stats(process_set: ProcessSet | None = None) -> None:
    """Set every counter of ``engine_stats()`` to zero (this rank only).

    Args:
        process_set: the set whose counters to reset. Default None: the global set.

    Raises:
        {needs_init}
        ValueError: this rank is not in ``process_set``, or it was never added or was
            removed.
        TypeError: ``process_set`` is not a ``ProcessSet``.
    """
    _engine_of(process_set, "reset_engine_stats()").stats.reset()


def _engine_of(process_set: ProcessSet | None, what: str):
    runtime = current.require(what)
    if process_set is None:
        return runtime.engine
    return runtime.process_sets.engine_for(process_set, what)[0]


def set_allreduce_algorithm(algorithm: str, ring_threshold: int | None = None) -> None:
    """Switch the algorithm for fused all-reduces at run time, as
    ``MPIDDP_ALLREDUCE_ALGORITHM`` / ``MPIDDP_RING_THRESHOLD`` do at start-up.

    A collective, ordered like a barrier: every rank must call it with the same arguments
    (different arguments are different barrier names: the ranks stall). The switch happens
    at the same point of the agreed execution order on every rank, so ranks never pick
    different algorithms for the same buffer. Blocks until every rank has called it.

    Args:
        algorithm: ``'auto'`` (native ``MPI_Allreduce`` up to ``ring_threshold`` bytes, the
            ring or recursive halving-doubling above; where mpiddp's TCP connections carry
            the transfers across nodes, recursive doubling over them for the smallest host
            buffers (at 2 nodes every one up to the ring threshold) and, where
            halving-doubling fits, halving-doubling above them), ``'ring'``,
            ``'halving_doubling'``, ``'recursive_doubling'``, ``'native'`` or
            ``'hierarchical'``. Case-sensitive.
        ring_threshold: the new threshold in bytes for ``'auto'``. Default None: keep the
            current one.

    Raises:
        ValueError: ``algorithm`` is not one of these (checked before ``init()`` is).
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()``, or the engine stopped before the switch.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm {algorithm!r} is not one of: {', '.join(ALGORITHMS)}")
    engine = current.require("set_allreduce_algorithm()").engine
    engine.barrier(f"set_allreduce_algorithm.{algorithm}.{ring_threshold}",
                   action=lambda: engine.executor.configure(algorithm, ring_threshold)).wait()


@shared_doc()
def start_timeline(file_path: str | None = None, mark_cycles: bool = False) -> None:
    """Start recording, on this rank, when each tensor is submitted, agreed and reduced;
    discards the events recorded so far (see ``timeline_events``).

    Args:
        file_path: as Horovod's ``start_timeline(file_path)``: ``stop_timeline()`` (or
            ``shutdown()``) writes the trace there, each rank to its own file
            (``<stem>.rank<r>.json`` when there are several ranks). Default None: kept in
            memory for ``stop_timeline(path)`` and ``timeline_events()``.
        mark_cycles: Horovod's cycle markers; mpiddp has none (each tensor's ``agreed``
            event is the cycle that agreed on it): True logs a warning.

    Raises:
        {needs_init}
        ValueError: ``file_path``'s directory does not exist and cannot be made.
    """
    runtime = current.require("start_timeline()")
    if mark_cycles:
        log.warning("start_timeline(mark_cycles=True): mpiddp's timeline has no cycle "
                    "markers; each tensor's 'agreed' event is the cycle that agreed on it")
    runtime.set_timeline_file(file_path, "start_timeline(file_path)")
    runtime.engine.timeline.start()


@shared_doc()
def stop_timeline(path: str | None = None) -> list[tuple[str, str, float]]:
    """Stop recording; return the events and optionally write them as a Chrome trace.

    Args:
        path: where to write the events as a Chrome trace (chrome://tracing, Perfetto): one
            row per tensor, NEGOTIATE spans (submission to agreement), QUEUE spans
            (agreement to the start of its reduction) and REDUCE spans.
            Written atomically (temporary file, then rename). Default None: write nothing.

    Returns:
        The recorded events, as ``timeline_events()`` returns them.

    Raises:
        {needs_init}
        OSError: ``path`` cannot be written.
    """
    runtime = current.require("stop_timeline()")
    events = runtime.engine.timeline.stop()
    if path:
        runtime.engine.timeline.write_chrome_trace(path, runtime.topology.rank)
    elif runtime.timeline_file:
        runtime.write_timeline_file(runtime.timeline_file)
    runtime.timeline_file = None
    return events


@shared_doc()
def timeline_events() -> list[tuple[str, str, float]]:
    """The events recorded on this rank since ``start_timeline()`` (or since ``init()`` with
    ``MPIDDP_TIMELINE=1``), without stopping the recording.

    Returns:
        A new list of ``(tensor name, phase, time)`` in recording order; phase is one of
        ``'submit'``, ``'agreed'``, ``'start'``, ``'end'``; time is ``time.perf_counter()``
        seconds.

    Raises:
        {needs_init}
    """
    return current.require("timeline_events()").engine.timeline.events()
