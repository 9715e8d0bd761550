"""The device kernels checked without a device (issue 23, defects 1 and 2).

* The kernels' arithmetic (float16, bfloat16, float32), modelled in NumPy operation for operation
  (``device_kernels.emulate_*``), equals the host path (``host_reduce``) bit for bit on
  subnormals, infinities, NaN, ties, the largest finite values and signed zeros, for every op
  and for scaling.
* The kernels compiled by NVRTC through CuPy's own compile path and options (what
  ``cupy.RawModule`` does, ``-ftz=true`` included) for compute capabilities 6.0 to 9.0: their
  PTX executes no float instruction that flushes subnormals, and none that the model does not
  reproduce. The model is then run with the arithmetic the PTX actually has, so a flushing
  build fails here with the values it would get wrong.
* The cubins NVRTC makes for sm_75 to sm_90 (what CuPy loads on such a device), disassembled
  with nvdisasm: no FTZ and no FFMA in the machine code.
* The GPU worker reduces only the ops the device path reduces (no Adasum).

Needs CuPy and NVRTC for the compile checks (``cupy-cuda12x`` and ``nvidia-cuda-nvrtc-cu12``
from requirements-dev.txt) and nvdisasm (``nvidia-cuda-nvdisasm``) for the machine code; they
skip with the reason where one is missing.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

from mpiddp.buffers import device_kernels as dk
from mpiddp.buffers import host_reduce
from mpiddp.buffers.dtypes import DTYPES
from mpiddp.reduce_ops import ReduceOp, combine_function, reducible_ops

HALF = ("bfloat16", "float16")
MODELLED = HALF + ("float32",)          # the dtypes with kernels of mpiddp's own
BITS = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.uint32}
ARCHS = ("60", "70", "75", "80", "86", "90")
SMALLEST_NORMAL = np.float32(2.0 ** -126)


# ---- the host path, and comparison with it ------------------------------------------------
def _widen(name, bits):
    if name == "float32":
        return np.asarray(bits, np.uint32).view(np.float32)
    with np.errstate(invalid="ignore"):
        return (dk.bf16_bits_to_f32 if name == "bfloat16" else dk.f16_bits_to_f32)(bits)


def host_reduce_bits(name, a, b, op):
    dtype = DTYPES[name]
    dst = a.copy().view(dtype.storage)
    with np.errstate(all="ignore"):
        host_reduce.reduce_into(dst, b.copy().view(dtype.storage), ReduceOp(op), dtype)
    return dst.view(BITS[name])


def host_scale_bits(name, bits, factor, exact):
    dtype = DTYPES[name]
    array = bits.copy().view(dtype.storage)
    with np.errstate(all="ignore"):
        host_reduce.scale_(array, factor, dtype, exact)
    return array.view(BITS[name])


def assert_same_bits(name, got, host, a, b=None, op=None, what=""):
    """Bitwise equal, with the two latitudes the host path itself takes: its NaN bits and the
    sign of min/max of +0 and -0 differ between torch's vector loop and its scalar tail loop
    (measured: 0x7fc0 vs 0xffff for a bfloat16 NaN), so there any NaN, or either zero, is
    the host's answer (kept for float32's NumPy loops too)."""
    got_nan, host_nan = np.isnan(_widen(name, got)), np.isnan(_widen(name, host))
    free = host_nan & got_nan
    if op in (dk.OP_MIN, dk.OP_MAX):
        magnitude = 0x7FFFFFFF if name == "float32" else 0x7FFF
        zero = lambda x: (x & magnitude) == 0  # noqa: E731
        free |= zero(a) & zero(b) & zero(got) & zero(host)
    bad = np.flatnonzero(~free & (got != host))
    if bad.size:
        rows = [f"a={a[i]:#x}" + (f" b={b[i]:#x}" if b is not None else "")
                + f" model={got[i]:#x} host={host[i]:#x}" for i in bad[:8]]
        pytest.fail(f"{name} {what}: {bad.size} of {got.size} differ from the host path:\n"
                    + "\n".join(rows))


# ---- inputs ---------------------------------------------------------------------------------
def special_bits(name):
    """Signed zeros, every subnormal (bfloat16) or a spread of them (others), the smallest
    normals, values around 1 with even and odd last bits (ties for sums with 2^-p), powers of
    two across the range (products that underflow to subnormals or overflow), the largest
    finite values, infinities and NaNs (quiet, signalling, negative)."""
    if name == "bfloat16":
        mantissa_bits, exp_max = 7, 0xFF
        subnormals = np.arange(0, 1 << mantissa_bits)
        exps = [1, 2, 3, 30, 60, 66, 100, 118, 119, 120, 125, 126, 127, 128, 134, 135, 190,
                200, 250, 253, 254]
    elif name == "float16":
        mantissa_bits, exp_max = 10, 0x1F
        subnormals = np.array([0, 1, 2, 3, 5, 0x1FF, 0x200, 0x201, 0x3FE, 0x3FF])
        exps = [1, 2, 3, 4, 5, 7, 10, 13, 14, 15, 16, 17, 20, 25, 28, 29, 30]
    else:
        mantissa_bits, exp_max = 23, 0xFF
        subnormals = np.array([0, 1, 2, 3, 5, 0x3FFFFF, 0x400000, 0x400001, 0x7FFFFE,
                               0x7FFFFF])
        exps = [1, 2, 3, 24, 25, 30, 60, 100, 102, 103, 104, 126, 127, 128, 150, 151, 200,
                250, 253, 254]
    top = (1 << mantissa_bits) - 1
    mantissas = np.array([0, 1, 2, 3, top >> 1, (top >> 1) + 1, top - 1, top])
    normal = [(e << mantissa_bits) | mantissas for e in exps]
    inf = exp_max << mantissa_bits
    specials = [inf, inf | 1, inf | (1 << (mantissa_bits - 1)), inf | top]   # inf, sNaN, qNaN
    bits = BITS[name]
    sign = bits(1 << (8 * np.dtype(bits).itemsize - 1))
    positive = np.concatenate([subnormals, *normal, specials]).astype(bits)
    return np.unique(np.concatenate([positive, positive | sign])).astype(bits)


def pairs(name):
    values = special_bits(name)
    a, b = np.meshgrid(values, values, indexing="ij")
    rng = np.random.default_rng(23)
    bits = BITS[name]
    random = rng.integers(0, 1 << (8 * np.dtype(bits).itemsize), (2, 100_000),
                          dtype=np.uint64).astype(bits)
    return (np.concatenate([a.ravel(), random[0]]), np.concatenate([b.ravel(), random[1]]))


# 1/n for Average's exact scaling (the host divides by n: the same bits, docs in host_reduce)
FACTORS = (0.5, 0.25, 1 / 3, 1 / 5, 1 / 6, 1 / 7, 1 / 24, 1 / 1000, 1 / 65535, 1 / 16777215,
           3.0, 2.0 ** -100, 2.0 ** 100, 1e-30)


# ---- (a) the model against the host path ---------------------------------------------------
def test_cpu_keeps_subnormals():
    """The model and the host path must see IEEE arithmetic: a library that set the CPU's
    flush-to-zero bits would make both flush and hide the difference."""
    tiny = np.float32(1e-45)
    assert tiny + tiny != 0 and SMALLEST_NORMAL / np.float32(2) != 0


@pytest.mark.parametrize("name", MODELLED)
@pytest.mark.parametrize("op", sorted(dk.KERNEL_OPS))
def test_model_reduce_equals_host_path(name, op):
    a, b = pairs(name)
    assert_same_bits(name, dk.emulate_reduce(name, a, b, op), host_reduce_bits(name, a, b, op),
                     a, b, op, f"op {op}")


def scale_values(name):
    """Special values, and every bit pattern (halves) or random ones (float32)."""
    if name in HALF:
        return np.concatenate([special_bits(name), np.arange(1 << 16, dtype=np.uint16)])
    rng = np.random.default_rng(5)
    return np.concatenate([special_bits(name), rng.integers(0, 1 << 32, 200_000,
                                                            dtype=np.uint64).astype(np.uint32)])


def model_scale(name, values, factor, exact, f32=dk.IEEE_F32):
    """The kernel the device uses for a scaling: the half kernels scale in float32 whatever
    ``exact`` says (as torch does on the host); float32 has an exact kernel (float64)."""
    if name in HALF:
        return dk.emulate_scale(name, values, factor, f32)
    return dk.emulate_scale(name, values, factor, f32, exact=exact)


@pytest.mark.parametrize("name", MODELLED)
def test_model_scale_equals_host_path(name):
    values = scale_values(name)
    for factor in FACTORS:
        for exact in (False, True):      # Average's 1/size (exact) and user scale factors
            assert_same_bits(name, model_scale(name, values, factor, exact),
                             host_scale_bits(name, values, factor, exact), values,
                             what=f"x {factor} exact={exact}")


KNOWN_BF16 = [
    # (a, b, op, result): subnormals that a flushing kernel zeroes, ties, overflow, zeros
    (0x0001, 0x0001, dk.OP_SUM, 0x0002),        # smallest subnormal twice
    (0x8001, 0x0000, dk.OP_MIN, 0x8001),        # -subnormal < +0
    (0x0001, 0x0000, dk.OP_MAX, 0x0001),
    (0x0040, 0x0040, dk.OP_SUM, 0x0080),        # two subnormals make the smallest normal
    (0x1F00, 0x1F00, dk.OP_PRODUCT, 0x0008),    # 2^-65 * 2^-65 = 2^-130: a subnormal
    (0x3F80, 0x3B80, dk.OP_SUM, 0x3F80),        # 1 + 2^-8: tie, to even (down)
    (0x3F81, 0x3B80, dk.OP_SUM, 0x3F82),        # (1 + 2^-7) + 2^-8: tie, to even (up)
    (0x7F7F, 0x7F7F, dk.OP_SUM, 0x7F80),        # largest finite twice: +inf
    (0xFF7F, 0x7F7F, dk.OP_SUM, 0x0000),        # x + -x = +0
    (0x8000, 0x8000, dk.OP_SUM, 0x8000),        # -0 + -0 = -0
    (0x7F80, 0xFF80, dk.OP_SUM, None),          # inf - inf: NaN
]


@pytest.mark.parametrize("a, b, op, result", KNOWN_BF16)
def test_known_bfloat16_results(a, b, op, result):
    a, b = np.array([a], np.uint16), np.array([b], np.uint16)
    host = host_reduce_bits("bfloat16", a, b, op)
    model = dk.emulate_reduce("bfloat16", a, b, op)
    if result is None:
        assert np.isnan(_widen("bfloat16", host)).all() and np.isnan(_widen("bfloat16", model))
    else:
        assert (host[0], model[0]) == (result, result)


KNOWN_F32 = [
    (0x00000001, 0x00000001, dk.OP_SUM, 0x00000002),    # smallest subnormal twice
    (0x80000001, 0x00000000, dk.OP_MIN, 0x80000001),
    (0x00400000, 0x00400000, dk.OP_SUM, 0x00800000),    # two subnormals: smallest normal
    (0x1A000000, 0x25000000, dk.OP_PRODUCT, 0x00200000),   # 2^-75 * 2^-53 = 2^-128
]


@pytest.mark.parametrize("a, b, op, result", KNOWN_F32)
def test_known_float32_results(a, b, op, result):
    a, b = np.array([a], np.uint32), np.array([b], np.uint32)
    assert host_reduce_bits("float32", a, b, op)[0] == result
    assert dk.emulate_reduce("float32", a, b, op)[0] == result


def test_known_float32_average_of_subnormals():
    bits = np.array([0x00000001, 0x00000003, 0x00000005], np.uint32)
    want = np.array([0x00000000, 0x00000002, 0x00000002], np.uint32)   # halves, ties to even
    np.testing.assert_array_equal(host_scale_bits("float32", bits, 0.5, True), want)
    np.testing.assert_array_equal(dk.emulate_scale("float32", bits, 0.5, exact=True), want)


def test_known_bfloat16_scale_ties_in_the_subnormal_range():
    bits = np.array([0x0001, 0x0003, 0x0005, 0x8003], np.uint16)
    want = np.array([0x0000, 0x0002, 0x0002, 0x8002], np.uint16)    # halves, ties to even
    np.testing.assert_array_equal(host_scale_bits("bfloat16", bits, 0.5, False), want)
    np.testing.assert_array_equal(dk.emulate_scale("bfloat16", bits, 0.5), want)


def test_kernel_source_has_what_the_model_mirrors():
    """The model's rounding and arithmetic are those of the source: bfloat16's integer
    round-to-nearest-even with NaN handled first, and one explicit PTX instruction (no .ftz)
    for each float operation the model performs."""
    source = dk.KERNEL_SOURCE
    rounding = re.search(r"mpiddp_f32_to_bf16\(float value\) \{(.*?)\n\}", source, re.S)
    assert rounding, "the float32 -> bfloat16 rounding helper is gone"
    body = " ".join(rounding.group(1).split())
    assert "if ((u & 0x7fffffffu) > 0x7f800000u) { return (unsigned short)0x7fc0u; }" in body
    assert "u += 0x7fffu + ((u >> 16) & 1u); return (unsigned short)(u >> 16);" in body
    for instruction in dk.F32_INSTRUCTIONS:
        assert re.search(r'asm\("[^"]*' + re.escape(instruction) + " ", source), instruction
    assert not [text for text in re.findall(r'asm\("([^"]*)"', source) if ".ftz" in text]
    assert set(vars(dk.IEEE_F32)) == set(dk.F32_INSTRUCTIONS.values())


# ---- (b) NVRTC through CuPy's compile path ------------------------------------------------
def _load_nvrtc():
    """CuPy with a working NVRTC, or the reason there is none. CuPy finds the NVRTC of the
    ``nvidia-cuda-nvrtc-cu12`` wheel itself (cuda-pathfinder); where it does not, the wheel's
    library is loaded by path first."""
    try:
        import cupy  # noqa: F401
        from cupy.cuda import compiler, nvrtc
    except Exception as error:          # ImportError, or CuPy built for a missing CUDA
        return None, f"CuPy is not importable ({type(error).__name__}: {error})"
    try:
        nvrtc.getVersion()
        return compiler, None
    except Exception as first:
        import ctypes

        for root in sys.path:
            for library in sorted(glob.glob(os.path.join(
                    root, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*"))):
                try:
                    ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
                    nvrtc.getVersion()
                    return compiler, None
                except Exception:
                    continue
        return None, f"NVRTC is not loadable ({type(first).__name__}: {first})"


COMPILER, NO_NVRTC = _load_nvrtc()
needs_nvrtc = pytest.mark.skipif(COMPILER is None, reason=str(NO_NVRTC))


def skip_unless_nvrtc_compiles_for(arch: str) -> None:
    """Each NVRTC compiles for its own range of compute capabilities (CUDA 13's from 7.5 on:
    an H200 machine's CuPy for CUDA 13 refused 6.0 and 7.0)."""
    from cupy.cuda import nvrtc

    supported = nvrtc.getSupportedArchs()
    if int(arch) not in supported:
        pytest.skip(f"this NVRTC ({nvrtc.getVersion()}) compiles only for {supported}")


_PTX_CACHE: dict = {}


class _Compiled(Exception):
    """Raised after NVRTC has compiled our source: loading the result needs a device."""


def cupy_compile(arch, monkeypatch, method="ptx"):
    """KERNEL_SOURCE compiled for compute capability ``arch`` by the call ``cupy.RawModule``
    makes (``core.compile_with_cache(code, options, prepend_cupy_headers=False, ...)``) with
    the options ``device.py`` passes. Only the device queries are replaced: the architecture,
    and ``method``: 'cubin' is what CuPy asks NVRTC for on a device (``-arch=sm_XX``), 'ptx'
    the virtual-architecture text. The options CuPy adds itself are kept. Returns the options
    NVRTC got and what it produced (PTX as text, a cubin as bytes)."""
    skip_unless_nvrtc_compiles_for(arch)
    key = arch, method
    if key in _PTX_CACHE:
        return _PTX_CACHE[key]
    from cupy._core import core

    compiler = COMPILER
    seen = {}
    compile_program = compiler._NVRTCProgram.compile

    def record(program, options=(), log_stream=None):
        result = compile_program(program, options, log_stream)
        if "mpiddp_bf16_reduce" in (program.src or ""):
            seen["options"], seen["output"] = tuple(options), result[0]
            raise _Compiled()
        return result

    flag = f"-arch={'compute' if method == 'ptx' else 'sm'}_{arch}"
    monkeypatch.setenv("CUPY_CACHE_IN_MEMORY", "1")     # no disk cache: compile every time
    monkeypatch.setattr(compiler._NVRTCProgram, "compile", record)
    monkeypatch.setattr(compiler, "_get_arch", lambda: arch)
    monkeypatch.setattr(compiler, "_get_arch_for_options_for_nvrtc",
                        lambda arch=None: (flag, method))
    with pytest.raises(_Compiled):
        core.compile_with_cache(dk.KERNEL_SOURCE, dk.COMPILE_OPTIONS,
                                prepend_cupy_headers=False, backend="nvrtc")
    output = seen["output"]
    if method == "ptx" and isinstance(output, bytes):
        output = output.decode()
    _PTX_CACHE[key] = seen["options"], output
    return _PTX_CACHE[key]


class _Anything:
    """Stands in for any CuPy object the device state touches: callable, a context manager,
    every attribute another one."""

    def __call__(self, *args, **kwargs):
        return self

    def __getattr__(self, name):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.skipif(COMPILER is None, reason=str(NO_NVRTC))
def test_device_module_is_built_with_these_options(monkeypatch):
    """The source and options compiled above are the ones ``device.py`` gives RawModule."""
    from mpiddp.buffers import device

    built = []
    fake = _Anything()
    fake.RawModule = lambda **kwargs: built.append(kwargs) or _Anything()
    monkeypatch.setattr(device, "cupy", fake)
    monkeypatch.setattr(device, "use_device", lambda device_id: None)   # no CUDA runtime here
    device._DeviceState(0)
    assert built == [{"code": dk.KERNEL_SOURCE, "options": dk.COMPILE_OPTIONS}]


def cupy_ptx(arch, monkeypatch):
    return cupy_compile(arch, monkeypatch, "ptx")


def kernel_bodies(ptx):
    bodies = dict(re.findall(r"\.entry (\w+)\((.*?)\n\}", ptx, re.S))
    assert set(dk.KERNEL_NAMES) <= set(bodies), sorted(bodies)
    return bodies


FLOAT_TYPE = re.compile(r"\.(f16|f16x2|bf16|bf16x2|f32|f64)\b")
# Instructions that move float registers without arithmetic (no flushing possible).
FLOAT_MOVES = re.compile(r"^(ld|st|mov|selp)\.")


def float_arithmetic(body):
    """The opcodes in a kernel body that compute on float values (not just move them)."""
    opcodes = re.findall(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)", body, re.M)
    return {op for op in opcodes if FLOAT_TYPE.search(op) and not FLOAT_MOVES.match(op)}


def _flush(x):
    x = np.asarray(x, np.float32)
    return np.where(np.abs(x) < SMALLEST_NORMAL, np.copysign(np.float32(0), x), x)


# .ftz semantics (PTX ISA): subnormal float32 inputs and results become zeros of the same
# sign (float64 has no .ftz).
FLUSHING_F32 = dk.F32Arithmetic(
    lambda a, b: _flush(np.add(_flush(a), _flush(b))),
    lambda a, b: _flush(np.multiply(_flush(a), _flush(b))),
    lambda a, b: np.less(_flush(a), _flush(b)),
    lambda x: _flush(x).astype(np.float64), np.multiply,
    lambda x: _flush(np.asarray(x, np.float64).astype(np.float32)))


def arithmetic_of(body):
    """The model's float32 arithmetic for a kernel, read from its PTX: a kernel with any .ftz
    instruction is modelled as flushing."""
    return FLUSHING_F32 if ".ftz" in body else dk.IEEE_F32


@needs_nvrtc
@pytest.mark.parametrize("arch", ARCHS)
def test_ptx_through_cupy_has_no_flush_to_zero(arch, monkeypatch):
    options, ptx = cupy_ptx(arch, monkeypatch)
    assert set(dk.COMPILE_OPTIONS) <= set(options), options
    for name, body in kernel_bodies(ptx).items():
        flushing = sorted({line.strip() for line in body.splitlines() if ".ftz" in line})
        assert not flushing, f"{name} (compute_{arch}, options {options}): {flushing[:6]}"
        unknown = float_arithmetic(body) - set(dk.F32_INSTRUCTIONS)
        assert not unknown, (f"{name} (compute_{arch}) computes with {sorted(unknown)}, which "
                             "the NumPy model does not reproduce (device_kernels."
                             "F32_INSTRUCTIONS)")
        assert not re.search(r"\b(fma|mad)\.[\w.]*f(16|32|64)\b|\.approx", body), name


@needs_nvrtc
@pytest.mark.parametrize("arch", ("60", "80", "90"))
def test_model_of_the_compiled_kernels_equals_host_path(arch, monkeypatch):
    """The model run with the float32 arithmetic the PTX has, against the host path: this is
    what a GPU would compute, and where a build flushes subnormals it shows the values."""
    _, ptx = cupy_ptx(arch, monkeypatch)
    bodies = kernel_bodies(ptx)
    prefix = {"bfloat16": "mpiddp_bf16", "float16": "mpiddp_f16", "float32": "mpiddp_f32"}
    for name in MODELLED:
        a, b = pairs(name)
        reduce_f32 = arithmetic_of(bodies[prefix[name] + "_reduce"])
        for op in sorted(dk.KERNEL_OPS):
            got = dk.emulate_reduce(name, a, b, op, reduce_f32)
            assert_same_bits(name, got, host_reduce_bits(name, a, b, op), a, b, op,
                             f"op {op} on compute_{arch}")
        values = scale_values(name)
        for exact in (False, True) if name == "float32" else (False,):
            kernel = prefix[name] + ("_scale_exact_kernel" if exact else "_scale_kernel")
            scale_f32 = arithmetic_of(bodies[kernel])
            for factor in FACTORS:
                assert_same_bits(name, model_scale(name, values, factor, exact, scale_f32),
                                 host_scale_bits(name, values, factor, exact), values,
                                 what=f"{kernel} x {factor} on compute_{arch}")


# ---- the machine code: NVRTC's cubin (what CuPy loads on a device) disassembled -----------
def _nvdisasm():
    """nvdisasm from the ``nvidia-cuda-nvdisasm`` wheel (CUDA 13: it reads sm_75 and newer)."""
    for root in sys.path:
        for path in sorted(glob.glob(os.path.join(root, "nvidia", "cu*", "bin", "nvdisasm"))):
            if os.access(path, os.X_OK):
                return path
    return shutil.which("nvdisasm")


NVDISASM = _nvdisasm()
SASS_ARCHS = ("75", "80", "86", "90")


def elf_sections(data: bytes) -> dict:
    """Section name -> bytes of a 64-bit little-endian ELF file (a cubin)."""
    assert data[:4] == b"\x7fELF" and data[4] == 2, "not a 64-bit ELF"
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx][4]
    sections = {}
    for name, _type, _flags, _addr, offset, size in headers:
        end = data.index(b"\0", names + name)
        sections[data[names + name:end].decode()] = data[offset:offset + size]
    return sections


