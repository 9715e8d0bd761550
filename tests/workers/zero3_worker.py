"""Stage 3 (``DistributedOptimizer(zero_stage=3, model=model)``) against ``zero_stage=0``.

Run with ``MPIDDP_ALLREDUCE_ALGORITHM=ring`` (the sharded reduce-scatter sums in the ring
all-reduce's order). Checks (rank 0 prints 'OK <check>'): parameters after every step bitwise
those of stage 0 at 2 ranks (allclose from 3) for SGD (momentum, nesterov, weight decay),
Adam and AdamW, with one bucket and with several (the early schedule), on a model with a
tied weight, a frozen layer and a layer used every other step, with a ``torch.no_grad()``
evaluation between steps; the full parameters' memory released after each step and nothing
gathered after an evaluation.
"""
import sys

import torch
import torch.nn.functional as F

import checks
import mpiddp
from zero_model import OPTIMIZERS, Net, batch, pair, step_once

torch.set_num_threads(1)
mpiddp.init()
RANK, SIZE = mpiddp.rank(), mpiddp.size()


def train(stage, kind, cap, steps=4, checkpointed=None, passes=1, scaler_inf_at=None,
          clip=None, schedule=False, unfreeze_at=None):
    torch.manual_seed(5)
    model = Net()
    model.checkpointed = checkpointed       # (an instance attribute: the class's stays None)
    opt = mpiddp.DistributedOptimizer(
        OPTIMIZERS[kind](model.parameters()), named_parameters=model.named_parameters(),
        zero_stage=stage, bucket_cap_mb=cap, backward_passes_per_step=passes,
        model=model if stage == 3 else None)
    sync = opt._mpiddp
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.7 ** step + 0.1 * step) \
        if schedule else None
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) \
        if scaler_inf_at is not None else None
    snaps, evals = [], []
    for step in range(steps):
        if step == unfreeze_at:
            model.frozen.requires_grad_(True)
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
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        elif clip is not None:
            if stage:
                opt.clip_grad_norm_(clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
        else:
            opt.step()
        if scheduler is not None:
            scheduler.step()
        if stage == 3:
            if not sync.timing.early:
                assert not any(b.gathered for b in sync.layout.buckets), "gathered after step"
            assert all(p.grad is None for p in model.parameters())
            if unfreeze_at is None or step < unfreeze_at:     # the frozen layer: sharded too
                frozen = sync.gathers.frozen_layout.buckets
                assert any(p is model.frozen.weight for b in frozen for p in b.params)
                assert not any(b.gathered for b in frozen), "frozen gathered after backward"
        with torch.no_grad():
            evals.append(model(*batch(100 + step, 0)[:1], step).clone())
        if stage == 3:
            gathered = sum(b.gathered for b in sync.gathers.all_buckets())
            assert gathered == 0, gathered        # (evaluation keeps nothing)
            released = [b for b in sync.gathers.all_buckets() if not b.gathered]
            assert all(p.untyped_storage().nbytes() == 0 for b in released for p in b.params)
        snaps.append([p.detach().clone() for p in model.parameters()])
    info = (len(sync.layout.buckets), sync.timing.mode, sync.gathers.gathers_done) \
        if stage == 3 else None
    del opt, sync
    return snaps, evals, info


def check_against_stage_0():
    compare = (lambda a, b: torch.equal(a, b)) if SIZE == 2 else \
        (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6))
    seen = {}
    for cap in (64.0, 0.0005):
        for kind in OPTIMIZERS:
            reference, ref_evals, _ = train(0, kind, cap)
            got, evals, info = train(3, kind, cap)
            seen[f"{kind} cap {cap}"] = info
            for step, (r, g) in enumerate(zip(reference, got)):
                assert all(compare(a, b) for a, b in zip(r, g)), (kind, cap, step)
            for step, (r, g) in enumerate(zip(ref_evals, evals)):
                assert compare(r, g), ("eval", kind, cap, step)
    checks.ok("stage 3 equal to zero_stage=0 after every step and in no_grad evaluation "
              "(SGD, Adam, AdamW; one bucket and several, the early schedule; tied, frozen "
              "(sharded too) and sometimes-used layers); full parameters released", RANK,
              bitwise=SIZE == 2, buckets_mode_gathers=seen)


