"""CUDA source of the half-precision (and float32) reduce and scale kernels, and a NumPy
emulation of the same arithmetic, so it can be checked on a machine without a GPU.

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

CuPy compiles every kernel with ``-ftz=true`` appended after the caller's options, so the
float32 arithmetic the kernels need (add, multiply, less-than) is written as PTX instructions
without ``.ftz`` (``mpiddp_add``, ``mpiddp_mul``, ``mpiddp_less``); everything else is integer
arithmetic on the bits. ``F32_INSTRUCTIONS`` names those instructions and the NumPy operation
that computes the same IEEE result; the tests compile the kernels through CuPy's own compile
path and check that their PTX executes no other float arithmetic.

The float32 kernels (``mpiddp_f32_*``) exist for the same reason: CuPy's own elementwise
kernels (``cupy.add`` and the rest) are compiled with ``-ftz=true`` and flush float32
subnormals on the device, where the host path keeps them.
"""
from __future__ import annotations

import numpy as np

# Reduction op codes as passed to the kernels: the values of mpiddp.ops.ReduceOp.
OP_AVERAGE, OP_SUM, OP_MIN, OP_MAX, OP_PRODUCT = 0, 1, 2, 3, 4
#: What ``mpiddp_combine`` does for each op code, by NumPy name (``reduce_ops``'s table must
#: agree; any other code would fall into the switch's default, an add).
KERNEL_OPS = {OP_AVERAGE: "add", OP_SUM: "add", OP_MIN: "minimum", OP_MAX: "maximum",
              OP_PRODUCT: "multiply"}

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

/* float16 -> float32, exact, in integer arithmetic only (NumPy's algorithm): no float
   instruction that a flush-to-zero mode could change. */
