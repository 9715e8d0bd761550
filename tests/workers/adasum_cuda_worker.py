"""op=Adasum on CUDA tensors: the collective against the float64 reference
(``adasum_reference.py``) and ``DistributedOptimizer(op=Adasum)`` with a GradScaler.

    mpiexec -n 2 python tests/workers/adasum_cuda_worker.py cuda|cpu|fake

* ``cuda`` (a GPU, torch.cuda and CuPy; scripts/gpu/gpu_check.sh): every floating dtype, alone
  and fused, orthogonal vectors add and parallel ones average, the same bits on every rank;
  then the delta optimizer (SGD with momentum) trained with ``GradScaler("cuda")`` against the
  one-process simulation of every rank on the same device, an inf on one rank skipping the step
  everywhere. Rank 0 prints 'OK <check> | {numbers}'.
* ``cpu``: the same worker on host tensors (CI: the checks themselves run).
* ``fake``: the collective through the real engine on the fake CUDA layer
  (tests/workers/fake_cuda.py; local rank k on fake cuda:k): the device buffers are staged,
  and Adasum's dot products and combinations run as torch kernels on views of the device
  memory, which the fake counts as work of torch's current stream (it must be the engine
  stream, ordered after the packing and the staged copies back; else OrderingError). The
  optimizer part does not run there: it trains a model, and torch's kernels on CUDA tensors
  (forward, backward, the optimizer's step) exist only on a real device.
"""
import os
import sys
import zlib

import numpy as np

MODE = sys.argv[1] if len(sys.argv) > 1 else "cuda"
assert MODE in ("cuda", "cpu", "fake"), MODE
if MODE == "fake":
    import fake_cuda

    LOCAL = int(os.environ.get("MPI_LOCALRANKID", os.environ.get(
        "OMPI_COMM_WORLD_LOCAL_RANK", os.environ.get("PMI_RANK", "0"))))
    SIZE_ENV = int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
    # Not strict: the staged Sendrecv's copy back into a buffer its copy to the host read
    # is ordered by the host's (blocking) wait for that copy, which strict mode ignores.
    GPU = fake_cuda.FakeGPU(SIZE_ENV, allowed=LOCAL % SIZE_ENV)
    cupy = fake_cuda.install(GPU)          # before mpiddp: it picks the device at import

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import checks  # noqa: E402
import mpiddp  # noqa: E402
from adasum_reference import adasum  # noqa: E402

torch.set_num_threads(1)
if MODE == "fake":
    from mpiddp import transport  # noqa: E402
    from mpiddp.transport import staging  # noqa: E402

    transport.device_comm = lambda comm, aware, copier, *a: staging.device_comm(
        fake_cuda.CheckingComm(comm, GPU), aware, copier, *a)
mpiddp.init()
RANK, SIZE = mpiddp.rank(), mpiddp.size()
DEVICE = torch.device("cuda", torch.cuda.current_device()) if MODE == "cuda" else \
    torch.device("cpu")
SIZES = [1, 7, 97, 4099, 40_000]
TOLERANCE = {"float16": 5e-3, "bfloat16": 4e-2, "float32": 1e-5, "float64": 1e-12}


def ok(check, **values):
    checks.ok(f"[{MODE}] {check}", RANK, barrier=mpiddp.barrier, **values)


def values(rank, name, n):
    """float64 values in [-1, 1), per (rank, name)."""
    return np.random.default_rng(zlib.crc32(f"{rank}/{name}".encode())).uniform(-1, 1, n)


def as_dtype(x64, dtype_name):
    """``x64`` rounded to ``dtype_name`` (as torch rounds), back in float64."""
    return torch.from_numpy(x64).to(getattr(torch, dtype_name)).double().numpy()


def relative_error(got64, want64):
    scale = max(1.0, float(np.max(np.abs(want64))) if want64.size else 1.0)
    return float(np.max(np.abs(got64 - want64))) / scale if want64.size else 0.0


def expected(name, n, dtype_name):
    return adasum([as_dtype(values(r, name, n), dtype_name) for r in range(SIZE)])


