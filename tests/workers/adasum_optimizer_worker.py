"""``DistributedOptimizer(op=Adasum)`` against its definition, simulated in one process: every
rank's optimizer (its own state) steps on that rank's batch from the same starting parameters,
and the deltas are combined by the float64 reference (``adasum_reference.py``).

Checks (rank 0 prints 'OK <check>'): SGD with momentum and Adam over several steps, the
parameters equal to the reference and bitwise the same on every rank; the local steps run
during backward from the second step (``overlap``); backward_passes_per_step=2; AMP's
GradScaler (``deferred``): an inf on one rank makes every rank skip the step and back off
alike; a gradient changed after backward in overlap mode is refused; fp16 compression; the
refusals (forward overlap, a predivide factor, LBFGS).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

import checks
import mpiddp
from adasum_reference import adasum

torch.set_num_threads(1)
mpiddp.init()
RANK, SIZE = mpiddp.rank(), mpiddp.size()
B, IN, OUT = 8, 12, 5


def model(seed=3):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, 16), nn.Tanh(), nn.Linear(16, OUT))


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(B, IN, generator=g), torch.randint(0, OUT, (B,), generator=g)


def loss_of(net, step, rank):
    x, y = batch(step, rank)
    return F.cross_entropy(net(x), y)


def reference_step(models, optimizers, step, passes=1, clip=None, wire=torch.float32):
    """Every rank's local step from the same start (``passes`` accumulated backward passes,
    gradients clipped to norm ``clip``); the start plus the Adasum of the deltas (as they
    travel: ``wire``), per tensor, in float64."""
    start = [p.detach().clone() for p in models[0].parameters()]
    deltas = []
    for rank, (net, opt) in enumerate(zip(models, optimizers)):
        opt.zero_grad()
        for part in range(passes):
            (loss_of(net, 10 * step + part if passes > 1 else step, rank) / passes).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        deltas.append([(p.detach() - s).to(wire).double() for p, s in
                       zip(net.parameters(), start)])
    combined = [torch.from_numpy(adasum([d[i].numpy() for d in deltas]))
                .reshape(start[i].shape) for i in range(len(start))]
    for net in models:
        with torch.no_grad():
            for p, s, c in zip(net.parameters(), start, combined):
                p.copy_((s.double() + c).to(p.dtype))


def max_error(net, models):
    return max(float((p - q).detach().abs().max()) for p, q in zip(net.parameters(),
                                                                 models[0].parameters()))


def same_everywhere(net, what):
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).view(torch.int32)
    every = mpiddp.allgather(flat.reshape(1, -1), name=f"same.{what}")
    assert all(torch.equal(every[r], every[0]) for r in range(SIZE)), f"{what}: ranks differ"


def against_reference(make_opt, what, steps=5, tolerance=2e-6):
    net = model()
    opt = mpiddp.DistributedOptimizer(make_opt(net.parameters()),
                                      named_parameters=net.named_parameters(), op=mpiddp.Adasum)
    models = [model() for _ in range(SIZE)]
    optimizers = [make_opt(m.parameters()) for m in models]
    worst = 0.0
    for step in range(steps):
        opt.zero_grad()
        loss_of(net, step, RANK).backward()
        opt.step()
        reference_step(models, optimizers, step)
        worst = max(worst, max_error(net, models))
        assert worst <= tolerance, f"{what}: step {step} differs from the reference by {worst}"
        same_everywhere(net, f"{what}.{step}")
    assert opt._mpiddp_adasum.timing.mode == "early", opt._mpiddp_adasum.timing.mode
    return worst


def optimizers():
    sgd = against_reference(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "sgd")
    adam = against_reference(lambda p: torch.optim.Adam(p, lr=0.01), "adam")
    checks.ok("adasum optimizer: SGD+momentum and Adam equal the reference, local steps "
              "during backward", RANK, barrier=mpiddp.barrier, sgd=sgd, adam=adam)


def accumulation():
    net, ref = model(), [model() for _ in range(SIZE)]
    opt = mpiddp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                      named_parameters=net.named_parameters(),
                                      op=mpiddp.Adasum, backward_passes_per_step=2)
    ref_opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in ref]
    for step in range(3):
        opt.zero_grad()
        for part in range(2):
            (loss_of(net, 10 * step + part, RANK) / 2).backward()
        opt.step()
        reference_step(ref, ref_opts, step, passes=2)
        assert max_error(net, ref) <= 2e-6, max_error(net, ref)
    checks.ok("adasum optimizer: backward_passes_per_step=2", RANK, barrier=mpiddp.barrier)


def grad_scaler():
    net = model()
    opt = mpiddp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                      named_parameters=net.named_parameters(), op=mpiddp.Adasum)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    skipped_at = 2
    for step in range(4):
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
        same_everywhere(net, f"amp.{step}")
        scales = mpiddp.allgather_object(float(scaler.get_scale()), name=f"scale.{step}")
        assert len(set(scales)) == 1, f"scales differ across ranks: {scales}"
    assert opt._mpiddp_adasum.timing.mode == "at_step"
    checks.ok("adasum optimizer: GradScaler, an inf on one rank skips the step everywhere",
              RANK, barrier=mpiddp.barrier, scale=float(scaler.get_scale()))


def misuse():
    net = model()
    opt = mpiddp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                      named_parameters=net.named_parameters(), op=mpiddp.Adasum)
    for step in range(2):
        opt.zero_grad()
        loss_of(net, step, RANK).backward()
        if step == 1:                   # overlap mode: the local steps already ran
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1e-3)
            checks.expect(RuntimeError, opt.step, "was changed after backward",
                          "optimizer.synchronize()")
        else:
            opt.step()
    for kwargs, needle in (({"overlap_forward": True}, "forward overlap"),
                           ({"gradient_predivide_factor": 2.0}, "gradient_predivide_factor")):
        fresh = model()
        checks.expect(ValueError, lambda: mpiddp.DistributedOptimizer(
            torch.optim.SGD(fresh.parameters(), lr=0.1), op=mpiddp.Adasum, **kwargs), needle)
    fresh = model()
    checks.expect(ValueError, lambda: mpiddp.DistributedOptimizer(
        torch.optim.LBFGS(fresh.parameters()), op=mpiddp.Adasum), "LBFGS")
    checks.ok("adasum optimizer: misuse refused", RANK, barrier=mpiddp.barrier)


def clipping_and_compression():
    """synchronize() before clipping keeps the local steps in step(); fp16 deltas."""
    net = model()
    opt = mpiddp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                      named_parameters=net.named_parameters(), op=mpiddp.Adasum,
                                      compression=mpiddp.Compression.fp16)
    ref = [model() for _ in range(SIZE)]
    ref_opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in ref]
    for step in range(3):
        opt.zero_grad()
        loss_of(net, step, RANK).backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        with opt.skip_synchronize():
            opt.step()
        reference_step(ref, ref_opts, step, clip=0.5, wire=torch.float16)
        assert max_error(net, ref) <= 1e-3, max_error(net, ref)
        same_everywhere(net, f"clip.{step}")
    assert opt._mpiddp_adasum.timing.mode == "at_step"
    checks.ok("adasum optimizer: clipping after synchronize(), fp16 deltas", RANK,
              barrier=mpiddp.barrier, error=max_error(net, ref))


for check in (optimizers, accumulation, grad_scaler, misuse, clipping_and_compression):
    check()
mpiddp.shutdown()
