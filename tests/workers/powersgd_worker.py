"""``DistributedOptimizer(compression=Compression.powersgd(...))`` against the float64
reference of the paper that simulates every rank (``powersgd_reference.py``).

Every rank computes every rank's local gradients itself (the data of rank i at step s is
seeded by (s, i) and the replicas are identical), steps the reference with them, trains one
step for real and compares, after every step: each gradient (compressed or averaged), this
rank's error buffer and the warm-started Q of each compressed tensor; and that the
parameters are identical on every rank. Backward sleeps a random time per rank in two places
(``Jitter``), so that ranks see their P's land at different points and submit their Q's in
different groups and orders.

Checks (rank 0 prints 'OK <check>'): float64 (tight) and float32 models; start_step, warm start
and error feedback on and off, epsilon, rank 1 and 2; one gradient per submission and all in
one; a >2-D tensor, matrices left uncompressed, biases, a frozen layer, a layer used on even
steps only (no gradient anywhere on odd steps), a layer only rank 0 uses; op=Sum;
backward_passes_per_step=2; GradScaler with one rank's inf (the step skipped everywhere, the
memories untouched, the next step matching); clipping; state_dict/load_state_dict (Q and the
step count kept, errors reset); a process set of all ranks but the last (from 3 ranks); the
refusals, each before any collective (the next check would hang otherwise).
"""
import gc
import os
import random
import shutil
import tempfile
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import checks
import mpiddp
from mpiddp.torch.gradients.powersgd import STATE_KEY
from powersgd_reference import Reference

torch.set_num_threads(1)
mpiddp.init()
RANK, SIZE = mpiddp.rank(), mpiddp.size()
BATCH = 5


class Jitter(torch.autograd.Function):
    """The identity; its backward sleeps 0-4 ms, differently on each rank and step."""

    @staticmethod
    def forward(ctx, x, seed):
        ctx.seed = seed
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(random.Random(str(ctx.seed)).random() * 0.004)
        return grad, None


class Net(nn.Module):
    """A conv (a 4-D weight, compressed as 6 x 27), two compressible matrices, a matrix too
    small to compress at rank 2 (``out``), biases, a frozen layer, a layer used on even steps
    only and one that only rank 0 uses."""

    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(3)
        self.conv = nn.Conv2d(3, 6, 3)
        self.l1 = nn.Linear(96, 40)
        self.l2 = nn.Linear(40, 40)
        self.sometimes = nn.Linear(40, 40)
        self.only_rank0 = nn.Linear(40, 40, bias=False)
        self.frozen = nn.Linear(40, 40)
        self.frozen.requires_grad_(False)
        self.out = nn.Linear(40, 3)
        self.to(dtype)
        self.jitter = False

    def forward(self, x, step, rank):
        h = torch.tanh(self.conv(x)).flatten(1)
        if self.jitter:
            h = Jitter.apply(h, (rank, step, 1))
        h = torch.tanh(self.l1(h))
        if self.jitter:
            h = Jitter.apply(h, (rank, step, 2))
        h = torch.tanh(self.l2(h)) + self.frozen(h)
        if step % 2 == 0:
            h = h + self.sometimes(h)
        if rank == 0:
            h = h + self.only_rank0(h)
        return self.out(torch.tanh(h))


def batch(step, rank, dtype):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, 3, 6, 6, generator=g).to(dtype), \
        torch.randint(0, 3, (BATCH,), generator=g)


def trainable(model):
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def local_grads(model, step, rank, passes, scale=1.0, inf=False):
    """Rank ``rank``'s own gradients of this step (no hook runs: autograd.grad)."""
    named = trainable(model)
    total = {name: None for name, _ in named}
    dtype = named[0][1].dtype
    for part in range(passes):
        x, y = batch(passes * step + part, rank, dtype)
        loss = F.cross_entropy(model(x, step, rank), y) / passes * scale
        if inf:
            loss = loss * float("inf")
        grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        for (name, _), g in zip(named, grads):
            if g is not None:
                g = g.detach().double().numpy()
                total[name] = g if total[name] is None else total[name] + g
    return total


