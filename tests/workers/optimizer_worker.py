"""DistributedOptimizer and the state-sync functions, checked on K ranks against one process.

Usage: optimizer_worker.py <group>[,<group>...]. Groups: equivalence, overlap, unused, clip,
compression, two_optimizers, mismatch, state, misuse, scheduler, closure, amp, join,
unfreeze.

Each passed check prints 'OK <check>' once (on rank 0) after every rank passed it; a failure
raises, which aborts the job (the worker runs under ``python -m mpi4py``). The reference runs
are plain torch in one process (inside rank 0), on the concatenation of every rank's batch.
"""
import functools
import math
import sys
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import checks
import mpiddp
from checks import expect

torch.set_num_threads(1)
mpiddp.init()
RANK, SIZE = mpiddp.rank(), mpiddp.size()
B = 8                 # samples per rank per backward pass
STEPS = 20
IN, OUT = 12, 4


# Every rank passed the check (a rank that failed has raised and aborted the job).
ok = functools.partial(checks.ok, rank=RANK, barrier=mpiddp.barrier)


def mlp(seed=1, dims=(IN, 32, 32, OUT)) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def batch(step: int, n: int, seed: int = 0):
    """The global batch of ``step`` (identical on every rank)."""
    g = torch.Generator().manual_seed(1000 * seed + step)
    return torch.randn(n, IN, generator=g), torch.randint(0, OUT, (n,), generator=g)


