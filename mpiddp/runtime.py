"""init/shutdown, the process topology, and the running engine.

``init()`` reads the settings, splits the communicator into node-local and cross-node
communicators, and starts the engine's coordinator thread. Everything that needs a running
engine goes through ``require_engine()``, which says clearly when ``init()`` is missing.
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from .config import Settings, read_settings, unknown_settings
from .errors import EngineShutdownError, NotInitializedError
from .launch_check import check_launch, ranks_on_this_node

__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
           "cross_rank", "cross_size", "mpi_threads_supported", "engine_stats",
           "reset_engine_stats", "set_allreduce_algorithm", "start_timeline", "stop_timeline",
           "timeline_events"]

log = logging.getLogger("mpiddp")


def _prefer_yielding_waits() -> None:
    # MPICH's waiting ranks busy-poll; with more ranks than cores they steal the cores that
    # compute needs. Must be set before MPI_Init (the first import of mpi4py.MPI), so it only
    # helps when mpiddp is imported first; users of other MPIs are unaffected.
    ranks_here = ranks_on_this_node(os.environ)
    if ranks_here is not None and ranks_here > (os.cpu_count() or 1):
        os.environ.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")


_prefer_yielding_waits()

from mpi4py import MPI  # noqa: E402  (after the environment above is set)

from .engine.coordinator import Engine, start_engine  # noqa: E402


@dataclass
class Runtime:
    comm: MPI.Comm
    local_comm: MPI.Comm
    cross_comm: MPI.Comm
    settings: Settings
    engine: Engine


_runtime: Runtime | None = None
_was_shut_down = False
_atexit_registered = False
_previous_excepthook = None
_previous_thread_excepthook = None


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
            (e.g. ``srun`` without ``--mpi=pmi2``/``pmix``).
        RuntimeError: MPI was initialised with less than ``MPI_THREAD_SERIALIZED``.
        ValueError: an ``MPIDDP_*`` setting is invalid on some rank, or a setting that must
            agree (fusion threshold, cache capacity, all-reduce algorithm, ring threshold)
            differs between ranks. Raised on every rank, naming the ranks and values.
        EngineShutdownError: the engine of an earlier ``init()`` stopped on its own (stall,
            failure) and ``shutdown()`` has not been called since.
    """
    global _runtime, _atexit_registered
    if _runtime is not None:
        if not _runtime.engine.running:
            raise EngineShutdownError(
                f"mpiddp's engine has stopped ({_runtime.engine.stopped_reason}); call "
                "mpiddp.shutdown() on every rank before calling mpiddp.init() again")
        return
    # Installed first, so that an error on one rank during start-up (a bad setting, say)
    # ends the job instead of leaving the others waiting in the collectives below.
    _install_abort_hook()
    check_launch(MPI.COMM_WORLD.Get_size(), os.environ)   # N singletons (srun without PMI)?
    provided = MPI.Query_thread()
    if provided < MPI.THREAD_SERIALIZED:
        raise RuntimeError(
            "mpiddp needs MPI initialised with at least MPI_THREAD_SERIALIZED (its coordinator "
            f"thread calls MPI), but the MPI library provides level {provided}. Let mpi4py "
            "initialise MPI (its default asks for MPI_THREAD_MULTIPLE).")
    comm = MPI.COMM_WORLD if comm is None else comm
    settings = _agreed_settings(comm)
    logging.getLogger("mpiddp").setLevel(settings.log_level)
    if not logging.getLogger().handlers and not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[mpiddp %(levelname)s] %(message)s"))
        log.addHandler(handler)
    unknown = unknown_settings()
    if unknown and comm.Get_rank() == 0:                 # once per job, not once per rank
        log.warning("\n".join(unknown))
    if provided < MPI.THREAD_MULTIPLE:
        log.warning("MPI provides only MPI_THREAD_SERIALIZED: do not make MPI calls of your own "
                    "while mpiddp collectives are in flight")
    local_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    cross_comm = comm.Split(color=local_comm.Get_rank(), key=comm.Get_rank())
    from . import gpu  # device selection before any CUDA call; CUDA-aware probe

    gpu.setup(settings, local_comm.Get_rank())
    engine = start_engine(comm, settings)
    _runtime = Runtime(comm, local_comm, cross_comm, settings, engine)
    if not _atexit_registered:
        atexit.register(_shutdown_at_exit)
        _atexit_registered = True
    if not settings.abort_on_exception:
        _remove_abort_hook()
    log.info("mpiddp initialised: rank %d of %d, local rank %d of %d", comm.Get_rank(),
             comm.Get_size(), local_comm.Get_rank(), local_comm.Get_size())
    if process_sets is not None and process_sets != "dynamic":
        from .process_sets import add_process_set

        for process_set in process_sets:      # Horovod's static process sets
            add_process_set(process_set)


