"""``DistributedOptimizer(zero_stage=1|2)`` against ``zero_stage=0`` and against one process on
the concatenated batch.

Run with ``MPIDDP_ALLREDUCE_ALGORITHM=ring`` (the sharded reduce-scatter sums in the ring
all-reduce's order; other algorithms sum in theirs). Argument ``per-tensor``: also with
``MPIDDP_FUSION_THRESHOLD=0``, so that the unsharded run reduces each gradient on its own and
one-parameter buckets (``bucket_cap_mb=0``) must match it bit for bit too.

Checks (rank 0 prints 'OK <check>'): bitwise equality after every step for SGD (momentum,
nesterov, weight decay), Adam and AdamW, stages 1 and 2, with and without forward overlap,
on a model with odd and prime sizes, a frozen layer, a layer used every other step and tied
weights; the state held (every element on exactly one rank); accumulation with fp16
compression; GradScaler skipping everywhere on one rank's inf; clip_grad_norm_ from the
shards (and torch's refusing); consolidate_state_dict / state_dict / load_state_dict, the
sharded state at another rank count; add_param_group with an LR scheduler; the errors.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import checks
import mpiddp
from zero_model import BATCH, OPTIMIZERS, VOCAB, Net, batch  # noqa: F401

torch.set_num_threads(1)
mpiddp.init()
RANK, SIZE = mpiddp.rank(), mpiddp.size()
PER_TENSOR = "per-tensor" in sys.argv[1:]
# The unsharded run fuses one step's gradients into one ring all-reduce (one bucket here), or,
# with per-tensor, reduces each on its own (one parameter per bucket here).
CAP = 0.0 if PER_TENSOR else 64.0


def net():
    torch.manual_seed(5)
    return Net()


def full_batch(step):
    parts = [batch(step, r) for r in range(SIZE)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def snapshot(model):
    with torch.no_grad():
        return [p.detach().clone() for p in model.parameters()]


def train(stage, kind="adam", steps=5, cap=CAP, overlap=False, passes=1,
          compression=mpiddp.Compression.none, model=None, scaler_inf_at=None, clip=None,
          schedule=False, synchronize=False):
    """Train ``steps`` steps; returns (snapshots after each step, optimizer, model, extras).
    ``schedule``: an LR scheduler changes the rate every step; ``synchronize``: the script
    calls optimizer.synchronize() after backward (the step then waits for step())."""
    model = model or net()
    opt = mpiddp.DistributedOptimizer(
        OPTIMIZERS[kind](model.parameters()), named_parameters=model.named_parameters(),
        zero_stage=stage, bucket_cap_mb=cap, overlap_forward=overlap,
        backward_passes_per_step=passes, compression=compression)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.7 ** step + 0.1 * step) \
        if schedule else None
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) \
        if scaler_inf_at is not None else None
    snaps, extras = [], []
    for step in range(steps):
        opt.zero_grad()
        for part in range(passes):
            tokens, labels = batch(passes * step + part, RANK)
            loss = F.cross_entropy(model(tokens, step), labels) / passes
            if scaler is not None:
                if step == scaler_inf_at and RANK == SIZE - 1:
                    loss = loss * float("inf")
                scaler.scale(loss).backward()
            else:
                loss.backward()
        if stage == 2:          # the full-size gradients are released as they are reduced
            assert all(p.grad is None for p in model.parameters())
        if synchronize:
            opt.synchronize()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
            extras.append(scaler.get_scale())
        elif clip is not None:
            if stage:
                extras.append(float(opt.clip_grad_norm_(clip)))
            else:
                extras.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            opt.step()
        else:
            opt.step()
        if scheduler is not None:
            scheduler.step()
        snaps.append(snapshot(model))
    return snaps, opt, model, extras


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def check_exact():
    for kind in OPTIMIZERS:
        reference, _, _, _ = train(0, kind)
        for stage in (1, 2):
            for overlap in (False, True):
                got, _, _, _ = train(stage, kind, overlap=overlap)
                for step, (r, g) in enumerate(zip(reference, got)):
                    assert same(r, g), (kind, stage, overlap, step)
    checks.ok("bitwise equal to zero_stage=0 after every step (SGD, Adam, AdamW; stages 1, 2; "
              "overlap_forward off and on)", RANK)


def close(a, b) -> bool:
    """Equal to float reassociation: the order of a sum differs with the fused layout."""
    return all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b))


def check_early_schedule():
    """The first step decides (every rank alike) when shards are stepped: during backward,
    bucket by bucket as reductions land (no clipping, no GradScaler, no synchronize()), or
    at step(). Both give zero_stage=0's parameters after every step: bitwise at 2 ranks,
    within reassociation from 3 (several buckets fuse differently unsharded), with an LR
    scheduler changing the rate every step, and with forward overlap."""
    cap = 0.0005             # several buckets of this model
    compare = same if SIZE == 2 else close
    for kind in OPTIMIZERS:
        reference, _, _, _ = train(0, kind, cap=cap, schedule=True, steps=4)
        for stage in (1, 2):
            for overlap in (False, True):
                got, opt, _, _ = train(stage, kind, cap=cap, overlap=overlap, schedule=True,
                                       steps=4)
                assert opt._mpiddp.timing.mode == "early", opt._mpiddp.timing.mode
                assert len(opt._mpiddp.layout.buckets) >= 3, len(opt._mpiddp.layout.buckets)
                for step, (r, g) in enumerate(zip(reference, got)):
                    assert compare(r, g), (kind, stage, overlap, step)
        got, opt, _, _ = train(2, kind, cap=cap, schedule=True, steps=4, synchronize=True)
        assert opt._mpiddp.timing.mode == "at_step", opt._mpiddp.timing.mode
        assert all(compare(r, g) for r, g in zip(reference, got)), kind
    for kind, clip, scaler in (("clip", 1.0, None), ("GradScaler", None, 4)):
        _, opt, _, _ = train(2, "adam", cap=cap, steps=2, clip=clip, scaler_inf_at=scaler)
        assert opt._mpiddp.timing.mode == "at_step", (kind, opt._mpiddp.timing.mode)
    checks.ok("the early schedule (steps during backward) and the fallback both match "
              "zero_stage=0 after every step, with an LR scheduler changing the rate every "
              "step; clipping, GradScaler and synchronize() keep steps at step()", RANK,
              bitwise=SIZE == 2)


def check_early_schedule_refusals():
    """What the early schedule cannot honour is refused with the reason, on every rank."""
    model = net()
    opt = mpiddp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(), zero_stage=2,
                                      bucket_cap_mb=0.0005)

    def backward(step):
        tokens, labels = batch(step, RANK)
        F.cross_entropy(model(tokens, step), labels).backward()

    backward(0)
    opt.step()                       # the first step decides: nothing touched the gradients
    assert opt._mpiddp.timing.mode == "early"
    opt.zero_grad()
    backward(1)
    checks.expect(RuntimeError, opt.zero_grad, "zero_grad() after a backward without step()")
    opt.step()
    opt.zero_grad()
    backward(2)
    checks.expect(RuntimeError, lambda: opt.clip_grad_norm_(1.0), "already stepped",
                  "synchronize()")
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))            # (the scale is made at the first use)
    checks.expect(RuntimeError, lambda: scaler.step(opt), "GradScaler stepped this optimizer",
                  "first step")
    opt.synchronize()                # every bucket stepped now, with lr 0.1
    for group in opt.param_groups:
        group["lr"] = 0.05
    checks.expect(RuntimeError, opt.step, "hyperparameters", "changed between backward")
    checks.ok("early schedule: a skipped step, clipping after the early steps, a GradScaler "
              "that the first step did not use and a learning rate set between backward and "
              "step() are refused", RANK)


def check_one_parameter_buckets():
    """bucket_cap_mb=0: one parameter per bucket, each cut unevenly across the ranks."""
    reference, _, _, _ = train(0, "adam", cap=0.0)
    got, opt, _, _ = train(2, "adam", cap=0.0)
    if PER_TENSOR or SIZE == 2:
        assert all(same(r, g) for r, g in zip(reference, got))
    single = net()
    plain = torch.optim.Adam(single.parameters(), lr=0.01)
    for step in range(5):
        plain.zero_grad()
        tokens, labels = full_batch(step)
        F.cross_entropy(single(tokens, step), labels).backward()
        plain.step()
    error = max((a - b).abs().max().item() for a, b in zip(snapshot(single), got[-1]))
    assert error < 2e-5, error
    checks.ok("one-parameter buckets: equal to one process on the concatenated batch", RANK,
              bitwise_to_zero_stage_0=PER_TENSOR or SIZE == 2, max_error=error)


def check_state_held():
    _, opt, model, _ = train(1, "adam", steps=1)
    mine = sum(v.numel() for s in opt.state.values() for k, v in s.items() if k != "step")
    everyone = mpiddp.allgather_object(mine)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # Adam: two elementwise tensors per element; every element on exactly one rank.
    assert sum(everyone) == 2 * trainable, (everyone, trainable)
    assert max(everyone) <= 2 * (trainable / SIZE * 1.05 + 8), everyone
    checks.ok("optimizer state: each element's on one rank", RANK, per_rank=everyone,
              trainable=trainable)


def check_accumulation_and_fp16():
    for stage in (1, 2):
        kwargs = dict(passes=2, compression=mpiddp.Compression.fp16, steps=3)
        reference, _, _, _ = train(0, "sgd", **kwargs)
        got, _, _, _ = train(stage, "sgd", **kwargs)
        assert all(same(r, g) for r, g in zip(reference, got)), stage
    checks.ok("backward_passes_per_step=2 with fp16 compression: bitwise", RANK)


def check_grad_scaler():
    reference, _, _, scales = train(0, "adam", scaler_inf_at=2)
    got, _, _, got_scales = train(2, "adam", scaler_inf_at=2)
    assert all(same(r, g) for r, g in zip(reference, got))
    assert scales == got_scales and scales[2] < scales[1], (scales, got_scales)
    everyone = mpiddp.allgather_object(got_scales)
    assert all(s == got_scales for s in everyone)
    assert same(got[1], got[2])             # the step with the inf was skipped
    checks.ok("GradScaler: one rank's inf skips the step on every rank", RANK, scales=got_scales)


def check_clipping():
    reference, _, _, norms = train(0, "sgd", clip=0.05)
    got, opt, model, got_norms = train(2, "sgd", clip=0.05)
    worst = max(abs(a - b) / a for a, b in zip(norms, got_norms))
    assert worst < 1e-6, (norms, got_norms)
    error = max((a - b).abs().max().item() for a, b in zip(reference[-1], got[-1]))
    assert error < 1e-6, error
    opt.zero_grad()
    tokens, labels = batch(0, RANK)
    F.cross_entropy(model(tokens, 0), labels).backward()
    checks.expect(RuntimeError, lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0),
                  "zero_stage=2", "optimizer.clip_grad_norm_")
    shards = [p for g in opt.param_groups for p in g["params"]]
    checks.expect(RuntimeError, lambda: torch.nn.utils.clip_grad_norm_(shards, 1.0),
                  "optimizer.clip_grad_norm_")
    opt.step()
    checks.ok("clip_grad_norm_ from the shards matches torch's on the whole gradients", RANK,
              norms=norms, relative=worst)


def check_state_dicts():
    reference, opt0, model0, _ = train(0, "adam", steps=3)
    got, opt, model, _ = train(2, "adam", steps=3)
    expected = opt0.state_dict()
    checks.expect(RuntimeError, opt.state_dict, "consolidate_state_dict")
    opt.consolidate_state_dict(to=0)
    if RANK == 0:
        whole = opt.state_dict()
        assert whole["param_groups"] == expected["param_groups"]
        assert sorted(whole["state"]) == sorted(expected["state"])
        for index, values in expected["state"].items():
            for key, value in values.items():
                assert torch.equal(whole["state"][index][key], value), (index, key)
        plain = torch.optim.Adam(net().parameters(), lr=0.01)
        plain.load_state_dict(whole)
    else:
        checks.expect(RuntimeError, opt.state_dict, "consolidate_state_dict", "rank 0")
    opt.consolidate_state_dict(to=None)
    whole = opt.state_dict()
    # Continue from the whole state in a new sharded optimizer: the same as going on.
    fresh_model = net()
    fresh_model.load_state_dict(model.state_dict())
    fresh = mpiddp.DistributedOptimizer(torch.optim.Adam(fresh_model.parameters(), lr=0.01),
                                        named_parameters=fresh_model.named_parameters(),
                                        zero_stage=1, bucket_cap_mb=0.0)
    fresh.load_state_dict(whole)
    for step in range(3, 5):
        for m, o in ((model, opt), (fresh_model, fresh), (model0, opt0)):
            o.zero_grad()
            tokens, labels = batch(step, RANK)
            F.cross_entropy(m(tokens, step), labels).backward()
            o.step()
    assert same(snapshot(model), snapshot(model0))
    if PER_TENSOR or SIZE == 2:
        assert same(snapshot(fresh_model), snapshot(model0))
    else:
        error = max((a - b).abs().max().item()
                    for a, b in zip(snapshot(fresh_model), snapshot(model0)))
        assert error < 1e-6, error
    checks.expect(RuntimeError, opt.state_dict, "consolidate_state_dict")   # a step since
    other = nn.Linear(3, 3)
    bad = torch.optim.Adam(other.parameters())
    other(torch.ones(1, 3)).sum().backward()
    bad.step()
    checks.expect(ValueError, lambda: opt.load_state_dict(bad.state_dict()), "another model")
    checks.ok("consolidate_state_dict, state_dict, load_state_dict (any bucket layout)", RANK)
    return opt, model


def check_other_rank_count(opt, model):
    """Sharded states of every rank, loaded by fewer ranks (a process set): the same
    continuation as the whole state loaded into an unsharded optimizer."""
    parts = mpiddp.allgather_object(opt.sharded_state_dict())
    mine = opt.sharded_state_dict()
    size_of_part = sum(v.numel() for s in mine["state"].values() for v in s.values()
                       if torch.is_tensor(v) and v.dim() > 0)
    opt.consolidate_state_dict(to=None)
    whole = opt.state_dict()
    fewer = mpiddp.add_process_set(list(range(SIZE - 1)))
    copies = []      # built on every rank (in order); outside the set, local optimizers
    for stage in (0, 2):
        m = net()
        m.load_state_dict(model.state_dict())
        o = mpiddp.DistributedOptimizer(torch.optim.Adam(m.parameters(), lr=0.01),
                                        named_parameters=m.named_parameters(),
                                        zero_stage=stage, process_set=fewer,
                                        bucket_cap_mb=CAP)
        if fewer.included():
            if stage:
                o.load_sharded_state_dict(parts)
            else:
                o.load_state_dict(whole)
        copies.append((m, o))
    if fewer.included():
        for step in range(5, 7):
            for m, o in copies:
                o.zero_grad()
                tokens, labels = batch(step, RANK)
                F.cross_entropy(m(tokens, step), labels).backward()
                o.step()
        # Bitwise where the smaller set's stage 0 sums in the ring's order as the sharded
        # reduce-scatter does (one node, or one rank per node); on nodes of several ranks the
        # uneven set (2 + 1 ranks) differed by reassociation (1.5e-8 on 2 x 2).
        compare = same if mpiddp.local_size() in (1, SIZE) else close
        assert compare(snapshot(copies[0][0]), snapshot(copies[1][0]))
    mpiddp.barrier()
    mpiddp.remove_process_set(fewer)
    checks.ok(f"sharded state of {SIZE} ranks continues on {SIZE - 1}", RANK,
              part_elements=size_of_part)


def check_param_groups_and_scheduler():
    results = []
    for stage in (0, 1):
        model = net()
        opt = mpiddp.DistributedOptimizer(
            torch.optim.SGD([{"params": model.l1.parameters()}], lr=0.1, momentum=0.9),
            named_parameters=model.named_parameters(), zero_stage=stage, bucket_cap_mb=CAP)
        rest = [p for n, p in model.named_parameters() if not n.startswith("l1.")]
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for step in range(4):
            if step == 1:
                opt.add_param_group({"params": rest, "lr": 0.05})
            opt.zero_grad()
            tokens, labels = batch(step, RANK)
            F.cross_entropy(model(tokens, step), labels).backward()
            opt.step()
            scheduler.step()
        results.append(snapshot(model))
    # Unsharded, the added group's gradients fuse with the first group's; sharded, they are
    # a bucket of their own: the same sums in another order where more than two ranks add.
    if PER_TENSOR or SIZE == 2:
        assert same(*results)
    error = max((a - b).abs().max().item() for a, b in zip(*results))
    assert error < 1e-6, error
    checks.ok("add_param_group and an LR scheduler", RANK, max_error=error)


def check_errors():
    model = net()
    make = lambda **kw: mpiddp.DistributedOptimizer(   # noqa: E731
        torch.optim.Adam(model.parameters()), named_parameters=model.named_parameters(), **kw)
    checks.expect(ValueError, lambda: make(zero_stage=4), "zero_stage must be 0, 1, 2 or 3")
    checks.expect(ValueError, lambda: make(zero_stage=True), "zero_stage must be 0, 1, 2 or 3")
    checks.expect(ValueError, lambda: make(zero_stage=1, op=mpiddp.Adasum), "Adasum")
    checks.expect(ValueError, lambda: mpiddp.DistributedOptimizer(
        torch.optim.LBFGS(model.parameters()), zero_stage=1), "LBFGS")

    class Lamb(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.data.add_(p.grad, alpha=-group["lr"])

    checks.expect(ValueError, lambda: mpiddp.DistributedOptimizer(
        Lamb(model.parameters()), zero_stage=1), "elementwise", "mpiddp.elementwise_optimizer")
    mpiddp.elementwise_optimizer(Lamb)
    opt = mpiddp.DistributedOptimizer(Lamb(model.parameters()), zero_stage=1)
    mpiddp.broadcast_optimizer_state(opt, 0)   # no state yet: the root's hyperparameters
    del opt
    checks.expect(ValueError, mpiddp.join, "join() with a DistributedOptimizer(zero_stage")
    stage = 1 if RANK == 0 else 2
    checks.expect(mpiddp.TensorMismatchError, lambda: make(zero_stage=stage),
                  "zero_stage", "rank 0 uses 1")
    checks.ok("errors: zero_stage outside 0-2, ranks disagreeing, Adasum, LBFGS, a "
              "non-elementwise optimizer, join()", RANK)


check_exact()
check_early_schedule()
check_early_schedule_refusals()
check_one_parameter_buckets()
check_state_held()
check_accumulation_and_fp16()
check_grad_scaler()
check_clipping()
opt, model = check_state_dicts()
if SIZE >= 3:
    check_other_rank_count(opt, model)
check_param_groups_and_scheduler()
check_errors()
mpiddp.shutdown()