def my_slice(t: torch.Tensor, per_rank: int) -> torch.Tensor:
    return t[RANK * per_rank:(RANK + 1) * per_rank]


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def assert_identical_everywhere(model: nn.Module, what: str) -> None:
    """Parameters are bitwise identical on every rank."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = mpiddp.allgather(flat.reshape(1, -1), name=f"identical.{what}")
    for r in range(SIZE):
        assert torch.equal(gathered[r], gathered[0]), \
            f"{what}: parameters on rank {r} differ from rank 0's"


def assert_close_to_reference(model: nn.Module, reference, what: str, tol: float) -> float:
    """Rank 0 compares with the single-process ``reference`` model (None elsewhere)."""
    diff = 0.0
    if RANK == 0:
        diff = max_diff(model, reference)
        assert diff <= tol, f"{what}: max |distributed - single process| = {diff:.3g} > {tol}"
    return diff


# ---- equivalence with one process on the concatenated batch ----------------------------
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}


def train_distributed(make_opt, passes=1, steps=STEPS, seed=1, **kwargs):
    model = mlp(seed)
    opt = mpiddp.DistributedOptimizer(make_opt(model.parameters()),
                                      named_parameters=model.named_parameters(),
                                      backward_passes_per_step=passes, **kwargs)
    for step in range(steps):
        x, y = batch(step, SIZE * B * passes)
        x, y = my_slice(x, B * passes), my_slice(y, B * passes)
        opt.zero_grad()
        for m in range(passes):
            xm, ym = x[m * B:(m + 1) * B], y[m * B:(m + 1) * B]
            (F.cross_entropy(model(xm), ym) / passes).backward()
        opt.step()
    return model, opt


def train_reference(make_opt, passes=1, steps=STEPS, seed=1):
    if RANK != 0:
        return None
    model = mlp(seed)
    opt = make_opt(model.parameters())
    for step in range(steps):
        x, y = batch(step, SIZE * B * passes)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model


# float32 tolerances. Adam divides by sqrt(second moment): for elements whose gradient is
# close to zero it turns float32 rounding differences (a different summation order) into
# visible differences, so its float32 tolerance is wider. The float64 runs show that the
# distributed result and the single process agree to rounding (1e-12).
TOLERANCES = {(torch.float32, "sgd"): 2e-5, (torch.float32, "adam"): 1e-3,
              (torch.float64, "sgd"): 1e-12, (torch.float64, "adam"): 1e-12}


def equivalence():
    for dtype in (torch.float32, torch.float64):
        torch.set_default_dtype(dtype)
        for opt_name, make_opt in OPTIMIZERS.items():
            for passes in (1, 2):
                model, opt = train_distributed(make_opt, passes)
                assert isinstance(opt, type(make_opt([nn.Parameter(torch.ones(1))])))
                reference = train_reference(make_opt, passes)
                diff = assert_close_to_reference(
                    model, reference, f"{dtype} {opt_name} passes={passes}",
                    tol=TOLERANCES[dtype, opt_name])
                assert_identical_everywhere(model, f"{opt_name}.{passes}.{dtype}")
                ok(f"equivalence {str(dtype)[6:]} {opt_name} backward_passes_per_step={passes} "
                   f"ranks={SIZE} steps={STEPS} bitwise-identical-across-ranks",
                   dtype=str(dtype)[6:], optimizer=opt_name, passes=passes, max_diff=diff)
    torch.set_default_dtype(torch.float32)

    # Submission granularity: every gradient on its own (0), tiny buckets, and one bucket.
    reference = train_reference(OPTIMIZERS["sgd"])
    diffs = []
    for cap in (0, 0.001, 100):
        model, opt = train_distributed(OPTIMIZERS["sgd"], bucket_cap_mb=cap)
        diffs.append(assert_close_to_reference(model, reference, f"bucket_cap_mb={cap}",
                                               tol=2e-5))
        assert_identical_everywhere(model, f"cap{cap}")
    ok("bucket_cap_mb 0 / 0.001 / 100 give the same result", max_diffs=diffs)

    # op=Sum with lr/size, and Average with gradient_predivide_factor, give the same result.
    model, _ = train_distributed(lambda p: torch.optim.SGD(p, lr=0.05 / SIZE, momentum=0.9,
                                                           weight_decay=1e-4 * SIZE),
                                 op=mpiddp.Sum)
    diff = assert_close_to_reference(model, reference, "op=Sum", tol=2e-5)
    model, _ = train_distributed(OPTIMIZERS["sgd"], gradient_predivide_factor=float(SIZE))
    diff2 = assert_close_to_reference(model, reference, "gradient_predivide_factor", tol=2e-5)
    ok(f"op=Sum and gradient_predivide_factor={SIZE} match (max_diff {diff:.1e}, {diff2:.1e})")

    # Without named_parameters: generated names, same result.
    model = mlp()
    opt = mpiddp.DistributedOptimizer(OPTIMIZERS["sgd"](model.parameters()))
    for step in range(STEPS):
        x, y = batch(step, SIZE * B)
        opt.zero_grad()
        F.cross_entropy(model(my_slice(x, B)), my_slice(y, B)).backward()
        opt.step()
    diff = assert_close_to_reference(model, reference, "generated names", tol=2e-5)
    ok(f"no named_parameters (generated names) max_diff={diff:.1e}")


# ---- overlap: the last layer is reduced while backward computes the first ones -----------
def overlap():
    torch.manual_seed(0)
    width, depth = 1024, 8
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(width, 10))
    last = f"{len(model) - 1}.weight"
    opt = mpiddp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                      named_parameters=model.named_parameters())
    x = torch.randn(128, width)
    y = torch.randint(0, 10, (128,))
    steps, backward_end, backward_time = 6, [], []
    mpiddp.start_timeline()
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        t0 = time.perf_counter()
        loss.backward()
        backward_end.append(time.perf_counter())
        backward_time.append(backward_end[-1] - t0)
        opt.step()
    events = mpiddp.stop_timeline()
    name = f"{opt._mpiddp.prefix}.grad.{last}"
    starts = [t for n, phase, t in events if n == name and phase == "start"]
    first_layer_submits = [t for n, phase, t in events
                           if n == f"{opt._mpiddp.prefix}.grad.0.weight" and phase == "submit"]
    assert len(starts) == steps and len(first_layer_submits) == steps, (starts, events[:5])
    lead = [end - start for start, end in zip(starts, backward_end)]
    overlapped = sum(1 for v in lead if v > 0)
    # Every step but the first (new names negotiate through rank 0) should overlap; allow a
    # noisy machine one more miss.
    assert overlapped >= steps - 2, (
        f"rank {RANK}: the reduction of '{last}' started before backward returned in only "
        f"{overlapped}/{steps} steps; lead times (s) {lead}, backward times {backward_time}")
    # Its reduction starts before the first layer's gradient even exists.
    early = sum(1 for s, f in zip(starts, first_layer_submits) if s < f)
    leads = mpiddp.allgather_object((overlapped, early, sorted(lead)[len(lead) // 2],
                                     sorted(backward_time)[len(backward_time) // 2]))
    text = "; ".join(f"rank {r}: {o}/{steps} steps, before first-layer grad in {e}, median "
                     f"lead {ld * 1e3:.1f} ms of {bt * 1e3:.1f} ms backward"
                     for r, (o, e, ld, bt) in enumerate(leads))
    ok(f"overlap: reduction of '{last}' started before loss.backward() returned ({text})",
       steps=steps, overlapped=[o for o, _, _, _ in leads],
       before_first_layer_gradient=[e for _, e, _, _ in leads])


# ---- unused parameters ------------------------------------------------------------------
class Branchy(nn.Module):
    """``trunk`` always; ``only_rank0`` on rank 0's samples only; ``even_steps`` on every rank
    at even steps and on none at odd steps; ``never`` never; ``frozen`` has requires_grad off."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.trunk = nn.Linear(IN, OUT)
        self.only_rank0 = nn.Linear(IN, OUT)
        self.even_steps = nn.Linear(IN, OUT)
        self.never = nn.Linear(IN, OUT)
        self.frozen = nn.Linear(IN, OUT)
        self.frozen.requires_grad_(False)

    def forward(self, x, step, owner):
        out = self.trunk(x) + self.frozen(x)
        if owner == 0:
            out = out + self.only_rank0(x)
        if step % 2 == 0:
            out = out + self.even_steps(x)
        return out


def unused():
    unused_with(mpiddp.Compression.none, tol=2e-5)
    # fp16: unused parameters take the generic compress/decompress path, used ones the
    # reused cast buffers; both in the same synchronize.
    unused_with(mpiddp.Compression.fp16, tol=5e-3)


def unused_with(compression, tol: float):
    model = Branchy()
    opt = mpiddp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                      named_parameters=model.named_parameters(),
                                      compression=compression)
    reference = Branchy() if RANK == 0 else None
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01) if RANK == 0 else None
    for step in range(8):
        x, y = batch(step, SIZE * B)
        opt.zero_grad()
        F.cross_entropy(model(my_slice(x, B), step, RANK), my_slice(y, B)).backward()
        opt.step()
        if RANK == 0:
            ref_opt.zero_grad()
            # mean over all samples == mean over ranks of per-rank means (equal sizes)
            losses = [F.cross_entropy(reference(x[r * B:(r + 1) * B], step, r),
                                      y[r * B:(r + 1) * B]) for r in range(SIZE)]
            (sum(losses) / SIZE).backward()
            ref_opt.step()
        if step % 2 == 1:      # nobody used even_steps: its grad stays None, like one process
            assert model.even_steps.weight.grad is None, "globally unused grad is not None"
    assert model.never.weight.grad is None and model.never.weight not in opt.state
    assert model.frozen.weight.grad is None and model.frozen.weight not in opt.state
    assert model.only_rank0.weight.grad is not None     # rank 0 used it: averaged everywhere
    diff = assert_close_to_reference(model, reference, "unused parameters", tol=tol)
    assert_identical_everywhere(model, "unused")
    ok(f"unused parameters ({compression.__name__}): no deadlock, used-on-one-rank averaged, "
       "unused-everywhere keeps grad None (Adam skips it like one process), frozen excluded; "
       f"max_diff={diff:.1e}")


