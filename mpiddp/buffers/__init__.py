"""Buffers: host (NumPy) and device (CuPy) storage, reduction kernels and transfers."""
from __future__ import annotations

from .backend import BufferBackend
from .default_device import default_device, set_default_device, use_default_device
from .host import HostBackend

__all__ = ["BufferBackend", "HostBackend", "backend_for", "set_default_device",
           "default_device", "use_default_device"]

_backends: dict = {"cpu": HostBackend()}


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
