"""Adasum's host kernels (mpiddp/buffers/adasum_kernels.py) against float64 arithmetic on
each segment: segments crossing the kernels' chunks, several in one chunk, empty ones, every
float dtype. (The collective itself is checked end to end in test_adasum.py.)"""
import numpy as np
import pytest
import torch

from mpiddp.buffers.adasum_kernels import HOST_CHUNK, HostAdasumKernels
from mpiddp.buffers.dtypes import dtype_named

LAYOUTS = {
    "one small": [0, 10],
    "empty ones": [0, 0, 5, 5, 9, 9],
    "crossing chunks": [0, 2 * HOST_CHUNK + 7],
    "mixed": [0, 3, HOST_CHUNK - 1, HOST_CHUNK + 2, 3 * HOST_CHUNK, 3 * HOST_CHUNK + 1],
}


def storage(tensor):
    """The buffer's storage array for a tensor (bfloat16: its raw uint16 bits)."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def as64(tensor):
    return tensor.double().numpy().copy()      # a float64 tensor's .double() is itself


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_host_kernels_match_float64_per_segment(dtype, layout):
    bounds = LAYOUTS[layout]
    segments = list(zip(bounds[:-1], bounds[1:]))
    generator = torch.Generator().manual_seed(len(bounds))
    pair = torch.randn(2, bounds[-1], generator=generator).to(getattr(torch, dtype))
    a, b = pair[0].clone(), pair[1]
    a64, b64 = as64(a), as64(b)
    kernels = HostAdasumKernels(dtype_named(dtype))

    dots = kernels.dots(storage(a), storage(b), segments)
    want = np.array([[a64[s:e] @ b64[s:e], a64[s:e] @ a64[s:e], b64[s:e] @ b64[s:e]]
                     for s, e in segments]).reshape(-1, 3)
    np.testing.assert_allclose(dots, want, rtol=1e-12, atol=1e-12)

    coefficients = np.random.default_rng(1).random((len(segments), 2)) * 2 - 0.5
    kernels.combine(storage(a), storage(b), segments, coefficients)
    combined = a64.copy()
    for (s, e), (ca, cb) in zip(segments, coefficients):
        combined[s:e] = ca * a64[s:e] + cb * b64[s:e]
    # Computed in float64 and rounded once (bfloat16 through float32, as torch converts).
    if dtype == "bfloat16":
        rounded = torch.from_numpy(combined).float().to(torch.bfloat16)
    else:
        rounded = torch.from_numpy(combined.astype(a.numpy().dtype))
    assert torch.equal(a, rounded)