@needs_nvrtc
@pytest.mark.skipif(NVDISASM is None, reason="nvdisasm is not installed "
                    "(nvidia-cuda-nvdisasm from requirements-dev.txt)")
@pytest.mark.parametrize("arch", SASS_ARCHS)
def test_machine_code_has_no_flush_to_zero(arch, monkeypatch, tmp_path):
    """ptxas (inside NVRTC) keeps the PTX's float semantics: no FTZ, no FFMA in the SASS of
    the cubin CuPy would load (the old kernels had FADD.FTZ, FMUL.FTZ, FSETP.*.FTZ)."""
    _, cubin = cupy_compile(arch, monkeypatch, "cubin")
    sections = elf_sections(bytes(cubin))
    for name in dk.KERNEL_NAMES:
        raw = tmp_path / f"{name}.bin"
        raw.write_bytes(sections[f".text.{name}"])
        sass = subprocess.run([NVDISASM, "-b", f"SM{arch}", str(raw)], capture_output=True,
                              text=True, check=True, timeout=60).stdout
        assert "EXIT" in sass, sass[:500]
        opcodes = set(re.findall(r"\b([A-Z][A-Z0-9]*(?:\.[A-Z0-9_]+)+|[A-Z][A-Z0-9]+)\b", sass))
        bad = {op for op in opcodes if "FTZ" in op.split(".") or op.split(".")[0] == "FFMA"}
        assert not bad, f"{name} sm_{arch}: {sorted(bad)}"
        assert "MUFU" not in sass, name


