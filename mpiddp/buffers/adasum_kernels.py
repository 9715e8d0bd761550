"""Adasum's arithmetic on a buffer's memory (``collectives/adasum.py`` says what it computes),
through torch views of the same memory: NumPy arrays for host buffers, CuPy arrays for device
ones, every floating-point dtype (bfloat16 is stored as raw ``uint16`` bits).

Dot products and squared norms are accumulated in float64 whatever the dtype; a combination
``x = cx x + cy y`` is computed in float64 and rounded once to the buffer's dtype.
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
    """``collectives.adasum.AdasumKernels`` for buffers of ``dtype``."""

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
