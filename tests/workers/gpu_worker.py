"""CUDA checks (run by tests/test_gpu.py only where a GPU, torch.cuda and CuPy exist).

    mpiexec -n K python -m mpi4py tests/workers/gpu_worker.py MODE

MODE is one of:
  unit         (1 rank) DeviceBackend kernels for every dtype and op against the NumPy
               emulation / NumPy, scaling, copies, wait_ready on a busy stream, and the staged
               communicator with real pinned memory and streams (to itself on COMM_SELF)
  collectives  every collective x dtype x op on CUDA tensors against a float64 reference,
               each all-reduce algorithm, fusion; the ranks may share one GPU
  stress       the producing stream is still busy (torch.cuda._sleep, matmuls, a side
               stream) when the tensor is submitted: the engine must wait for its event
  mixed        CPU and CUDA tensors in one job (fused apart), a CPU/GPU mismatch of one name,
               a tensor on a device other than the rank's
  optimizer    DistributedOptimizer on CUDA equals full-batch training in one process
  overlap      forward overlap on CUDA: a model big enough for its kernels to take time,
               trained with overlap_forward=True and with the standard path: the same losses
               and parameters after every run (a missed wait on the reduced gradients or on
               the update would leave a layer one step behind)

Prints 'OK <check>' lines on rank 0 and 'DONE' at the end; any failure aborts the job.
"""
import sys

import numpy as np
import torch

import mpiddp
from reference_data import as64, data

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
          torch.int32, torch.int64, torch.bool]
TOLERANCE = {torch.float16: 2e-2, torch.bfloat16: 8e-2, torch.float32: 1e-5,
             torch.float64: 1e-12}
SIZES = [0, 1, 7, 97, 4099, 70_000]       # 70k float32 > the 64 KiB ring threshold


def say(rank, text):
    if rank == 0:
        print(f"OK {text}", flush=True)


def ops_for(dtype):
    if dtype == torch.bool:
        return [mpiddp.Min, mpiddp.Max]
    ops = [mpiddp.Sum, mpiddp.Min, mpiddp.Max, mpiddp.Product]
    return ops + [mpiddp.Average] if dtype.is_floating_point else ops


def unit_ops(dtype):
    """The ops mode_unit reduces a buffer dtype with: those the backends reduce, from the table
    the device code dispatches on (``reduce_ops.reducible_ops``; never Adasum)."""
    from mpiddp.reduce_ops import reducible_ops

    return reducible_ops(dtype.kind)


def reference(op, inputs):
    stack = np.stack([as64(t) for t in inputs])
    if stack.dtype == bool:
        return stack.all(0) if op == mpiddp.Min else stack.any(0)
    return {mpiddp.Sum: stack.sum(0), mpiddp.Average: stack.mean(0), mpiddp.Min: stack.min(0),
            mpiddp.Max: stack.max(0), mpiddp.Product: stack.prod(0)}[op]


def assert_close(got, want, dtype, what):
    got64 = as64(got)
    if dtype in TOLERANCE:
        scale = max(1.0, float(np.abs(want).max())) if want.size else 1.0
        np.testing.assert_allclose(got64, want, rtol=TOLERANCE[dtype],
                                   atol=TOLERANCE[dtype] * scale, err_msg=what)
    else:
        np.testing.assert_array_equal(got64, want, err_msg=what)