# Settings every rank must share: they decide message sizes, fusion plans and algorithms.
_PROTOCOL_SETTINGS = ("fusion_threshold", "cache_capacity", "allreduce_algorithm",
                      "ring_threshold", "hierarchical_allreduce")


def _agreed_settings(comm) -> Settings:
    """Read the settings on every rank and check that the ranks agree; every rank raises the
    same error otherwise (a collective: no rank is left waiting)."""
    try:
        settings, error = read_settings(), None
    except ValueError as exc:
        settings, error = None, str(exc)
    everyone = comm.allgather((settings, error))
    errors = [f"rank {r}: {e}" for r, (_, e) in enumerate(everyone) if e]
    if errors:
        raise ValueError("invalid mpiddp settings: " + "; ".join(errors))
    for field in _PROTOCOL_SETTINGS:
        values = {r: getattr(s, field) for r, (s, _) in enumerate(everyone)}
        if len(set(values.values())) > 1:
            listing = ", ".join(f"rank {r} has {v!r}" for r, v in values.items())
            raise ValueError(f"MPIDDP_{field.upper()} must be the same on every rank, but "
                             f"{listing}")
    return settings


def shutdown() -> None:
    """Stop the engine, on every rank: a shutdown on one rank is agreed by all ranks in the
    next engine cycle, so the other ranks' engines stop too.

    Blocks until this rank's coordinator thread has ended. Requests still in flight on any
    rank fail with ``EngineShutdownError`` naming the cause. Idempotent, and a no-op before
    ``init()``; it also runs at interpreter exit. Later calls that need the engine raise
    ``EngineShutdownError`` until ``init()`` is called again.
    """
    global _runtime, _was_shut_down
    runtime = _runtime
    if runtime is None:
        return
    from . import process_sets

    process_sets.shutdown_all()
    runtime.engine.shutdown("shutdown() was called")
    _write_timeline_file(runtime)
    _runtime = None
    _was_shut_down = True
    runtime.local_comm.Free()
    runtime.cross_comm.Free()


def _write_timeline_file(runtime: Runtime) -> None:
    """MPIDDP_TIMELINE=path: every rank writes its events as a Chrome trace at shutdown,
    rank r to ``<path stem>.rank<r><suffix>`` (one file when there is one rank)."""
    path = runtime.settings.timeline
    if path in ("", "1"):
        return
    rank, size = runtime.comm.Get_rank(), runtime.comm.Get_size()
    if size > 1:
        stem, dot, suffix = path.rpartition(".")
        path = f"{stem}.rank{rank}.{suffix}" if dot and "/" not in suffix else \
            f"{path}.rank{rank}"
    runtime.engine.timeline.write_chrome_trace(path, rank)


def _shutdown_at_exit() -> None:
    if _runtime is not None and not MPI.Is_finalized():
        shutdown()


def _abort_job(what: str) -> None:
    """End the whole MPI job after ``what`` killed part of this rank (no-op on one rank)."""
    if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
        sys.stderr.write(f"mpiddp: rank {MPI.COMM_WORLD.Get_rank()} {what}; aborting the MPI "
                         "job so that the other ranks do not wait for it "
                         "(MPIDDP_ABORT_ON_EXCEPTION=0 disables this)\n")
        sys.stdout.flush()
        sys.stderr.flush()
        # MPI_Abort tears the job down at once; give the launcher a moment to forward what
        # this rank printed (the traceback above), or the user sees no reason at all.
        time.sleep(0.5)
        MPI.COMM_WORLD.Abort(1)