# ---- clipping through synchronize() + skip_synchronize() --------------------------------
def clip():
    max_norm = 0.05
    model = mlp()
    opt = mpiddp.DistributedOptimizer(OPTIMIZERS["sgd"](model.parameters()),
                                      named_parameters=model.named_parameters())
    reference = mlp() if RANK == 0 else None
    ref_opt = OPTIMIZERS["sgd"](reference.parameters()) if RANK == 0 else None
    norms = []
    for step in range(STEPS):
        x, y = batch(step, SIZE * B)
        opt.zero_grad()
        F.cross_entropy(model(my_slice(x, B)), my_slice(y, B)).backward()
        opt.synchronize()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        with opt.skip_synchronize():
            opt.step()
        if RANK == 0:
            ref_opt.zero_grad()
            F.cross_entropy(reference(x), y).backward()
            ref_norm = float(nn.utils.clip_grad_norm_(reference.parameters(), max_norm))
            assert math.isclose(ref_norm, norms[-1], rel_tol=1e-4), (ref_norm, norms[-1])
            ref_opt.step()
    assert max(norms) > max_norm, "the test should clip"
    diff = assert_close_to_reference(model, reference, "clipping", tol=2e-5)
    assert_identical_everywhere(model, "clip")

    # backward() returns with averaged gradients: step() inside skip_synchronize() without
    # synchronize() applies them too (identical on every rank before the step).
    opt.zero_grad()
    F.cross_entropy(model(my_slice(x, B)), my_slice(y, B)).backward()
    grads = mpiddp.allgather(flat(p.grad for p in model.parameters()).reshape(1, -1),
                             name="clip.after_backward")
    assert all(torch.equal(grads[r], grads[0]) for r in range(SIZE)), \
        "gradients differ across ranks when backward() returns"
    with opt.skip_synchronize():
        opt.step()
    assert_identical_everywhere(model, "clip.skip")

    # Gradients set by hand after a synchronize() (no step() between, zero_grad() only) are
    # new: the next synchronize() averages them instead of returning at once.
    opt.zero_grad()
    F.cross_entropy(model(my_slice(x, B)), my_slice(y, B)).backward()
    opt.synchronize()
    opt.zero_grad(set_to_none=False)
    for p in model.parameters():
        p.grad.fill_(float(RANK + 1))
    opt.synchronize()
    average = (SIZE + 1) / 2
    assert all(torch.all(p.grad == average) for p in model.parameters()), \
        "hand-set gradients after zero_grad() were not averaged by synchronize()"
    ok(f"clipping via synchronize()+skip_synchronize() matches one process (max_diff={diff:.1e})"
       "; backward() returns with gradients averaged on every rank")


# ---- compression ------------------------------------------------------------------------
def compression():
    fp32, _ = train_distributed(OPTIMIZERS["sgd"])
    for comp, tol in ((mpiddp.Compression.fp16, 5e-3), (mpiddp.Compression.bf16, 3e-2)):
        model, opt = train_distributed(OPTIMIZERS["sgd"], compression=comp)
        diff = max_diff(model, fp32)
        assert 0 < diff <= tol, f"{comp.__name__}: max diff to the fp32 run {diff}"
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        assert_identical_everywhere(model, comp.__name__)
        # The cast of each gradient goes into the same wire tensor every step (no per-step
        # allocation), and that tensor is what the engine reduced.
        wires = opt._mpiddp.wire_casts.buffers
        before = {name: wires[p].data_ptr() for name, p in model.named_parameters()}
        x, y = batch(STEPS, SIZE * B)
        opt.zero_grad()
        F.cross_entropy(model(my_slice(x, B)), my_slice(y, B)).backward()
        after = {name: wires[p].data_ptr() for name, p in model.named_parameters()}
        assert before == after, f"{comp.__name__}: wire tensors reallocated"
        for p in model.parameters():
            assert wires[p].dtype == comp.wire_dtype
            assert torch.equal(p.grad, wires[p].to(torch.float32)), "grad is not the reduced wire"
        ok(f"compression {comp.__name__}: close to the float32 run (max diff {diff:.1e}), "
           "gradients restored to float32, identical across ranks")
    model, _ = train_distributed(OPTIMIZERS["sgd"], compression=mpiddp.Compression.fp16,
                                 gradient_predivide_factor=float(SIZE))
    diff = max_diff(model, fp32)
    assert diff <= 5e-3, diff
    ok(f"compression fp16 with gradient_predivide_factor={SIZE} (max diff {diff:.1e})")


