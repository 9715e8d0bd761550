"""The device check prepared on a CPU (docs/dev/gpu.md, "The device plan"): the CUDA workers
of the sharded optimizer and Adasum, run here on host tensors and, where the fake CUDA layer
(tests/workers/fake_cuda.py) can carry them, on fake device buffers; scripts/gpu/gpu_check.sh's
syntax, part selection and summary; scripts/horovod/horovod_suite.py's NumPy 2 aliases.

What the fake layer cannot carry (docs/dev/gpu.md says why) runs only in scripts/gpu/gpu_check.sh
on a GPU; the tests below that need one run the workers where a GPU is present.
"""
from __future__ import annotations

import os
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from mpi_launch import ROOT, WORKERS, assert_ok, reported, run_mpi
from test_gpu import HAVE_GPU

sys.path.insert(0, str(WORKERS))
import fake_cuda  # noqa: E402
from fake_cuda import FakeGPU, OrderingError  # noqa: E402

SCRIPT = ROOT / "scripts" / "gpu" / "gpu_check.sh"


needs_gpu = pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU with torch.cuda and CuPy "
                               "(scripts/gpu/gpu_check.sh runs it on one)")


# ---- the sharded optimizer --------------------------------------------------------------------
ZERO_ENV = {"MPIDDP_ALLREDUCE_ALGORITHM": "ring"}


def _check_zero(result, device):
    assert_ok(result, expect_lines=2)
    exact = reported(result, "bitwise equal to zero_stage=0", f"on {device}")
    assert exact and exact[0]["configurations"] == 8, result.output
    memory = reported(result, "zero memory on", device)
    assert memory, result.output
    for stage in (0, 1, 2):
        assert abs(memory[0][f"stage{stage}_ratio"] - 1.0) <= 0.05, memory[0]
    return memory[0]


def test_zero_cuda_worker_on_host_tensors():
    """The CUDA worker's checks, on the host: stages 1 and 2 (overlap_forward off and on)
    bitwise equal to stage 0, SGD and Adam; memory against the ZeRO formula (tensor bytes)."""
    result = run_mpi("zero_cuda_worker.py", 2, "cpu", timeout=300, env=ZERO_ENV)
    numbers = _check_zero(result, "cpu")
    assert numbers["stage0_model_state_MiB"] > numbers["stage1_model_state_MiB"] > \
        numbers["stage2_model_state_MiB"], numbers


@needs_gpu
def test_zero_cuda_worker_on_a_gpu():
    result = run_mpi("zero_cuda_worker.py", 2, "cuda", timeout=300, env=ZERO_ENV)
    _check_zero(result, "cuda")


# ---- Adasum ----------------------------------------------------------------------------------
def test_adasum_cuda_worker_on_host_tensors():
    """The collective against the float64 reference (every float dtype, alone and fused,
    orthogonal and parallel vectors) and the delta optimizer with GradScaler, on the host."""
    result = run_mpi("adasum_cuda_worker.py", 2, "cpu", timeout=300)
    assert_ok(result, expect_lines=2)
    assert reported(result, "adasum collective on cpu"), result.output
    optimizer = reported(result, "adasum optimizer on cpu with GradScaler")
    assert optimizer and optimizer[0]["max_abs_error"] <= 2e-6, result.output


@pytest.mark.parametrize("ranks", [2, 3])
def test_adasum_on_fake_device_buffers(ranks):
    """Adasum through the engine on fake CUDA buffers (local rank k on cuda:k), staged: the
    result against the float64 reference, and Adasum's torch kernels on views of device memory
    queued on the engine stream after what wrote the buffers (the fake fails otherwise:
    test_fake_torch_view_is_work_of_the_current_stream). 3 ranks: a pair folded first."""
    result = run_mpi("adasum_cuda_worker.py", ranks, "fake", timeout=240,
                     env={"MPIDDP_CUDA_AWARE": "0"})
    assert_ok(result, expect_lines=1)
    values = reported(result, "adasum collective on fake device buffers")
    assert values and values[0]["views"] > 0, result.output


@needs_gpu
def test_adasum_cuda_worker_on_a_gpu():
    result = run_mpi("adasum_cuda_worker.py", 2, "cuda", timeout=300)
    assert_ok(result, expect_lines=2)


def test_fake_torch_view_is_work_of_the_current_stream(monkeypatch):
    """The fake's ``torch.as_tensor`` of device memory (Adasum's kernels): a view made while
    torch's current stream has not waited for the buffer's writer fails; made on the writer's
    stream it passes, and another stream must then wait for it before reading."""
    import mpiddp.buffers as buffers

    gpu = FakeGPU(1, allowed=0)
    fake_cuda.install(gpu, monkeypatch)
    monkeypatch.setattr(buffers, "_backends", {"cpu": buffers._backends["cpu"]})
    cupy = gpu.cupy
    engine = cupy.cuda.Stream(non_blocking=True)
    array = cupy.empty(4, np.float32, name="fusion buffer")
    with engine:
        array[...] = np.arange(4, dtype=np.float32)           # packed on the engine stream
    with pytest.raises(OrderingError, match="torch kernels on a view of device memory"):
        torch.as_tensor(array, device="cuda:0")                # torch's default stream
    gpu.violations.clear()
    with torch.cuda.stream(torch.cuda.ExternalStream(engine.ptr)):
        view = torch.as_tensor(array, device="cuda:0")
        view.mul_(2)
    other = cupy.cuda.Stream(non_blocking=True)
    with other, pytest.raises(OrderingError, match="before waiting for torch kernels"):
        cupy.empty(4, np.float32)[...] = array
    gpu.violations.clear()
    event = cupy.cuda.Event()
    event.record(engine)
    other.wait_event(event)
    with other:
        cupy.empty(4, np.float32)[...] = array
    assert torch.as_tensor([1.0, 2.0]).tolist() == [1.0, 2.0]     # anything else: torch's own
    with pytest.raises(fake_cuda.DeviceError):
        torch.as_tensor(array, device="cuda:1")
    done = cupy.cuda.Event(block=True)
    done.record(engine)
    done.synchronize()
    assert gpu.host_read(array).tolist() == [0, 2, 4, 6]


