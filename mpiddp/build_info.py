"""What this installation of mpiddp can do, answered truthfully under Horovod's probe names
(Horovod scripts and tests ask them before choosing devices, dtypes or backends).

mpiddp is pure Python over mpi4py: MPI is its only controller and transport; Gloo, NCCL,
oneCCL and DDL are never used; CUDA tensors are supported where CuPy can be imported.
"""
from __future__ import annotations

import importlib.util

__all__ = ["mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled", "nccl_built",
           "ccl_built", "ddl_built", "cuda_built", "rocm_built"]


def mpi_built() -> bool:
    """Whether MPI can be used: always True (mpiddp runs on mpi4py).

    Returns:
        True.
    """
    return True


def mpi_enabled() -> bool:
    """Whether MPI is the controller of this run: always True for mpiddp.

    Returns:
        True.
    """
    return True


def gloo_built() -> bool:
    """Whether Gloo can be used: never (mpiddp has no Gloo controller).

    Returns:
        False.
    """
    return False


def gloo_enabled() -> bool:
    """Whether Gloo is the controller of this run: never.

    Returns:
        False.
    """
    return False


def nccl_built() -> int:
    """The NCCL version collectives are built with: 0, mpiddp does not use NCCL (device
    buffers go through CUDA-aware MPI or host staging).

    Returns:
        0.
    """
    return 0


def ccl_built() -> bool:
    """Whether Intel oneCCL is used: never.

    Returns:
        False.
    """
    return False


def ddl_built() -> bool:
    """Whether IBM DDL is used: never.

    Returns:
        False.
    """
    return False


def cuda_built() -> bool:
    """Whether CUDA tensors can be reduced: True when CuPy is installed (``pip install
    mpiddp[cuda]``); whether a GPU is present is ``torch.cuda.is_available()``.

    Returns:
        True when the ``cupy`` package can be imported.
    """
    return importlib.util.find_spec("cupy") is not None


def rocm_built() -> bool:
    """Whether ROCm tensors are supported: no.

    Returns:
        False.
    """
    return False