# ---- two optimizers (GAN-style), same parameter names ------------------------------------
def two_optimizers():
    def models():
        torch.manual_seed(5)
        return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, IN)), \
            nn.Sequential(nn.Linear(IN, 16), nn.Tanh(), nn.Linear(16, 1))

    def gan_step(gen, disc, g_opt, d_opt, real, noise):
        d_opt.zero_grad()
        fake = gen(noise)
        d_loss = F.softplus(-disc(real)).mean() + F.softplus(disc(fake.detach())).mean()
        d_loss.backward()
        d_opt.step()
        g_opt.zero_grad()
        g_loss = F.softplus(-disc(fake)).mean()
        g_loss.backward()          # also fills disc grads: discarded by d_opt.zero_grad()
        g_opt.step()

    gen, disc = models()
    assert [n for n, _ in gen.named_parameters()] == [n for n, _ in disc.named_parameters()]
    g_opt = mpiddp.DistributedOptimizer(torch.optim.Adam(gen.parameters(), lr=1e-3),
                                        named_parameters=gen.named_parameters())
    d_opt = mpiddp.DistributedOptimizer(torch.optim.Adam(disc.parameters(), lr=1e-3),
                                        named_parameters=disc.named_parameters())
    if RANK == 0:
        ref_gen, ref_disc = models()
        ref_g = torch.optim.Adam(ref_gen.parameters(), lr=1e-3)
        ref_d = torch.optim.Adam(ref_disc.parameters(), lr=1e-3)
    for step in range(10):
        g = torch.Generator().manual_seed(step)
        real, noise = torch.randn(SIZE * B, IN, generator=g), torch.randn(SIZE * B, 4,
                                                                          generator=g)
        gan_step(gen, disc, g_opt, d_opt, my_slice(real, B), my_slice(noise, B))
        if RANK == 0:
            gan_step(ref_gen, ref_disc, ref_g, ref_d, real, noise)
    diff = 0.0
    if RANK == 0:
        diff = max(max_diff(gen, ref_gen), max_diff(disc, ref_disc))
        assert diff < 2e-5, diff
    assert_identical_everywhere(gen, "gen")
    assert_identical_everywhere(disc, "disc")
    ok(f"two DistributedOptimizers (GAN-style, same parameter names) match one process "
       f"(max_diff={diff:.1e}); names {g_opt._mpiddp.prefix}.* and {d_opt._mpiddp.prefix}.*")


# ---- models that differ across ranks, and bad arguments ----------------------------------
def mismatch():
    hidden = 32 if RANK == 0 else 33
    model = mlp(dims=(IN, hidden, OUT))
    text = expect(mpiddp.TensorMismatchError,
                  lambda: mpiddp.DistributedOptimizer(
                      torch.optim.SGD(model.parameters(), lr=0.1),
                      named_parameters=model.named_parameters()),
                  "differ across ranks", "first difference at parameter 0", "'0.weight'",
                  f"rank 0 has '0.weight' [32, {IN}] float32", "rank 1 has '0.weight' [33, ")
    texts = mpiddp.allgather_object(text)
    assert all(t == texts[0] for t in texts), texts
    assert all(not hasattr(p, "_mpiddp_optimizer") for p in model.parameters())
    ok(f"different shapes: TensorMismatchError on every rank: {text}")

    dims = (IN, 32, OUT) if RANK != SIZE - 1 else (IN, 32, 32, OUT)
    model = mlp(dims=dims)
    text = expect(mpiddp.TensorMismatchError,
                  lambda: mpiddp.DistributedOptimizer(
                      torch.optim.SGD(model.parameters(), lr=0.1),
                      named_parameters=model.named_parameters()),
                  "Rank 0 has 4 trainable parameters", f"rank {SIZE - 1} has 6",
                  "first difference at parameter 2")
    ok(f"different parameter counts: {text}")

    model = mlp()
    passes = 1 if RANK == 0 else 2
    expect(mpiddp.TensorMismatchError,
           lambda: mpiddp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                               backward_passes_per_step=passes),
           "backward_passes_per_step", "rank 0 uses 1", "rank 1 uses 2")
    ok("different settings across ranks: TensorMismatchError naming the setting")

    # Shapes that change after construction: the engine's mismatch error reaches backward()
    # (which finishes the reductions) on every rank (no hang), naming the gradient and what
    # each rank sent.
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(IN, OUT)
            self.scale = nn.Parameter(torch.ones(2))

        def forward(self, x):
            return self.lin(x) * self.scale.mean()

    scaled = Scaled()
    opt = mpiddp.DistributedOptimizer(torch.optim.SGD(scaled.parameters(), lr=0.1),
                                      named_parameters=scaled.named_parameters())
    if RANK == 1:
        scaled.scale.data = torch.ones(3)
    text = expect(mpiddp.TensorMismatchError,
                  lambda: F.cross_entropy(scaled(batch(0, B)[0]), batch(0, B)[1]).backward(),
                  f"Mismatched allreduce shapes for '{opt._mpiddp.prefix}.grad.scale'",
                  "rank 1 sent [3]")
    ok(f"a gradient shape that differs at run time: backward() raises on every rank: {text}")

    # Local argument errors (every rank raises the same, no collective is involved).
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    named = list(model.named_parameters())
    expect(ValueError, lambda: mpiddp.DistributedOptimizer(
        sgd, named_parameters=[("w", named[0][1]), ("w", named[1][1])] + named[2:]),
        "'w' more than once")
    expect(ValueError, lambda: mpiddp.DistributedOptimizer(sgd, named_parameters=named[1:]),
           "1 parameter(s) of the optimizer are not in it", f"[32, {IN}]")
    expect(TypeError, lambda: mpiddp.DistributedOptimizer(torch.optim.SGD),
           "not its class")
    expect(ValueError, lambda: mpiddp.DistributedOptimizer(sgd, backward_passes_per_step=0),
           "positive integer")
    expect(ValueError, lambda: mpiddp.DistributedOptimizer(
        sgd, op=mpiddp.Sum, gradient_predivide_factor=2.0), "only supported with op=Average")
    expect(ValueError, lambda: mpiddp.DistributedOptimizer(sgd, op=mpiddp.Max), "Average or")
    wrapped = mpiddp.DistributedOptimizer(sgd, named_parameters=named)
    expect(ValueError, lambda: mpiddp.DistributedOptimizer(wrapped), "already")
    expect(ValueError, lambda: mpiddp.DistributedOptimizer(
        torch.optim.Adam(model.parameters())), "already belongs to another")
    ok("bad arguments: duplicate names, unnamed parameters, class instead of instance, "
       "wrapping twice, a parameter in two optimizers: clear errors")