def close(got, want, tol, what):
    if want is None:
        assert got is None, f"{what}: expected no gradient"
        return 0.0
    assert got is not None, f"{what}: no gradient"
    got = got.detach().double().numpy().reshape(want.shape)
    if not np.isfinite(want).all():
        assert not np.isfinite(got).all(), f"{what}: expected a non-finite result"
        return 0.0
    error = float(np.linalg.norm(got - want) / (np.linalg.norm(want) + 1e-30))
    assert error <= tol, f"{what}: relative error {error:.3g} > {tol}"
    return error


def identical_everywhere(model, process_set=None):
    state = [p.detach().clone() for p in model.parameters()]
    everyone = mpiddp.allgather_object(state, process_set=process_set)
    assert all(all(torch.equal(a, b) for a, b in zip(other, state)) for other in everyone), \
        "the replicas differ"


def run(settings, dtype=torch.float64, steps=5, passes=1, cap=None, op=mpiddp.Average,
        process_set=None, members=None, inf_at=None, clip=None, reload_at=None,
        checkpoint=None):
    """Train ``steps`` steps and compare with the reference after each; returns the largest
    relative error seen and how many Q reductions were submitted from gradient hooks."""
    members = list(range(SIZE)) if members is None else members
    tol = 1e-9 if dtype == torch.float64 else 2e-4
    model = Net(dtype)
    compression = mpiddp.Compression.powersgd(**settings)

    def make():
        opt = mpiddp.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            named_parameters=model.named_parameters(), compression=compression,
            backward_passes_per_step=passes, bucket_cap_mb=cap, op=op,
            process_set=process_set)
        return opt, opt._mpiddp

    opt, sync = make()
    shapes = {name: tuple(p.shape) for name, p in trainable(model)}
    ref = Reference(shapes, len(members), **settings)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if inf_at is not None else None
    worst, from_hooks = 0.0, 0
    me = members.index(RANK)
    for step in range(steps):
        if step == reload_at:
            saved = opt.state_dict()
            assert saved[STATE_KEY]["steps"] == step and saved[STATE_KEY]["q"], saved.keys()
            if checkpoint is not None:
                mpiddp.Checkpoint(checkpoint, model=model, optimizer=opt).save(epoch=0,
                                                                              step=step)
            del opt, sync
            gc.collect()
            opt, sync = make()
            if checkpoint is not None:      # rank 0 reads, the rest get it by broadcast
                assert mpiddp.Checkpoint(checkpoint, model=model, optimizer=opt).restore()
            else:
                opt.load_state_dict(saved)
            assert sync.steps == step and all(m.error is None for m in sync.memories.values())
            assert sorted(sync.memories) == sorted(saved[STATE_KEY]["q"])
            ref.reset_errors()
        scale = scaler.get_scale() if scaler is not None else 1.0
        model.jitter = False
        grads = [local_grads(model, step, r, passes, scale, inf=step == inf_at
                             and r == members[-1]) for r in members]
        expected = ref.step(grads)
        if op == mpiddp.Sum:
            expected = {k: None if v is None else v * len(members) for k, v in expected.items()}
        before_q = {k: m.q.clone() for k, m in sync.memories.items() if m.q is not None}
        before_e = {k: m.error.clone() for k, m in sync.memories.items()
                    if m.error is not None}
        before_params = [p.detach().clone() for p in model.parameters()]

        original = sync.complete_factors
        counted = []

        def complete_factors():
            counted.append(len(sync.awaiting_q))
            original()
        sync.complete_factors = complete_factors
        opt.zero_grad()
        model.jitter = True
        for part in range(passes):
            x, y = batch(passes * step + part, RANK, dtype)
            loss = F.cross_entropy(model(x, step, RANK), y) / passes
            if step == inf_at and RANK == members[-1]:
                loss = loss * float("inf")
            (scaler.scale(loss) if scaler is not None else loss).backward()
        del sync.complete_factors, original, complete_factors    # they hold the sync
        compressed = [k for k in shapes if ref.compressed(k) and step >= ref.start_step]
        from_hooks += len(compressed) - sum(counted) if counted else 0

        for name, p in trainable(model):
            worst = max(worst, close(p.grad, expected[name], tol, f"step {step} {name} grad"))
        for name in compressed:
            memory = sync.memories[name]
            if ref.warm_start and name in ref.q:
                worst = max(worst, close(memory.q, ref.q[name], tol, f"step {step} {name} Q"))
            if ref.error_feedback and name in ref.errors:
                worst = max(worst, close(memory.error, ref.errors[name][me], tol,
                                         f"step {step} {name} error"))
        if step == inf_at:      # the memories of every tensor the inf reached: untouched
            poisoned = [k for k in compressed if expected[k] is not None
                        and not np.isfinite(expected[k]).all()]
            assert poisoned
            assert all(torch.equal(before_q[k], sync.memories[k].q) for k in poisoned
                       if k in before_q)
            assert all(torch.equal(before_e[k], sync.memories[k].error) for k in poisoned
                       if k in before_e)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if step == inf_at:
            assert all(torch.equal(a, b) for a, b in zip(before_params, model.parameters()))
        identical_everywhere(model, process_set)
    del opt, sync
    gc.collect()
    return worst, from_hooks


