"""Intel MPI's environment, read without MPI: its GPU switches (docs/gpu.md), and what its
``MPI_Init`` would crash or hang on (docs/dev/intel-mpi.md).

Intel MPI takes device pointers in MPI calls only when ``I_MPI_OFFLOAD=1`` (default 0); its
``I_MPI_OFFLOAD_MODE`` picks the GPU API: ``auto`` (the default), ``cuda`` (NVIDIA, through
the CUDA driver library ``I_MPI_OFFLOAD_CUDA_LIBRARY``, default ``libcuda.so``) or
``level_zero`` (Intel GPUs, ``libze_loader.so.1``). The CUDA-aware decision table
(``transport/cuda_aware.py``) reads these switches through ``offload``.

Intel MPI 2021.14 crashes in ``MPI_Init`` (a segmentation fault, no message) when offload is
on in the ``cuda`` or ``auto`` mode and the driver library cannot be loaded (a machine without
a GPU driver, a driver that installs only ``libcuda.so.1``), and with an unknown mode.
``offload_crash`` tells that before MPI starts, so that mpiddp can refuse with the reason.
``wheel_root`` finds the ``I_MPI_ROOT`` the PyPI wheel needs under srun.
"""
from __future__ import annotations

import ctypes
import importlib.metadata
import os
import sys
from dataclasses import dataclass
from typing import Callable, Optional

MODES = ("auto", "cuda", "level_zero")
CUDA_LIBRARY = "libcuda.so"                 # Intel MPI's default I_MPI_OFFLOAD_CUDA_LIBRARY
LEVEL_ZERO_LIBRARY = "libze_loader.so.1"    # ... and I_MPI_OFFLOAD_LEVEL_ZERO_LIBRARY
# Variables that say this process belongs to an Intel MPI job before MPI starts: its hydra
# sets I_MPI_HYDRA_UUID in every rank, its environment scripts and modules I_MPI_ROOT, and
# srun launches need I_MPI_PMI_LIBRARY.
_MARKS = ("I_MPI_HYDRA_UUID", "I_MPI_ROOT", "I_MPI_PMI_LIBRARY")


@dataclass(frozen=True)
class Offload:
    """Intel MPI's GPU switches as set: ``requested`` when ``I_MPI_OFFLOAD`` is a positive
    number; ``setting`` its text ('' when unset); ``mode`` as set (Intel MPI reads it case by
    case: ``CUDA`` is no mode), 'auto' when unset."""

    requested: bool
    setting: str
    mode: str
    cuda_library: str
    level_zero_library: str


def offload(environ=os.environ) -> Offload:
    setting = environ.get("I_MPI_OFFLOAD", "").strip()
    return Offload(requested=setting.isdigit() and int(setting) > 0, setting=setting,
                   mode=environ.get("I_MPI_OFFLOAD_MODE", "").strip() or "auto",
                   cuda_library=environ.get("I_MPI_OFFLOAD_CUDA_LIBRARY", "").strip()
                   or CUDA_LIBRARY,
                   level_zero_library=environ.get("I_MPI_OFFLOAD_LEVEL_ZERO_LIBRARY",
                                                  "").strip() or LEVEL_ZERO_LIBRARY)


def load_error(name: str) -> Optional[str]:
    """Why ``dlopen(name)`` fails, or None when it loads (nothing is initialised: loading the
    CUDA driver library does not start CUDA)."""
    try:
        ctypes.CDLL(name)
    except OSError as exc:
        return str(exc)
    return None


def _impi_installed() -> bool:
    try:
        importlib.metadata.distribution("impi_rt")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def likely_intel_mpi(environ=os.environ, installed: Callable[[], bool] = _impi_installed) -> bool:
    """Whether this process will start Intel MPI, as far as can be told before it starts:
    Intel's launcher or environment marks (``_MARKS``), or the ``impi-rt`` wheel installed."""
    return any(environ.get(name) for name in _MARKS) or installed()


def wheel_root(environ=os.environ, prefix: str = sys.prefix,
               installed: Callable[[], bool] = _impi_installed) -> Optional[str]:
    """The root that ``I_MPI_ROOT`` should name for the ``impi-rt`` wheel installed in this
    environment (its files: ``<prefix>/opt/mpi/etc``), where it is needed and unset, else None.

    Needed under srun with Slurm's PMI library (``I_MPI_PMI_LIBRARY``): without
    ``I_MPI_ROOT`` Intel MPI 2021.14 finds no tuning file there and spins in ``MPI_Init``
    forever (in its collective selection). Intel's environment scripts and modules set it; the
    wheel does not."""
    if environ.get("I_MPI_ROOT") or not environ.get("I_MPI_PMI_LIBRARY") or not installed():
        return None
    return prefix if os.path.isdir(os.path.join(prefix, "opt", "mpi", "etc")) else None


def offload_crash(environ=os.environ,
                  load: Callable[[str], Optional[str]] = load_error) -> Optional[str]:
    """The reason Intel MPI would crash in ``MPI_Init`` with these switches, or None."""
    found = offload(environ)
    if not found.requested or found.mode == "level_zero":      # level_zero fails with a message
        return None
    unset = ("unset I_MPI_OFFLOAD (or set it to 0) where no GPU buffers are passed to MPI, as "
             "on a node without GPUs")
    if found.mode not in MODES:
        return (f"I_MPI_OFFLOAD={found.setting} with I_MPI_OFFLOAD_MODE={found.mode}, which is "
                f"not one of {', '.join(MODES)}: Intel MPI would crash in MPI_Init (a "
                "segmentation fault). Set I_MPI_OFFLOAD_MODE=cuda for NVIDIA GPUs, or "
                f"{unset}")
    cuda_error = load(found.cuda_library)
    if cuda_error is None:
        return None
    if found.mode == "auto" and load(found.level_zero_library) is None:
        return None                                   # Intel GPUs: Level Zero is there
    what = ("I_MPI_OFFLOAD_MODE=cuda" if found.mode == "cuda" else
            f"I_MPI_OFFLOAD_MODE=auto (the default), and Level Zero ({found.level_zero_library}) "
            "cannot be loaded either")
    return (f"I_MPI_OFFLOAD={found.setting} asks Intel MPI to take GPU buffers ({what}), but "
            f"the CUDA driver library {found.cuda_library} (I_MPI_OFFLOAD_CUDA_LIBRARY) cannot "
            f"be loaded: {cuda_error}. Intel MPI would crash in MPI_Init (a segmentation "
            "fault). On a GPU node whose driver installs only libcuda.so.1, set "
            f"I_MPI_OFFLOAD_CUDA_LIBRARY=libcuda.so.1; otherwise {unset}.")
