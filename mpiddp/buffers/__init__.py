"""Buffers: host (NumPy) and device (CuPy) storage, reduction kernels and transfers."""
from __future__ import annotations

from .backend import BufferBackend
from .host import HostBackend

__all__ = ["BufferBackend", "HostBackend", "backend_for", "set_default_device",
           "default_device"]

_backends: dict = {"cpu": HostBackend()}
_default_device = None


def set_default_device(index) -> None:
    """The CUDA device that plain 'cuda' requests use (chosen by ``mpiddp.gpu`` at init)."""
    global _default_device
    _default_device = index


def default_device():
    return _default_device


def backend_for(device: str) -> BufferBackend:
    """The buffer backend for a device string such as 'cpu' or 'cuda:1'."""
    device_type = device.split(":")[0]
    backend = _backends.get(device_type)
    if backend is None:
        if device_type != "cuda":
            raise TypeError(f"unsupported device type {device_type!r} (supported: cpu, cuda)")
        from .device import DeviceBackend  # CuPy is optional: import only when used

        backend = _backends[device_type] = DeviceBackend()
    return backend