def check_against_reference():
    base = dict(rank=2, start_step=2, min_compression_rate=2)
    results = {}
    for label, settings, kwargs in (
            ("f64 rank 2 warm ef", base, dict(steps=5)),
            ("f64 one gradient per submission", base, dict(steps=3, cap=0.0)),
            ("f64 rank 1 no warm start no ef", dict(rank=1, start_step=0, warm_start=False,
                                                    error_feedback=False), dict(steps=3)),
            ("f64 rank 3 no warm start, ef, epsilon", dict(rank=3, start_step=1,
                                                           warm_start=False,
                                                           orthogonalization_epsilon=1e-8,
                                                           seed=7), dict(steps=4)),
            ("f32 rank 2", dict(rank=2, start_step=1), dict(steps=4, dtype=torch.float32)),
            ("f64 Sum", dict(rank=2, start_step=1), dict(steps=3, op=mpiddp.Sum)),
            ("f64 two passes per step", dict(rank=2, start_step=1), dict(steps=3, passes=2)),
            ("f64 clip", dict(rank=2, start_step=1), dict(steps=3, clip=0.5)),
    ):
        results[label] = run(settings, **kwargs)
    checks.ok("equal to the float64 reference after every step: gradients, errors, Q "
              "(settings, dtypes, bucketing, Sum, accumulation, clipping); replicas "
              "identical", RANK, barrier=mpiddp.barrier,
              worst={k: v[0] for k, v in results.items()},
              q_from_hooks={k: v[1] for k, v in results.items()})


def check_grad_scaler():
    worst, _ = run(dict(rank=2, start_step=1), dtype=torch.float32, steps=5, inf_at=3)
    checks.ok("GradScaler: one rank's inf skips the step everywhere, the memories of the "
              "tensors it reached untouched, "
              "the next steps match the reference", RANK, barrier=mpiddp.barrier, worst=worst)


def check_state_dict():
    worst, _ = run(dict(rank=2, start_step=1), steps=5, reload_at=3)
    path = mpiddp.broadcast_object(
        os.path.join(tempfile.mkdtemp(prefix="powersgd-"), "checkpoint.pt") if RANK == 0
        else None)
    worst_checkpoint, _ = run(dict(rank=2, start_step=1), steps=5, reload_at=3,
                              checkpoint=path)
    checks.ok("state_dict/load_state_dict and mpiddp.Checkpoint: Q and the step count kept, "
              "errors reset, then as the reference", RANK, barrier=mpiddp.barrier,
              worst=max(worst, worst_checkpoint))
    if RANK == 0:
        shutil.rmtree(os.path.dirname(path))


