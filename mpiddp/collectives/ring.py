"""Ring all-reduce and ring reduce-scatter on flat buffers, over point-to-point MPI.

A buffer of ``count`` elements is cut into ``size`` chunks (uneven lengths are normal).
Reduce-scatter takes ``size - 1`` steps: each rank sends one chunk to its right neighbour,
receives one from its left neighbour into ``scratch`` and folds it in. All-gather then
circulates the finished chunks for ``size - 1`` more steps. Each rank sends
``2 (size-1)/size`` of the buffer in all, the bandwidth optimum.

Buffers move as raw bytes; the arithmetic is the ``reduce_into(dst, src)`` callable, so the
same code serves host (NumPy) and device (CuPy) buffers and every dtype.
"""
from __future__ import annotations

from typing import Callable, Sequence

from mpi4py import MPI

ReduceInto = Callable[[object, object], None]
_TAG_REDUCE_SCATTER = 17
_TAG_ALLGATHER = 18


def chunk_bounds(count: int, parts: int) -> list[int]:
    """Offsets of ``parts`` near-equal chunks of ``count`` items; the first chunks get
    the remainder."""
    base, extra = divmod(count, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def _bytes(array):
    return [array, MPI.BYTE]


def reduce_scatter_steps(comm: MPI.Comm, buf, scratch, bounds: Sequence[int],
                         reduce_into: ReduceInto, owner_shift: int) -> None:
    """Run the reduce-scatter half of the ring in place on ``buf``.

    Afterwards rank ``r`` holds the fully reduced chunk ``(r + 1 + owner_shift) % size``.
    ``scratch`` must hold at least the largest chunk.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    right, left = (rank + 1) % size, (rank - 1) % size
    for step in range(size - 1):
        send_index = (rank - step + owner_shift) % size
        recv_index = (rank - step - 1 + owner_shift) % size
        send = buf[bounds[send_index]:bounds[send_index + 1]]
        lo, hi = bounds[recv_index], bounds[recv_index + 1]
        incoming = scratch[:hi - lo]
        comm.Sendrecv(_bytes(send), right, _TAG_REDUCE_SCATTER,
                      _bytes(incoming), left, _TAG_REDUCE_SCATTER)
        reduce_into(buf[lo:hi], incoming)


def allgather_steps(comm: MPI.Comm, buf, bounds: Sequence[int], owner_shift: int) -> None:
    """Circulate finished chunks until every rank holds the whole reduced buffer."""
    size, rank = comm.Get_size(), comm.Get_rank()
    right, left = (rank + 1) % size, (rank - 1) % size
    for step in range(size - 1):
        send_index = (rank + 1 - step + owner_shift) % size
        recv_index = (rank - step + owner_shift) % size
        send = buf[bounds[send_index]:bounds[send_index + 1]]
        recv = buf[bounds[recv_index]:bounds[recv_index + 1]]
        comm.Sendrecv(_bytes(send), right, _TAG_ALLGATHER, _bytes(recv), left, _TAG_ALLGATHER)


def ring_allreduce(comm: MPI.Comm, buf, scratch, reduce_into: ReduceInto,
                   finish_chunk: Callable[[object], None] | None = None) -> None:
    """All-reduce the flat ``buf`` in place. ``scratch`` holds ``ceil(len/size)`` elements.
    ``finish_chunk(chunk)`` (e.g. the 1/size of an Average) runs on the one chunk this rank
    finished reducing, before the all-gather spreads it: 1/size of the work of scaling all."""
    size = comm.Get_size()
    if size == 1 or len(buf) == 0:
        if finish_chunk is not None:
            finish_chunk(buf)
        return
    bounds = chunk_bounds(len(buf), size)
    reduce_scatter_steps(comm, buf, scratch, bounds, reduce_into, owner_shift=0)
    if finish_chunk is not None:
        owned = (comm.Get_rank() + 1) % size
        finish_chunk(buf[bounds[owned]:bounds[owned + 1]])
    allgather_steps(comm, buf, bounds, owner_shift=0)


def ring_reduce_scatter(comm: MPI.Comm, buf, scratch, bounds: Sequence[int],
                        reduce_into: ReduceInto) -> None:
    """Reduce ``buf`` so that rank ``r`` ends with the reduced chunk ``bounds[r]:bounds[r+1]``
    (in place; the other chunks hold partial sums afterwards)."""
    if comm.Get_size() == 1:
        return
    reduce_scatter_steps(comm, buf, scratch, bounds, reduce_into, owner_shift=-1)
