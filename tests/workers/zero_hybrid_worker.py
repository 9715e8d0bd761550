"""``DistributedOptimizer(zero_stage=1|2|3, hybrid_shard=True)``: sharded within each node,
replicated across nodes (collectives/shard_grid.py), against ``zero_stage=0``.

Argument ``exact``: the unsharded run sums in the hybrid reduction's order (on the emulated
cluster with the hierarchical all-reduce over the cross-node ring, or at 2 ranks), so the
parameters must be bitwise equal; else within rounding.

Checks (rank 0 prints 'OK <check>'): the parameters after every step for Adam and SGD at
stages 1, 2 and 3, one bucket and several; each rank holds 1/ranks-per-node of the state,
the same on every node; clip_grad_norm_ counts one node's copy (torch's norm of the whole
averaged gradients); the sharded state forms load into a plain sharded optimizer and
continue as the consolidated state does in an unsharded one; the errors.
"""
import sys

import torch

import checks
import mpiddp
from zero_model import OPTIMIZERS, Net, batch, step_once

torch.set_num_threads(1)
mpiddp.init()
RANK, SIZE = mpiddp.rank(), mpiddp.size()
LOCAL = mpiddp.local_size()
EXACT = "exact" in sys.argv[1:] or SIZE == 2


def build(stage, kind="adam", cap=64.0, hybrid=True, seed=5):
    torch.manual_seed(seed)
    model = Net()
    opt = mpiddp.DistributedOptimizer(
        OPTIMIZERS[kind](model.parameters()), named_parameters=model.named_parameters(),
        zero_stage=stage, bucket_cap_mb=cap, model=model if stage == 3 else None,
        hybrid_shard=hybrid and stage > 0)
    return model, opt


def snapshot(model):
    with torch.no_grad():
        return [p.detach().clone() for p in model.state_dict().values()]


def equal(a, b, exact) -> bool:
    if exact:
        return all(torch.equal(x, y) for x, y in zip(a, b))
    return all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b))


def train(stage, kind, cap, steps=4):
    model, opt = build(stage, kind, cap)
    snaps = []
    for step in range(steps):
        step_once(model, opt, step)
        snaps.append(snapshot(model))
    return snaps, model, opt


def check_training():
    for kind in ("adam", "sgd"):
        for cap in (64.0, 0.0005):        # one bucket; several (several fused passes)
            reference, _, _ = train(0, kind, cap)
            for stage in (1, 2, 3):
                got, _, _ = train(stage, kind, cap)
                exact = EXACT and cap == 64.0
                for step, (r, g) in enumerate(zip(reference, got)):
                    assert equal(r, g, exact), (kind, cap, stage, step)
    checks.ok("hybrid_shard: stages 1, 2, 3 train as zero_stage=0 (Adam, SGD; one bucket and "
              "several)", RANK, bitwise=EXACT, ranks_per_node=LOCAL)


def check_state_held():
    model, opt = build(2)
    step_once(model, opt, 0)
    held = sum(v.numel() for s in opt.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim() > 0)
    total = 2 * sum(p.numel() for p in model.parameters() if p.requires_grad)  # Adam: 2 each
    everyone = mpiddp.allgather_object(held)
    assert sum(everyone) == total * (SIZE // LOCAL), (everyone, total)
    shards = [p.detach().clone() for group in opt.param_groups for p in group["params"]]
    copies = mpiddp.allgather_object((mpiddp.local_rank(), shards))
    for local_rank, theirs in copies:
        if local_rank == mpiddp.local_rank():
            assert all(torch.equal(a, b) for a, b in zip(shards, theirs))
    checks.ok("hybrid_shard: each rank holds 1/ranks-per-node of the state, the same shards "
              "on every node", RANK, per_rank=everyone, total=total)


def check_clip_norm():
    norms = []
    for stage in (0, 2):
        model, opt = build(stage)
        opt.zero_grad()
        tokens, labels = batch(0, RANK)
        torch.nn.functional.cross_entropy(model(tokens, 0), labels).backward()
        opt.synchronize()
        if stage:
            norms.append(float(opt.clip_grad_norm_(0.5)))
        else:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
    assert abs(norms[0] - norms[1]) <= 1e-6 * norms[0], norms
    checks.ok("hybrid_shard: clip_grad_norm_ counts each shard once", RANK, norms=norms)


def check_state_forms():
    model, opt = build(2, cap=0.0005)
    for step in range(2):
        step_once(model, opt, step)
    parts = mpiddp.allgather_object(opt.sharded_state_dict())
    opt.consolidate_state_dict(to=None)
    whole = opt.state_dict()
    results = []
    for stage, hybrid in ((0, False), (2, False), (1, True)):
        m, o = build(stage, cap=0.0005, hybrid=hybrid)
        m.load_state_dict(model.state_dict())
        if stage:
            o.load_sharded_state_dict(parts)
        else:
            o.load_state_dict(whole)
        for step in range(2, 4):
            step_once(m, o, step)
        results.append(snapshot(m))
    assert equal(results[0], results[1], SIZE == 2), "flat sharded load"
    assert equal(results[0], results[2], SIZE == 2), "hybrid load"
    checks.ok("hybrid_shard: its sharded state continues in a flat sharded optimizer and a "
              "hybrid one as its consolidated state does unsharded", RANK)


def check_errors():
    model = Net()
    checks.expect(ValueError, lambda: mpiddp.DistributedOptimizer(
        torch.optim.Adam(model.parameters()), named_parameters=model.named_parameters(),
        hybrid_shard=True), "zero_stage=1, 2 or 3")
    checks.expect(ValueError, lambda: mpiddp.DistributedOptimizer(
        torch.optim.Adam(model.parameters()), named_parameters=model.named_parameters(),
        zero_stage=2, hybrid_shard="node"), "True or False")
    uneven = LOCAL > 1 and SIZE > LOCAL          # nodes of several ranks: drop one rank
    if uneven:
        fewer = mpiddp.add_process_set(list(range(SIZE - 1)))
        if fewer.included():
            checks.expect(ValueError, lambda: mpiddp.DistributedOptimizer(
                torch.optim.Adam(model.parameters()), named_parameters=model.named_parameters(),
                zero_stage=2, hybrid_shard=True, process_set=fewer),
                "same number of the optimizer's ranks")
        mpiddp.barrier()
        mpiddp.remove_process_set(fewer)
    checks.ok("hybrid_shard: without a zero_stage, not a bool, or on nodes of different "
              "numbers of ranks, refused", RANK, uneven_checked=uneven)


check_training()
check_state_held()
check_clip_norm()
check_state_forms()
check_errors()
mpiddp.shutdown()
