"""The device code's streams, events and devices, checked on a CPU with a fake CUDA layer
(tests/workers/fake_cuda.py): a fake cupy and torch.cuda whose devices are per host thread and
whose streams keep the order of their work, failing when a buffer is read before the event
that guards it was waited for, when a thread touches a device other than its rank's own, or
(counted) when a host wait spins a core.

* Each rank's threads touch only its own device: the real engine (coordinator thread,
  executor, DeviceBackend, staging) on one rank in this process, and on three ranks under
  mpiexec, local rank k on cuda:k (tests/workers/gpu_fake_device_worker.py).
* The staging and fusion code orders its copies by events on the right streams, also when
  only device-side waits count (``strict``), and never spins waiting.
* Outputs the engine allocates belong to the engine stream and are recorded for the
  caller's stream; the caller's stream waits for the engine's done event.
* The device is chosen from the launcher's local rank before MPI_Init.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading
import types

import numpy as np
import pytest
import torch
from mpi4py import MPI

from mpi_launch import ROOT, WORKERS, assert_ok, run_mpi

sys.path.insert(0, str(WORKERS))
import fake_cuda  # noqa: E402
from fake_cuda import DeviceError, FakeGPU, OrderingError  # noqa: E402

from mpiddp import buffers  # noqa: E402
from mpiddp.buffers.dtypes import dtype_named  # noqa: E402
from mpiddp.config import read_settings  # noqa: E402
from mpiddp.engine.handle import Handle  # noqa: E402
from mpiddp.engine.request import ALLGATHER, ALLREDUCE, BROADCAST, Entry, Request  # noqa: E402
from mpiddp.reduce_ops import ReduceOp  # noqa: E402
from mpiddp.transport import cuda_aware  # noqa: E402

F32 = dtype_named("float32")


def make_fake(monkeypatch, count=2, allowed=1, strict=False) -> FakeGPU:
    """Install a fake machine of ``count`` devices on which this process may use only
    ``allowed``; the main thread has chosen it (as ``gpu.setup`` does at ``init()``)."""
    gpu = FakeGPU(count, allowed, strict=strict)
    fake_cuda.install(gpu, monkeypatch)
    monkeypatch.setattr(buffers, "_backends", {"cpu": buffers._backends["cpu"]})
    monkeypatch.setattr(cuda_aware, "_decision",
                        cuda_aware.Decision(False, "0", None))    # staged through the host
    buffers.set_default_device(allowed)
    gpu.set_device(allowed, "gpu.setup on the main thread")
    return gpu


@pytest.fixture
def restore_default_device():
    yield
    buffers.set_default_device(None)


def producer_array(gpu, values, stream):
    """A device array written by a kernel on ``stream`` (the user's producing stream), and
    the event recorded after it."""
    array = gpu.cupy.empty(len(values), np.asarray(values).dtype, name="user tensor")
    with stream:
        array[...] = np.asarray(values)
    event = fake_cuda.FakeEvent(gpu)
    event.record(stream)
    return array, event


def in_thread(fn):
    """Run ``fn`` on a fresh host thread (device 0 current, as CUDA starts every thread);
    re-raise what it raised."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:   # noqa: BLE001 - handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=run, name="test-thread")
    thread.start()
    thread.join(60)
    if "error" in box:
        raise box["error"]
    return box.get("value")


# ---- the fake itself fails where it should --------------------------------------------------
def test_fake_fails_on_a_read_before_the_guarding_event(monkeypatch, restore_default_device):
    gpu = make_fake(monkeypatch)
    cupy = gpu.cupy
    producer, consumer = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    a, event = producer_array(gpu, np.arange(4, dtype=np.float32), producer)
    b = cupy.empty(4, np.float32)
    with consumer, pytest.raises(OrderingError, match=r"reads user tensor \[0:16\] before waiting"):
        b[...] = a
    consumer.wait_event(event)
    with consumer:
        b[...] = a                                  # ordered now
    with pytest.raises(OrderingError):
        gpu.host_read(b)                            # the host has not waited for consumer
    event2 = cupy.cuda.Event(block=True)
    event2.record(consumer)
    event2.synchronize()
    assert gpu.host_read(b).tolist() == [0, 1, 2, 3]


def test_fake_fails_on_another_device_and_on_restoring_device_0(monkeypatch,
                                                                 restore_default_device):
    gpu = make_fake(monkeypatch)
    with pytest.raises(DeviceError, match="cuda:0"):
        gpu.cupy.cuda.runtime.setDevice(0)

    def guard_on_a_fresh_thread():
        with gpu.cupy.cuda.Device(1):           # CuPy restores device 0 when leaving
            pass

    with pytest.raises(DeviceError, match="restoring cuda:0"):
        in_thread(guard_on_a_fresh_thread)
    gpu.violations.clear()


# ---- defect 3: every thread of a rank uses only the rank's device -----------------------------
def _run_engine_on_one_rank(gpu, settings_env=None):
    """The production engine (coordinator thread, executor, DeviceBackend, staging) on
    COMM_SELF, with fake device arrays: allreduce (fused and alone), broadcast, allgather."""
    from mpiddp.engine.coordinator import start_engine

    settings = read_settings(dict(settings_env or {}))
    engine = start_engine(MPI.COMM_SELF, settings)
    engine.channel.abort = lambda: None      # a failure fails the handles, not pytest
    cupy = gpu.cupy
    user = cupy.cuda.Stream(non_blocking=True)
    try:
        entries, outputs = [], {}
        for i, n in enumerate((5, 7, 1000)):
            values = np.arange(n, dtype=np.float32) + i
            array, event = producer_array(gpu, values, user)
            request = Request(f"ar{i}", ALLREDUCE, "float32", (n,), "cuda",
                              op=int(ReduceOp.SUM), postscale=2.0)
            entries.append(Entry(request, array, array, Handle(request.name),
                                 ready_event=event))
            outputs[request.name] = (array, values * 2)
        b, event = producer_array(gpu, np.full(3, 7, np.int32), user)
        entries.append(Entry(Request("bc", BROADCAST, "int32", (3,), "cuda", root=0), b, b,
                             Handle("bc"), ready_event=event))
        outputs["bc"] = (b, np.full(3, 7))
        g, event = producer_array(gpu, np.arange(6, dtype=np.float32), user)
        holder = {}

        def allocate(shape):          # the engine thread allocates the gathered output
            holder["out"] = cupy.empty(shape, np.float32, name="gathered output")
            return holder["out"]

        entries.append(Entry(Request("ag", ALLGATHER, "float32", (6,), "cuda"), g, None,
                             Handle("ag"), allocate=allocate, ready_event=event))
        handles = engine.submit_many(entries)
        for handle in handles:
            try:
                handle.wait(timeout=30)
            except BaseException as exc:
                raise AssertionError(f"{exc!r}; the fake saw: {gpu.violations}") from exc
        for name, (array, want) in outputs.items():
            np.testing.assert_array_equal(gpu.host_read(array, f"the test reading {name}"),
                                          want, err_msg=name)
        np.testing.assert_array_equal(gpu.host_read(holder["out"]), np.arange(6))
    finally:
        engine.shutdown("test over")


def test_engine_threads_touch_only_the_rank_device(monkeypatch, restore_default_device):
    """Rank on cuda:1 of 2: before the fix the coordinator thread (device 0 until set)
    created a context on cuda:0 when a device guard restored 'its' device."""
    gpu = make_fake(monkeypatch, count=2, allowed=1)
    _run_engine_on_one_rank(gpu)
    gpu.check_clean()
    assert set(gpu.touched) == {1}, gpu.touched
    assert any("coordinator" in name for name in gpu.touched[1]), gpu.touched


def test_three_ranks_on_fake_gpus_touch_only_their_own():
    """Local rank k on cuda:k of 3: init, the engine's threads, staging, join. (The
    launcher's local rank: hydra's follow the ranks, Open MPI's need not; the worker checks
    its own against it.)"""
    result = run_mpi("gpu_fake_device_worker.py", 3, timeout=240,
                     env={"MPIDDP_CUDA_AWARE": "0"})
    assert_ok(result, expect_lines=3)
    devices = re.findall(r"OK rank \d on cuda:(\d)", result.output)
    assert sorted(devices) == ["0", "1", "2"], result.output
    assert "share a GPU" not in result.output, result.output


def test_ranks_sharing_a_gpu_are_named_once():
    """Two ranks on the one fake GPU: the engine works as it does with a GPU each, and
    init() warns once (rank 0) naming both ranks and the device's UUID."""
    result = run_mpi("gpu_fake_device_worker.py", 2, timeout=240,
                     env={"MPIDDP_CUDA_AWARE": "0", "FAKE_GPU_COUNT": "1"})
    assert_ok(result, expect_lines=2)
    assert sorted(re.findall(r"OK rank \d on cuda:(\d)", result.output)) == ["0", "0"]
    warnings = re.findall(r"\[mpiddp WARNING\] several ranks share a GPU: (.*)", result.output)
    assert len(warnings) == 1, result.output
    assert warnings[0].startswith("ranks 0-1 on ") and \
        "(cuda:0, 00000000-0000-0000-0000-000000000000)" in warnings[0], warnings[0]
    assert "CUDA MPS" in warnings[0] and "CUDA_VISIBLE_DEVICES" in warnings[0], warnings[0]


# ---- defect 6: events on the right streams, waits that block ----------------------------------
def _staging_round(gpu, segment=1024):
    """Pack on the engine stream, a staged ring step and a broadcast to itself (COMM_SELF),
    a kernel on what arrived, results read by the host after the engine's done event."""
    from mpiddp.transport.staging import StagedComm

    backend = buffers.backend_for("cuda")
    user = gpu.cupy.cuda.Stream(non_blocking=True)
    values = np.arange(3000, dtype=np.float32)
    src, event = producer_array(gpu, values, user)
    entry = Entry(Request("x", ALLREDUCE, "float32", (3000,), "cuda"), src, src, Handle("x"),
                  ready_event=event)
    backend.wait_ready(entry)
    send = backend.empty(3000, F32)          # the fusion buffer
    recv = backend.empty(3000, F32)
    backend.copy(send, src)                  # packed on the engine stream
    comm = StagedComm(fake_cuda.CheckingComm(MPI.COMM_SELF, gpu), backend.copier(), segment)
    comm.Sendrecv([send, MPI.FLOAT], 0, recvbuf=[recv, MPI.FLOAT], source=0)
    backend.scale_(recv, 2.0, F32)           # a kernel on what arrived
    comm.Bcast([recv, MPI.FLOAT], root=0)
    gathered = backend.empty(3000, F32)
    comm.Allgatherv([recv, MPI.FLOAT], [gathered, [3000], [0], MPI.FLOAT])
    backend.scale_(gathered, 0.5, F32)
    done = backend.after_unpack("cuda")
    comm.finish()
    return backend, done, gathered, values


def test_staging_orders_copies_by_events_on_the_right_streams(monkeypatch,
                                                               restore_default_device):
    """strict: a stream knows of another stream's work only through an event it waited for.
    The staging copy stream reads the fusion buffer the engine stream wrote: it must wait
    for the flush event recorded on the engine stream, not rely on the host's wait."""
    gpu = make_fake(monkeypatch, strict=True)
    _, _, gathered, values = _staging_round(gpu)
    np.testing.assert_array_equal(gpu.host_read(gathered), values)
    gpu.check_clean()


def test_event_waits_block_instead_of_spinning(monkeypatch, restore_default_device):
    gpu = make_fake(monkeypatch)
    backend, done, gathered, values = _staging_round(gpu, segment=512)
    np.testing.assert_array_equal(gpu.host_read(gathered), values)
    backend.after_unpack("cuda")
    assert gpu.spin_waits == 0, f"{gpu.spin_waits} host waits spun a core"
    assert done is not None and done.block      # cudaEventBlockingSync
    gpu.check_clean()


# ---- defect 6: the device is chosen before MPI_Init ---------------------------------------------
def _stand_in(gpu):
    return types.SimpleNamespace(**fake_cuda.torch_cuda_functions(gpu))


@pytest.fixture
def clean_local_device():
    from mpiddp import gpu as gpu_setup

    gpu_setup.reset()
    yield
    gpu_setup.reset()


@pytest.mark.parametrize("variable", ["OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                                      "MV2_COMM_WORLD_LOCAL_RANK", "PMI_LOCAL_RANK",
                                      "SLURM_LOCALID"])
def test_device_chosen_from_the_launchers_local_rank(variable, clean_local_device):
    from mpiddp import local_device

    gpu = FakeGPU(4, allowed=1)
    assert local_device.select_before_mpi({variable: "5"}, _stand_in(gpu), {}) == 1
    assert gpu.current() == 1 and set(gpu.touched) == {1}
    assert local_device.chosen_before_mpi() == (1, variable)


def test_device_choice_before_mpi_innermost_launcher_and_when_not(clean_local_device):
    from mpiddp import local_device

    gpu = FakeGPU(4)
    both = {"SLURM_LOCALID": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "3"}   # mpirun inside srun
    assert local_device.select_before_mpi(both, _stand_in(gpu), {}) == 3
    for environ, modules, fake in (({}, {}, FakeGPU(4)),                    # no launcher
                                   ({"MPI_LOCALRANKID": "1"}, {"mpi4py.MPI": 1}, FakeGPU(4)),
                                   ({"MPI_LOCALRANKID": "1"}, {}, FakeGPU(0))):  # no GPU
        local_device.reset()
        assert local_device.select_before_mpi(environ, _stand_in(fake), modules) is None
        assert not fake.touched and local_device.chosen_before_mpi() is None
    chosen_by_program = FakeGPU(4)
    chosen_by_program.set_device(2)
    assert local_device.select_before_mpi({"MPI_LOCALRANKID": "1"},
                                          _stand_in(chosen_by_program), {}) is None
    assert chosen_by_program.current() == 2


def test_init_confirms_the_choice_made_before_mpi(clean_local_device):
    from mpiddp import gpu as gpu_setup, local_device

    gpu = FakeGPU(4)
    local_device.select_before_mpi({"MPI_LOCALRANKID": "1"}, _stand_in(gpu), {})
    assert gpu_setup.select_device(1, _stand_in(gpu)) == 1
    assert "chosen before MPI_Init from MPI_LOCALRANKID" in gpu_setup._how
    local_device.reset()
    gpu = FakeGPU(4)
    local_device.select_before_mpi({"MPI_LOCALRANKID": "1"}, _stand_in(gpu), {})
    assert gpu_setup.select_device(3, _stand_in(gpu)) == 3      # MPI's layout has the last word
    assert gpu.current() == 3 and "MPI's node layout differs" in gpu_setup._how


def test_import_mpiddp_chooses_the_device_before_mpi_init():
    code = textwrap.dedent("""
        import sys
        sys.path.insert(0, %r)
        import torch, fake_cuda
        gpu = fake_cuda.FakeGPU(4, allowed=2)
        fake_cuda.install(gpu)
        set_device = torch.cuda.set_device
        seen = []
        def recording(device):
            seen.append("mpi4py.MPI" in sys.modules)
            set_device(device)
        torch.cuda.set_device = recording
        import mpiddp
        assert "mpi4py.MPI" in sys.modules
        assert gpu.current() == 2 and seen == [False], (gpu.current(), seen)
        print("OK")
        """ % str(WORKERS))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPI_LOCALRANKID": "6"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, cwd=str(ROOT), env=env)
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr


# ---- defects 5 and 6: torch tensors, the caller's streams --------------------------------------
def test_flat_array_is_a_view_by_pointer_without_dlpack_waits(monkeypatch,
                                                              restore_default_device):
    from mpiddp.torch.core.views import flat_array

    gpu = make_fake(monkeypatch)
    t = fake_cuda.FakeCudaTensor(gpu, (4, 3))
    waits = sum(1 for entry in gpu.log if entry[1] == "wait_event")
    array = flat_array(t)
    assert array.data.ptr == t.data_ptr() and array.size == 12 and array.dtype == np.float32
    assert array.memory is t.array.memory
    assert gpu.dlpack_syncs == 0, "DLPack made a stream wait that no one needs"
    assert sum(1 for entry in gpu.log if entry[1] == "wait_event") == waits
    assert flat_array(fake_cuda.FakeCudaTensor(gpu, (5,), torch.bfloat16)).dtype == np.uint16


def test_engine_allocated_output_is_safe_on_the_callers_side_stream(monkeypatch,
                                                                     restore_default_device):
    """An allgather submitted from a side stream: the output the engine thread allocates
    belongs to the engine stream and is recorded for the caller's stream (the caching
    allocator must not hand it out while the caller still uses it), and the caller's stream
    waits for the engine's done event before reading it (strict: the host's wait does not
    count for a stream)."""
    from mpiddp.engine.coordinator import start_engine
    from mpiddp.torch.ops import requests
    from mpiddp.torch.ops.handles import TensorHandle

    gpu = make_fake(monkeypatch, strict=True)
    monkeypatch.setattr(torch, "empty", fake_cuda.fake_empty(gpu, torch.empty))
    engine = start_engine(MPI.COMM_SELF, read_settings({}))
    engine.channel.abort = lambda: None
    try:
        side = torch.cuda.Stream()
        x = fake_cuda.FakeCudaTensor(gpu, (6,), name="input")
        with side:
            x.array[...] = np.arange(6, dtype=np.float32)         # produced on the side stream
        with torch.cuda.stream(side):
            holder = {}
            entry = requests._entry(Request("g", ALLGATHER, "float32", (6,), "cuda"), x,
                                    allocate=requests._output_allocator(x, holder))
            handle = TensorHandle(engine.submit_many([entry]), lambda: holder["output"])
            try:
                out = handle.wait()
            except BaseException as exc:
                raise AssertionError(f"{exc!r}; the fake saw: {gpu.violations}") from exc
            with side:
                result = gpu.cupy.empty(6, np.float32, name="caller's copy")
                result[...] = out.array                          # the caller reads it
        engine_stream = buffers.backend_for("cuda").state(1).stream
        assert out.allocated_on == engine_stream, out.allocated_on
        assert side in out.recorded, out.recorded
        done = gpu.cupy.cuda.Event(block=True)
        done.record(side)
        done.synchronize()
        np.testing.assert_array_equal(gpu.host_read(result), np.arange(6))
        gpu.check_clean()
    finally:
        engine.shutdown("test over")


def test_gradient_ready_event_is_recorded_on_the_producing_stream(monkeypatch,
                                                                  restore_default_device):
    """A bucket is flushed in the hook of its last gradient, possibly on another stream than
    the one that produced the earlier gradients: each gradient's event is recorded in its
    own hook, on its producing stream."""
    from mpiddp.torch.gradients import sync as gradient_sync
    from mpiddp.torch.compression import Compression

    gpu = make_fake(monkeypatch)
    captured = []
    monkeypatch.setattr(gradient_sync, "allreduce_request_",
                        lambda tensor, name, *a, **kw: captured.append((name, kw)) or name)
    monkeypatch.setattr(gradient_sync, "submit_together", lambda entries, ps: [
        TensorStub() for _ in entries])
    sync = gradient_sync.GradientSync(0, Compression.none, 1, ReduceOp.AVERAGE, 1.0, False,
                                      25, None)

    class Param:
        def __init__(self, name):
            self.grad = fake_cuda.FakeCudaTensor(gpu, (8,), name=name)

    first, second = Param("g1"), Param("g2")
    sync.names = {first: "g1", second: "g2"}
    producer, other = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(producer):
        sync._queue(first)
    with torch.cuda.stream(other):
        sync._queue(second)
        sync._flush()
    events = {name: kw.get("ready_event") for name, kw in captured}
    assert events["g1"] is not None and events["g1"].stream == producer, events
    assert events["g2"] is not None and events["g2"].stream == other, events


class TensorStub:
    _handles = ()


def test_backend_on_a_thread_that_never_chose_a_device(monkeypatch, restore_default_device):
    """The backend sets the rank's device on the calling thread before its CUDA calls, and
    leaves it: no guard 'restores' device 0 on a thread that never set one."""
    gpu = make_fake(monkeypatch, count=3, allowed=2)

    def work():
        backend = buffers.backend_for("cuda")
        a, b = backend.empty(100, F32), backend.empty(100, F32)
        backend.fill(a, 1.5)
        backend.copy(b, a)
        backend.reduce_into(a, b, ReduceOp.SUM, F32)
        backend.scale_(a, 0.5, F32)
        half = dtype_named("bfloat16")
        h = backend.empty(10, half)
        backend.reduce_into(h, h, ReduceOp.SUM, half)
        backend.after_unpack("cuda")
        return a

    a = in_thread(work)
    np.testing.assert_array_equal(gpu.host_read(a), np.full(100, 1.5))
    gpu.check_clean()
    assert set(gpu.touched) == {2}, gpu.touched


def test_ready_event_follows_the_contiguous_copy(monkeypatch, restore_default_device):
    """A non-contiguous input is reduced from a contiguous copy queued at the call: the
    engine's ready event must be recorded after that copy."""
    from mpiddp.torch.ops import requests

    gpu = make_fake(monkeypatch)
    monkeypatch.setattr(requests, "check_tensor", lambda tensor, name: "float32")
    side = torch.cuda.Stream()
    x = fake_cuda.FakeCudaTensor(gpu, (6,), name="strided input", contiguous=False)
    out = fake_cuda.FakeCudaTensor(gpu, (6,), name="output")
    with torch.cuda.stream(side):
        with side:
            x.array[...] = np.arange(6, dtype=np.float32)
        entry = requests.allreduce_entry(x, out, "x", ReduceOp.SUM, 1.0, 1.0)
    engine = gpu.cupy.cuda.Stream(non_blocking=True)
    engine.wait_event(entry.ready_event)
    with engine:
        gpu.cupy.empty(6, np.float32)[...] = entry.input      # the engine reads the copy
    gpu.check_clean()


def test_floating_reductions_and_scaling_run_our_non_flushing_kernels(monkeypatch,
                                                                     restore_default_device):
    """float16, bfloat16 and float32 reduce and scale with mpiddp's kernels (no CuPy
    elementwise kernel, which CuPy compiles with -ftz=true); float32's exact scaling (an
    Average's 1/size) takes the float64 kernel, so a subnormal result survives as on the host."""
    gpu = make_fake(monkeypatch, count=1, allowed=0)
    backend = buffers.backend_for("cuda")
    for name in ("float16", "bfloat16", "float32"):
        dtype = dtype_named(name)
        a, b = backend.empty(8, dtype), backend.empty(8, dtype)
        backend.fill(a, 1.0)
        backend.fill(b, 2.0)
        for op in (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT):
            backend.reduce_into(a, b, op, dtype)
        backend.scale_(a, 0.25, dtype)
    tiny = backend.empty(1, F32)
    backend.fill(tiny, 3e-38)                           # normal; a third of it is subnormal
    backend.scale_(tiny, 1 / 3, F32, exact=True)
    backend.after_unpack("cuda")
    assert gpu.kernel_calls.count("mpiddp_f32_reduce") == 4, gpu.kernel_calls
    assert {"mpiddp_f16_reduce", "mpiddp_bf16_reduce", "mpiddp_f16_scale_kernel",
            "mpiddp_bf16_scale_kernel", "mpiddp_f32_scale_kernel",
            "mpiddp_f32_scale_exact_kernel"} <= set(gpu.kernel_calls), gpu.kernel_calls
    assert gpu.host_read(tiny)[0] == np.float32(np.float64(np.float32(3e-38)) / 3)
    assert gpu.host_read(tiny)[0] != 0