# ---- unit: the backend on one GPU ---------------------------------------------------------
def mode_unit():
    import cupy

    from mpi4py import MPI

    from mpiddp.buffers import device_kernels as dk
    from mpiddp.buffers.device import CupyCopier, DeviceBackend
    from mpiddp.buffers.dtypes import DTYPES as BUFFER_DTYPES
    from mpiddp.transport.staging import StagedComm
    from mpiddp.engine.handle import Handle
    from mpiddp.engine.request import ALLREDUCE, Entry, Request
    from mpiddp.reduce_ops import ReduceOp

    mpiddp.init()
    backend = DeviceBackend()
    rng = np.random.default_rng(0)

    def inputs_ready():
        # inputs made here on this thread's stream; the engine stream is non-blocking
        cupy.cuda.runtime.deviceSynchronize()
    n = 100_003
    for name, dtype in BUFFER_DTYPES.items():
        for op in unit_ops(dtype):
            if name in ("float16", "bfloat16"):
                a = rng.integers(0, 1 << 16, n, dtype=np.uint64).astype(np.uint16)
                b = rng.integers(0, 1 << 16, n, dtype=np.uint64).astype(np.uint16)
                want = dk.emulate_reduce(name, a, b, int(op))
                da, db = cupy.asarray(a.view(dtype.storage)), cupy.asarray(b.view(dtype.storage))
                inputs_ready()
                backend.reduce_into(da, db, op, dtype)
                backend.after_unpack("cuda")
                got = cupy.asnumpy(da).view(np.uint16)
                widen = dk.bf16_bits_to_f32 if name == "bfloat16" else dk.f16_bits_to_f32
                nan = np.isnan(widen(want))
                np.testing.assert_array_equal(got[~nan], want[~nan], err_msg=f"{name} {op}")
                assert np.isnan(widen(got[nan])).all()
                continue
            if dtype.kind == "bool":
                a, b = rng.integers(0, 2, n).astype(bool), rng.integers(0, 2, n).astype(bool)
                want = (np.logical_and if op == ReduceOp.MIN else np.logical_or)(a, b)
            else:
                if dtype.kind == "float":
                    a, b = (rng.uniform(-3, 3, n).astype(dtype.storage) for _ in range(2))
                elif dtype.kind == "complex":     # summed part by part, as float pairs
                    a, b = ((rng.uniform(-3, 3, n) + 1j * rng.uniform(-3, 3, n))
                            .astype(dtype.storage) for _ in range(2))
                else:
                    info = np.iinfo(dtype.storage)
                    a, b = (rng.integers(info.min, info.max, n, endpoint=True)
                            .astype(dtype.storage) for _ in range(2))
                with np.errstate(over="ignore"):
                    want = {ReduceOp.SUM: np.add, ReduceOp.AVERAGE: np.add,
                            ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
                            ReduceOp.PRODUCT: np.multiply}[op](a, b)
            da, db = cupy.asarray(a), cupy.asarray(b)
            inputs_ready()
            backend.reduce_into(da, db, op, dtype)
            backend.after_unpack("cuda")
            np.testing.assert_array_equal(cupy.asnumpy(da), want, err_msg=f"{name} {op}")
    print("OK reduce kernels, every dtype and op", flush=True)

    for name in ("float16", "bfloat16", "float32", "float64"):
        dtype = BUFFER_DTYPES[name]
        for factor in (0.25, 1 / 3, 1 / 7, 1024.0):
            if name in ("float16", "bfloat16"):
                bits = rng.integers(0, 1 << 16, n, dtype=np.uint64).astype(np.uint16)
                want = dk.emulate_scale(name, bits, factor)
                arr = cupy.asarray(bits.view(dtype.storage))
                inputs_ready()
                backend.scale_(arr, factor, dtype)
                backend.after_unpack("cuda")
                got = cupy.asnumpy(arr).view(np.uint16)
                widen = dk.bf16_bits_to_f32 if name == "bfloat16" else dk.f16_bits_to_f32
                nan = np.isnan(widen(want))
                np.testing.assert_array_equal(got[~nan], want[~nan])
            else:
                values = rng.uniform(-5, 5, n).astype(dtype.storage)
                arr = cupy.asarray(values)
                inputs_ready()
                backend.scale_(arr, factor, dtype)
                backend.after_unpack("cuda")
                want = values * dtype.storage.type(factor)
                np.testing.assert_array_equal(cupy.asnumpy(arr), want)
    print("OK scaling on the device", flush=True)

    f32 = BUFFER_DTYPES["float32"]
    buf = backend.empty(1000, f32)
    backend.after_unpack("cuda")
    assert buf.device.id == torch.cuda.current_device() and float(buf.sum()) == 0
    src = cupy.arange(1000, dtype=cupy.float32)
    inputs_ready()
    backend.copy(buf[10:20], src[:10])
    backend.fill(buf[:5], 0)
    backend.after_unpack("cuda")
    assert cupy.asnumpy(buf[10:20]).tolist() == list(range(10))
    print("OK empty, copy, fill", flush=True)

    # wait_ready: the tensor's value is written by the producing stream after a long sleep
    for _ in range(3):
        x = torch.zeros(1 << 20, device="cuda")
        torch.cuda._sleep(200_000_000)
        x.fill_(3.0)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        with cupy.cuda.Stream.null:
            # consumer stream = torch's default stream: DLPack itself adds no wait, so only
            # wait_ready orders the engine after the producer
            view = cupy.from_dlpack(x)
        entry = Entry(Request("x", ALLREDUCE, "float32", tuple(x.shape), "cuda"),
                      view, None, Handle("x"), ready_event=event)
        out = backend.empty(x.numel(), f32)
        backend.wait_ready(entry)
        backend.copy(out, entry.input)
        backend.after_unpack("cuda")
        assert bool((out == 3.0).all()), "the engine read the tensor before it was produced"
    never = torch.cuda.Event()
    backend.wait_ready(Entry(Request("y", ALLREDUCE, "float32", (1,), "cuda"),
                             cupy.zeros(1, cupy.float32), None, Handle("y"), ready_event=never))
    print("OK wait_ready waits for the producing stream", flush=True)

    # staged communicator with real pinned memory and streams, to itself
    state = backend.state(backend.device_id())
    staged = StagedComm(MPI.COMM_SELF, CupyCopier(state), segment_bytes=4096)
    for count in (0, 1, 1000, 100_001):
        send = cupy.arange(count, dtype=cupy.float32)
        recv = cupy.zeros(count, dtype=cupy.float32)
        inputs_ready()
        staged.Sendrecv([send, MPI.BYTE], 0, 3, [recv, MPI.BYTE], 0, 3)
        backend.after_unpack("cuda")
        assert bool((recv == send).all())
        gathered = cupy.zeros(count, dtype=cupy.float32)
        staged.Allgatherv([send, MPI.BYTE], [gathered, [count * 4], [0], MPI.BYTE])
        backend.after_unpack("cuda")
        assert bool((gathered == send).all())
        reduced = cupy.zeros(count, dtype=cupy.float32)
        staged.Allreduce([send, MPI.FLOAT], [reduced, MPI.FLOAT], MPI.SUM)
        backend.after_unpack("cuda")
        assert bool((reduced == send).all())
    print("OK staged communicator with pinned memory and streams", flush=True)
    mpiddp.shutdown()