# ---- the collective --------------------------------------------------------------------------
def collective_torch():
    worst = {}
    for dtype_name in TOLERANCE:
        dtype = getattr(torch, dtype_name)
        names = [f"{dtype_name}.{n}" for n in SIZES]
        tensors = [torch.from_numpy(values(RANK, nm, n)).to(dtype).to(DEVICE)
                   for nm, n in zip(names, SIZES)]
        alone = mpiddp.allreduce(tensors[-1], op=mpiddp.Adasum, name=f"alone.{dtype_name}")
        handles = [mpiddp.allreduce_async(t, op=mpiddp.Adasum, name=nm)   # fused
                   for t, nm in zip(tensors, names)]
        outs = [mpiddp.synchronize(h) for h in handles] + [alone]
        errors = []
        for out, nm, n in zip(outs, names + [names[-1]], SIZES + [SIZES[-1]]):
            assert out.device == DEVICE, (out.device, DEVICE)
            errors.append(relative_error(out.double().cpu().numpy(),
                                         expected(nm, n, dtype_name)))
            bits = out.reshape(1, -1).view({2: torch.int16, 4: torch.int32,
                                            8: torch.int64}[out.element_size()])
            every = mpiddp.allgather(bits, name=f"bits.{nm}.{len(errors)}")
            assert all(torch.equal(every[r], every[0]) for r in range(SIZE)), nm
        worst[dtype_name] = max(errors)
        assert worst[dtype_name] <= TOLERANCE[dtype_name], (dtype_name, worst[dtype_name])
    # Adasum's defining properties: orthogonal vectors add, equal ones stay.
    basis = torch.zeros(SIZE, 4 * SIZE, dtype=torch.float64)
    for r in range(SIZE):
        basis[r, 4 * r:4 * r + 4] = float(r + 1)
    out = mpiddp.allreduce(basis[RANK].clone().to(DEVICE), op=mpiddp.Adasum, name="orthogonal")
    assert torch.allclose(out.cpu(), basis.sum(0), rtol=1e-12), "orthogonal vectors must add"
    direction = torch.arange(1.0, 11.0, dtype=torch.float64)
    out = mpiddp.allreduce(direction.clone().to(DEVICE), op=mpiddp.Adasum, name="parallel")
    assert torch.allclose(out.cpu(), direction, rtol=1e-12), "equal vectors must stay"
    ok("adasum collective on %s tensors against the float64 reference, alone and fused, "
       "every float dtype; orthogonal add, parallel stay; same bits on every rank"
       % DEVICE.type, **{f"max_rel_error_{k}": v for k, v in worst.items()})


def collective_fake():
    """The engine's Adasum on fake device buffers (see the module docstring)."""
    from mpiddp import runtime
    from mpiddp.engine.handle import Handle
    from mpiddp.engine.request import ALLREDUCE, Entry, Request

    engine = runtime.require_engine("test")
    user = cupy.cuda.Stream(non_blocking=True)
    worst = {}
    for dtype_name in ("float32", "float64", "float16", "bfloat16"):
        entries, want = [], {}
        for n in SIZES:
            name = f"{dtype_name}.{n}"
            x = torch.from_numpy(values(RANK, name, n)).to(getattr(torch, dtype_name))
            host = x.view(torch.int16).numpy().view(np.uint16) if dtype_name == "bfloat16" \
                else x.numpy()
            array = cupy.empty(host.shape, host.dtype, name=name)
            with user:                                    # produced on the user's stream
                array[...] = host
            event = cupy.cuda.Event()
            event.record(user)
            request = Request(name, ALLREDUCE, dtype_name, (n,), "cuda",
                              op=int(mpiddp.Adasum))
            entries.append(Entry(request, array, array, Handle(name), ready_event=event))
            want[name] = (array, expected(name, n, dtype_name))
        for handle in engine.submit_many(entries):
            try:
                handle.wait(timeout=60)
            except BaseException as exc:
                raise AssertionError(f"{exc!r}; the fake saw: {GPU.violations}") from exc
        errors = []
        for name, (array, expect) in want.items():
            raw = GPU.host_read(array, f"the test reading {name}")
            got = torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16).double().numpy() \
                if dtype_name == "bfloat16" else raw.astype(np.float64)
            errors.append(relative_error(got, expect))
        worst[dtype_name] = max(errors)
        assert worst[dtype_name] <= TOLERANCE[dtype_name], (dtype_name, worst[dtype_name])
    from mpi4py import MPI

    views = MPI.COMM_WORLD.allreduce(
        sum(1 for entry in GPU.log if entry[1].startswith("torch kernels on a view")))
    assert views > 0, "Adasum's device kernels never ran (on any rank)"
    ok("adasum collective on fake device buffers against the float64 reference, every float "
       "dtype, fused; torch's kernels on the engine stream", views=views,
       **{f"max_rel_error_{k}": v for k, v in worst.items()})


