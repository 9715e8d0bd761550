"""Ring all-reduce and ring reduce-scatter on flat buffers, over point-to-point MPI.

A buffer of ``count`` elements is cut into ``size`` chunks (uneven lengths are normal).
Reduce-scatter takes ``size - 1`` steps: each rank sends one chunk to its right neighbour,
receives one from its left neighbour into ``scratch`` and folds it in. All-gather then
circulates the finished chunks for ``size - 1`` more steps. Each rank sends
``2 (size-1)/size`` of the buffer in all, the bandwidth optimum.

Buffers move as raw bytes; the arithmetic is the ``reduce_into(dst, src)`` callable, so the
same code serves host (NumPy) and device (CuPy) buffers and every dtype. The steps are
generators: each yields its started transfer, so a caller can interleave other work with a
ring whose transport leaves transfers in flight (``transport.start_sendrecv``), as the
pipelined hierarchical all-reduce does.
"""
from __future__ import annotations

from typing import Callable, Iterator, Sequence

from mpi4py import MPI

from ..transport import Transfer, start_sendrecv

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


def neighbours(rank: int, size: int) -> set[int]:
    """The ranks ``rank`` exchanges with in a ring of ``size``: right and left."""
    return {(rank + 1) % size, (rank - 1) % size} - {rank}


def as_bytes(array):
    """``array`` as an mpi4py buffer of raw bytes (steps move bytes, any dtype)."""
    return [array, MPI.BYTE]


def complete(steps: Iterator[Transfer]) -> None:
    """Run a generator of ring steps to the end, waiting for each step's transfer."""
    for transfer in steps:
        transfer.wait()


def reduce_scatter_steps(comm, buf, scratch, bounds: Sequence[int], reduce_into: ReduceInto,
                         owner_shift: int) -> Iterator[Transfer]:
    """The reduce-scatter half of the ring, in place on ``buf``, one step at a time: each
    step is started and yielded; the caller waits for it (``complete``, or later, with other
    work in between) before asking for the next, which first folds the received chunk in.

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
        yield start_sendrecv(comm, as_bytes(send), right, as_bytes(incoming), left,
                             _TAG_REDUCE_SCATTER)
        reduce_into(buf[lo:hi], incoming)


def allgather_steps(comm, buf, bounds: Sequence[int], owner_shift: int) -> Iterator[Transfer]:
    """Circulate finished chunks until every rank holds the whole reduced buffer (steps
    yielded as in ``reduce_scatter_steps``)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    right, left = (rank + 1) % size, (rank - 1) % size
    for step in range(size - 1):
        send_index = (rank + 1 - step + owner_shift) % size
        recv_index = (rank - step + owner_shift) % size
        send = buf[bounds[send_index]:bounds[send_index + 1]]
        recv = buf[bounds[recv_index]:bounds[recv_index + 1]]
        yield start_sendrecv(comm, as_bytes(send), right, as_bytes(recv), left, _TAG_ALLGATHER)


def ring_allreduce_steps(comm, buf, scratch, reduce_into: ReduceInto,
                         postprocess: Callable[[object], None] | None = None
                         ) -> Iterator[Transfer]:
    """``ring_allreduce`` one step at a time (see ``reduce_scatter_steps``)."""
    size = comm.Get_size()
    if size == 1 or len(buf) == 0:
        if postprocess is not None:
            postprocess(buf)
        return
    bounds = chunk_bounds(len(buf), size)
    yield from reduce_scatter_steps(comm, buf, scratch, bounds, reduce_into, owner_shift=0)
    if postprocess is not None:
        owned = (comm.Get_rank() + 1) % size
        postprocess(buf[bounds[owned]:bounds[owned + 1]])
    yield from allgather_steps(comm, buf, bounds, owner_shift=0)


def ring_allreduce(comm, buf, scratch, reduce_into: ReduceInto,
                   postprocess: Callable[[object], None] | None = None) -> None:
    """All-reduce the flat ``buf`` in place. ``scratch`` holds ``ceil(len/size)`` elements.
    ``postprocess(chunk)`` (e.g. the 1/size of an Average) runs on the one chunk this rank
    finished reducing, before the all-gather spreads it: 1/size of the work of scaling all."""
    complete(ring_allreduce_steps(comm, buf, scratch, reduce_into, postprocess))


def ring_reduce_scatter(comm: MPI.Comm, buf, scratch, bounds: Sequence[int],
                        reduce_into: ReduceInto, ring_order: bool = False) -> None:
    """Reduce ``buf`` so that rank ``r`` ends with the reduced chunk ``bounds[r]:bounds[r+1]``
    (in place; the other chunks hold partial sums afterwards). ``ring_order``: rank ``r``
    ends with chunk ``(r + 1) % size`` instead, summed in the order ``ring_allreduce`` sums
    it (``owned_chunk``)."""
    if comm.Get_size() == 1:
        return
    complete(reduce_scatter_steps(comm, buf, scratch, bounds, reduce_into,
                                  owner_shift=0 if ring_order else -1))


def owned_chunk(rank: int, size: int, ring_order: bool) -> int:
    """The chunk a reduce-scatter leaves reduced on ``rank`` (see ``ring_reduce_scatter``)."""
    return (rank + 1) % size if ring_order else rank
