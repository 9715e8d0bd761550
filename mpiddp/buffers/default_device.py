"""The CUDA device that plain 'cuda' requests use: this rank's engine device, chosen by
``mpiddp.gpu`` at ``init()`` (None before, or without CUDA).

CUDA's current device belongs to each host thread, and is device 0 on a thread that never
set one: any CUDA call there creates a context on GPU 0. So every thread mpiddp starts (the
coordinator, the watchdog) makes the rank's device current first, ``use_default_device``."""
from __future__ import annotations

from typing import Optional

_default_device: Optional[int] = None


def set_default_device(index: Optional[int]) -> None:
    global _default_device
    _default_device = index


def default_device() -> Optional[int]:
    return _default_device


def use_default_device() -> None:
    """Make this rank's engine device current on the calling thread (nothing without one:
    CPU jobs never touch CUDA)."""
    if _default_device is None:
        return
    import torch

    if torch.cuda.current_device() != _default_device:
        torch.cuda.set_device(_default_device)