# ---- collectives on CUDA tensors ----------------------------------------------------------
def mode_collectives():
    mpiddp.init()
    rank, size = mpiddp.rank(), mpiddp.size()
    device = torch.device("cuda", torch.cuda.current_device())
    algorithms = ["ring", "native"] if hasattr(mpiddp, "set_allreduce_algorithm") else [None]
    for algorithm in algorithms:
        if algorithm:
            mpiddp.set_allreduce_algorithm(algorithm)
        for dtype in DTYPES:
            for op in ops_for(dtype):
                for count in SIZES:
                    name = f"ar.{algorithm}.{dtype}.{op.name}.{count}"
                    inputs = [data(r, name, (count,), dtype, op) for r in range(size)]
                    out = mpiddp.allreduce(inputs[rank].to(device), name=name, op=op)
                    assert out.device == device and out.dtype == dtype
                    assert_close(out, reference(op, inputs), dtype, name)
        say(rank, f"allreduce every dtype and op ({algorithm or 'default'})")
    if algorithms[0]:
        mpiddp.set_allreduce_algorithm("auto")

    # fusion: many tensors of mixed dtypes at once, in place and not
    tensors = [data(rank, f"g{i}", (i * 37 + 1,), DTYPES[i % 4]).to(device) for i in range(40)]
    wants = [reference(mpiddp.Average, [data(r, f"g{i}", (i * 37 + 1,), DTYPES[i % 4])
                                        for r in range(size)]) for i in range(40)]
    outs = mpiddp.grouped_allreduce(tensors, name="grouped")
    for i, (out, want) in enumerate(zip(outs, wants)):
        assert_close(out, want, DTYPES[i % 4], f"grouped {i}")
    handles = [mpiddp.allreduce_async_(t, name=f"inplace{i}") for i, t in enumerate(tensors)]
    for i, handle in enumerate(handles):
        assert mpiddp.synchronize(handle) is tensors[i]
    for i, (t, want) in enumerate(zip(tensors, wants)):
        assert_close(t, want, DTYPES[i % 4], f"in place {i}")
    say(rank, "fused and in-place allreduce")

    for dtype in DTYPES:
        for root in range(size):
            name = f"bc.{dtype}.{root}"
            t = data(rank, name, (3, 5), dtype).to(device)
            out = mpiddp.broadcast(t, root, name=name)
            assert_close(out, as64(data(root, name, (3, 5), dtype)), dtype, name)
            mpiddp.broadcast_(t, root, name=name + ".inplace")
            assert_close(t, as64(data(root, name, (3, 5), dtype)), dtype, name)
        rows = [(r * 3 + 1) % 5 for r in range(size)]
        name = f"ag.{dtype}"
        out = mpiddp.allgather(data(rank, name, (rows[rank], 4), dtype).to(device), name=name)
        want = np.concatenate([as64(data(r, name, (rows[r], 4), dtype)) for r in range(size)])
        assert_close(out, want, dtype, name)
    say(rank, "broadcast and allgather")

    splits = [(rank + d) % 3 for d in range(size)]
    t = torch.cat([torch.full((n, 2), float(rank * 10 + d)) for d, n in enumerate(splits)])
    out, received = mpiddp.alltoall(t.to(device), splits=torch.tensor(splits), name="a2a")
    want = np.concatenate([np.full(((s + rank) % 3, 2), float(s * 10 + rank))
                           for s in range(size)]) if size else None
    np.testing.assert_array_equal(as64(out), want.reshape(-1, 2))
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int32):
        for op in (mpiddp.Sum, mpiddp.Average) if dtype.is_floating_point else (mpiddp.Sum,):
            name = f"rs.{dtype}.{op.name}"
            inputs = [data(r, name, (size * 3 + 1, 4), dtype) for r in range(size)]
            out = mpiddp.reducescatter(inputs[rank].to(device), name=name, op=op)
            full = reference(op, inputs)
            per = [(size * 3 + 1) // size + (1 if r < (size * 3 + 1) % size else 0)
                   for r in range(size)]
            start = sum(per[:rank])
            assert_close(out, full[start:start + per[rank]], dtype, name)
    say(rank, "alltoall and reducescatter")
    stats = mpiddp.engine_stats()
    if rank == 0:
        print(f"engine stats: {stats}; CUDA-aware: {mpiddp.mpi_cuda_aware()}", flush=True)
    mpiddp.shutdown()


