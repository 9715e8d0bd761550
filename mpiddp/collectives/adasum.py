"""Adasum (Maleki et al., MLSys 2021; Horovod's ``op=Adasum``) on a fused flat buffer, per tensor.

Two ranks' vectors ``a`` and ``b`` combine as

    a (1 - a.b / (2 |a|^2)) + b (1 - a.b / (2 |b|^2))

(a coefficient is 1 where its squared norm is below sqrt(DBL_MIN)): orthogonal vectors add,
parallel ones average. Dot products and squared norms are accumulated in float64 whatever the
dtype, and taken per tensor: a fused buffer holds several tensors, each combined with its own.

Adasum is not associative, so the pairing is part of the definition. Ranks combine by vector
halving, distance doubling (Horovod's VHDD): at distance ``d`` = 1, 2, 4, ... rank ``v`` pairs
with ``v ^ d``, the pair splits the range it works on (the lower rank keeps the first half)
and each combines its half; the dot products of a half are partial, summed over the ``2d``
ranks whose halves make up the two subtrees' whole vectors (recursive doubling among them:
every rank of the group then holds the same sums, bit for bit). With 4 ranks the result is
``(r0 + r1) + (r2 + r3)`` in Adasum's sense. An all-gather by distance halving spreads the
finished pieces: every element is combined once, by one rank, so every rank ends with the
same bits.

Other rank counts (Horovod refuses them): with ``P`` the largest power of two below ``N`` and
``E = N - P``, the first ``2E`` ranks pair up first, as recursive halving folds them
(``halving_doubling.fold_layout``): rank ``2i`` hands its vector to rank ``2i + 1``, which
combines the two and takes part for both; so 3 ranks give ``(r0 + r1) + r2`` and 6 give
``((r0 + r1) + (r2 + r3)) + ((r4) + (r5))``. The folded ranks get the result back at the end.

Zeros are Adasum's identity (``a + 0 = a``): a rank that joined contributes zeros.

``kernels`` does the arithmetic on the buffer's memory (host or device): ``dots(a, b,
segments)`` returns a float64 ``(len(segments), 3)`` array of ``(a.b, a.a, b.b)`` per segment,
``combine(x, y, segments, coefficients)`` sets ``x = cx x + cy y`` on each segment (the
coefficients a ``(len(segments), 2)`` float64 array).
"""
from __future__ import annotations

import math
import sys
from typing import Callable, Iterator, Optional, Protocol, Sequence

import numpy as np

from ..transport import Transfer, start_sendrecv
from .halving_doubling import fold_layout, folded_steps, real_rank
from .ring import as_bytes, complete

_TAG_FOLD, _TAG_HALVE, _TAG_DOTS, _TAG_DOUBLE, _TAG_UNFOLD = 31, 32, 33, 34, 35
# Below this a squared norm counts as zero (Horovod's threshold): its coefficient stays 1.
NORM_FLOOR = math.sqrt(sys.float_info.min)


class AdasumKernels(Protocol):
    def dots(self, a, b, segments: Sequence[tuple[int, int]]) -> np.ndarray: ...

    def combine(self, x, y, segments: Sequence[tuple[int, int]],
                coefficients: np.ndarray) -> None: ...


def coefficients(dots: np.ndarray) -> np.ndarray:
    """``(ca, cb)`` per tensor from its ``(a.b, a.a, b.b)``: ``1 - a.b / (2 |x|^2)``, or 1
    where ``|x|^2`` is below ``NORM_FLOOR``."""
    ab, aa, bb = dots[:, 0], dots[:, 1], dots[:, 2]
    with np.errstate(divide="ignore", invalid="ignore"):
        ca = np.where(aa >= NORM_FLOOR, 1.0 - ab / aa * 0.5, 1.0)
        cb = np.where(bb >= NORM_FLOOR, 1.0 - ab / bb * 0.5, 1.0)
    return np.stack([ca, cb], axis=1)


def tensor_segments(bounds: Sequence[int], lo: int, hi: int) -> tuple[list, list]:
    """The tensors (indices) that the range ``[lo, hi)`` of the buffer cuts, and each one's
    part of the range, relative to ``lo``. ``bounds``: the tensors' offsets, ``[0, ...,
    count]``."""
    first = int(np.searchsorted(bounds, lo, side="right")) - 1
    indices, segments = [], []
    for i in range(max(first, 0), len(bounds) - 1):
        start, stop = max(bounds[i], lo), min(bounds[i + 1], hi)
        if start >= hi:
            break
        if stop > start:
            indices.append(i)
            segments.append((start - lo, stop - lo))
    return indices, segments


def scratch_elements(count: int, size: int) -> int:
    """Scratch a rank needs: the whole buffer where ranks fold (``size`` not a power of
    two), else the larger half."""
    if size < 2:
        return 0
    pof2 = 1 << (size.bit_length() - 1)
    return count if pof2 != size else count - count // 2