def test_flushing_model_does_flush():
    """The flushing arithmetic above is what .ftz does (so the check above can fail)."""
    sub = np.array([0x0001], np.uint16)
    assert dk.emulate_reduce("bfloat16", sub, sub, dk.OP_SUM, FLUSHING_F32)[0] == 0
    assert dk.emulate_reduce("bfloat16", sub, sub, dk.OP_SUM)[0] == 0x0002


# ---- defect 2: the GPU worker's ops -------------------------------------------------------
def _gpu_worker():
    workers = os.path.join(os.path.dirname(__file__), "workers")
    if workers not in sys.path:
        sys.path.append(workers)
    import gpu_worker

    return gpu_worker


def device_reduces(op, dtype):
    """Whether ``DeviceBackend.reduce_into`` has a kernel for ``op`` on ``dtype``, by its own
    dispatch: the half kernels' op codes, otherwise CuPy's function named by
    ``combine_function`` (a KeyError there is the failure the worker used to hit)."""
    if dtype.name in HALF:
        return int(op) in dk.KERNEL_OPS and dk.KERNEL_OPS[int(op)] == combine_function(op, "float")
    try:
        name = combine_function(op, dtype.kind)
    except KeyError:
        return False
    try:
        import cupy
    except Exception:
        cupy = np                      # CuPy mirrors NumPy's names
    return callable(getattr(cupy, name, None))


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_gpu_worker_reduces_only_what_the_device_path_supports(name):
    dtype = DTYPES[name]
    ops = list(_gpu_worker().unit_ops(dtype))
    assert ops and ReduceOp.ADASUM not in ops
    assert all(device_reduces(op, dtype) for op in ops), ops
    # and nothing the device path supports is left out
    assert {op for op in ReduceOp if device_reduces(op, dtype)} == set(ops)


def test_half_kernel_op_codes_are_the_reduce_op_values():
    for op in reducible_ops("float"):
        assert dk.KERNEL_OPS[int(op)] == combine_function(op, "float"), op
    assert int(ReduceOp.ADASUM) not in dk.KERNEL_OPS