def _install_abort_hook() -> None:
    """An uncaught exception on one rank ends the whole job instead of leaving the other ranks
    waiting forever for collectives this rank will never submit. Both hooks: the main thread's
    (``sys.excepthook``) and every other thread's (``threading.excepthook``), since a data
    loading or logging thread that dies leaves its rank just as unable to go on."""
    global _previous_excepthook, _previous_thread_excepthook
    if _previous_excepthook is not None:
        return
    _previous_excepthook = sys.excepthook
    _previous_thread_excepthook = threading.excepthook

    def abort_on_uncaught(exc_type, exc, tb):
        _previous_excepthook(exc_type, exc, tb)
        _abort_job(f"died of an uncaught {exc_type.__name__}")

    def abort_on_uncaught_in_thread(args):
        _previous_thread_excepthook(args)
        if args.exc_type is SystemExit:
            return                      # a thread's sys.exit() is a normal end, as in Python
        name = args.thread.name if args.thread is not None else "?"
        _abort_job(f"lost its thread '{name}' to an uncaught {args.exc_type.__name__}")

    sys.excepthook = abort_on_uncaught
    threading.excepthook = abort_on_uncaught_in_thread


def _remove_abort_hook() -> None:
    global _previous_excepthook, _previous_thread_excepthook
    if _previous_excepthook is not None:
        sys.excepthook = _previous_excepthook
        threading.excepthook = _previous_thread_excepthook
        _previous_excepthook = _previous_thread_excepthook = None


def is_initialized() -> bool:
    """Whether ``init()`` has been called and ``shutdown()`` has not been called since.

    Stays True when the engine stopped on its own (stall timeout, a shutdown agreed from
    another rank); collectives then raise ``EngineShutdownError``.

    Returns:
        True between ``init()`` and ``shutdown()`` on this rank.
    """
    return _runtime is not None


def require(what: str) -> Runtime:
    """The running runtime, or a clear error naming the call that needed it."""
    if _runtime is None:
        if _was_shut_down:
            raise EngineShutdownError(f"mpiddp.{what} was called after mpiddp.shutdown(); "
                                      "call mpiddp.init() again first")
        raise NotInitializedError(f"mpiddp.{what} needs mpiddp.init() to be called first")
    return _runtime


def require_engine(what: str) -> Engine:
    return require(what).engine


def rank() -> int:
    """This process's rank in the communicator given to ``init()``.

    Returns:
        The rank, ``0 <= rank() < size()``.

    Raises:
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()``.
    """
    return require("rank()").comm.Get_rank()


def size() -> int:
    """The number of ranks in the communicator given to ``init()``.

    Returns:
        The number of ranks (``>= 1``).

    Raises:
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()``.
    """
    return require("size()").comm.Get_size()


def local_rank() -> int:
    """This process's rank among the ranks on its node (those sharing memory with it:
    ``MPI_COMM_TYPE_SHARED``), ordered by global rank. Selects the GPU: see docs/gpu.md.

    Returns:
        The node-local rank, ``0 <= local_rank() < local_size()``.

    Raises:
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()``.
    """
    return require("local_rank()").local_comm.Get_rank()


def local_size() -> int:
    """The number of ranks on this process's node.

    Returns:
        The number of ranks sharing this node (``>= 1``).

    Raises:
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()``.
    """
    return require("local_size()").local_comm.Get_size()


def cross_rank() -> int:
    """This process's rank among the ranks with the same ``local_rank()`` on all nodes; with
    the same number of ranks on every node, the index of this node.

    Returns:
        The cross-node rank, ``0 <= cross_rank() < cross_size()``.

    Raises:
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()``.
    """
    return require("cross_rank()").cross_comm.Get_rank()


def cross_size() -> int:
    """The number of ranks with the same ``local_rank()`` as this process; with the same
    number of ranks on every node, the number of nodes.

    Returns:
        The size of this rank's cross-node group (``>= 1``).

    Raises:
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()``.
    """
    return require("cross_size()").cross_comm.Get_size()


def mpi_threads_supported() -> bool:
    """Whether MPI provides ``MPI_THREAD_MULTIPLE``, i.e. whether your own MPI calls may run
    while mpiddp collectives are in flight. Does not need ``init()``.

    Returns:
        True with ``MPI_THREAD_MULTIPLE``; False otherwise (mpiddp itself needs only
        ``MPI_THREAD_SERIALIZED``).
    """
    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE


def engine_stats() -> dict[str, int]:
    """Counters of what the engine did on this rank since ``init()`` or the last
    ``reset_engine_stats()``.

    Returns:
        A new dict of counters: ``cycles``, ``cached_cycles`` (cycles that needed only the
        bit-vector all-reduce), ``slow_cycles`` (cycles that went through rank 0),
        ``tensors`` (requests completed, errors included), ``errors``, ``cache_hits``,
        ``allreduce_batches``, ``fused_batches``, ``fused_tensors``, ``max_batch_tensors``,
        ``allreduce_bytes``, ``ring_batches``, ``native_batches``, ``hierarchical_batches``,
        ``pipelined_batches`` (hierarchical batches cut into pipelined segments),
        ``reducescatter_bytes``.

    Raises:
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()``.
    """
    return require("engine_stats()").engine.stats.snapshot()


def reset_engine_stats() -> None:
    """Set every counter of ``engine_stats()`` to zero (this rank only).

    Raises:
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()``.
    """
    require("reset_engine_stats()").engine.stats.reset()


def set_allreduce_algorithm(algorithm: str, ring_threshold: int | None = None) -> None:
    """Switch the algorithm for fused all-reduces at run time, as
    ``MPIDDP_ALLREDUCE_ALGORITHM`` / ``MPIDDP_RING_THRESHOLD`` do at start-up.

    A collective, ordered like a barrier: every rank must call it with the same arguments
    (different arguments are different barrier names: the ranks stall). The switch happens
    at the same point of the agreed execution order on every rank, so ranks never pick
    different algorithms for the same buffer. Blocks until every rank has called it.

    Args:
        algorithm: ``'auto'`` (native ``MPI_Allreduce`` up to ``ring_threshold`` bytes, the
            ring above), ``'ring'`` or ``'native'``. Case-sensitive.
        ring_threshold: the new threshold in bytes for ``'auto'``. Default None: keep the
            current one.

    Raises:
        ValueError: ``algorithm`` is not one of the three (checked before ``init()`` is).
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()``, or the engine stopped before the switch.
    """
    from .config import ALGORITHMS

    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm {algorithm!r} is not one of: {', '.join(ALGORITHMS)}")
    engine = require("set_allreduce_algorithm()").engine
    engine.barrier(f"set_allreduce_algorithm.{algorithm}.{ring_threshold}",
                   action=lambda: engine.executor.configure(algorithm, ring_threshold)).wait()


def start_timeline() -> None:
    """Start recording, on this rank, when each tensor is submitted, agreed and reduced;
    discards the events recorded so far (see ``timeline_events``).

    Raises:
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()``.
    """
    require("start_timeline()").engine.timeline.start()


def stop_timeline(path: str | None = None) -> list[tuple[str, str, float]]:
    """Stop recording; return the events and optionally write them as a Chrome trace.

    Args:
        path: where to write the events as a Chrome trace (chrome://tracing, Perfetto): one
            row per tensor, NEGOTIATE spans (submission to agreement) and REDUCE spans.
            Written atomically (temporary file, then rename). Default None: write nothing.

    Returns:
        The recorded events, as ``timeline_events()`` returns them.

    Raises:
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()``.
        OSError: ``path`` cannot be written.
    """
    runtime = require("stop_timeline()")
    events = runtime.engine.timeline.stop()
    if path:
        runtime.engine.timeline.write_chrome_trace(path, runtime.comm.Get_rank())
    return events


def timeline_events() -> list[tuple[str, str, float]]:
    """The events recorded on this rank since ``start_timeline()`` (or since ``init()`` with
    ``MPIDDP_TIMELINE=1``), without stopping the recording.

    Returns:
        A new list of ``(tensor name, phase, time)`` in recording order; phase is one of
        ``'submit'``, ``'agreed'``, ``'start'``, ``'end'``; time is ``time.perf_counter()``
        seconds.

    Raises:
        NotInitializedError: before ``init()``.
        EngineShutdownError: after ``shutdown()``.
    """
    return require("timeline_events()").engine.timeline.events()
