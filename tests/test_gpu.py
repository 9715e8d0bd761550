"""GPU support: what can be checked without a GPU runs everywhere; the rest skips cleanly.

Without a GPU (every machine of this project, CI included):
* the CUDA-awareness probe against the bundled MPICH, the MPIDDP_CUDA_AWARE override and
  its validation, and the one-line report at init;
* the staging communicators (StagedComm, DirectComm) over real MPI with host memory posing
  as device memory (tests/workers/gpu_fakes.py), and the staging decision;
* the half-precision kernels' arithmetic: the C element functions compiled with the host C
  compiler, their NumPy emulation, an exhaustive correctly-rounded reference and torch's
  own CPU conversions; the CUDA source compiled with nvcc where nvcc exists;
* device selection with a stand-in for torch.cuda; a CPU/GPU device mismatch reported by
  negotiation; fusion keeping CPU and GPU tensors apart; `import mpiddp` not importing CuPy.

With a GPU (skipped here): every collective and dtype against a float64 reference on 1, 2
and 4 ranks sharing one GPU, staged and (when the MPI is CUDA-aware) direct; a producer
stream still busy at submission; mixed CPU and GPU tensors; DistributedOptimizer on CUDA,
with forward overlap too.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from mpi_launch import ROOT, assert_ok, run_mpi

from mpiddp import gpu
from mpiddp.buffers import device_kernels as dk
from mpiddp.transport import cuda_aware
from mpiddp.transport.staging import DirectComm, StagedComm, device_comm, segments
from mpiddp.config import read_settings
from mpiddp.engine.fusion import plan_batches
from mpiddp.engine.negotiation import RequestTable, agree
from mpiddp.engine.request import ALLREDUCE, Request, Response


def _gpu_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import cupy
    except ImportError:
        return False
    try:
        return bool(cupy.cuda.is_available())
    except Exception:
        return False


HAVE_GPU = _gpu_available()
needs_gpu = pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU with torch.cuda and CuPy")
PROBE = cuda_aware.probe()
# The PyPI MPICH wheel this repository installs (inside the virtual environment) is known not
# to be CUDA-aware; a site MPI may be either.
BUNDLED_MPICH = bool(PROBE.library) and os.path.realpath(PROBE.library).startswith(
    os.path.realpath(sys.prefix))


# ---- CUDA-awareness probe -----------------------------------------------------------------
@pytest.mark.skipif(not BUNDLED_MPICH, reason=f"not the bundled MPICH: {PROBE.library}")
def test_probe_reports_bundled_mpich_is_not_cuda_aware():
    found = cuda_aware.probe()
    assert found.supported is False, found
    assert found.query is not None and found.query.startswith("MPIX_"), found
    assert "libmpi" in os.path.basename(found.library or ""), found
    assert "says no" in found.describe()
    assert cuda_aware.decide("auto", found).cuda_aware is False


def test_probe_of_a_library_without_the_query_is_not_cuda_aware(tmp_path):
    libc = ctypes.util.find_library("c")
    found = cuda_aware.probe([str(tmp_path / "missing.so"), libc])
    assert found.supported is None and found.query is None
    decision = cuda_aware.decide("auto", found)
    assert decision.cuda_aware is False and "has no MPIX_" in decision.describe()


def test_loaded_mpi_libraries_from_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(textwrap.dedent("""\
        7f00-7f01 r-xp 00000000 08:01 1 /opt/ompi/lib/libmpi.so.40.30.0
        7f01-7f02 r-xp 00000000 08:01 2 /opt/ompi/lib/libmpi_mpifh.so.40
        7f02-7f03 r-xp 00000000 08:01 3 /usr/lib/libmpich.so.12
        7f03-7f04 r-xp 00000000 08:01 4 /usr/lib/libucp.so.0
        7f04-7f05 rw-p 00000000 00:00 0
        7f05-7f06 r-xp 00000000 08:01 1 /opt/ompi/lib/libmpi.so.40.30.0
        """))
    assert cuda_aware.loaded_mpi_libraries(str(maps)) == [
        "/opt/ompi/lib/libmpi.so.40.30.0", "/usr/lib/libmpich.so.12"]
    assert cuda_aware.loaded_mpi_libraries(str(tmp_path / "absent")) == []


@pytest.mark.parametrize("setting,probed,expected", [
    ("auto", True, True), ("auto", False, False), ("auto", None, False),
    ("1", False, True), ("1", None, True), ("0", True, False), ("0", False, False),
])
def test_decision_matrix(setting, probed, expected):
    found = cuda_aware.Probe(probed, "/x/libmpi.so", None if probed is None else "MPIX_q()")
    decision = cuda_aware.decide(setting, found)
    assert decision.cuda_aware is expected
    text = decision.describe()
    assert text.startswith("yes" if expected else "no")
    if setting != "auto":
        assert f"MPIDDP_CUDA_AWARE={setting}" in text


def test_env_override_and_bad_value(monkeypatch):
    cuda_aware.reset()
    monkeypatch.setenv("MPIDDP_CUDA_AWARE", "1")
    assert cuda_aware.mpi_cuda_aware() is True
    monkeypatch.setenv("MPIDDP_CUDA_AWARE", "0")
    assert cuda_aware.mpi_cuda_aware() is False
    monkeypatch.setenv("MPIDDP_CUDA_AWARE", "auto")
    assert cuda_aware.mpi_cuda_aware() is bool(PROBE.supported)
    monkeypatch.setenv("MPIDDP_CUDA_AWARE", "maybe")
    with pytest.raises(ValueError, match="MPIDDP_CUDA_AWARE='maybe'"):
        cuda_aware.mpi_cuda_aware()
    with pytest.raises(ValueError, match="MPIDDP_CUDA_AWARE"):
        read_settings({"MPIDDP_CUDA_AWARE": "yes please"})
    with pytest.raises(ValueError, match="not one of"):
        cuda_aware.decide("2", None)


def test_init_reports_probe_and_override_on_every_rank():
    """init() on 2 ranks: the one-line GPU/CUDA-aware report, mpi_cuda_aware(), no CuPy
    import on the CPU path, and a CPU/'cuda' mismatch of one name reported by negotiation;
    then the same with MPIDDP_CUDA_AWARE=1."""
    aware = bool(PROBE.supported)
    result = run_mpi("gpu_init_worker.py", 2, "1" if aware else "0", timeout=120,
                     env={"MPIDDP_LOG_LEVEL": "info"})
    assert_ok(result, expect_lines=2)
    answer = "yes" if aware else "no"
    assert result.output.count(f"CUDA-aware MPI: {answer} (MPIX_") == 2, result.output
    forced = run_mpi("gpu_init_worker.py", 2, "1", timeout=120,
                     env={"MPIDDP_CUDA_AWARE": "1", "MPIDDP_LOG_LEVEL": "info"})
    assert_ok(forced, expect_lines=2)
    assert forced.output.count("CUDA-aware MPI: yes (MPIDDP_CUDA_AWARE=1") == 2, forced.output


def test_import_and_cpu_path_never_import_cupy():
    code = ("import sys, torch, mpiddp; mpiddp.init(); "
            "assert mpiddp.allreduce(torch.ones(3), op=mpiddp.Sum).tolist() == [1.0] * 3; "
            "mpiddp.shutdown(); assert 'cupy' not in sys.modules, 'cupy imported'; print('OK')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, cwd=str(ROOT),
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr


# ---- staging ------------------------------------------------------------------------------
def test_staging_communicators_over_mpi_with_fake_device_memory():
    result = run_mpi("gpu_staging_worker.py", 3, timeout=180)
    assert_ok(result, expect_lines=6)
    assert "DONE" in result.output


def test_staging_decision_and_segments():
    class Copier:
        def sync(self):
            pass

    comm = object()
    assert isinstance(device_comm(comm, False, Copier()), StagedComm)
    direct = device_comm(comm, True, Copier())
    assert isinstance(direct, DirectComm) and isinstance(direct.staged, StagedComm)
    assert segments(0, 64) == []
    assert segments(64, 64) == [(0, 64)]
    assert segments(130, 64) == [(0, 64), (64, 128), (128, 130)]
    with pytest.raises(ValueError):
        StagedComm(comm, Copier(), 0)


@pytest.mark.skipif(HAVE_GPU, reason="a GPU is present: the backend works")
def test_device_backend_without_a_gpu_says_so():
    pytest.importorskip("cupy")
    from mpiddp.buffers import backend_for
    from mpiddp.errors import MpiddpError

    with pytest.raises(MpiddpError, match="no usable CUDA device"):
        backend_for("cuda")


# ---- half-precision arithmetic --------------------------------------------------------------
def _all_values(dtype_name):
    bits = np.arange(1 << 16, dtype=np.uint16)
    with np.errstate(invalid="ignore"):        # signalling NaNs among the bit patterns
        if dtype_name == "bfloat16":
            return bits, dk.bf16_bits_to_f32(bits).astype(np.float64)
        return bits, bits.view(np.float16).astype(np.float64)


def reference_round(x: np.ndarray, dtype_name: str) -> np.ndarray:
    """Correctly rounded (nearest, ties to even) float64 -> half bits, by search in the sorted
    table of every finite value of the format, plus the overflow threshold: a magnitude that
    rounds past the largest finite value becomes infinity, whose bit pattern is even."""
    bits, values = _all_values(dtype_name)
    finite_pos = np.isfinite(values) & (values >= 0) & ~((values == 0) & (bits != 0))
    grid, grid_bits = values[finite_pos], bits[finite_pos]
    order = np.argsort(grid)
    grid, grid_bits = grid[order], grid_bits[order].astype(np.uint32)
    top = grid[-1] + (grid[-1] - grid[-2])           # 2^128 (bf16) or 2^16 (fp16): infinity
    inf_bits = 0x7F80 if dtype_name == "bfloat16" else 0x7C00
    grid = np.append(grid, top)
    grid_bits = np.append(grid_bits, inf_bits)
    mag = np.abs(x)
    hi = np.clip(np.searchsorted(grid, mag, side="left"), 1, len(grid) - 1)
    lo = hi - 1
    exact = grid[hi] == mag
    lo = np.where(exact, hi, lo)
    d_lo, d_hi = mag - grid[lo], grid[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (grid_bits[hi] % 2 == 0) & ~exact)
    out = np.where(pick_hi, grid_bits[hi], grid_bits[lo])
    out = np.where(mag >= top, inf_bits, out)
    sign = np.where(np.signbit(x), 0x8000, 0)
    return (out | sign).astype(np.uint16)


def _random_bits(dtype_name, n, rng, low_exp=-20, high_exp=20):
    """Random finite values with magnitudes 2^low_exp .. 2^high_exp, as half bits."""
    mant = rng.uniform(1, 2, n) * np.exp2(rng.integers(low_exp, high_exp, n))
    values = np.where(rng.random(n) < 0.5, -mant, mant).astype(np.float32)
    if dtype_name == "bfloat16":
        return dk.f32_to_bf16_bits(values)
    return dk.f32_to_f16_bits(values)


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_half_sum_and_product_are_correctly_rounded(dtype_name):
    rng = np.random.default_rng(7)
    high = 14 if dtype_name == "float16" else 60
    a = _random_bits(dtype_name, 200_000, rng, -12, high // 2)
    b = _random_bits(dtype_name, 200_000, rng, -12, high // 2)
    widen = dk.bf16_bits_to_f32 if dtype_name == "bfloat16" else dk.f16_bits_to_f32
    for op, exact in ((dk.OP_SUM, lambda x, y: x + y), (dk.OP_PRODUCT, lambda x, y: x * y)):
        exact_values = exact(widen(a).astype(np.float64), widen(b).astype(np.float64))
        want = reference_round(exact_values, dtype_name)
        got = dk.emulate_reduce(dtype_name, a, b, op)
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, (op, a[bad[:5]], b[bad[:5]], got[bad[:5]], want[bad[:5]])


def test_half_rounding_edges():
    # bf16: ties to even both ways, carry into the exponent, overflow to inf, NaN
    f32 = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -20, 3.3895314e38,
                    3.4e38, np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-40, 2 - 2 ** -9],
                   dtype=np.float32)
    got = dk.f32_to_bf16_bits(f32)
    want = reference_round(f32[:7].astype(np.float64), "bfloat16")
    np.testing.assert_array_equal(got[:7], want)
    assert got[7] == 0x7FC0 and got[8] == 0 and got[9] == 0x8000
    assert got[11] == 0x4000                       # 2 - 2^-9 rounds up to 2.0
    by_torch = torch.from_numpy(f32).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    number = ~np.isnan(f32)
    np.testing.assert_array_equal(got[number], by_torch[number])
    # fp16: overflow threshold 65520 (tie to even -> inf), subnormal ties
    f32 = np.array([65504, 65519.99, 65520, 2 ** -25, 2 ** -25 * 1.0001, 3 * 2 ** -25,
                    2 ** -24 * 1.5, -(2 ** -14)], dtype=np.float32)
    np.testing.assert_array_equal(dk.f32_to_f16_bits(f32),
                                  reference_round(f32.astype(np.float64), "float16"))


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_half_kernels_agree_with_torch_cpu_path(dtype_name):
    """The device kernels compute what the CPU path (torch half arithmetic) computes, bit for
    bit, so a job gives the same numbers on CPU and GPU tensors."""
    rng = np.random.default_rng(3)
    a = _random_bits(dtype_name, 50_000, rng)
    b = _random_bits(dtype_name, 50_000, rng)
    tdtype = torch.bfloat16 if dtype_name == "bfloat16" else torch.float16

    def t(bits):
        return torch.from_numpy(bits.view(np.int16).copy()).view(tdtype)

    def back(tensor):
        return tensor.view(torch.int16).numpy().view(np.uint16)

    for op, fn in ((dk.OP_SUM, torch.add), (dk.OP_PRODUCT, torch.mul),
                   (dk.OP_MIN, torch.minimum), (dk.OP_MAX, torch.maximum)):
        np.testing.assert_array_equal(dk.emulate_reduce(dtype_name, a, b, op),
                                      back(fn(t(a), t(b))), err_msg=str(op))
    for factor in (0.25, 1 / 3, 1 / 7, 3.0):
        np.testing.assert_array_equal(dk.emulate_scale(dtype_name, a, factor),
                                      back(t(a) * factor), err_msg=str(factor))


def _host_compiler():
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


@pytest.mark.skipif(_host_compiler() is None, reason="no C compiler")
def test_c_element_functions_match_numpy_emulation(tmp_path):
    """The element functions the CUDA kernels call, compiled as C, against the emulation."""
    harness = dk.ELEMENT_SOURCE + textwrap.dedent("""
        void reduce_bits(int bf16, const unsigned short* a, const unsigned short* b,
                         unsigned short* out, long n, int op) {
            for (long i = 0; i < n; i++)
                out[i] = bf16 ? mpiddp_bf16_combine(a[i], b[i], op)
                              : mpiddp_f16_combine(a[i], b[i], op);
        }
        void scale_bits(int bf16, const unsigned short* a, unsigned short* out, long n,
                        float f) {
            for (long i = 0; i < n; i++)
                out[i] = bf16 ? mpiddp_bf16_scale(a[i], f) : mpiddp_f16_scale(a[i], f);
        }
        void round_f32(int bf16, const float* x, unsigned short* out, long n) {
            for (long i = 0; i < n; i++)
                out[i] = bf16 ? mpiddp_f32_to_bf16(x[i]) : mpiddp_f32_to_f16(x[i]);
        }
        void widen(int bf16, const unsigned short* h, float* out, long n) {
            for (long i = 0; i < n; i++)
                out[i] = bf16 ? mpiddp_bf16_to_f32(h[i]) : mpiddp_f16_to_f32(h[i]);
        }
        """)
    source = tmp_path / "elements.c"
    source.write_text(harness)
    library = tmp_path / "elements.so"
    subprocess.run([_host_compiler(), "-O2", "-std=c99", "-Wall", "-Werror", "-shared", "-fPIC",
                    "-o", str(library), str(source)], check=True)
    lib = ctypes.CDLL(str(library))
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    rng = np.random.default_rng(11)
    every = np.arange(1 << 16, dtype=np.uint16)
    # float32 inputs: random bit patterns, every half value, and values near rounding ties
    f32 = np.concatenate([
        rng.integers(0, 1 << 32, 300_000, dtype=np.uint64).astype(np.uint32).view(np.float32),
        dk.bf16_bits_to_f32(every), dk.f16_bits_to_f32(every),
        (dk.bf16_bits_to_f32(every).view(np.uint32) + 0x8000).view(np.float32),
        (dk.f16_bits_to_f32(every).view(np.uint32) + 0x1000).view(np.float32),
        rng.uniform(-7e4, 7e4, 100_000).astype(np.float32),
        rng.uniform(-1e-4, 1e-4, 100_000).astype(np.float32),
    ])
    for bf16, name in ((1, "bfloat16"), (0, "float16")):
        widened = np.empty(len(every), np.float32)
        lib.widen(bf16, ptr(every), ptr(widened), ctypes.c_long(len(every)))
        reference = dk.bf16_bits_to_f32(every) if bf16 else dk.f16_bits_to_f32(every)
        np.testing.assert_array_equal(widened.view(np.uint32), reference.view(np.uint32))

        out = np.empty(len(f32), np.uint16)
        lib.round_f32(bf16, ptr(f32), ptr(out), ctypes.c_long(len(f32)))
        with np.errstate(all="ignore"):
            want = dk.f32_to_bf16_bits(f32) if bf16 else dk.f32_to_f16_bits(f32)
        nan = np.isnan(f32)
        np.testing.assert_array_equal(out[~nan], want[~nan], err_msg=name)
        widen = dk.bf16_bits_to_f32 if bf16 else dk.f16_bits_to_f32
        assert np.isnan(widen(out[nan])).all()

        a = rng.integers(0, 1 << 16, 200_000, dtype=np.uint64).astype(np.uint16)
        b = rng.integers(0, 1 << 16, 200_000, dtype=np.uint64).astype(np.uint16)
        for op in (dk.OP_AVERAGE, dk.OP_SUM, dk.OP_MIN, dk.OP_MAX, dk.OP_PRODUCT):
            got = np.empty(len(a), np.uint16)
            lib.reduce_bits(bf16, ptr(a), ptr(b), ptr(got), ctypes.c_long(len(a)), op)
            want = dk.emulate_reduce(name, a, b, op)
            nan = np.isnan(widen(want))
            np.testing.assert_array_equal(got[~nan], want[~nan], err_msg=f"{name} op {op}")
            assert np.isnan(widen(got[nan])).all()
        for factor in (0.5, 1 / 3, 1 / 24, 1000.0):
            got = np.empty(len(a), np.uint16)
            lib.scale_bits(bf16, ptr(a), ptr(got), ctypes.c_long(len(a)), ctypes.c_float(factor))
            want = dk.emulate_scale(name, a, factor)
            nan = np.isnan(widen(want))
            np.testing.assert_array_equal(got[~nan], want[~nan], err_msg=f"{name} x {factor}")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_kernel_source_compiles(tmp_path):
    source = tmp_path / "kernels.cu"
    source.write_text(dk.KERNEL_SOURCE)
    ptx = tmp_path / "kernels.ptx"
    subprocess.run(["nvcc", "-ptx", "--std=c++11", "-arch=compute_75", "-o", str(ptx),
                    str(source)], check=True, timeout=180)
    text = ptx.read_text()
    for name in dk.KERNEL_NAMES:
        assert f".entry {name}(" in text, name


def test_launch_blocks():
    assert dk.launch_blocks(0) == 1
    assert dk.launch_blocks(1) == 1
    assert dk.launch_blocks(dk.THREADS_PER_BLOCK + 1) == 2
    assert dk.launch_blocks(1 << 40) == dk.MAX_BLOCKS


# ---- device selection ---------------------------------------------------------------------
class FakeCuda:
    """A stand-in for torch.cuda with ``count`` devices."""

    def __init__(self, count, initialized=False, current=0):
        self.count, self.initialized, self.current = count, initialized, current
        self.set_calls = []

    def is_available(self):
        return self.count > 0

    def device_count(self):
        return self.count

    def is_initialized(self):
        return self.initialized

    def current_device(self):
        return self.current

    def set_device(self, index):
        self.set_calls.append(index)
        self.current = index
        self.initialized = True


@pytest.fixture
def clean_gpu_state():
    gpu.reset()
    yield
    gpu.reset()


@pytest.mark.parametrize("local_rank,count,expected", [
    (0, 1, 0), (3, 1, 0), (0, 4, 0), (3, 4, 3), (5, 4, 1), (7, 2, 1), (2, 0, None)])
def test_choose_device(local_rank, count, expected):
    assert gpu.choose_device(local_rank, count) == expected


def test_select_device_sets_local_rank_modulo_count(clean_gpu_state):
    cuda = FakeCuda(4)
    assert gpu.select_device(6, cuda) == 2
    assert cuda.set_calls == [2] and gpu.engine_device() == 2
    gpu.check_tensor_device(2)
    with pytest.raises(ValueError, match="cuda:3 .* this rank uses cuda:2"):
        gpu.check_tensor_device(3)


def test_select_device_keeps_a_device_chosen_before_init(clean_gpu_state):
    cuda = FakeCuda(4, initialized=True, current=1)
    assert gpu.select_device(2, cuda) == 1
    assert cuda.set_calls == [] and gpu.engine_device() == 1


def test_select_device_without_cuda(clean_gpu_state):
    cuda = FakeCuda(0)
    assert gpu.select_device(0, cuda) is None
    assert gpu.engine_device() is None and cuda.set_calls == []
    gpu.check_tensor_device(5)            # nothing chosen: nothing to check against
    if not torch.cuda.is_available():
        assert gpu.select_device(0) is None    # this machine's torch (CPU build or no GPU)
    with pytest.raises(ValueError):
        gpu.choose_device(-1, 2)


def test_setup_reports_one_line(clean_gpu_state):
    settings = read_settings({"MPIDDP_CUDA_AWARE": "0"})
    line = gpu.setup(settings, 1, FakeCuda(2))
    assert "\n" not in line and "CUDA-aware MPI: no (MPIDDP_CUDA_AWARE=0" in line
    assert line.startswith("GPU: cuda:1 = local rank 1 % 2 visible device(s);"), line
    assert line.endswith("device buffers are staged through pinned host memory"), line
    assert cuda_aware.mpi_cuda_aware() is False


def test_ranks_sharing_a_gpu_are_grouped_by_uuid():
    same = "GPU-a"
    identities = [("n1", 0, same), ("n1", 0, same), None, ("n1", 0, same), ("n2", 0, "GPU-b"),
                  ("n2", 1, "GPU-c"), ("n2", 1, "GPU-c"), ("n3", 0, None)]
    report = gpu.shared_devices_report(identities)
    assert report.startswith("several ranks share a GPU: ranks 0-1, 3 on n1 use one GPU "
                             "(cuda:0, GPU-a); ranks 5-6 on n2 use one GPU (cuda:1, GPU-c). "), \
        report
    assert "CUDA MPS" in report and "\n" not in report
    # one GPU each, CPU-only ranks, no UUID: nothing to say
    assert gpu.shared_devices_report([("n1", 0, "a"), ("n1", 1, "b"), None]) is None
    assert gpu.shared_devices_report([None, None, ("n1", 0, None), ("n1", 0, None)]) is None
    # a job where every node is misconfigured: the first few GPUs, then a count
    many = [(f"n{r // 2}", 0, f"uuid-{r // 2}") for r in range(20)]
    report = gpu.shared_devices_report(many, shown=2)
    assert "ranks 0-1 on n0" in report and "ranks 2-3 on n1" in report, report
    assert "ranks 4-5" not in report and "and 8 more GPUs shared alike" in report, report


class _PropertiesCuda(FakeCuda):
    """FakeCuda whose devices report UUIDs (torch's ``_CUuuid`` is a str()-able object)."""

    def __init__(self, count, uuids, **kwargs):
        super().__init__(count, **kwargs)
        self.uuids = uuids

    def get_device_properties(self, index):
        uuid = self.uuids[index]
        if isinstance(uuid, Exception):
            raise uuid
        return type("Properties", (), {"uuid": type("U", (), {"__str__": lambda _: uuid})()})


class _GatherComm:
    """A communicator stand-in: allgather returns the other ranks' given values with ours."""

    def __init__(self, rank, others):
        self.rank, self.others, self.sent = rank, others, []

    def Get_rank(self):
        return self.rank

    def allgather(self, value):
        self.sent.append(value)
        everyone = list(self.others)
        everyone.insert(self.rank, value)
        return everyone


def test_shared_gpu_warning_gathers_every_rank_and_rank_0_logs(clean_gpu_state, caplog):
    cuda = _PropertiesCuda(2, ["u0", "u1"])
    gpu.select_device(1, cuda)
    assert gpu.device_identity(cuda) == "u1"
    comm = _GatherComm(0, [("h", 1, "u1")])      # rank 1 chose the same device
    with caplog.at_level("WARNING", logger="mpiddp"):
        report = gpu.warn_about_shared_devices(comm, "h", cuda)
    assert comm.sent == [("h", 1, "u1")]
    assert report.startswith("several ranks share a GPU: ranks 0-1 on h use one GPU (cuda:1, u1)")
    assert [r.getMessage() for r in caplog.records] == [report]
    caplog.clear()
    comm = _GatherComm(1, [("h", 1, "u1")])      # the same job seen from rank 1: no log line
    with caplog.at_level("WARNING", logger="mpiddp"):
        assert gpu.warn_about_shared_devices(comm, "h", cuda) == report
    assert not caplog.records


def test_shared_gpu_check_without_a_gpu_or_a_uuid(clean_gpu_state):
    comm = _GatherComm(0, [None])
    assert gpu.warn_about_shared_devices(comm, "h", FakeCuda(0)) is None
    assert comm.sent == [None]                  # still a collective: every rank takes part
    cuda = _PropertiesCuda(1, [RuntimeError("no uuid on this driver")])
    gpu.select_device(0, cuda)
    assert gpu.device_identity(cuda) is None
    comm = _GatherComm(0, [None])
    assert gpu.warn_about_shared_devices(comm, "h", cuda) is None and comm.sent == [None]


# ---- mixed CPU and GPU tensors ------------------------------------------------------------
def test_cpu_gpu_mismatch_of_one_name_is_reported():
    requests = {0: Request("w", ALLREDUCE, "float32", (4,), device="cpu"),
                1: Request("w", ALLREDUCE, "float32", (4,), device="cuda"),
                2: Request("w", ALLREDUCE, "float32", (4,), device="cuda")}
    response = agree(requests, 3)
    assert response.error == ("Mismatched allreduce devices for 'w': rank 0 sent cpu, "
                              "ranks 1, 2 sent cuda")
    table = RequestTable(2)
    table.add(0, Request("g", ALLREDUCE, "float16", (2,), device="cuda"))
    table.add(1, Request("g", ALLREDUCE, "float16", (2,), device="cuda"))
    assert table.take_complete(())[0].error is None   # the same device type on every rank


def test_fusion_keeps_cpu_and_gpu_tensors_apart():
    responses = [Response(Request(f"t{i}", ALLREDUCE, "float32", (10,),
                                  device="cuda" if i % 2 else "cpu")) for i in range(6)]
    batches = plan_batches(responses, 1 << 20)
    assert [[r.name for r in batch] for batch in batches] == [["t0", "t2", "t4"],
                                                              ["t1", "t3", "t5"]]


# ---- on a GPU -----------------------------------------------------------------------------
@needs_gpu
def test_device_backend_kernels_and_staging_on_one_gpu():
    result = run_mpi("gpu_worker.py", 1, "unit", timeout=300)
    assert_ok(result)
    assert "DONE" in result.output


@needs_gpu
@pytest.mark.parametrize("nprocs", [1, 2, 4])
@pytest.mark.parametrize("cuda_aware_setting", ["0", "auto"])
def test_every_collective_on_cuda_matches_reference(nprocs, cuda_aware_setting):
    env = {"MPIDDP_CUDA_AWARE": cuda_aware_setting, "MPIDDP_FUSION_THRESHOLD": "262144"}
    result = run_mpi("gpu_worker.py", nprocs, "collectives", timeout=420, env=env)
    assert_ok(result)
    assert "DONE" in result.output
    # init() names ranks that share a GPU (by the device's UUID), once, on rank 0
    shared = result.output.count("several ranks share a GPU: ranks 0")
    assert shared == (1 if nprocs > torch.cuda.device_count() else 0), result.output


@needs_gpu
@pytest.mark.parametrize("algorithm", ["ring", "native"])
def test_busy_producer_stream_is_waited_for(algorithm):
    env = {"MPIDDP_ALLREDUCE_ALGORITHM": algorithm, "MPIDDP_CUDA_AWARE": "0"}
    result = run_mpi("gpu_worker.py", 2, "stress", timeout=300, env=env)
    assert_ok(result)
    assert "DONE" in result.output


@needs_gpu
def test_mixed_cpu_and_gpu_tensors_in_one_job():
    result = run_mpi("gpu_worker.py", 2, "mixed", timeout=300)
    assert_ok(result)
    assert "DONE" in result.output


@needs_gpu
def test_distributed_optimizer_on_cuda_matches_single_process():
    import mpiddp

    if not hasattr(mpiddp, "DistributedOptimizer"):
        pytest.skip("mpiddp.DistributedOptimizer is not available")
    result = run_mpi("gpu_worker.py", 2, "optimizer", timeout=300)
    assert_ok(result)
    assert "DONE" in result.output


@needs_gpu
def test_forward_overlap_on_cuda_equals_the_standard_path():
    result = run_mpi("gpu_worker.py", 2, "overlap", timeout=300)
    assert_ok(result)
    assert "DONE" in result.output
