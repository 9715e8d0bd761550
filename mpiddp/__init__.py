"""mpiddp: data-parallel training for PyTorch over MPI, Horovod-style.

    import mpiddp
    mpiddp.init()
    opt = mpiddp.DistributedOptimizer(opt, named_parameters=model.named_parameters())

A Horovod PyTorch script runs after ``import mpiddp as hvd``.
"""
import sys as _sys

__version__ = "0.1.0"


# Modules run with ``python -m`` that need neither MPI nor the package's collectives.
_STANDALONE = ("mpiddp.run", "mpiddp.checkpoint_convert")


def _running_the_launcher(orig_argv=None, argv=None) -> bool:
    """True in ``python -m mpiddp.run``, the elastic launcher (docs/elastic.md): it needs
    nothing of the package, and importing it would load torch and initialise MPI in a process
    that only starts and watches ``mpiexec`` or ``srun`` (in a batch script, outside any job
    step); and in ``python -m mpiddp.checkpoint_convert``, an offline tool (no MPI there).
    Read from the interpreter's own options (``-Im``, ``-X opt -m``), only while ``-m``
    locates its module (``sys.argv[0]`` is then "-m"); Python 3.9 has no ``sys.orig_argv``:
    there the package loads as before."""
    orig_argv = getattr(_sys, "orig_argv", None) if orig_argv is None else orig_argv
    argv = _sys.argv if argv is None else argv
    if not orig_argv or argv[:1] != ["-m"]:
        return False
    args = iter(orig_argv[1:])
    for arg in args:
        if not arg.startswith("-") or arg == "-" or arg.startswith("--"):
            return False                    # a script, stdin, a long option: not our -m
        for position, flag in enumerate(arg[1:], 2):
            value = arg[position:]
            if flag == "m":
                return (value or next(args, "")) in _STANDALONE
            if flag == "c":
                return False
            if flag in "XW":                # an option's value: attached, or the next one
                if not value:
                    next(args, None)
                break
    return False


if not _running_the_launcher():
    from .runtime import (cross_rank, cross_size, engine_stats, init, is_initialized,  # noqa: F401
                          local_rank, local_size, mpi_cuda_aware, mpi_threads_supported, rank,
                          reset_engine_stats, set_allreduce_algorithm, shutdown, size,
                          start_timeline, stop_timeline, timeline_events)
    from .reduce_ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum  # noqa: F401
    from .build_info import (ccl_built, cuda_built, ddl_built, gloo_built,  # noqa: F401
                             gloo_enabled, mpi_built, mpi_enabled, nccl_built, rocm_built)
    from .errors import (DuplicateNameError, EngineShutdownError,  # noqa: F401
                         HorovodInternalError, InvalidInputError, InvalidInputTypeError,
                         LaunchError, MpiddpError, NotInitializedError, TensorMismatchError)
    from .torch.ops.async_ops import (allgather_async, allreduce_async, allreduce_async_,  # noqa: F401
                                  alltoall_async, broadcast_async, broadcast_async_,
                                  grouped_allgather_async, grouped_allreduce_async,
                                  grouped_allreduce_async_, grouped_reducescatter_async,
                                  reducescatter_async, sparse_allreduce_async)
    from .torch.ops.collectives import (allgather, allreduce, allreduce_, alltoall,  # noqa: F401
                                    barrier, broadcast, broadcast_, grouped_allgather,
                                    grouped_allreduce, grouped_allreduce_, grouped_reducescatter,
                                    join, reducescatter)
    from .torch.ops.handles import poll, synchronize  # noqa: F401

    from .process_sets import (ProcessSet, add_process_set, global_process_set,  # noqa: F401
                               remove_process_set)
    from .torch.compression import Compression  # noqa: F401,E402
    from .torch.ops.functions import (allgather_object, broadcast_object,  # noqa: F401,E402
                                  broadcast_optimizer_state, broadcast_parameters)
    from .torch.optimizer import DistributedOptimizer  # noqa: F401,E402
    from .torch.sharding.optimizer import elementwise_optimizer  # noqa: F401,E402
    from .torch.sharding.mixed_precision import MixedPrecisionPolicy  # noqa: F401,E402
    from .torch.features.sync_batch_norm import SyncBatchNorm  # noqa: F401,E402
    from .torch.features.profiler import profile  # noqa: F401,E402
    from . import elastic  # noqa: F401,E402  (snapshots, ElasticSampler: docs/elastic.md)
    from . import checkpoint  # noqa: F401,E402  (docs/checkpointing.md)
    from .checkpoint import Checkpoint  # noqa: F401,E402

__all__ = [
    # runtime: start-up, topology, engine controls
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "mpi_threads_supported", "mpi_cuda_aware",
    "engine_stats", "reset_engine_stats", "set_allreduce_algorithm",
    "start_timeline", "stop_timeline", "timeline_events", "profile",
    # reduction operations
    "ReduceOp", "Average", "Sum", "Min", "Max", "Product", "Adasum",
    "mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled", "nccl_built", "ccl_built",
    "ddl_built", "cuda_built", "rocm_built",
    # exceptions
    "MpiddpError", "NotInitializedError", "TensorMismatchError", "DuplicateNameError",
    "EngineShutdownError", "LaunchError", "InvalidInputError", "InvalidInputTypeError",
    "HorovodInternalError",
    "ProcessSet", "add_process_set", "remove_process_set", "global_process_set",
    # tensor collectives
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "allgather", "allgather_async",
    "grouped_allgather", "grouped_allgather_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "sparse_allreduce_async",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "reducescatter", "reducescatter_async", "alltoall", "alltoall_async",
    "barrier", "join", "synchronize", "poll",
    # framework glue
    "DistributedOptimizer", "elementwise_optimizer", "MixedPrecisionPolicy", "SyncBatchNorm", "Compression", "broadcast_parameters",
    "broadcast_optimizer_state", "broadcast_object", "allgather_object",
    # checkpoints that survive preemption
    "Checkpoint",
]
