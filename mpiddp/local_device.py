"""This process's GPU, chosen when mpiddp is imported: before MPI starts.

A CUDA-aware MPI sets up its CUDA support in ``MPI_Init`` on the device current at that
moment (UCX, for one, binds its CUDA transports to the current context). The first import of
``mpi4py.MPI`` initialises MPI, and mpiddp imports it, so ``init()`` is too late: here the
device is chosen from the launcher's local rank, by the rule ``init()`` applies
(``local_rank % device_count``, ``mpiddp.gpu``), which then confirms it against MPI's own
node layout. The launchers' variables: ``launcher_env.py``.

Nothing is chosen when torch has no CUDA device, when CUDA is already initialised (the
program chose its device: kept), when no launcher variable is set, or when ``mpi4py.MPI`` was
imported before mpiddp (MPI has started: too late to matter). No MPI import here.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

from .launcher_env import launcher_local_rank

_chosen: Optional[tuple[int, str]] = None     # (device, the variable it came from)


def select_before_mpi(environ=os.environ, cuda=None, modules=sys.modules) -> Optional[int]:
    """Make ``local_rank % device_count`` current (``cuda``: default ``torch.cuda``; tests
    pass a stand-in). Returns the device chosen, or None (see the module docstring)."""
    global _chosen
    if "mpi4py.MPI" in modules:
        return None
    found = launcher_local_rank(environ)
    if found is None:
        return None
    if cuda is None:
        import torch

        cuda = torch.cuda
    if not cuda.is_available() or cuda.is_initialized():
        return None
    count = cuda.device_count()
    if count <= 0:
        return None
    local_rank, variable = found
    device = local_rank % count
    try:
        cuda.set_device(device)
    except RuntimeError:          # a broken device: init() reports what CUDA says
        return None
    _chosen = (device, variable)
    return device


def chosen_before_mpi() -> Optional[tuple[int, str]]:
    """(device, launcher variable) if this module chose the device, else None."""
    return _chosen


def reset() -> None:
    """Forget the choice (tests)."""
    global _chosen
    _chosen = None
