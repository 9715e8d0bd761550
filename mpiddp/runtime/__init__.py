"""init/shutdown, the process topology, and the running engines.

``init()`` installs this rank's ``Runtime`` (``lifecycle.py``): the agreed settings, the
topology, the engine's coordinator thread and the process-set table. Every call that needs a
running mpiddp goes through ``require()`` (``current.py``), which says clearly when
``init()`` is missing.
"""
from ..local_device import select_before_mpi
from .mpi_environment import (keep_mpi_out_of_rank_children, mark_mpi_process,
                              point_intel_mpi_at_its_files, prefer_yielding_waits,
                              refuse_crashing_offload)

# Before the first import of mpi4py.MPI below initialises MPI: the environment MPI reads
# (refused where it would crash MPI_Init, completed where it would hang it), and the GPU a
# CUDA-aware MPI binds to. Not in a process a rank started (a DataLoader worker that 'spawn'
# or 'forkserver' started): no MPI there, and no CUDA context on the rank's GPU either.
if not keep_mpi_out_of_rank_children():
    refuse_crashing_offload()
    point_intel_mpi_at_its_files()
    prefer_yielding_waits()
    select_before_mpi()

from .api import (cross_rank, cross_size, engine_stats, init, is_initialized,  # noqa: E402
                  local_rank, local_size, mpi_cuda_aware, mpi_threads_supported, rank,
                  reset_engine_stats, set_allreduce_algorithm, shutdown, size, start_timeline,
                  stop_timeline, timeline_events)
from .current import require  # noqa: E402
from .deferred_work import complete_all as complete_deferred_work  # noqa: E402
from .deferred_work import register as register_deferred_work  # noqa: E402
from .process_set_table import GLOBAL_ID, ProcessSet, global_process_set  # noqa: E402

from mpi4py import MPI  # noqa: E402  (imported by .api above)

if MPI.Is_initialized():     # for the DataLoader workers this rank may start (init() too)
    mark_mpi_process(MPI.COMM_WORLD.Get_size())

__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
           "cross_rank", "cross_size", "mpi_cuda_aware", "mpi_threads_supported", "engine_stats",
           "reset_engine_stats", "set_allreduce_algorithm", "start_timeline", "stop_timeline",
           "timeline_events"]


def require_engine(what: str):
    """The global engine of the running runtime (raises as ``require``)."""
    return require(what).engine


def engine_for(process_set, what: str):
    """(engine, set) for a collective ``what`` on ``process_set`` (None: the global set).

    Raises:
        TypeError: ``process_set`` is not a ProcessSet.
        ValueError: the set was never added (or was removed), or this rank is not in it.
        NotInitializedError, EngineShutdownError: as ``require``.
    """
    return require(what).process_sets.engine_for(process_set, what)


def set_size(process_set) -> int:
    """The number of ranks in ``process_set`` (None: the global set, every rank)."""
    return (process_set or global_process_set).size()


def set_rank(process_set) -> int:
    """This rank's rank in ``process_set`` (None: the global set)."""
    return (process_set or global_process_set).rank()


def shard_grid(process_set, hybrid: bool = False):
    """How a sharded optimizer on ``process_set`` cuts its buckets
    (``collectives/shard_grid.py``): ``hybrid``, sharded within each node and replicated
    across nodes; else by node where its ranks are the same number, more than one, on each of
    several nodes and the hierarchical all-reduce is not turned off
    (``MPIDDP_HIERARCHICAL_ALLREDUCE=0``); else flat. The same choice on every rank.

    Raises:
        ValueError: ``hybrid`` where the nodes hold different numbers of the set's ranks.
    """
    from ..collectives.shard_grid import ShardGrid
    engine, _ = engine_for(process_set, "DistributedOptimizer")
    executor = engine.executor
    if hybrid:
        if not executor.topology.uniform:
            raise ValueError(
                f"DistributedOptimizer(hybrid_shard=True) shards within each node, so every "
                f"node must run the same number of the optimizer's ranks; this rank's node "
                f"runs {executor.topology.local_size} of {executor.size}, others differ. "
                f"Launch the same number of ranks per node, or drop hybrid_shard")
        return ShardGrid.hybrid(executor.topology)
    if executor.topology.hierarchical_usable and executor.settings.hierarchical_allreduce != "0":
        return ShardGrid.by_node(executor.topology)
    return ShardGrid.flat(executor.rank, executor.size)
