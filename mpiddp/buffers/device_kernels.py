"""CUDA source of the half-precision reduce and scale kernels, and a NumPy emulation of the
same rounding, so the arithmetic can be checked on a machine without a GPU.

float16 and bfloat16 buffers are reduced as raw ``uint16`` bits: CuPy has no bfloat16, and
doing both formats the same way keeps one code path. Each element is widened to float32
(exact), combined in float32 and rounded back once, to nearest with ties to even. For sum
and product that single rounding is the correctly rounded result: float32 has at least
2p+2 significand bits for both formats (p = 11 for float16, 8 for bfloat16), so rounding
the float32 result again to p bits cannot double-round. NaN inputs give a NaN.

The element functions are plain C that compiles three ways: as CUDA device code (NVRTC, at
run time, through CuPy), as CUDA host code (nvcc) and as C (gcc): the CPU tests compile them
with a C compiler and compare them bit for bit with the NumPy emulation and an exhaustive
reference. This module imports neither CuPy nor torch.
"""
from __future__ import annotations

import numpy as np

# Reduction op codes as passed to the kernels: the values of mpiddp.ops.ReduceOp.
OP_AVERAGE, OP_SUM, OP_MIN, OP_MAX, OP_PRODUCT = 0, 1, 2, 3, 4

#: Element functions: C that also compiles as CUDA (host and device).
ELEMENT_SOURCE = r"""
#ifdef __CUDACC__
#define MPIDDP_HD __host__ __device__ __forceinline__
#else
#define MPIDDP_HD static inline
#endif

MPIDDP_HD unsigned int mpiddp_f2u(float f) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    union { float f; unsigned int u; } v;
    v.f = f;
    return v.u;
#endif
}

MPIDDP_HD float mpiddp_u2f(unsigned int u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    union { float f; unsigned int u; } v;
    v.u = u;
    return v.f;
#endif
}

/* bfloat16: the upper half of a float32. */
MPIDDP_HD float mpiddp_bf16_to_f32(unsigned short h) {
    return mpiddp_u2f(((unsigned int)h) << 16);
}

/* Round to nearest, ties to even; NaN becomes the canonical quiet NaN (as torch does). */
MPIDDP_HD unsigned short mpiddp_f32_to_bf16(float value) {
    unsigned int u = mpiddp_f2u(value);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)0x7fc0u;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

/* float16 -> float32, exact. */
MPIDDP_HD float mpiddp_f16_to_f32(unsigned short h) {
    unsigned int sign = ((unsigned int)h & 0x8000u) << 16;
    unsigned int exponent = ((unsigned int)h >> 10) & 0x1fu;
    unsigned int mantissa = (unsigned int)h & 0x3ffu;
    if (exponent == 0u) {
        /* zero or subnormal: mantissa * 2^-24 is exact in float32 */
        float magnitude = (float)mantissa * 5.9604644775390625e-08f;
        return sign ? -magnitude : magnitude;
    }
    if (exponent == 0x1fu) {
        /* infinity or NaN: keep the payload */
        return mpiddp_u2f(sign | 0x7f800000u | (mantissa << 13));
    }
    return mpiddp_u2f(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

/* float32 -> float16, round to nearest, ties to even (NumPy's algorithm). */
MPIDDP_HD unsigned short mpiddp_f32_to_f16(float value) {
    unsigned int f = mpiddp_f2u(value);
    unsigned int sign = (f & 0x80000000u) >> 16;
    unsigned int f_exp = f & 0x7f800000u;
    unsigned int f_sig;
    if (f_exp >= 0x47800000u) {
        /* too large for float16, infinity or NaN */
        if (f_exp == 0x7f800000u && (f & 0x007fffffu) != 0u) {
            unsigned int nan = 0x7c00u + ((f & 0x007fffffu) >> 13);
            if (nan == 0x7c00u) {
                nan += 1u;
            }
            return (unsigned short)(sign + nan);
        }
        return (unsigned short)(sign + 0x7c00u);
    }
    if (f_exp <= 0x38000000u) {
        /* a float16 subnormal, or zero */
        if (f_exp < 0x33000000u) {
            return (unsigned short)sign;
        }
        f_exp >>= 23;
        f_sig = 0x00800000u + (f & 0x007fffffu);
        f_sig >>= (113u - f_exp);
        /* round half to even; the shift above may have dropped up to 11 low bits */
        if (((f_sig & 0x00003fffu) != 0x00001000u) || (f & 0x000007ffu)) {
            f_sig += 0x00001000u;
        }
        return (unsigned short)(sign + (f_sig >> 13));
    }
    f_sig = f & 0x007fffffu;
    if ((f_sig & 0x00003fffu) != 0x00001000u) {
        f_sig += 0x00001000u;
    }
    /* a carry out of the significand correctly bumps the exponent (up to infinity) */
    return (unsigned short)(sign + (((f_exp - 0x38000000u) >> 13) + (f_sig >> 13)));
}

/* op: 0 average, 1 sum (both add), 2 min, 3 max, 4 product. NaN in, NaN out. */
MPIDDP_HD float mpiddp_combine(float a, float b, int op) {
    switch (op) {
    case 2:
        return (a != a || b != b) ? a + b : (b < a ? b : a);
    case 3:
        return (a != a || b != b) ? a + b : (b > a ? b : a);
    case 4:
        return a * b;
    default:
        return a + b;
    }
}

MPIDDP_HD unsigned short mpiddp_bf16_combine(unsigned short a, unsigned short b, int op) {
    return mpiddp_f32_to_bf16(mpiddp_combine(mpiddp_bf16_to_f32(a), mpiddp_bf16_to_f32(b), op));
}

MPIDDP_HD unsigned short mpiddp_f16_combine(unsigned short a, unsigned short b, int op) {
    return mpiddp_f32_to_f16(mpiddp_combine(mpiddp_f16_to_f32(a), mpiddp_f16_to_f32(b), op));
}

MPIDDP_HD unsigned short mpiddp_bf16_scale(unsigned short a, float factor) {
    return mpiddp_f32_to_bf16(mpiddp_bf16_to_f32(a) * factor);
}

MPIDDP_HD unsigned short mpiddp_f16_scale(unsigned short a, float factor) {
    return mpiddp_f32_to_f16(mpiddp_f16_to_f32(a) * factor);
}
"""

