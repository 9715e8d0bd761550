"""Recursive halving-doubling all-reduce (Rabenseifner's algorithm) over point-to-point MPI.

With ``P`` ranks, ``P`` a power of two, the buffer is cut into ``P`` chunks. Reduce-scatter by
recursive halving: in ``log2 P`` steps each rank swaps half of the range it still works on
with the partner whose rank differs in one bit (the highest first), keeps the half its own
bit selects and folds the partner's copy of that half in; afterwards rank ``r`` holds the
reduced chunk ``r``. All-gather by recursive doubling runs the steps backwards, each doubling
the finished range. Every rank sends ``2 (P-1)/P`` of the buffer, as in the ring, but in
``2 log2 P`` steps instead of ``2 (P-1)``: at 16 nodes 8 messages and fixed costs per
all-reduce instead of 30.

It is what MPICH and Open MPI run for large buffers; ours waits for the network as the ring
does (``transport.start_sendrecv``: transfers in flight, tested with sleeps between), where
``MPI_Allreduce`` busy-polls a core for the whole transfer.

Other rank counts: with ``P`` the largest power of two below ``N`` and ``E = N - P``, the
first ``2E`` ranks pair up first: each even one sends its whole buffer to the odd one above
it, which folds it in and takes part for both; at the end it sends the result back (two more
whole-buffer messages on those ranks: beyond some size the ring is cheaper, which the cost
model decides).

Steps are generators yielding their started transfer, like ``ring.py``'s. Every element's
sum is formed once, by the rank that owns its chunk, and then copied: every rank ends with
the same bits.
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional

from ..transport import Transfer, start_sendrecv
from .ring import ReduceInto, as_bytes, chunk_bounds, complete

_TAG_FOLD, _TAG_HALVE, _TAG_DOUBLE, _TAG_UNFOLD = 21, 22, 23, 24


def power_of_two_below(size: int) -> int:
    """The largest power of two that is at most ``size`` (>= 1)."""
    return 1 << (size.bit_length() - 1)


def scratch_elements(count: int, size: int) -> int:
    """Scratch a rank needs for a buffer of ``count`` elements over ``size`` ranks: the
    larger first half, or the whole buffer where ranks fold (``size`` not a power of two)."""
    pof2 = power_of_two_below(size)
    if size < 2:
        return 0
    if pof2 != size:
        return count
    return chunk_bounds(count, pof2)[pof2 // 2]


def virtual_rank(rank: int, extra: int) -> Optional[int]:
    """The rank's place among the power of two that takes part (None: folded away)."""
    if rank < 2 * extra:
        return rank // 2 if rank % 2 else None
    return rank - extra


def real_rank(virtual: int, extra: int) -> int:
    return 2 * virtual + 1 if virtual < extra else virtual + extra


def fold_layout(rank: int, size: int) -> tuple[int, int, Optional[int]]:
    """(P, the ranks folded in, ``rank``'s place among the P or None where it is folded)."""
    pof2 = power_of_two_below(size)
    extra = size - pof2
    return pof2, extra, virtual_rank(rank, extra)


def folded_steps(comm, buf, tags: tuple[int, int]) -> Iterator[Transfer]:
    """A folded rank's part (``fold_layout`` says None): hand ``buf`` to the rank above,
    which takes part for both, then take the result back (``tags``: fold, unfold)."""
    rank, nothing = comm.Get_rank(), buf[:0]
    yield start_sendrecv(comm, as_bytes(buf), rank + 1, as_bytes(nothing), rank + 1, tags[0])
    yield start_sendrecv(comm, as_bytes(nothing), rank + 1, as_bytes(buf), rank + 1, tags[1])


def partners(rank: int, size: int) -> set[int]:
    """The ranks ``rank`` exchanges with in ``halving_doubling_steps`` over ``size``."""
    pof2, extra, virtual = fold_layout(rank, size)
    if virtual is None:
        return {rank + 1}
    found = {rank - 1} if rank < 2 * extra else set()
    width = 1
    while width < pof2:
        found.add(real_rank(virtual ^ width, extra))
        width *= 2
    return found


def halving_doubling_steps(comm, buf, scratch, reduce_into: ReduceInto,
                           postprocess: Callable[[object], None] | None = None
                           ) -> Iterator[Transfer]:
    """All-reduce the flat ``buf`` in place, one started transfer at a time (the caller
    waits for each before asking for the next: ``complete``). ``postprocess(chunk)`` runs
    on the one chunk this rank finished reducing, before the all-gather spreads it."""
    size, rank, count = comm.Get_size(), comm.Get_rank(), len(buf)
    if size == 1 or count == 0:
        if postprocess is not None:
            postprocess(buf)
        return
    pof2, extra, virtual = fold_layout(rank, size)
    nothing = buf[:0]
    if virtual is None:          # folded: hand the buffer over, take the result back
        yield from folded_steps(comm, buf, (_TAG_FOLD, _TAG_UNFOLD))
        return
    if rank < 2 * extra:         # takes part for itself and the even rank below it
        incoming = scratch[:count]
        yield start_sendrecv(comm, as_bytes(nothing), rank - 1, as_bytes(incoming), rank - 1,
                             _TAG_FOLD)
        reduce_into(buf, incoming)
    bounds = chunk_bounds(count, pof2)
    lo, width = 0, pof2          # the chunks this rank works on: [lo, lo + width)
    while width > 1:
        half = width // 2
        partner = real_rank(virtual ^ half, extra)
        keep = lo + half if virtual & half else lo
        give = lo if virtual & half else lo + half
        start, stop = bounds[keep], bounds[keep + half]
        incoming = scratch[:stop - start]
        yield start_sendrecv(comm, as_bytes(buf[bounds[give]:bounds[give + half]]), partner,
                             as_bytes(incoming), partner, _TAG_HALVE)
        reduce_into(buf[start:stop], incoming)
        lo, width = keep, half
    if postprocess is not None:
        postprocess(buf[bounds[lo]:bounds[lo + 1]])
    while width < pof2:
        partner = real_rank(virtual ^ width, extra)
        other = lo ^ width       # the partner's finished range, as wide as ours
        yield start_sendrecv(comm, as_bytes(buf[bounds[lo]:bounds[lo + width]]), partner,
                             as_bytes(buf[bounds[other]:bounds[other + width]]), partner,
                             _TAG_DOUBLE)
        lo, width = min(lo, other), 2 * width
    if rank < 2 * extra:
        yield start_sendrecv(comm, as_bytes(buf), rank - 1, as_bytes(nothing), rank - 1,
                             _TAG_UNFOLD)


def halving_doubling_allreduce(comm, buf, scratch, reduce_into: ReduceInto,
                               postprocess: Callable[[object], None] | None = None) -> None:
    """All-reduce the flat ``buf`` in place (``scratch``: ``scratch_elements`` elements)."""
    complete(halving_doubling_steps(comm, buf, scratch, reduce_into, postprocess))