def check_process_set():
    if SIZE < 3:
        return
    members = list(range(SIZE - 1))
    fewer = mpiddp.add_process_set(members)
    if RANK in members:
        worst, _ = run(dict(rank=2, start_step=1), steps=4, process_set=fewer,
                       members=members)
    mpiddp.barrier()
    mpiddp.remove_process_set(fewer)
    checks.ok(f"process set of {SIZE - 1} of {SIZE} ranks", RANK, barrier=mpiddp.barrier)


def check_refusals():
    P = mpiddp.Compression.powersgd
    for bad in (dict(rank=0), dict(rank=1.5), dict(rank=True), dict(start_step=-1),
                dict(min_compression_rate=0), dict(warm_start=1),
                dict(orthogonalization_epsilon=-1.0), dict(seed=-2)):
        checks.expect(ValueError, lambda: P(**bad), "Compression.powersgd",
                      next(iter(bad)))
    model = Net(torch.float32)

    def build(**kwargs):
        kwargs.setdefault("compression", P(rank=2))
        return mpiddp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(),
                                           **kwargs)
    checks.expect(ValueError, lambda: build(zero_stage=1), "zero_stage=1", "reduce-scatter")
    checks.expect(ValueError, lambda: build(op=mpiddp.Adasum), "Adasum")
    weird = nn.Linear(8, 8, dtype=torch.complex64)
    checks.expect(ValueError, lambda: mpiddp.DistributedOptimizer(
        torch.optim.SGD(weird.parameters(), lr=0.1), named_parameters=weird.named_parameters(),
        compression=P(rank=1)), "'weight'", "complex64")
    # Settings that differ across ranks: refused on every rank by the construction check.
    if SIZE > 1:
        checks.expect(mpiddp.TensorMismatchError,
                      lambda: build(compression=P(rank=1 + (RANK == SIZE - 1))),
                      "compression_settings")
    gc.collect()
    checks.ok("refusals: bad settings, zero_stage, Adasum, complex, "
              "settings differing across ranks", RANK, barrier=mpiddp.barrier)


def check_forward_overlap(steps=6):
    """overlap_forward=True: the same parameters after every step, bitwise, as without it
    (the same arithmetic, finished in the next forward instead of at the end of backward);
    also with two passes a step."""
    def train(overlap, passes):
        model = Net(torch.float32)
        opt = mpiddp.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            named_parameters=model.named_parameters(),
            compression=mpiddp.Compression.powersgd(rank=2, start_step=1),
            backward_passes_per_step=passes, overlap_forward=overlap, bucket_cap_mb=0.0)
        model.jitter = True
        history = []
        for step in range(steps):
            opt.zero_grad()
            for part in range(passes):
                x, y = batch(passes * step + part, RANK, torch.float32)
                loss = F.cross_entropy(model(x, step, RANK), y) / passes
                loss.backward()
            opt.step()
            # Reading the parameters completes the deferred update first (the guard).
            history.append([p.detach().clone() for p in model.parameters()])
        identical_everywhere(model)
        deferred = getattr(opt._mpiddp.schedule, "deferred_steps", 0)
        del opt
        gc.collect()
        return history, deferred

    for passes in (1, 2):
        plain, _ = train(False, passes)
        overlapped, deferred = train(True, passes)
        assert deferred == steps, f"{deferred} of {steps} steps deferred"
        for step, (a, b) in enumerate(zip(plain, overlapped)):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), \
                f"passes={passes}: step {step} differs with overlap_forward"
    checks.ok("overlap_forward=True: every step deferred into the next forward, parameters "
              "bitwise those without it (1 and 2 passes a step)", RANK, barrier=mpiddp.barrier)


check_refusals()
check_forward_overlap()
check_against_reference()
check_grad_scaler()
check_state_dict()
check_process_set()