# ---- Horovod's CUDA Adasum tests: NumPy 2's removed aliases -----------------------------------
def test_horovod_suite_gives_ranks_numpy_2s_removed_aliases():
    sys.path.insert(0, str(ROOT / "scripts" / "horovod"))
    import horovod_suite

    shim = horovod_suite.RANK_RUNNER.split("rank =")[0]
    numpy = types.ModuleType("numpy")
    numpy.all, numpy.any, numpy.prod, numpy.cumprod = all, any, "prod", "cumprod"
    sys_modules = dict(sys.modules, numpy=numpy)
    code = compile(shim.replace("import os, sys, pytest\n", ""), "run_rank.py", "exec")
    namespace = {"__builtins__": __builtins__}
    saved = sys.modules.get("numpy")
    try:
        sys.modules["numpy"] = numpy
        exec(code, namespace)
    finally:
        sys.modules["numpy"] = saved
    assert numpy.alltrue is all and numpy.sometrue is any and numpy.product == "prod"
    assert sys_modules["numpy"] is numpy


# ---- scripts/gpu/gpu_check.sh: syntax, parts, summary (nothing heavy runs) --------------------
def _script(env, *args, timeout=60):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=str(ROOT), env={**os.environ, **env})


def test_gpu_check_script_syntax_parts_and_summary(tmp_path):
    for script in ("gpu_check.sh", "gpu_check_prepare.sh"):
        check = subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu" / script)],
                               capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    base = {"WHEELS": str(empty)}
    result = _script({**base, "PARTS": "none"}, str(tmp_path / "none"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[gpu_check] summary" in result.stdout and "0 part(s) failed" in result.stdout
    assert (tmp_path / "none" / "summary.txt").exists()
    result = _script({**base, "PARTS": "machine bogus"}, str(tmp_path / "bad"))
    assert result.returncode == 2 and "no part 'bogus'" in result.stdout, result.stdout
    # Parts whose inputs are missing say so and count as not run; the rest is left alone.
    result = _script({**base, "PARTS": "horovod intelmpi", "HOROVOD": str(tmp_path / "none")},
                     str(tmp_path / "missing"))
    assert result.returncode == 0, result.stdout + result.stderr
    summary = (tmp_path / "missing" / "summary.txt").read_text()
    assert "horovod   not run" in summary and "intelmpi  not run" in summary, summary
    assert "gpu_check_prepare.sh" in summary and "part zero" not in result.stdout, summary
    # The whole run's budget: a part whose expected time is not left is not started.
    result = _script({**base, "PARTS": "zero tests", "TOTAL_LIMIT_S": "5"},
                     str(tmp_path / "budget"))
    assert result.returncode == 0 and "part zero" not in result.stdout, result.stdout
    assert result.stdout.count("of TOTAL_LIMIT_S=5 left") == 2, result.stdout


def test_gpu_check_reports_a_failed_part(tmp_path):
    """Without a GPU the 'zero' part (the CUDA worker) fails: the summary says so, with the
    exit status, and the script exits non-zero."""
    if HAVE_GPU:
        pytest.skip("a GPU is present: the part would pass")
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    result = _script({"WHEELS": str(empty), "PARTS": "zero", "TOTAL_LIMIT_S": "100"},
                     str(tmp_path / "out"), timeout=150)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert result.returncode == 1, result.stdout + result.stderr
    assert "zero      failed" in summary and "1 part(s) failed" in summary, summary
    assert "            | " in summary, summary          # the last lines of its output


def test_horovod_suite_shares_gpus_by_changing_only_the_device_index(tmp_path):
    """--share-gpus (two ranks on a one-GPU machine): Horovod's cuda:{local_rank} becomes
    cuda:{local_rank % visible GPUs}, nothing else in the copy changes."""
    sys.path.insert(0, str(ROOT / "scripts" / "horovod"))
    import horovod_suite

    original = ("import torch\nimport horovod.torch as hvd\n"
                "device = torch.device('cuda:{}'.format(hvd.local_rank()))\n"
                "other = torch.device('cuda:{}'.format(hvd.local_rank())) if x else cpu\n")
    test_file = tmp_path / "test_x.py"
    test_file.write_text(original)
    (tmp_path / "copy").mkdir()
    copy = horovod_suite.share_gpus(test_file, tmp_path / "copy")
    assert copy.read_text() == original.replace(
        "hvd.local_rank()", "hvd.local_rank() % max(1, torch.cuda.device_count())")
    test_file.write_text("nothing to share\n")
    with pytest.raises(SystemExit, match="has no"):
        horovod_suite.share_gpus(test_file, tmp_path / "copy")