def check_activation_checkpointing():
    """torch.utils.checkpoint (both forms): the recomputation in backward gathers what it
    uses (the guard runs backward inside itself)."""
    compare = (lambda a, b: torch.equal(a, b)) if SIZE == 2 else \
        (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6))
    reference, _, _ = train(0, "adam", 0.0005)
    for reentrant in (False, True):
        got, _, _ = train(3, "adam", 0.0005, checkpointed=reentrant)
        for step, (r, g) in enumerate(zip(reference, got)):
            assert all(compare(a, b) for a, b in zip(r, g)), (reentrant, step)
    checks.ok("activation checkpointing (use_reentrant False and True) with stage 3: equal "
              "to zero_stage=0", RANK, bitwise=SIZE == 2)


def check_with_the_rest():
    """Accumulation (two passes a step), GradScaler skipping everywhere on one rank's inf,
    optimizer.clip_grad_norm_ from the shards (to float reassociation: the norm's sum), an LR
    scheduler changing the rate every step, the frozen layer unfrozen at step 2: stage 0's
    parameters (bitwise at 2 ranks)."""
    compare = (lambda a, b: torch.equal(a, b)) if SIZE == 2 else \
        (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6))
    for label, kwargs in (("two passes", dict(passes=2)),
                          ("GradScaler", dict(scaler_inf_at=2)),
                          ("clip", dict(clip=0.05)),
                          ("scheduler", dict(schedule=True)),
                          ("unfrozen", dict(unfreeze_at=2))):
        reference, _, _ = train(0, "adam", 0.0005, **kwargs)
        got, _, _ = train(3, "adam", 0.0005, **kwargs)
        # (The global norm sums the shards' squares in another order than torch's.)
        same = compare if label != "clip" else \
            (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6))
        for step, (r, g) in enumerate(zip(reference, got)):
            assert all(same(a, b) for a, b in zip(r, g)), (label, step)
    checks.ok("stage 3 with backward_passes_per_step=2, GradScaler (one rank's inf), "
              "clip_grad_norm_, an LR scheduler, unfreezing: equal to zero_stage=0", RANK,
              bitwise=SIZE == 2)


def check_state_dicts():
    """model.state_dict(): the full parameters, from consolidate_state_dict(to=0)'s copies on
    rank 0 (elsewhere an error, not a hang) or gathered on every rank;
    model.load_state_dict(full) with the optimizer's whole state on a fresh stage-3 pair goes
    on exactly as stage 0 does."""
    pairs = {}
    for stage in (0, 3):
        model, opt = pair(stage)
        for step in range(3):
            step_once(model, opt, step)
        pairs[stage] = (model, opt)
    compare = (lambda a, b: torch.equal(a, b)) if SIZE == 2 else \
        (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6))
    (model0, opt0), (model3, opt3) = pairs[0], pairs[3]
    want = model0.state_dict()
    every = model3.state_dict()                  # no consolidation: gathered on every rank
    assert every.keys() == want.keys()
    assert all(compare(every[k], want[k]) for k in want), "gathered state_dict"
    opt3.consolidate_state_dict(to=0)
    if RANK == 0:                                # rank 0 alone: the consolidated copies
        mine = model3.state_dict()
        assert all(torch.equal(mine[k], every[k]) for k in want), "consolidated state_dict"
        whole = opt3.state_dict()
    else:
        checks.expect(RuntimeError, model3.state_dict, "consolidated onto rank 0")
    step_once(model3, opt3, 3)
    step_once(model0, opt0, 3)
    # A fresh stage-3 pair loads stage 0's model and optimizer state, then both go on.
    fresh, opt = pair(3, seed=6)
    fresh.load_state_dict(model0.state_dict())
    opt.load_state_dict(opt0.state_dict())
    for step in (4, 5):
        step_once(model0, opt0, step)
        step_once(fresh, opt, step)
    assert all(compare(a, b) for a, b in zip(model0.parameters(), fresh.parameters())), \
        "after load_state_dict"
    # Loads that fail leave what they did not load as it was.
    before = fresh.state_dict()
    bad = dict(model0.state_dict(), **{"l1.weight": torch.zeros(2)})
    checks.expect(RuntimeError, lambda: fresh.load_state_dict(bad), "l1.weight")
    assert torch.equal(fresh.state_dict()["l1.weight"], before["l1.weight"]), "failed load"
    parts = mpiddp.allgather_object(opt.sharded_state_dict())
    for part in parts:
        del part["frozen"]["frozen.weight"]
    state_before = {k: dict(v) for k, v in opt.state.items()}
    checks.expect(ValueError, lambda: opt.load_sharded_state_dict(parts), "frozen.weight")
    assert opt.state.keys() == state_before.keys() and all(
        all(torch.equal(opt.state[k][n], v) for n, v in values.items() if torch.is_tensor(v))
        for k, values in state_before.items()), "failed sharded load"
    checks.ok("stage 3 model.state_dict() (consolidated on rank 0, or gathered everywhere) is "
              "stage 0's; load_state_dict with the whole optimizer state goes on as stage 0; "
              "failed loads change nothing they did not load",
              RANK, bitwise=SIZE == 2, consolidated_keys=len(whole["state"]) if RANK == 0
              else None)


