"""torch tensors <-> flat buffers the engine can move, sharing memory where possible."""
from __future__ import annotations

import ctypes

import numpy as np
import torch

from ... import gpu
from ...buffers.dtypes import DTYPES, dtype_named

_TORCH_NAMES = {getattr(torch, name): name for name in DTYPES}


def dtype_name(tensor: torch.Tensor, tensor_name: str) -> str:
    try:
        return _TORCH_NAMES[tensor.dtype]
    except KeyError:
        raise TypeError(f"tensor '{tensor_name}' has unsupported dtype {tensor.dtype}; "
                        f"supported: {', '.join(DTYPES)}") from None


def device_name(tensor: torch.Tensor) -> str:
    if tensor.is_cuda:
        # Each rank uses one GPU (its engine device, chosen at init); requests say only
        # "cuda", so that ranks on different local GPUs agree on the same name.
        gpu.check_tensor_device(tensor.get_device())
        return "cuda"
    if tensor.is_cpu:
        return "cpu"
    raise TypeError(f"unsupported device {tensor.device}: mpiddp reduces cpu and cuda tensors")


def flat_array(tensor: torch.Tensor):
    """A flat array over the memory of a contiguous tensor: NumPy for host tensors, CuPy for
    device tensors. bfloat16 is exposed as its raw uint16 bits."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.is_cuda:
        return _device_view(tensor)
    bf16 = tensor.dtype == torch.bfloat16
    if bf16:
        tensor = tensor.view(torch.int16)
    array = tensor.numpy().reshape(-1)   # NumPy's reshape is cheaper than torch's
    return array.view(np.uint16) if bf16 else array


def resizable_array(tensor: torch.Tensor):
    """``flat_array`` of a contiguous tensor without pinning its storage's size: NumPy made
    from the memory's address (``Tensor.numpy()`` marks a storage not resizable for good,
    and stage 3 frees a bucket's parameters by resizing theirs to 0). The caller keeps the
    memory alive and unresized while the array is in use."""
    if tensor.is_cuda:
        return _device_view(tensor)
    dtype = DTYPES[_TORCH_NAMES[tensor.dtype]].storage     # flat_array's dtype
    if not tensor.numel():
        return np.empty(0, dtype=dtype)
    memory = (ctypes.c_char * (tensor.numel() * tensor.element_size())).from_address(
        tensor.data_ptr())
    return np.frombuffer(memory, dtype=dtype)


def _device_view(tensor: torch.Tensor):
    """A CuPy array over a contiguous CUDA tensor's memory, made from its pointer. Not DLPack:
    its exchange makes CuPy's current stream wait for torch's current one, a wait on the
    legacy default stream here, and the engine orders itself by the tensor's ready event
    anyway. Naming the device saves a pointer-attributes query (a CUDA call)."""
    try:
        import cupy
    except ImportError as exc:
        raise ImportError("mpiddp needs CuPy for CUDA tensors: pip install 'mpiddp[cuda]' "
                          "(cupy-cuda12x; see docs/gpu.md)") from exc
    if not tensor.is_contiguous():
        raise ValueError("device buffers must be contiguous")
    storage = dtype_named(_TORCH_NAMES[tensor.dtype]).storage   # bfloat16: its uint16 bits
    count = tensor.numel()
    memory = cupy.cuda.UnownedMemory(tensor.data_ptr(), count * tensor.element_size(), tensor,
                                     tensor.device.index)
    return cupy.ndarray((count,), storage, cupy.cuda.MemoryPointer(memory, 0))
