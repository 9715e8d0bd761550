"""Adasum's arithmetic on a buffer's memory (``collectives/adasum.py`` says what it computes):
NumPy on host buffers (``HostAdasumKernels``), torch views of CuPy memory on device ones
(``TorchAdasumKernels``); every floating-point dtype (bfloat16 is stored as raw ``uint16``
bits).

Dot products and squared norms are accumulated in float64 whatever the dtype; a combination
``x = cx x + cy y`` is computed in float64 and rounded once to the buffer's dtype (bfloat16:
through float32, as torch converts).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .dtypes import DType


def torch_view(array, dtype: DType):
    """A torch tensor over ``array``'s memory, holding its values as ``dtype`` (host NumPy or
    device CuPy memory)."""
    import torch

    tensor = torch.from_numpy(array) if isinstance(array, np.ndarray) else \
        torch.as_tensor(array, device=f"cuda:{array.device.id}")
    return tensor.view(torch.bfloat16) if dtype.name == "bfloat16" else tensor


class TorchAdasumKernels:
    """``collectives.adasum.AdasumKernels`` for device buffers of ``dtype``: torch's
    kernels on views of the memory (whole-segment float64 copies: fine in device memory)."""

    def __init__(self, dtype: DType):
        self.dtype = dtype

    def dots(self, a, b, segments: Sequence[tuple[int, int]]) -> np.ndarray:
        import torch

        ta, tb = torch_view(a, self.dtype), torch_view(b, self.dtype)
        rows = []
        for start, stop in segments:
            x, y = ta[start:stop].double(), tb[start:stop].double()
            rows.append(torch.stack([torch.dot(x, y), torch.dot(x, x), torch.dot(y, y)]))
        return torch.stack(rows).cpu().numpy()      # one copy back from a device

    def combine(self, x, y, segments: Sequence[tuple[int, int]],
                coefficients: np.ndarray) -> None:
        tx, ty = torch_view(x, self.dtype), torch_view(y, self.dtype)
        for (start, stop), (cx, cy) in zip(segments, coefficients.tolist()):
            part = tx[start:stop]
            part.copy_(part.double() * cx + ty[start:stop].double() * cy)


# Host buffers are converted to float64 a chunk at a time: two chunks of scratch stay in the
# cache (whole-segment float64 copies went to main memory and were the all-reduce's bottleneck).
HOST_CHUNK = 1 << 15


class HostAdasumKernels:
    """``collectives.adasum.AdasumKernels`` for host (NumPy) buffers of ``dtype``: each chunk
    of ``HOST_CHUNK`` elements is converted to float64 once; a chunk holding several tensors'
    segments takes their sums in one vectorised pass (``np.add.reduceat``). ``segments`` must
    be contiguous and ascending, as ``collectives.adasum.tensor_segments`` gives them."""

    def __init__(self, dtype: DType):
        self.dtype = dtype
        self._x = np.empty(HOST_CHUNK)
        self._y = np.empty(HOST_CHUNK)

    def _load(self, source: np.ndarray, into: np.ndarray) -> np.ndarray:
        if self.dtype.name == "bfloat16":          # the bits are a float32's upper half
            np.copyto(into, (source.astype(np.uint32) << 16).view(np.float32))
        else:
            np.copyto(into, source)
        return into

    def _store(self, target: np.ndarray, values: np.ndarray) -> None:
        if self.dtype.name == "bfloat16":          # torch rounds to nearest even
            import torch

            torch_view(target, self.dtype).copy_(torch.from_numpy(values))
        else:
            np.copyto(target, values, casting="unsafe")

    def _chunks(self, segments: Sequence[tuple[int, int]]):
        """``(start, stop, first, offsets)`` per chunk: the chunk's range, its first segment's
        index and each of its segments' start within it (no segment may be empty)."""
        if not segments:
            return
        starts = np.fromiter((s for s, _ in segments), dtype=np.int64, count=len(segments))
        lo, hi = segments[0][0], segments[-1][1]
        for start in range(lo, hi, HOST_CHUNK):
            stop = min(start + HOST_CHUNK, hi)
            first = int(np.searchsorted(starts, start, side="right")) - 1
            last = int(np.searchsorted(starts, stop, side="left"))
            offsets = np.maximum(starts[first:last], start) - start
            yield start, stop, first, offsets

    def dots(self, a, b, segments: Sequence[tuple[int, int]]) -> np.ndarray:
        nonempty = _nonempty(segments)
        out = np.zeros((len(segments), 3))
        out[nonempty] = self._dots(a, b, [segments[i] for i in nonempty])
        return out

    def _dots(self, a, b, segments: Sequence[tuple[int, int]]) -> np.ndarray:
        out = np.zeros((len(segments), 3))
        for start, stop, first, offsets in self._chunks(segments):
            n = stop - start
            x, y = self._load(a[start:stop], self._x[:n]), self._load(b[start:stop], self._y[:n])
            if len(offsets) == 1:
                out[first] += (np.dot(x, y), np.dot(x, x), np.dot(y, y))
            else:
                rows = slice(first, first + len(offsets))
                out[rows, 0] += np.add.reduceat(x * y, offsets)
                out[rows, 1] += np.add.reduceat(x * x, offsets)
                out[rows, 2] += np.add.reduceat(y * y, offsets)
        return out

    def combine(self, x, y, segments: Sequence[tuple[int, int]],
                coefficients: np.ndarray) -> None:
        nonempty = _nonempty(segments)
        self._combine(x, y, [segments[i] for i in nonempty], coefficients[nonempty])

    def _combine(self, x, y, segments: Sequence[tuple[int, int]],
                 coefficients: np.ndarray) -> None:
        for start, stop, first, offsets in self._chunks(segments):
            n = stop - start
            u, v = self._load(x[start:stop], self._x[:n]), self._load(y[start:stop], self._y[:n])
            if len(offsets) == 1:
                cx, cy = coefficients[first]
            else:
                lengths = np.diff(np.append(offsets, n))
                chunk_coefficients = coefficients[first:first + len(offsets)]
                cx = np.repeat(chunk_coefficients[:, 0], lengths)
                cy = np.repeat(chunk_coefficients[:, 1], lengths)
            u *= cx
            v *= cy
            u += v
            self._store(x[start:stop], u)


def _nonempty(segments: Sequence[tuple[int, int]]) -> list[int]:
    """The indices of the segments that hold elements (``_chunks`` takes no empty one)."""
    return [i for i, (start, stop) in enumerate(segments) if stop > start]
