"""torch tensors <-> flat buffers the engine can move, sharing memory where possible."""
from __future__ import annotations

import numpy as np
import torch

from .. import gpu
from ..buffers.dtypes import DTYPES

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
    bf16 = tensor.dtype == torch.bfloat16
    if bf16:
        tensor = tensor.view(torch.int16)
    if tensor.is_cuda:
        try:
            import cupy
        except ImportError as exc:
            raise ImportError("mpiddp needs CuPy for CUDA tensors: pip install 'mpiddp[cuda]' "
                              "(cupy-cuda12x; see docs/gpu.md)") from exc

        array = cupy.from_dlpack(tensor.reshape(-1))
    else:
        array = tensor.numpy().reshape(-1)   # NumPy's reshape is cheaper than torch's
    return array.view(np.uint16) if bf16 else array