def adasum_steps(comm, buf, scratch, bounds: Sequence[int], kernels: AdasumKernels,
                 postprocess: Optional[Callable[[object], None]] = None,
                 sum_dots: Optional[Callable[[np.ndarray], np.ndarray]] = None,
                 dots_comm=None) -> Iterator[Transfer]:
    """Adasum-reduce the flat ``buf`` in place across ``comm`` (see the module docstring),
    one started transfer at a time (the caller waits for each: ``complete``). ``bounds``:
    the fused tensors' offsets ``[0, ..., len(buf)]``. ``postprocess(piece)`` runs on the
    piece this rank finished, before the all-gather. ``sum_dots(partial)``: where ``buf`` is
    itself one part of a larger vector held by other ranks too (the hierarchical form), adds
    their parts of every dot product (the same on each of them); where a folded node's
    ranks are all folded alike, none of them calls it. ``dots_comm``: the communicator (host
    memory) the dot products travel over, if not ``comm`` (device buffers)."""
    dots_comm = comm if dots_comm is None else dots_comm
    size, rank, count = comm.Get_size(), comm.Get_rank(), len(buf)
    tensors = len(bounds) - 1
    # An empty buffer has nothing to combine, except where other ranks' parts of the same
    # vectors do (sum_dots: they wait for this rank's part of every dot product).
    if size == 1 or (count == 0 and sum_dots is None):
        if postprocess is not None:
            postprocess(buf)
        return
    pof2, extra, virtual = fold_layout(rank, size)
    nothing = buf[:0]
    if virtual is None:          # folded: hand the vector over, take the result back
        yield from folded_steps(comm, buf, (_TAG_FOLD, _TAG_UNFOLD))
        return
    if rank < 2 * extra:         # combines the even rank below with itself, takes part for both
        incoming = scratch[:count]
        yield start_sendrecv(comm, as_bytes(nothing), rank - 1, as_bytes(incoming), rank - 1,
                             _TAG_FOLD)
        whole = [(bounds[i], bounds[i + 1]) for i in range(tensors)]
        dots = kernels.dots(incoming, buf, whole)            # a: the lower rank's vector
        if sum_dots is not None:
            dots = sum_dots(dots)
        kernels.combine(buf, incoming, whole, coefficients(dots)[:, ::-1])
    lo, hi = 0, count
    ranges = []                  # the range before each halving, for the all-gather
    distance = 1
    while distance < pof2:
        partner = real_rank(virtual ^ distance, extra)
        mid = lo + (hi - lo) // 2
        left = not virtual & distance
        keep, give = ((lo, mid), (mid, hi)) if left else ((mid, hi), (lo, mid))
        incoming = scratch[:keep[1] - keep[0]]
        yield start_sendrecv(comm, as_bytes(buf[give[0]:give[1]]), partner,
                             as_bytes(incoming), partner, _TAG_HALVE)
        ranges.append((lo, hi, left))
        lo, hi = keep
        indices, segments = tensor_segments(bounds, lo, hi)
        mine = buf[lo:hi]
        # a is the lower subtree's vector: ours on the left, the partner's on the right.
        a, b = (mine, incoming) if left else (incoming, mine)
        partial = np.zeros((tensors, 3))
        if segments:
            partial[indices] = kernels.dots(a, b, segments)
        group = yield from _group_sum(dots_comm, virtual, extra, distance, partial)
        if sum_dots is not None:
            group = sum_dots(group)
        if segments:
            coeff = coefficients(group[indices])
            kernels.combine(mine, incoming, segments, coeff if left else coeff[:, ::-1])
        distance *= 2
    if postprocess is not None:
        postprocess(buf[lo:hi])
    while ranges:                # distance halving: gather the pieces back
        distance //= 2
        partner = real_rank(virtual ^ distance, extra)
        parent_lo, parent_hi, left = ranges.pop()
        other = (hi, parent_hi) if left else (parent_lo, lo)
        yield start_sendrecv(comm, as_bytes(buf[lo:hi]), partner,
                             as_bytes(buf[other[0]:other[1]]), partner, _TAG_DOUBLE)
        lo, hi = parent_lo, parent_hi
    if rank < 2 * extra:
        yield start_sendrecv(comm, as_bytes(buf), rank - 1, as_bytes(nothing), rank - 1,
                             _TAG_UNFOLD)


def _group_sum(comm, virtual: int, extra: int, distance: int, partial: np.ndarray):
    """Sum ``partial`` over the ``2 * distance`` ranks of ``virtual``'s group by recursive
    doubling (a generator of the transfers; returns the sums). Each step adds the partner's
    sums to ours, which the partner does alike: float addition commutes, so every rank of the
    group ends with the same bits."""
    total = partial.copy()
    theirs = np.empty_like(total)
    step = 1
    while step <= distance:
        partner = real_rank(virtual ^ step, extra)
        yield start_sendrecv(comm, total, partner, theirs, partner, _TAG_DOTS)
        total += theirs
        step *= 2
    return total


def adasum_allreduce(comm, buf, scratch, bounds: Sequence[int], kernels: AdasumKernels,
                     postprocess: Optional[Callable[[object], None]] = None,
                     sum_dots: Optional[Callable[[np.ndarray], np.ndarray]] = None,
                     dots_comm=None) -> None:
    """Adasum-reduce ``buf`` in place (``scratch``: ``scratch_elements`` elements)."""
    complete(adasum_steps(comm, buf, scratch, bounds, kernels, postprocess, sum_dots,
                          dots_comm))
