"""Recursive doubling: every rank swaps its whole buffer with one partner per step and folds
the partner's copy in, so after ``log2 P`` steps every rank holds the reduction of all (``P``
the largest power of two <= N; the other ranks fold in first and take the result back, two
more steps for them and their partners, as in ``halving_doubling.py``).

It sends the whole buffer ``log2 P`` times where halving-doubling sends ``2 (P-1)/P`` of it in
``2 log2 P`` steps: the fewest messages in a row, for buffers so small that the messages'
latency is the cost. The engine reduces the cycle's bit vector this way over its own TCP
connections (``engine/channel.py``): at 16 emulated nodes a 400-byte AND took 1.3 ms where
``MPI_Allreduce`` took 1.9 ms (docs/dev/benchmark-record.md).

Every rank combines ``(its buffer, its partner's)`` and the partner ``(its own, ours)``: with a
commutative ``combine`` (AND, a float sum) both get the same bits, so every rank ends with
the same result.
"""
from __future__ import annotations

from typing import Callable

from .halving_doubling import fold_layout, partners, real_rank

# exchange(dest, send, source, recv): send ``send`` to ``dest`` and receive ``recv`` from
# ``source``, both done when it returns (an empty buffer: nothing moves that way).
Exchange = Callable[[int, object, int, object], None]

__all__ = ["recursive_doubling", "partners"]


def recursive_doubling(exchange: Exchange, rank: int, size: int, buf, scratch,
                       combine: Callable[[object, object], None]) -> None:
    """Reduce ``buf`` (a flat array) in place over ``size`` ranks; ``scratch``: an array like
    it; ``combine(buf, other)`` folds ``other`` into ``buf``. The ranks exchanged with are
    ``partners(rank, size)``."""
    if size < 2:
        return
    pof2, extra, virtual = fold_layout(rank, size)
    nothing = buf[:0]
    if virtual is None:                 # folded: hand the buffer over, take the result back
        exchange(rank + 1, buf, rank + 1, nothing)
        exchange(rank + 1, nothing, rank + 1, buf)
        return
    folds = rank < 2 * extra            # takes part for itself and the even rank below it
    if folds:
        exchange(rank - 1, nothing, rank - 1, scratch)
        combine(buf, scratch)
    width = 1
    while width < pof2:
        partner = real_rank(virtual ^ width, extra)
        exchange(partner, buf, partner, scratch)
        combine(buf, scratch)
        width *= 2
    if folds:
        exchange(rank - 1, buf, rank - 1, nothing)
