"""Is the MPI library CUDA-aware? A run-time probe through ctypes, and the decision in force.

mpi4py has no query for this, but the libraries do, as extensions:

* MPICH (4.0 and later): ``int MPIX_GPU_query_support(int gpu_type, int *is_supported)``
  with ``MPIX_GPU_SUPPORT_CUDA`` (0). It is true only when MPICH was built with CUDA *and*
  GPU support is enabled at run time (``MPIR_CVAR_ENABLE_GPU``, on by default in such builds).
* Open MPI, and MPICH too: ``int MPIX_Query_cuda_support(void)`` (Open MPI declares it in
  ``mpi-ext.h``; it returns 1 only when CUDA support is available at run time).

The functions are looked up in the MPI library this process has loaded (the one mpi4py uses,
found in ``/proc/self/maps``, or through mpi4py's extension module, whose dependencies
``dlsym`` searches). A library without either function is treated as not CUDA-aware.

``MPIDDP_CUDA_AWARE`` overrides the probe: ``1`` (trust that device pointers may go to MPI),
``0`` (always stage through host memory) or ``auto`` (the default: probe).
"""
from __future__ import annotations

import ctypes
import logging
import os
import re
from dataclasses import dataclass
from typing import Optional

from mpi4py import MPI

log = logging.getLogger("mpiddp")

MPIX_GPU_SUPPORT_CUDA = 0
_MPI_LIBRARY = re.compile(r"^lib(mpi|mpich|mpi_abi|msmpi|impi)(\.|-|_)?[\w.\-]*\.so")
_NOT_MPI = ("libmpi_cxx", "libmpi_mpifh", "libmpi_usempi", "libmpifort", "libmpicxx")


@dataclass(frozen=True)
class Probe:
    """What the MPI library says. ``supported`` is None when it offers no query."""

    supported: Optional[bool]
    library: Optional[str]     # path of the library that answered (or was searched)
    query: Optional[str]       # the function that answered

    def describe(self) -> str:
        where = os.path.basename(self.library) if self.library else "the MPI library"
        if self.supported is None:
            return f"{where} has no MPIX_GPU_query_support/MPIX_Query_cuda_support"
        return f"{self.query} in {where} says {'yes' if self.supported else 'no'}"


@dataclass(frozen=True)
class Decision:
    """Whether the engine hands device pointers to MPI, and why."""

    cuda_aware: bool
    setting: str
    probe: Optional[Probe]

    def describe(self) -> str:
        answer = "yes" if self.cuda_aware else "no"
        if self.setting == "auto":
            return f"{answer} ({self.probe.describe()})"
        text = f"{answer} (MPIDDP_CUDA_AWARE={self.setting}"
        if self.probe is not None:
            text += f"; the probe: {self.probe.describe()}"
        return text + ")"


def loaded_mpi_libraries(maps_path: str = "/proc/self/maps") -> list[str]:
    """Paths of MPI libraries mapped into this process (Linux); empty elsewhere."""
    try:
        with open(maps_path) as maps:
            lines = maps.read().splitlines()
    except OSError:
        return []
    found: list[str] = []
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) < 6 or not parts[5].startswith("/"):
            continue
        path = parts[5].strip()
        name = os.path.basename(path)
        if _MPI_LIBRARY.match(name) and not name.startswith(_NOT_MPI) and path not in found:
            found.append(path)
    return found


def _candidates() -> list[str]:
    paths = loaded_mpi_libraries()
    module = getattr(MPI, "__file__", None)
    if module:
        paths.append(module)      # dlsym on its handle searches its dependencies (libmpi)
    return paths


def _ask(library: ctypes.CDLL) -> tuple[Optional[bool], Optional[str]]:
    gpu_query = getattr(library, "MPIX_GPU_query_support", None)
    if gpu_query is not None:
        gpu_query.restype = ctypes.c_int
        gpu_query.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        supported = ctypes.c_int(0)
        if gpu_query(MPIX_GPU_SUPPORT_CUDA, ctypes.byref(supported)) == 0:
            return bool(supported.value), "MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA)"
    cuda_query = getattr(library, "MPIX_Query_cuda_support", None)
    if cuda_query is not None:
        cuda_query.restype = ctypes.c_int
        cuda_query.argtypes = []
        return bool(cuda_query()), "MPIX_Query_cuda_support()"
    return None, None


def probe(libraries: Optional[list[str]] = None) -> Probe:
    """Ask the loaded MPI library whether it can read and write CUDA device memory.
    Call it after MPI is initialised (importing ``mpi4py.MPI`` does that)."""
    searched = None
    for path in (_candidates() if libraries is None else libraries):
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        searched = searched or path
        supported, query = _ask(library)
        if query is not None:
            return Probe(supported, path, query)
    return Probe(None, searched, None)


def decide(setting: str, found: Optional[Probe]) -> Decision:
    """Apply the ``MPIDDP_CUDA_AWARE`` setting ('auto', '0' or '1') to a probe result."""
    if setting not in ("auto", "0", "1"):
        raise ValueError(f"MPIDDP_CUDA_AWARE={setting!r} is not one of: auto, 0, 1")
    if setting == "auto":
        if found is None:
            raise ValueError("MPIDDP_CUDA_AWARE=auto needs a probe result")
        return Decision(bool(found.supported), setting, found)
    return Decision(setting == "1", setting, found)


_decision: Optional[Decision] = None


def configure(setting: str) -> Decision:
    """Decide at ``init()`` (probing unless overridden) and keep the decision for the run."""
    global _decision
    _decision = decide(setting, probe())
    if setting == "1" and _decision.probe is not None and _decision.probe.supported is False:
        log.warning("MPIDDP_CUDA_AWARE=1 although %s: device pointers will be passed to MPI, "
                    "which crashes or corrupts data if MPI cannot read device memory",
                    _decision.probe.describe())
    return _decision


def current_decision() -> Decision:
    """The decision of the running job, or (before ``init()``) one made now from the
    environment and a fresh probe."""
    if _decision is not None:
        return _decision
    from ..config import read_settings

    return decide(read_settings().cuda_aware, probe())


def reset() -> None:
    global _decision
    _decision = None


def mpi_cuda_aware() -> bool:
    """Whether mpiddp hands CUDA device buffers to MPI directly.

    Decided at ``init()`` from ``MPIDDP_CUDA_AWARE`` (default ``auto``: ask the loaded MPI
    library through ``MPIX_GPU_query_support`` or ``MPIX_Query_cuda_support``; a library
    with neither counts as not CUDA-aware). Before ``init()`` the answer is worked out now,
    from the environment and a fresh probe.

    Returns:
        True when device buffers go to MPI as they are; False when they are staged through
        pinned host memory.

    Raises:
        ValueError: before ``init()`` only: an ``MPIDDP_*`` environment variable has an
            invalid value.
    """
    return current_decision().cuda_aware
