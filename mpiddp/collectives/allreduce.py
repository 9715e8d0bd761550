"""Algorithm choice for all-reducing one flat buffer: our ring, or native MPI_Allreduce."""
from __future__ import annotations

from mpi4py import MPI

from ..buffers.dtypes import DType
from ..ops import ReduceOp
from .native import native_allreduce
from .ring import ring_allreduce


def choose_algorithm(setting: str, nbytes: int, ring_threshold: int) -> str:
    """``auto`` picks native MPI_Allreduce up to ``ring_threshold`` bytes (latency-bound
    sizes, where MPI's recursive doubling needs fewer steps) and the ring above it."""
    if setting != "auto":
        return setting
    return "native" if nbytes <= ring_threshold else "ring"


def allreduce_buffer(comm: MPI.Comm, buf, scratch, dtype: DType, op: ReduceOp,
                     algorithm: str, reduce_kernel, finish=None) -> str:
    """All-reduce ``buf`` in place with ``algorithm`` ('ring' or 'native'); returns it.
    ``reduce_kernel(dst, src, op, dtype)`` does the local arithmetic; ``finish(array)``, an
    elementwise post-processing such as Average's scaling, is applied to the result (by the
    ring only to the chunk it owns, before the all-gather)."""
    if algorithm == "ring":
        ring_allreduce(comm, buf, scratch, lambda dst, src: reduce_kernel(dst, src, op, dtype),
                       finish)
    else:
        native_allreduce(comm, buf, dtype, op, reduce_kernel)
        if finish is not None:
            finish(buf)
    return algorithm