# ---- a busy producer ----------------------------------------------------------------------
def mode_stress():
    mpiddp.init()
    rank, size = mpiddp.rank(), mpiddp.size()
    device = torch.device("cuda", torch.cuda.current_device())
    total = size * (size + 1) / 2
    for i in range(4):
        x = torch.zeros(1 << 18, device=device)
        torch.cuda._sleep(300_000_000)             # the producing stream stays busy...
        x.add_(rank + 1)                           # ...and only then writes the value
        out = mpiddp.allreduce(x, name=f"sleep{i}", op=mpiddp.Sum)
        assert bool((out == total).all()), f"stale data read (round {i})"
    a = torch.randn(4096, 4096, device=device) / 64
    for i in range(3):
        g = torch.full((1 << 20,), float(rank + 1), device=device)
        c = a
        for _ in range(4):
            c = c @ a                              # seconds of queued work on the stream
        g.add_(c.sum() * 0)                        # g is final only after the matmuls
        handle = mpiddp.allreduce_async_(g, name=f"matmul{i}", op=mpiddp.Sum)
        mpiddp.synchronize(handle)
        assert bool((g == total).all()), f"stale data read behind matmuls (round {i})"
    side = torch.cuda.Stream(device)
    for i in range(3):
        with torch.cuda.stream(side):
            y = torch.zeros(1 << 16, device=device)
            torch.cuda._sleep(200_000_000)
            y.fill_(float(rank + 1))
            handle = mpiddp.allreduce_async(y, name=f"side{i}", op=mpiddp.Sum)
        out = mpiddp.synchronize(handle)
        assert bool((out == total).all()), f"stale data read from a side stream (round {i})"
    # many in flight at once behind one sleep, fused
    xs = [torch.zeros(1000 + i, device=device) for i in range(32)]
    torch.cuda._sleep(300_000_000)
    for x in xs:
        x.add_(rank + 1)
    handles = [mpiddp.allreduce_async_(x, name=f"many{i}", op=mpiddp.Sum)
               for i, x in enumerate(xs)]
    for handle, x in zip(handles, xs):
        mpiddp.synchronize(handle)
        assert bool((x == total).all())
    say(rank, "the engine waits for busy producer streams")
    mpiddp.shutdown()


# ---- mixed devices ------------------------------------------------------------------------
def mode_mixed():
    mpiddp.init()
    rank, size = mpiddp.rank(), mpiddp.size()
    device = torch.device("cuda", torch.cuda.current_device())
    tensors = [torch.full((100,), float(rank + 1)), torch.full((100,), float(rank + 1),
                                                               device=device),
               torch.full((7,), rank + 1, dtype=torch.float16),
               torch.full((7,), rank + 1, dtype=torch.bfloat16, device=device)]
    mpiddp.reset_engine_stats()
    outs = mpiddp.grouped_allreduce(tensors, name="mixed", op=mpiddp.Sum)
    for t, out in zip(tensors, outs):
        assert out.device == t.device and out.dtype == t.dtype
        assert bool((out.float() == size * (size + 1) / 2).all())
    say(rank, "CPU and GPU tensors in one group, each reduced on its own device")

    t = torch.ones(4, device=device) if rank == 0 else torch.ones(4)
    try:
        mpiddp.allreduce(t, name="layer.weight")
    except mpiddp.TensorMismatchError as exc:
        assert "Mismatched allreduce devices for 'layer.weight'" in str(exc), str(exc)
        assert "rank 0 sent cuda" in str(exc) or size == 1, str(exc)
    else:
        assert size == 1, "a CPU/GPU mismatch was not reported"
    out = mpiddp.allreduce(torch.ones(3, device=device), name="after", op=mpiddp.Sum)
    assert bool((out == size).all())
    say(rank, "a CPU/GPU mismatch of one name is an error on every rank")

    if torch.cuda.device_count() > 1:
        other = (torch.cuda.current_device() + 1) % torch.cuda.device_count()
        try:
            mpiddp.allreduce(torch.ones(2, device=f"cuda:{other}"), name="elsewhere")
        except ValueError as exc:
            assert "this rank uses" in str(exc), str(exc)
        else:
            raise AssertionError("a tensor on another GPU was accepted")
    say(rank, "a tensor on another GPU than the rank's is refused at submission")
    mpiddp.shutdown()


