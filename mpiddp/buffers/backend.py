"""The interface every buffer backend offers the engine: ``HostBackend`` (NumPy, device type
'cpu', ``host.py``) and ``DeviceBackend`` (CuPy, 'cuda', ``device.py``).

The engine never asks which one it has: it gets the backend for a request's device
(``buffers.backend_for``) and calls these methods. A new kind of memory is a new class with
these methods, registered in ``backend_for``.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

from ..reduce_ops import ReduceOp
from .dtypes import DType


@runtime_checkable
class BufferBackend(Protocol):
    """Memory, kernels and device ordering for one device type."""

    device_type: str        # 'cpu' or 'cuda': matches ``Request.device_type``

    def empty(self, count: int, dtype: DType) -> Any:
        """A new flat buffer of ``count`` elements, its pages touched (persistent buffers
        must not page-fault inside a timed collective)."""

    def copy(self, dst: Any, src: Any) -> None:
        """Copy ``src`` into ``dst`` (flat arrays of the same length and storage dtype)."""

    def fill(self, array: Any, value: Any) -> None:
        """Set every element of ``array`` to ``value``."""

    def reduce_into(self, dst: Any, src: Any, op: ReduceOp, dtype: DType) -> None:
        """``dst = op(dst, src)`` elementwise; bit-identical across backends."""

    def scale_(self, array: Any, factor: float, dtype: DType, exact: bool = False) -> None:
        """Multiply ``array`` by ``factor`` in place (integers: in float64, truncated);
        ``exact``: Average's 1/size, rounded once."""

    def wait_ready(self, entry: Any) -> None:
        """Before reading ``entry.input``: wait for the device work that produces it."""

    def allocating(self) -> Any:
        """A context for the torch layer's allocation of an output (``Entry.allocate``):
        device memory allocated inside belongs to the stream that will write it."""

    def after_unpack(self, device: str) -> Optional[Any]:
        """After results are written: make them visible to the caller's streams. Returns the
        device event that marks them written (None on the host)."""

    def copier(self) -> Optional[Any]:
        """The device-host copier for staging (``transport.staging.Copier``); None on the
        host, whose buffers go to MPI as they are."""