# ---- state broadcast --------------------------------------------------------------------
class CountingOptimizer(torch.optim.Optimizer):
    """Keeps Python scalars and lists of tensors in its state."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                state["count"] = state.get("count", 0) + 1
                state["history"] = state.get("history", [])[-1:] + [p.grad.clone()]
                state["scale"] = (0.5 * state["count"], True)
                p.data.add_(p.grad, alpha=-group["lr"])


def state():
    root = SIZE - 1
    # Optimizer state differs per rank: a different number of steps, lr and data.
    for make in (lambda p: torch.optim.Adam(p, lr=0.01 * (RANK + 1)),
                 lambda p: torch.optim.SGD(p, lr=0.1 * (RANK + 1), momentum=0.9),
                 lambda p: CountingOptimizer(p, lr=0.1 * (RANK + 1))):
        model = mlp(seed=RANK)
        opt = make(model.parameters())
        for step in range(RANK + 1):
            opt.zero_grad()
            x, y = batch(step, B, seed=RANK)
            F.cross_entropy(model(x), y).backward()
            opt.step()
        mpiddp.broadcast_parameters(model.state_dict(), root_rank=root)
        mpiddp.broadcast_optimizer_state(opt, root_rank=root)
        mine = opt.state_dict()
        everyone = mpiddp.allgather_object(mine)
        for r in range(SIZE):
            assert deep_equal(everyone[r], everyone[root]), f"rank {r} state differs"
        assert opt.param_groups[0]["lr"] == everyone[root]["param_groups"][0]["lr"]
        counters = {k: v for k, v in mine["state"][0].items() if k in ("step", "count")}
        assert_identical_everywhere(model, f"bcast.{type(opt).__name__}")
        # The broadcast state is live: one more identical step keeps ranks identical.
        opt.zero_grad()
        x, y = batch(99, B)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        assert_identical_everywhere(model, f"after.{type(opt).__name__}")
        ok(f"broadcast_optimizer_state {type(opt).__name__} from rank {root}: state, step "
           f"counters {counters} and lr equal everywhere")

    # Empty state on the root (no step yet), non-empty elsewhere -> empty everywhere; and an
    # optimizer that is empty on every rank.
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if RANK != 0:
        F.cross_entropy(model(batch(0, B)[0]), batch(0, B)[1]).backward()
        opt.step()
    mpiddp.broadcast_optimizer_state(opt, root_rank=0)
    assert len(opt.state) == 0, f"rank {RANK} kept state {list(opt.state)[:2]}"
    mpiddp.broadcast_optimizer_state(opt, root_rank=0)
    assert len(opt.state) == 0
    ok("broadcast_optimizer_state with an empty state on the root empties every rank's state")

    # A DistributedOptimizer after load: state broadcast from the root, then training on.
    model = mlp(seed=RANK)
    opt = mpiddp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                      named_parameters=model.named_parameters())
    if RANK == root:
        opt.load_state_dict(train_reference_like_state())
    mpiddp.broadcast_parameters(model.named_parameters(), root_rank=root)
    mpiddp.broadcast_optimizer_state(opt, root_rank=root)
    assert float(opt.state_dict()["state"][0]["step"]) == 3.0
    for step in range(3):
        opt.zero_grad()
        x, y = batch(step, SIZE * B)
        F.cross_entropy(model(my_slice(x, B)), my_slice(y, B)).backward()
        opt.step()
    assert float(opt.state_dict()["state"][0]["step"]) == 6.0
    assert_identical_everywhere(model, "resumed")
    ok("DistributedOptimizer: state loaded on one rank and broadcast, training continues "
       "identically")

    # broadcast_parameters: a state_dict with buffers (BatchNorm counters, int64).
    bn = nn.BatchNorm1d(5)
    bn(torch.randn(4, 5) * (RANK + 1))
    mpiddp.broadcast_parameters(bn.state_dict(), root_rank=root)
    stats = mpiddp.allgather_object({k: v.clone() for k, v in bn.state_dict().items()})
    for r in range(SIZE):
        for k in stats[root]:
            assert torch.equal(stats[r][k], stats[root][k]), (r, k)
    ok("broadcast_parameters(state_dict) includes buffers (running stats, int64 counter)")

    # Python objects.
    obj = {"epoch": 7, "rank": RANK, "t": torch.arange(3) * RANK, "s": "x" * (RANK * 1000)}
    got = mpiddp.broadcast_object(obj if RANK == root else None, root_rank=root)
    assert got["rank"] == root and got["epoch"] == 7 and torch.equal(got["t"],
                                                                     torch.arange(3) * root)
    gathered = mpiddp.allgather_object(obj)
    assert [g["rank"] for g in gathered] == list(range(SIZE))
    assert [len(g["s"]) for g in gathered] == [r * 1000 for r in range(SIZE)]
    assert mpiddp.allgather_object(None) == [None] * SIZE
    assert mpiddp.broadcast_object(b"", root_rank=0) == b""
    ok("broadcast_object / allgather_object: nested objects, tensors, sizes differing by rank")


def deep_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and \
            all(deep_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and \
            all(deep_equal(x, y) for x, y in zip(a, b))
    return a == b


def train_reference_like_state():
    """A checkpointed Adam state after 3 steps (as if loaded from disk on the root)."""
    model = mlp(seed=42)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    for step in range(3):
        opt.zero_grad()
        x, y = batch(step, B, seed=42)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return opt.state_dict()


# ---- misuse: extra backward passes, zero_grad right after backward ------------------------
def extra_backward_runs(passes: int, steps: int = 4):
    """Each step runs ``passes + 1`` backward passes (one more than the optimizer was built
    for), then step(): the gradients accumulate exactly as in one process."""
    model = mlp()
    opt = mpiddp.DistributedOptimizer(OPTIMIZERS["sgd"](model.parameters()),
                                      named_parameters=model.named_parameters(),
                                      backward_passes_per_step=passes)
    reference = mlp() if RANK == 0 else None
    ref_opt = OPTIMIZERS["sgd"](reference.parameters()) if RANK == 0 else None
    for step in range(steps):
        opt.zero_grad()
        if RANK == 0:
            ref_opt.zero_grad()
        for m in range(passes + 1):
            x, y = batch(10 * step + m, SIZE * B)
            F.cross_entropy(model(my_slice(x, B)), my_slice(y, B)).backward()
            if RANK == 0:
                F.cross_entropy(reference(x), y).backward()
        opt.step()
        if RANK == 0:
            ref_opt.step()
    diff = assert_close_to_reference(model, reference, f"{passes + 1} backward passes", 2e-5)
    assert_identical_everywhere(model, f"extra_backward.{passes}")
    return diff


def misuse():
    for passes in (1, 2):
        diff = extra_backward_runs(passes)
        ok(f"backward_passes_per_step={passes} with {passes + 1} backward passes before step(): "
           f"gradients accumulate as in one process (max_diff={diff:.1e})")

    # zero_grad(set_to_none=False) right after backward: no reduction writes after it, so the
    # zeros stay zeros.
    model = mlp()
    opt = mpiddp.DistributedOptimizer(OPTIMIZERS["sgd"](model.parameters()),
                                      named_parameters=model.named_parameters())
    x, y = batch(0, SIZE * B)
    xs, ys = my_slice(x, B), my_slice(y, B)
    for _ in range(3):
        F.cross_entropy(model(xs), ys).backward()
        opt.zero_grad(set_to_none=False)
        time.sleep(0.05)
        assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())
    # ... and training afterwards is still exact.
    reference = train_reference(OPTIMIZERS["sgd"], steps=5)
    model2, _ = train_distributed(OPTIMIZERS["sgd"], steps=5)
    diff = assert_close_to_reference(model2, reference, "after misuse", tol=2e-5)
    ok(f"zero_grad() right after backward leaves no late writes; training after it is exact "
       f"(max_diff={diff:.1e})")


# ---- LR schedulers, state_dict round trip, add_param_group ------------------------------
def scheduler():
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # no scheduler-order warnings either
        model = mlp()
        base = torch.optim.SGD(model.parameters(), lr=0.1)
        early = torch.optim.lr_scheduler.StepLR(base, step_size=1, gamma=0.5)  # before wrap
        opt = mpiddp.DistributedOptimizer(base, named_parameters=model.named_parameters())
        late = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)         # after wrap
        assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"
        for step in range(3):
            x, y = batch(step, SIZE * B)
            opt.zero_grad()
            F.cross_entropy(model(my_slice(x, B)), my_slice(y, B)).backward()
            opt.step()
            early.step()
            late.step()
        expected = 0.1 * (0.5 * 0.9) ** 3
        assert math.isclose(opt.param_groups[0]["lr"], expected), opt.param_groups[0]["lr"]
        saved = opt.state_dict()
        opt.load_state_dict(saved)
        assert opt.state_dict()["param_groups"][0]["lr"] == saved["param_groups"][0]["lr"]
        assert not getattr(type(opt).step, "__wrapped__", None), "step was re-wrapped"
    assert_identical_everywhere(model, "sched")
    ok(f"LR schedulers built before and after wrapping both apply (lr {expected:.4g}); "
       "state_dict/load_state_dict round trip")

    # Optimizer step hooks run once per step, after the gradients are averaged.
    calls = []
    handle = opt.register_step_pre_hook(
        lambda o, args, kwargs: calls.append(model[0].weight.grad.clone()))
    x, y = batch(5, SIZE * B)
    opt.zero_grad()
    F.cross_entropy(model(my_slice(x, B)), my_slice(y, B)).backward()
    opt.step()
    handle.remove()
    assert len(calls) == 1
    grads = mpiddp.allgather(calls[0].reshape(1, -1), name="hookgrads")
    assert all(torch.equal(grads[r], grads[0]) for r in range(SIZE))
    ok("optimizer step pre-hooks run once, and see averaged gradients")

    # add_param_group after wrapping: the new parameters are averaged too.
    extra = nn.Linear(IN, OUT)
    torch.manual_seed(9)
    nn.init.normal_(extra.weight)
    opt.add_param_group({"params": list(extra.parameters()), "lr": 0.05})
    opt.zero_grad()
    x, y = batch(6, SIZE * B)
    (F.cross_entropy(model(my_slice(x, B)), my_slice(y, B))
     + extra(my_slice(x, B)).pow(2).mean()).backward()
    opt.step()
    assert_identical_everywhere(extra, "extra")
    ok("add_param_group after wrapping: new parameters are averaged")


# ---- step(closure): LBFGS stays in lockstep and matches one process ---------------------
def closure():
    # In float64: the strong-Wolfe line search branches on loss comparisons, and in float32
    # one process's full-batch run itself leaves the exact path at some sizes (32 ranks: its
    # second loss 1.32060 where the shard average, in one process without MPI, and both in
    # float64 give 1.31720), so a float32 reference would fail mpiddp for being exact.
    model = mlp().double()
    opt = mpiddp.DistributedOptimizer(
        torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5,
                          line_search_fn="strong_wolfe"),
        named_parameters=model.named_parameters())
    reference = mlp().double() if RANK == 0 else None
    ref_opt = (torch.optim.LBFGS(reference.parameters(), lr=0.5, max_iter=5,
                                 line_search_fn="strong_wolfe") if RANK == 0 else None)
    x, y = batch(0, SIZE * B)
    x = x.double()
    xs, ys = my_slice(x, B), my_slice(y, B)
    for _ in range(3):
        def local():
            opt.zero_grad()
            loss = F.cross_entropy(model(xs), ys)
            loss.backward()
            return loss
        loss = opt.step(local)
        if RANK == 0:
            def full():
                ref_opt.zero_grad()
                loss = F.cross_entropy(reference(x), y)
                loss.backward()
                return loss
            ref_loss = ref_opt.step(full)
            assert math.isclose(float(loss), float(ref_loss.detach()), rel_tol=1e-9), \
                (loss, ref_loss)
    diff = assert_close_to_reference(model, reference, "LBFGS", tol=1e-8)
    assert_identical_everywhere(model, "lbfgs")
    ok(f"step(closure) with LBFGS + strong Wolfe line search: ranks stay in lockstep and "
       f"match one process (max_diff={diff:.1e})")


# ---- AMP: torch.amp.GradScaler's standard recipes ------------------------------------------
def amp_run(recipe: str, compression, steps: int = 20, inf_step: int = 7):
    """Train with the standard GradScaler recipe; return (model, per-step records). Each
    record holds the scale of that step, this rank's local (scaled, unreduced) gradients and
    the gradients the wrapped optimizer stepped with (None when the scaler skipped the step).
    At ``inf_step`` rank SIZE-1 alone produces an inf gradient: every rank must skip."""
    torch.manual_seed(11)
    dims = (64, 128, 128, 128, OUT)
    layers = []
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    model = nn.Sequential(*layers[:-1])
    opt = mpiddp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                      named_parameters=model.named_parameters(),
                                      compression=compression)
    # fp16 compression: a large initial scale overflows float16 on the wire in the first steps
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** (24 if compression is not
                                                             mpiddp.Compression.none else 16),
                                  growth_interval=4)
    params = list(model.parameters())
    local, stepped = {}, []
    for p in params:
        p.register_hook(lambda g, p=p: local.__setitem__(p, g.clone()))
    opt.register_step_pre_hook(lambda o, a, k: stepped.append([p.grad.clone() for p in params]))
    records = []
    for step in range(steps):
        g = torch.Generator().manual_seed(500 + step)
        x, y = torch.randn(SIZE * B, dims[0], generator=g), torch.randint(0, OUT, (SIZE * B,),
                                                                         generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(model(my_slice(x, B)), my_slice(y, B))
        if step == inf_step and RANK == SIZE - 1:
            loss = loss * float("inf")
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        if recipe == "clip":
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        before = len(stepped)
        scaler.step(opt)
        scaler.update()
        records.append((scale, [local[p] for p in params],
                        stepped[-1] if len(stepped) > before else None))
    return model, records


def amp():
    """GradScaler recipes give the optimizer exactly the rank-average of the unscaled local
    gradients (clipped, for the clipping recipe), every rank skips the same steps, and the
    replicas stay bitwise identical."""
    for recipe, compression, tol in (("plain", mpiddp.Compression.none, 1e-6),
                                     ("clip", mpiddp.Compression.none, 1e-6),
                                     ("plain", mpiddp.Compression.fp16, 2e-3),
                                     ("clip", mpiddp.Compression.fp16, 2e-3)):
        model, records = amp_run(recipe, compression)
        skipped = [i for i, (_, _, seen) in enumerate(records) if seen is None]
        worst, compared = 0.0, 0
        for i, (scale, local_grads, seen) in enumerate(records):
            everyone = mpiddp.allgather(flat(local_grads).reshape(1, -1), name=f"amp.local.{i}")
            expected = everyone.mean(0) / scale              # float64 hand-averaged reference
            if not torch.isfinite(expected).all():
                assert seen is None, f"{recipe}: step {i} has inf/nan gradients but was taken"
                continue
            if seen is None:
                assert compression is mpiddp.Compression.fp16, \
                    f"{recipe}: step {i} was skipped although every gradient is finite"
                continue
            if recipe == "clip":
                norm = expected.norm()
                expected = expected * min(1.0, 0.5 / (float(norm) + 1e-6))
            got = flat(seen)
            err = float((got - expected).abs().max() / expected.abs().max())
            assert err <= tol, (f"{recipe} {compression.__name__}: step {i}: the optimizer "
                                f"stepped with gradients off the hand-averaged reference by "
                                f"{err:.3g} (relative), tolerance {tol}")
            worst, compared = max(worst, err), compared + 1
        assert 7 in skipped, f"{recipe}: the step with an inf on one rank was not skipped"
        every_skip_list = mpiddp.allgather_object(skipped)
        assert all(s == skipped for s in every_skip_list), \
            f"{recipe}: ranks skipped different steps: {every_skip_list}"
        assert_identical_everywhere(model, f"amp.{recipe}.{compression.__name__}")
        ok(f"AMP {recipe} recipe, {compression.__name__}: {compared} steps match the "
           f"hand-averaged unscaled gradients (max rel err {worst:.1e}), every rank skipped "
           f"steps {skipped}, replicas bitwise identical")


# ---- uneven data: each rank trains its own number of batches, then join() -----------------
def join():
    model = mlp()
    opt = mpiddp.DistributedOptimizer(OPTIMIZERS["sgd"](model.parameters()),
                                      named_parameters=model.named_parameters())
    last_ranks = []
    for epoch in range(12):
        batches = 2 + (RANK + epoch) % SIZE               # uneven, and the longest rank varies
        for step in range(batches):
            x, y = batch(100 * epoch + step, B, seed=RANK)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        last = mpiddp.join()
        last_ranks.append(last)
        # The ranks that trained longest hold the newest model: continue from theirs.
        mpiddp.broadcast_parameters(model.state_dict(), root_rank=last)
        mpiddp.broadcast_optimizer_state(opt, root_rank=last)
        assert_identical_everywhere(model, f"join.{epoch}")
    ok(f"uneven data: 12 epochs of step() then join() on every rank, no error; join() "
       f"returned the ranks {sorted(set(last_ranks))}; replicas identical after broadcast")


# ---- gradual unfreezing: requires_grad_(True) on a parameter frozen at construction --------
class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(21)
        self.backbone = nn.Sequential(nn.Linear(IN, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Linear(32, OUT)

    def forward(self, x):
        return self.head(self.backbone(x))


def unfreeze():
    """Build with the backbone frozen, unfreeze it after 4 steps (a scheduler keeps the
    optimizer alive), freeze it again after 8: matches one process doing the same."""
    def schedule(model, step):
        model.backbone.requires_grad_(4 <= step < 8)

    def run(m, opt, sched, xs, ys, step):
        schedule(m, step)
        opt.zero_grad()
        F.cross_entropy(m(xs), ys).backward()
        opt.step()
        sched.step()

    model = Backbone()
    model.backbone.requires_grad_(False)
    opt = mpiddp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                      named_parameters=model.named_parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    if RANK == 0:
        reference = Backbone()
        ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
        ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=3, gamma=0.5)
    frozen_start = model.backbone[0].weight.detach().clone()
    for step in range(12):
        x, y = batch(step, SIZE * B)
        run(model, opt, sched, my_slice(x, B), my_slice(y, B), step)
        if RANK == 0:
            run(reference, ref_opt, ref_sched, x, y, step)
        if step == 3:
            assert torch.equal(model.backbone[0].weight, frozen_start), "frozen weights moved"
    assert not torch.equal(model.backbone[0].weight, frozen_start), "unfrozen weights stayed"
    diff = assert_close_to_reference(model, reference if RANK == 0 else None, "unfreeze",
                                     tol=2e-5)
    assert_identical_everywhere(model, "unfreeze")
    ok(f"gradual unfreezing: frozen at construction, unfrozen at step 4, frozen again at step "
       f"8, with a live LR scheduler: matches one process (max_diff={diff:.1e})")


def compiled():
    """torch.compile (backend aot_eager: no C compiler needed): a compiled model, and a whole
    training step compiled at once (Dynamo breaks its graph where mpiddp waits on the engine
    and runs that eagerly), each against one process on the concatenated batch."""
    reference = train_reference(OPTIMIZERS["sgd"])
    for form in ("model", "step"):
        model = mlp()
        opt = mpiddp.DistributedOptimizer(OPTIMIZERS["sgd"](model.parameters()),
                                          named_parameters=model.named_parameters())
        forward = torch.compile(model, backend="aot_eager") if form == "model" else model

        def train_step(x, y):
            opt.zero_grad()
            F.cross_entropy(forward(x), y).backward()
            opt.step()

        run = torch.compile(train_step, backend="aot_eager") if form == "step" else train_step
        for step in range(STEPS):
            x, y = batch(step, SIZE * B)
            run(my_slice(x, B), my_slice(y, B))
        diff = assert_close_to_reference(model, reference, f"compiled {form}", tol=2e-5)
        assert_identical_everywhere(model, f"compiled.{form}")
        ok(f"torch.compile'd {form}: matches one process (max_diff={diff:.1e})")


GROUPS = {name: globals()[name] for name in (
    "equivalence", "overlap", "unused", "clip", "compression", "two_optimizers", "mismatch",
    "state", "misuse", "scheduler", "closure", "amp", "join", "unfreeze", "compiled")}

if __name__ == "__main__":
    started = time.perf_counter()
    for group in sys.argv[1].split(","):
        t0 = time.perf_counter()
        GROUPS[group]()
        if RANK == 0:
            print(f"TIME {group} {time.perf_counter() - t0:.2f}s", flush=True)
    if RANK == 0:
        print(f"DONE in {time.perf_counter() - started:.1f}s", flush=True)