MPIDDP_HD float mpiddp_f16_to_f32(unsigned short h) {
    unsigned int sign = ((unsigned int)h & 0x8000u) << 16;
    unsigned int exponent = ((unsigned int)h >> 10) & 0x1fu;
    unsigned int mantissa = (unsigned int)h & 0x3ffu;
    if (exponent == 0u) {
        if (mantissa == 0u) {
            return mpiddp_u2f(sign);
        }
        /* subnormal: normalise; each shift halves the scale (float32 exponent 113 = 2^-14) */
        exponent = 113u;
        while ((mantissa & 0x400u) == 0u) {
            mantissa <<= 1;
            exponent -= 1u;
        }
        return mpiddp_u2f(sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13));
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

/* The only float32 arithmetic in the kernels: add, multiply and less-than. On the device they
   are PTX instructions written out, without .ftz: CuPy appends -ftz=true to every kernel's
   options (after ours, so -ftz=false cannot win), which would flush the float32 subnormals
   that bfloat16 subnormals widen to. The .rn rounding also keeps add and multiply from being
   contracted into an fma. As C they are IEEE operations with subnormals, like the CPU's. */
MPIDDP_HD float mpiddp_add(float a, float b) {
#ifdef __CUDA_ARCH__
    float r;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
#else
    return a + b;
#endif
}

MPIDDP_HD float mpiddp_mul(float a, float b) {
#ifdef __CUDA_ARCH__
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
#else
    return a * b;
#endif
}

MPIDDP_HD int mpiddp_less(float a, float b) {
#ifdef __CUDA_ARCH__
    unsigned int r;
    asm("{\n\t.reg .pred p;\n\tsetp.lt.f32 p, %1, %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(r) : "f"(a), "f"(b));
    return (int)r;
#else
    return a < b;
#endif
}

MPIDDP_HD int mpiddp_isnan(float a) {
    return (mpiddp_f2u(a) & 0x7fffffffu) > 0x7f800000u;
}

/* op: 0 average, 1 sum (both add), 2 min, 3 max, 4 product. NaN in, NaN out. Min and max
   of equal values (+0 and -0) give b, as NumPy's and torch's vector loops do. */
MPIDDP_HD float mpiddp_combine(float a, float b, int op) {
    switch (op) {
    case 2:
        return (mpiddp_isnan(a) || mpiddp_isnan(b)) ? mpiddp_add(a, b)
                                                    : (mpiddp_less(a, b) ? a : b);
    case 3:
        return (mpiddp_isnan(a) || mpiddp_isnan(b)) ? mpiddp_add(a, b)
                                                    : (mpiddp_less(b, a) ? a : b);
    case 4:
        return mpiddp_mul(a, b);
    default:
        return mpiddp_add(a, b);
    }
}

MPIDDP_HD unsigned short mpiddp_bf16_combine(unsigned short a, unsigned short b, int op) {
    return mpiddp_f32_to_bf16(mpiddp_combine(mpiddp_bf16_to_f32(a), mpiddp_bf16_to_f32(b), op));
}

MPIDDP_HD unsigned short mpiddp_f16_combine(unsigned short a, unsigned short b, int op) {
    return mpiddp_f32_to_f16(mpiddp_combine(mpiddp_f16_to_f32(a), mpiddp_f16_to_f32(b), op));
}

MPIDDP_HD unsigned short mpiddp_bf16_scale(unsigned short a, float factor) {
    return mpiddp_f32_to_bf16(mpiddp_mul(mpiddp_bf16_to_f32(a), factor));
}

MPIDDP_HD unsigned short mpiddp_f16_scale(unsigned short a, float factor) {
    return mpiddp_f32_to_f16(mpiddp_mul(mpiddp_f16_to_f32(a), factor));
}

/* float32 scaled in float64 and rounded once (the host's exact scaling, Average's 1/size). */
MPIDDP_HD float mpiddp_f32_scale_exact(float a, double factor) {
#ifdef __CUDA_ARCH__
    double wide, product;
    float r;
    asm("cvt.f64.f32 %0, %1;" : "=d"(wide) : "f"(a));
    asm("mul.rn.f64 %0, %1, %2;" : "=d"(product) : "d"(wide), "d"(factor));
    asm("cvt.rn.f32.f64 %0, %1;" : "=f"(r) : "d"(product));
    return r;
#else
    return (float)((double)a * factor);
#endif
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

/* float32: CuPy's own elementwise kernels are compiled with -ftz=true and would flush. */
extern "C" __global__ void mpiddp_f32_reduce(float* dst, const float* src, long long n,
                                             int op) {
    MPIDDP_GRID_LOOP(i, n) { dst[i] = mpiddp_combine(dst[i], src[i], op); }
}

extern "C" __global__ void mpiddp_f32_scale_kernel(float* x, long long n, float factor) {
    MPIDDP_GRID_LOOP(i, n) { x[i] = mpiddp_mul(x[i], factor); }
}

extern "C" __global__ void mpiddp_f32_scale_exact_kernel(float* x, long long n,
                                                         double factor) {
    MPIDDP_GRID_LOOP(i, n) { x[i] = mpiddp_f32_scale_exact(x[i], factor); }
}
#endif
"""

KERNEL_NAMES = ("mpiddp_bf16_reduce", "mpiddp_f16_reduce", "mpiddp_bf16_scale_kernel",
                "mpiddp_f16_scale_kernel", "mpiddp_f32_reduce", "mpiddp_f32_scale_kernel",
                "mpiddp_f32_scale_exact_kernel")
#: NVRTC options for ``cupy.RawModule(code=KERNEL_SOURCE, ...)``. CuPy adds ``-ftz=true``
#: after these (a ``-ftz=false`` here would lose), hence the explicit PTX arithmetic above;
#: ``-fmad=false`` keeps any future float code from being contracted into an fma.
COMPILE_OPTIONS = ("--std=c++11", "-fmad=false")
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


class F32Arithmetic:
    """The float operations the kernels execute, as NumPy functions (for the emulation)."""

    def __init__(self, add, mul, less, widen64, mul64, narrow64):
        self.add, self.mul, self.less = add, mul, less
        self.widen64, self.mul64, self.narrow64 = widen64, mul64, narrow64


#: The float instructions in the kernel source (``mpiddp_add``, ``mpiddp_mul``,
#: ``mpiddp_less``, ``mpiddp_f32_scale_exact``) and the operation each is in the emulation:
#: IEEE 754, round to nearest even, subnormals kept, as NumPy computes on the CPU.
F32_INSTRUCTIONS = {"add.rn.f32": "add", "mul.rn.f32": "mul", "setp.lt.f32": "less",
                    "cvt.f64.f32": "widen64", "mul.rn.f64": "mul64",
                    "cvt.rn.f32.f64": "narrow64"}
IEEE_F32 = F32Arithmetic(np.add, np.multiply, np.less,
                         lambda x: np.asarray(x, np.float32).astype(np.float64), np.multiply,
                         lambda x: np.asarray(x, np.float64).astype(np.float32))


def _isnan_bits(x: np.ndarray) -> np.ndarray:
    """``mpiddp_isnan``: an integer test on the bits."""
    return (np.asarray(x, np.float32).view(np.uint32) & 0x7FFFFFFF) > 0x7F800000


def _combine_f32(a: np.ndarray, b: np.ndarray, op: int, f32: F32Arithmetic) -> np.ndarray:
    """``mpiddp_combine``, operation for operation."""
    with np.errstate(all="ignore"):
        if op in (OP_MIN, OP_MAX):
            nan = _isnan_bits(a) | _isnan_bits(b)
            pick_a = f32.less(a, b) if op == OP_MIN else f32.less(b, a)
            return np.where(nan, f32.add(a, b), np.where(pick_a, a, b)).astype(np.float32)
        if op == OP_PRODUCT:
            return f32.mul(a, b)
        return f32.add(a, b)


def emulate_reduce(dtype_name: str, a_bits: np.ndarray, b_bits: np.ndarray, op: int,
                   f32: F32Arithmetic = IEEE_F32):
    """What the ``*_reduce`` kernels write into ``dst`` (bits: uint16, uint32 for float32).
    ``f32``: the float operations (the tests pass flushing ones to model ``.ftz``)."""
    widen, narrow = _codec(dtype_name)
    a = widen(a_bits).astype(np.float32)
    b = widen(b_bits).astype(np.float32)
    return narrow(np.asarray(_combine_f32(a, b, op, f32), dtype=np.float32))


def emulate_scale(dtype_name: str, bits: np.ndarray, factor: float,
                  f32: F32Arithmetic = IEEE_F32, exact: bool = False):
    """What the ``*_scale_kernel`` kernels write (bits); ``exact``: float32's
    ``mpiddp_f32_scale_exact_kernel`` (float64 product, rounded once)."""
    widen, narrow = _codec(dtype_name)
    with np.errstate(all="ignore"):
        if exact:
            if dtype_name != "float32":
                raise ValueError("exact scaling is a float32 kernel")
            product = f32.mul64(f32.widen64(widen(bits)), np.float64(factor))
            return narrow(np.asarray(f32.narrow64(product), dtype=np.float32))
        return narrow(np.asarray(f32.mul(widen(bits), np.float32(factor)), dtype=np.float32))


def _codec(dtype_name: str):
    if dtype_name == "bfloat16":
        return bf16_bits_to_f32, f32_to_bf16_bits
    if dtype_name == "float16":
        return f16_bits_to_f32, f32_to_f16_bits
    if dtype_name == "float32":         # float32 bits as uint32, unchanged by the codec
        return (lambda bits: np.asarray(bits, np.uint32).view(np.float32),
                lambda values: np.asarray(values, np.float32).view(np.uint32))
    raise ValueError(f"no kernel for {dtype_name}")
