"""Deterministic per-(rank, name) test data and float64 views, shared by the workers that
check collectives against a NumPy reference (each rank computes every rank's data locally)."""
import zlib

import numpy as np
import torch
from mpi4py import MPI

import mpiddp


def data(rank, name, shape, dtype, op=mpiddp.Sum):
    """Deterministic per-(rank, name) data in a range that cannot overflow the dtype."""
    rng = np.random.default_rng(zlib.crc32(f"{rank}/{name}".encode()))
    if dtype == torch.bool:
        values = rng.integers(0, 2, size=shape).astype(bool)
    elif op == mpiddp.Product:
        if dtype.is_floating_point:
            values = rng.uniform(0.8, 1.25, size=shape)
        elif dtype == torch.uint8:
            values = rng.integers(0, 2, size=shape)
        else:
            values = rng.choice([-1, 1], size=shape)
    elif dtype.is_floating_point:
        values = rng.uniform(-1, 1, size=shape)
    elif dtype.is_complex:
        values = rng.uniform(-1, 1, size=shape) + 1j * rng.uniform(-1, 1, size=shape)
    elif dtype == torch.uint8:
        values = rng.integers(0, _int_bound(dtype, 19) + 1, size=shape)
    else:
        bound = _int_bound(dtype, 10)
        values = rng.integers(-bound, bound + 1, size=shape)
    return torch.from_numpy(np.asarray(values)).to(dtype)


def _int_bound(dtype, high):
    """The largest magnitude, up to ``high``, whose sum over every rank fits ``dtype`` (int8:
    10 up to 12 ranks, 3 at 32; integer sums wrap, as MPI's and Horovod's do)."""
    ranks = MPI.COMM_WORLD.Get_size()       # also in workers that do not call mpiddp.init()
    return max(1, min(high, torch.iinfo(dtype).max // ranks))


def as64(tensor):
    """A float64 NumPy copy of any tensor (bool stays bool, complex is complex128), from host
    or device."""
    tensor = tensor.cpu()
    if tensor.dtype == torch.bool:
        return tensor.numpy()
    if tensor.is_complex():         # complex128, conjugate views resolved
        return tensor.resolve_conj().to(torch.complex128).numpy()
    return tensor.to(torch.float64).numpy()