# ---- DistributedOptimizer -----------------------------------------------------------------
def mode_optimizer():
    mpiddp.init()
    rank, size = mpiddp.rank(), mpiddp.size()
    device = torch.device("cuda", torch.cuda.current_device())

    def model():
        torch.manual_seed(1)
        return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(),
                                   torch.nn.Linear(32, 3)).to(device)

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64 * size, 10, generator=gen).to(device)
    y = torch.randn(64 * size, 3, generator=gen).to(device)

    reference = model()
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    distributed_model = model()
    mpiddp.broadcast_parameters(distributed_model.state_dict(), root_rank=0)
    distributed = mpiddp.DistributedOptimizer(
        torch.optim.SGD(distributed_model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=distributed_model.named_parameters())
    for step in range(5):
        plain.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        plain.step()
        distributed.zero_grad()
        shard = slice(rank * 64, (rank + 1) * 64)
        torch.nn.functional.mse_loss(distributed_model(x[shard]), y[shard]).backward()
        distributed.step()
    for (name, p), q in zip(distributed_model.named_parameters(), reference.parameters()):
        assert p.device == device
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)
    say(rank, "DistributedOptimizer on CUDA matches full-batch training")
    mpiddp.shutdown()


def mode_overlap():
    mpiddp.init()
    rank = mpiddp.rank()
    device = torch.device("cuda", torch.cuda.current_device())

    def model():
        torch.manual_seed(3)
        layers = []
        for _ in range(4):
            layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers, torch.nn.Linear(1024, 10)).to(device)

    gen = torch.Generator().manual_seed(4 + rank)
    batches = [(torch.randn(512, 1024, generator=gen).to(device),
                torch.randint(0, 10, (512,), generator=gen).to(device)) for _ in range(6)]
    cases = {"sgd-momentum": (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                              mpiddp.Compression.none),
             "adam+fp16": (lambda p: torch.optim.Adam(p, lr=1e-3), mpiddp.Compression.fp16)}
    for label, (make_optimizer, compression) in cases.items():
        runs = []
        for overlap in (False, True):
            net = model()
            opt = mpiddp.DistributedOptimizer(make_optimizer(net.parameters()),
                                              named_parameters=net.named_parameters(),
                                              compression=compression, bucket_cap_mb=1,
                                              overlap_forward=overlap)
            losses = []
            for x, y in batches:
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(net(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.detach())
            if overlap:
                opt.synchronize()          # the last step's deferred update
                pieces = opt._mpiddp.piece_bytes   # sized from a measured device all-reduce
            runs.append((net, torch.stack(losses)))
        (standard, standard_losses), (overlapped, overlapped_losses) = runs
        # A stale layer is off by a whole update (~lr x gradient); the tolerance only
        # allows for a matrix product that rounds differently between two identical calls.
        torch.testing.assert_close(overlapped_losses, standard_losses, rtol=1e-6, atol=0,
                                   msg=f"{label}: losses")
        bitwise = torch.equal(overlapped_losses, standard_losses)
        for (name, p), q in zip(overlapped.named_parameters(), standard.parameters()):
            assert p.device == device
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=f"{label}: {name}")
            bitwise = bitwise and torch.equal(p, q)
        say(rank, f"forward overlap on CUDA equals the standard path ({label}, "
                  f"{'bitwise' if bitwise else 'within rounding'}; pieces of "
                  f"{pieces >> 20} MiB)")
    mpiddp.shutdown()


if __name__ == "__main__":
    mode = sys.argv[1]
    {"unit": mode_unit, "collectives": mode_collectives, "stress": mode_stress,
     "mixed": mode_mixed, "optimizer": mode_optimizer, "overlap": mode_overlap}[mode]()
    print("DONE", flush=True)
