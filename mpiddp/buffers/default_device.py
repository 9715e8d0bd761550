"""The CUDA device that plain 'cuda' requests use: this rank's engine device, chosen by
``mpiddp.gpu`` at ``init()`` (None before, or without CUDA)."""
from __future__ import annotations

from typing import Optional

_default_device: Optional[int] = None


def set_default_device(index: Optional[int]) -> None:
    global _default_device
    _default_device = index


def default_device() -> Optional[int]:
    return _default_device