# ---- the delta optimizer with a GradScaler ---------------------------------------------------
B, IN, OUT = 8, 12, 5


def model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(IN, 16), nn.Tanh(), nn.Linear(16, OUT)).to(DEVICE)


def loss_of(net, step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(B, IN, generator=g), torch.randint(0, OUT, (B,), generator=g)
    return F.cross_entropy(net(x.to(DEVICE)), y.to(DEVICE))


def reference_step(models, optimizers, step):
    """Every rank's local step from the same start, then the start plus the Adasum of the
    deltas, per tensor, in float64 (on the host)."""
    start = [p.detach().clone() for p in models[0].parameters()]
    deltas = []
    for rank, (net, opt) in enumerate(zip(models, optimizers)):
        opt.zero_grad()
        loss_of(net, step, rank).backward()
        opt.step()
        deltas.append([(p.detach() - s).double().cpu().numpy() for p, s in
                       zip(net.parameters(), start)])
    for net in models:
        with torch.no_grad():
            for i, (p, s) in enumerate(zip(net.parameters(), start)):
                combined = torch.from_numpy(adasum([d[i] for d in deltas])).reshape(s.shape)
                p.copy_((s.double() + combined.to(DEVICE)).to(p.dtype))


def optimizer_with_grad_scaler():
    net = model()
    make = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
    opt = mpiddp.DistributedOptimizer(make(net.parameters()),
                                      named_parameters=net.named_parameters(), op=mpiddp.Adasum)
    models = [model() for _ in range(SIZE)]
    optimizers = [make(m.parameters()) for m in models]
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=2.0 ** 10)
    skipped_at, worst = 2, 0.0
    for step in range(5):
        opt.zero_grad()
        loss = loss_of(net, step, RANK)
        if step == skipped_at and RANK == SIZE - 1:
            loss = loss * float("inf")                 # an overflow on one rank only
        before = [p.detach().clone() for p in net.parameters()]
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        unchanged = all(torch.equal(p, b) for p, b in zip(net.parameters(), before))
        assert unchanged == (step == skipped_at), (step, unchanged)
        if step != skipped_at:
            reference_step(models, optimizers, step)
        worst = max(worst, max(float((p - q).detach().abs().max()) for p, q in
                               zip(net.parameters(), models[0].parameters())))
        assert worst <= 2e-6, f"step {step}: {worst} from the reference"
        flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).view(torch.int32)
        every = mpiddp.allgather(flat.reshape(1, -1), name=f"same.{step}")
        assert all(torch.equal(every[r], every[0]) for r in range(SIZE)), f"step {step}"
        scales = mpiddp.allgather_object(float(scaler.get_scale()), name=f"scale.{step}")
        assert len(set(scales)) == 1, scales
    assert all(p.device == DEVICE for p in net.parameters())
    ok("adasum optimizer on %s with GradScaler: the reference's parameters, the same bits on "
       "every rank, an inf on one rank skips the step everywhere" % DEVICE.type,
       max_abs_error=worst, scale=float(scaler.get_scale()))


if MODE == "fake":
    collective_fake()
    mpiddp.shutdown()
    GPU.check_clean()
    assert GPU.spin_waits == 0, f"{GPU.spin_waits} host waits spun a core"
else:
    collective_torch()
    optimizer_with_grad_scaler()
    mpiddp.shutdown()