def check_checkpoint():
    """mpiddp.Checkpoint at stage 3: the file is stage 0's (the full model and the whole
    optimizer state); a fresh stage-3 pair restores it and goes on as stage 0 does."""
    import os
    import shutil
    import tempfile
    directory = mpiddp.broadcast_object(tempfile.mkdtemp(prefix="zero3-") if RANK == 0
                                        else None)
    path = os.path.join(directory, "checkpoint.pt")
    model0, opt0 = pair(0, "adamw")
    model3, opt3 = pair(3, "adamw")
    checks.expect(ValueError, lambda: mpiddp.Checkpoint(path, model=Net(), optimizer=opt3),
                  "zero_stage=3", "model=model")
    for step in range(3):
        step_once(model0, opt0, step)
        step_once(model3, opt3, step)
    mpiddp.Checkpoint(path, model=model3, optimizer=opt3).save(epoch=1)
    compare = (lambda a, b: torch.equal(a, b)) if SIZE == 2 else \
        (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6))
    if RANK == 0:
        saved = torch.load(path, weights_only=False)
        want = model0.state_dict()
        assert saved["model"].keys() == want.keys()
        assert all(compare(saved["model"][k], want[k]) for k in want), "the file's model"
        assert len(saved["optimizer"]["state"]) == len(opt0.state_dict()["state"])
    fresh, opt = pair(3, "adamw", seed=9)
    checkpoint = mpiddp.Checkpoint(path, model=fresh, optimizer=opt)
    assert checkpoint.restore() and checkpoint.epoch == 1
    for step in (3, 4):
        step_once(model0, opt0, step)
        step_once(fresh, opt, step)
    assert all(compare(a, b) for a, b in zip(model0.parameters(), fresh.parameters())), \
        "after restore"
    mpiddp.barrier()
    if RANK == 0:
        shutil.rmtree(directory)
    checks.ok("mpiddp.Checkpoint at stage 3: the file is stage 0's, a restore goes on as stage "
              "0 does", RANK, bitwise=SIZE == 2)


def check_refusals():
    """What stage 3 cannot do is refused with the reason: torch.compile'd code (at its first
    run, before the compiled graph reads a released parameter); PowerSGD, Adasum."""
    model, opt = pair(3, "sgd")
    compiled = torch.compile(model, backend="eager")
    tokens, _ = batch(0, RANK)
    checks.expect(RuntimeError, lambda: compiled(tokens, 0), "zero_stage=3", "torch.compile")
    model(tokens, 0)                    # uncompiled, it still runs
    del opt
    net = Net()
    for bad in (dict(compression=mpiddp.Compression.powersgd(rank=1)),
                dict(op=mpiddp.Adasum)):
        checks.expect(ValueError, lambda: mpiddp.DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.1), zero_stage=3, model=net, **bad),
            "zero_stage")
    checks.expect(ValueError, lambda: mpiddp.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.1), zero_stage=3), "model=model")
    checks.expect(ValueError, lambda: mpiddp.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.1), zero_stage=2, model=net), "zero_stage=3 only")
    checks.expect(ValueError, lambda: mpiddp.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.1), zero_stage=3, model=Net()), "not the model")
    checks.ok("stage 3 refuses torch.compile'd code, PowerSGD, Adasum and a missing or wrong "
              "model with the reason", RANK)


