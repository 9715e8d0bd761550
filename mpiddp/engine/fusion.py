"""Fusion planning and the persistent buffers the engine packs tensors into."""
from __future__ import annotations

import math

from ..buffers.dtypes import DType, dtype_named
from .request import ALLGATHER, ALLREDUCE, REDUCESCATTER, Response


def fusion_key(response: Response):
    r = response.request
    return (r.kind, r.dtype, r.device, r.op, r.prescale, r.postscale, r.ring_order)


def fusable(request) -> bool:
    """All-reduces, and the ring-order halves of sharded optimizers (their reduce-scatters,
    and their all-gathers: one pass for several buckets cut alike, ``ring_halves.py``)."""
    return request.kind == ALLREDUCE or (
        request.ring_order and request.kind in (REDUCESCATTER, ALLGATHER))


def plan_batches(responses: list[Response], threshold_bytes: int) -> list[list[Response]]:
    """Group agreed responses that may share one buffer (``fusable``: the same kind, dtype,
    device, op, scale factors and cut) into batches of at most ``threshold_bytes``; every other
    response (and every error) forms a batch of its own. Batches keep the order of their
    first member, so every rank computes the same plan from the same response list."""
    if len(responses) == 1:    # the common case of small steps: nothing to group
        return [responses]
    batches: list[list[Response]] = []
    open_batch: dict = {}      # fusion key -> (batch, bytes so far)
    for response in responses:
        r = response.request
        if response.error is not None or not fusable(r):
            batches.append([response])
            continue
        nbytes = r.numel * dtype_named(r.dtype).itemsize
        key = fusion_key(response)
        current = open_batch.get(key)
        if current is not None and current[1] + nbytes <= threshold_bytes:
            current[0].append(response)
            open_batch[key] = (current[0], current[1] + nbytes)
            continue
        batch = [response]
        batches.append(batch)
        if nbytes < threshold_bytes:     # an oversized tensor leaves the open batch open
            open_batch[key] = (batch, nbytes)
    return batches


class BufferPool:
    """Persistent buffers per (device, dtype, role), grown when too small and never freed
    during a run: allocating per call costs page faults on every collective."""

    def __init__(self):
        self._buffers: dict = {}

    def get(self, backend, device: str, dtype: DType, role: str, count: int):
        key = (device, dtype.name, role)
        buf = self._buffers.get(key)
        if buf is None or len(buf) < count:
            grown = max(count, 2 * len(buf) if buf is not None else 0)
            # Round up to a whole page of elements so small growth does not reallocate.
            per_page = max(1, 4096 // dtype.itemsize)
            buf = backend.empty(math.ceil(grown / per_page) * per_page, dtype)
            self._buffers[key] = buf
        return buf[:count]