#: Grid-stride kernels over the element functions (CUDA only). ``n`` is a 64-bit count.
KERNEL_SOURCE = ELEMENT_SOURCE + r"""
#ifdef __CUDACC__
#define MPIDDP_GRID_LOOP(i, n) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (long long)blockDim.x * gridDim.x)

extern "C" __global__ void mpiddp_bf16_reduce(unsigned short* dst, const unsigned short* src,
                                              long long n, int op) {
    MPIDDP_GRID_LOOP(i, n) { dst[i] = mpiddp_bf16_combine(dst[i], src[i], op); }
}

extern "C" __global__ void mpiddp_f16_reduce(unsigned short* dst, const unsigned short* src,
                                             long long n, int op) {
    MPIDDP_GRID_LOOP(i, n) { dst[i] = mpiddp_f16_combine(dst[i], src[i], op); }
}

extern "C" __global__ void mpiddp_bf16_scale_kernel(unsigned short* x, long long n,
                                                    float factor) {
    MPIDDP_GRID_LOOP(i, n) { x[i] = mpiddp_bf16_scale(x[i], factor); }
}

extern "C" __global__ void mpiddp_f16_scale_kernel(unsigned short* x, long long n,
                                                   float factor) {
    MPIDDP_GRID_LOOP(i, n) { x[i] = mpiddp_f16_scale(x[i], factor); }
}
#endif
"""

KERNEL_NAMES = ("mpiddp_bf16_reduce", "mpiddp_f16_reduce", "mpiddp_bf16_scale_kernel",
                "mpiddp_f16_scale_kernel")
THREADS_PER_BLOCK = 256
MAX_BLOCKS = 4096


def launch_blocks(count: int) -> int:
    """Blocks for a grid-stride launch over ``count`` elements (at least one)."""
    return max(1, min(MAX_BLOCKS, -(-count // THREADS_PER_BLOCK)))


# ---- NumPy emulation of the same algorithm (vectorised; for tests and reference) -----------
def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even; NaN -> 0x7fc0 (``mpiddp_f32_to_bf16``)."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, np.uint16(0x7FC0), rounded)


def f16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint16).view(np.float16).astype(np.float32)


def f32_to_f16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> float16 bits; NumPy's own conversion is the same algorithm."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(values, dtype=np.float32).astype(np.float16).view(np.uint16)


def _combine_f32(a: np.ndarray, b: np.ndarray, op: int) -> np.ndarray:
    with np.errstate(all="ignore"):
        if op == OP_MIN:
            return np.where(np.isnan(a) | np.isnan(b), a + b, np.where(b < a, b, a))
        if op == OP_MAX:
            return np.where(np.isnan(a) | np.isnan(b), a + b, np.where(b > a, b, a))
        if op == OP_PRODUCT:
            return a * b
        return a + b


def emulate_reduce(dtype_name: str, a_bits: np.ndarray, b_bits: np.ndarray, op: int):
    """What the ``*_reduce`` kernels write into ``dst`` (uint16 bits)."""
    widen, narrow = _codec(dtype_name)
    return narrow(_combine_f32(widen(a_bits), widen(b_bits), op).astype(np.float32))


def emulate_scale(dtype_name: str, bits: np.ndarray, factor: float):
    widen, narrow = _codec(dtype_name)
    with np.errstate(all="ignore"):
        return narrow(widen(bits) * np.float32(factor))


def _codec(dtype_name: str):
    if dtype_name == "bfloat16":
        return bf16_bits_to_f32, f32_to_bf16_bits
    if dtype_name == "float16":
        return f16_bits_to_f32, f32_to_f16_bits
    raise ValueError(f"no half-precision kernel for {dtype_name}")
