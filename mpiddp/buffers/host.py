"""Host (NumPy) buffers: allocation, copies and the reduction kernels for CPU tensors."""
from __future__ import annotations

import contextlib

import numpy as np

from .dtypes import DType
from .adasum_kernels import HostAdasumKernels
from .host_reduce import reduce_into, scale_


class HostBackend:
    """Buffer operations for device type 'cpu'. Device backends offer the same methods."""

    device_type = "cpu"
    reduce_into = staticmethod(reduce_into)
    scale_ = staticmethod(scale_)

    def empty(self, count: int, dtype: DType) -> np.ndarray:
        # Touch every page now: a persistent buffer must not page-fault on first use
        # inside a timed collective.
        array = np.empty(count, dtype=dtype.storage)
        array.fill(0)
        return array

    @staticmethod
    def copy(dst, src) -> None:
        np.copyto(dst, src)

    @staticmethod
    def adasum_kernels(dtype: DType) -> HostAdasumKernels:
        """Adasum's dot products and combinations on host buffers of ``dtype``."""
        return HostAdasumKernels(dtype)

    @staticmethod
    def fill(array, value) -> None:
        array.fill(value)

    def wait_ready(self, entry) -> None:
        """Host tensors are ready when submitted."""

    def after_unpack(self, device: str) -> None:
        """Host results are visible as soon as they are written (no done event)."""

    @staticmethod
    def allocating():
        """Host allocations need no stream."""
        return contextlib.nullcontext()

    @staticmethod
    def copier():
        """Host buffers go to MPI as they are: no device side to staging."""
        return None
