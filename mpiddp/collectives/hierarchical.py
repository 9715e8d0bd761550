"""Hierarchical all-reduce: within a node over shared memory, across nodes over the network
only once per byte.

1. Node-local reduce-scatter (a ring over the node's ranks): local rank ``l`` ends with the
   node's sum of chunk ``l`` (1/local_size of the buffer).
2. Cross-node all-reduce of that chunk among the ranks with the same local rank (one per
   node): every byte of the buffer crosses the network once per direction, split over the
   node's ranks, instead of ``2 (N-1)/N`` times in a flat ring over all N ranks.
3. Node-local all-gather of the finished chunks.

It needs the same number of ranks on every node (then the cross-node groups line up with the
chunks); ``hierarchical_layout`` says whether a communicator qualifies.
"""
from __future__ import annotations

from mpi4py import MPI

from ..buffers.dtypes import DType
from ..ops import ReduceOp
from .allreduce import allreduce_buffer
from .ring import allgather_steps, chunk_bounds, reduce_scatter_steps


def hierarchical_layout(comm: MPI.Comm) -> tuple[MPI.Comm, MPI.Comm, bool]:
    """(node-local communicator, cross-node communicator of the ranks with this local rank,
    whether the hierarchical algorithm applies: several nodes, several ranks on each, the same
    number on every node). A collective of ``comm``."""
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    cross = comm.Split(color=local.Get_rank(), key=comm.Get_rank())
    sizes = set(comm.allgather(local.Get_size()))
    usable = len(sizes) == 1 and local.Get_size() > 1 and comm.Get_size() > local.Get_size()
    return local, cross, usable


def hierarchical_allreduce(local: MPI.Comm, cross: MPI.Comm, buf, scratch, dtype: DType,
                           op: ReduceOp, reduce_kernel, cross_algorithm: str = "native",
                           finish=None) -> None:
    """All-reduce the flat ``buf`` in place over ``local`` x ``cross`` (see the module
    docstring). ``scratch`` holds ``ceil(len(buf) / local size)`` elements. ``finish(chunk)``
    (Average's scaling) runs on the one chunk this rank owns, before the all-gather.
    ``cross_algorithm`` ('native' or 'ring') reduces the chunk across nodes."""
    size, rank = local.Get_size(), local.Get_rank()
    if size == 1 or len(buf) == 0:
        allreduce_buffer(cross, buf, scratch, dtype, op, cross_algorithm, reduce_kernel, finish)
        return
    bounds = chunk_bounds(len(buf), size)
    reduce_scatter_steps(local, buf, scratch, bounds,
                         lambda dst, src: reduce_kernel(dst, src, op, dtype), owner_shift=-1)
    mine = buf[bounds[rank]:bounds[rank + 1]]          # this node's sum of chunk ``rank``
    allreduce_buffer(cross, mine, scratch, dtype, op, cross_algorithm, reduce_kernel, finish)
    allgather_steps(local, buf, bounds, owner_shift=-1)
