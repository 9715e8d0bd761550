"""Native MPI collectives on flat buffers: the library's own algorithms, used where they win
(small messages) and for the collectives the engine does not implement itself."""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
from mpi4py import MPI

from ..buffers.dtypes import DType
from ..reduce_ops import ReduceOp, combine_function

# MPI's predefined op for each elementwise function of ``ops.combine_function``.
_MPI_OPS = {"add": MPI.SUM, "minimum": MPI.MIN, "maximum": MPI.MAX, "multiply": MPI.PROD,
            "logical_and": MPI.LAND, "logical_or": MPI.LOR}
_user_ops: dict = {}
_resolved: dict = {}     # (op, dtype kind) -> MPI op: this runs for every native all-reduce


def _user_op(dtype: DType, op: ReduceOp, reduce_into) -> MPI.Op:
    """An MPI user op for dtypes MPI cannot reduce itself (float16, bfloat16): the library
    moves the bytes and calls back into our kernel for the arithmetic."""
    key = (dtype.name, op)
    if key not in _user_ops:
        def combine(inbuf, inoutbuf, datatype, _dtype=dtype, _op=op):
            src = np.frombuffer(inbuf, dtype=_dtype.storage)
            dst = np.frombuffer(inoutbuf, dtype=_dtype.storage)
            reduce_into(dst, src, _op, _dtype)

        _user_ops[key] = MPI.Op.Create(combine, commute=True)
    return _user_ops[key]


def mpi_op(dtype: DType, op: ReduceOp, reduce_into: Callable) -> MPI.Op:
    if not dtype.native_reduce:
        return _user_op(dtype, op, reduce_into)
    key = (op, dtype.kind)
    found = _resolved.get(key)
    if found is None:
        found = _resolved[key] = _MPI_OPS[combine_function(op, dtype.kind)]
    return found


def native_allreduce(comm: MPI.Comm, buf, dtype: DType, op: ReduceOp, reduce_into) -> None:
    """MPI_Allreduce in place on the flat ``buf``."""
    if len(buf) == 0 or comm.Get_size() == 1:
        return
    comm.Allreduce(MPI.IN_PLACE, [buf, dtype.mpi], mpi_op(dtype, op, reduce_into))


def byte_layout(counts: Sequence[int], itemsize: int) -> tuple[list[int], list[int]]:
    """Byte counts and displacements for a v-collective over ``counts`` elements."""
    sizes = [c * itemsize for c in counts]
    displs = list(np.cumsum([0] + sizes[:-1]).tolist())
    return sizes, displs


def allgatherv(comm: MPI.Comm, send, recv, counts: Sequence[int], itemsize: int) -> None:
    """Gather each rank's ``counts[r]`` elements into ``recv`` in rank order."""
    sizes, displs = byte_layout(counts, itemsize)
    comm.Allgatherv([send, MPI.BYTE], [recv, sizes, displs, MPI.BYTE])


def broadcast(comm: MPI.Comm, buf, root: int) -> None:
    if len(buf) == 0 or comm.Get_size() == 1:
        return
    comm.Bcast([buf, MPI.BYTE], root=root)


def alltoallv(comm: MPI.Comm, send, send_counts: Sequence[int], recv,
              recv_counts: Sequence[int], itemsize: int) -> None:
    s_sizes, s_displs = byte_layout(send_counts, itemsize)
    r_sizes, r_displs = byte_layout(recv_counts, itemsize)
    comm.Alltoallv([send, s_sizes, s_displs, MPI.BYTE], [recv, r_sizes, r_displs, MPI.BYTE])