def check_start_and_threads():
    """Construction (here inside ``with torch.device(...)``, another torch-function mode)
    gives every rank the first rank's parameters, frozen ones too (whatever each built). Two
    threads in turn (the second may get the first's thread id), the first starting with
    the whole model under an activation checkpoint, train as stage 0 does on the main thread.
    Rebuilt optimizers leave no guard behind."""
    import threading
    modes = torch._C._len_torch_function_stack()
    with torch.device("cpu"):
        model, opt = pair(3, seed=20 + RANK)
    mine = [p.detach().clone() for p in model.parameters()]
    everyone = mpiddp.allgather_object(mine)
    assert all(torch.equal(a, b) for other in everyone for a, b in zip(other, mine)), "start"
    torch.manual_seed(20)
    assert all(torch.equal(a, b) for a, b in zip(Net().parameters(), mine)), "rank 0's"
    reference, ref_opt = pair(0, seed=20)
    failures = []

    def train_here(step, checkpointed):
        try:
            opt.zero_grad()
            tokens, labels = batch(step, RANK)
            output = torch.utils.checkpoint.checkpoint(model, tokens, step, use_reentrant=False) \
                if checkpointed else model(tokens, step)
            F.cross_entropy(output, labels).backward()
            opt.step()
        except BaseException as exc:        # (reported on the main thread)
            failures.append(exc)
    for step in range(3):
        thread = threading.Thread(target=train_here, args=(step, step == 0))
        thread.start()
        thread.join()
    assert not failures, failures
    for step in range(3):
        step_once(reference, ref_opt, step)
    compare = (lambda a, b: torch.equal(a, b)) if SIZE == 2 else \
        (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6))
    assert all(compare(a, b) for a, b in zip(reference.parameters(), model.parameters()))
    del opt
    for _ in range(3):
        pair(3)
    assert torch._C._len_torch_function_stack() <= max(modes, 1), "guards left behind"
    checks.ok("stage 3 starts from the first rank's parameters; training on other threads "
              "is stage 0's; rebuilt optimizers leave no guard behind", RANK,
              bitwise=SIZE == 2)


def check_state_across_rank_counts(mode, directory):
    """``save DIR`` (one rank count) then ``restore DIR`` (another), in each of the three
    forms: mpiddp.Checkpoint (the file is stage 0's), every rank's sharded_state_dict(), and
    an elastic.State snapshot. Each restore gives the saved model bitwise and the optimizer
    state (the next step is stage 0's from the file), the replicas identical."""
    import os
    path = os.path.join(directory, "checkpoint.pt")
    model, opt = pair(3)
    checkpoint = mpiddp.Checkpoint(path, model=model, optimizer=opt)
    snapshots = os.path.join(directory, "snapshots")
    if mode == "save":
        for step in range(3):
            step_once(model, opt, step)
        checkpoint.save(epoch=2)
        torch.save(opt.sharded_state_dict(), os.path.join(directory, f"sharded-{RANK}.pt"))
        state = mpiddp.elastic.State(model, opt, directory=snapshots, writer=RANK == 0)
        state.step = 3
        state.commit()
        state.wait()
        checks.ok(f"stage 3 saved at {SIZE} ranks (Checkpoint, sharded, elastic)", RANK)
        return
    assert checkpoint.restore() and checkpoint.epoch == 2 and checkpoint.ranks != SIZE
    saved = torch.load(path, weights_only=False)
    plain, plain_opt = pair(0, seed=7)
    plain.load_state_dict(saved["model"])
    plain_opt.load_state_dict(saved["optimizer"])
    step_once(plain, plain_opt, 3)
    files = sorted(f for f in os.listdir(directory) if f.startswith("sharded-"))
    sharded_model, sharded_opt = pair(3, seed=8)
    sharded_opt.load_sharded_state_dict(
        [torch.load(os.path.join(directory, f), weights_only=False) for f in files])
    elastic_model, elastic_opt = pair(3, seed=9)
    state = mpiddp.elastic.State(elastic_model, elastic_opt, directory=snapshots)
    assert state.restore() and state.step == 3
    for label, restored, restored_opt in (("Checkpoint", model, opt),
                                          ("sharded", sharded_model, sharded_opt),
                                          ("elastic", elastic_model, elastic_opt)):
        now = restored.state_dict()
        assert all(torch.equal(now[k], saved["model"][k]) for k in saved["model"]), label
        step_once(restored, restored_opt, 3)
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                   for a, b in zip(plain.parameters(), restored.parameters())), label
        mine = [p.detach().clone() for p in restored.parameters()]
        everyone = mpiddp.allgather_object(mine)
        assert all(all(torch.equal(a, b) for a, b in zip(other, mine)) for other in everyone)
    checks.ok(f"stage 3 restored at {SIZE} ranks what {checkpoint.ranks} saved (Checkpoint, "
              "sharded, elastic): the model bitwise, the next step stage 0's", RANK)


if len(sys.argv) > 2:                   # save DIR / restore DIR
    check_state_across_rank_counts(sys.argv[1], sys.argv[2])
else:
    check_start_and_threads()
    check_against_stage_0()
    check_refusals()
    check_checkpoint()
    check_activation_checkpointing()
    check_with_the_rest()
    check_state_dicts()
