"""A sharded optimizer (``zero_stage``) with what a script already calls on its optimizer:
``broadcast_optimizer_state``, ``consolidate_state_dict`` at stage 0, and ``mpiddp.Checkpoint``
(saving, preemption, a mid-epoch resume, files of either stage, another rank count).

Run with ``MPIDDP_ALLREDUCE_ALGORITHM=ring`` (then the sharded runs give the unsharded runs'
bits; see tests/workers/zero_worker.py). Arguments: ``save DIR`` at 2 ranks writes the
checkpoints that ``restore DIR`` reads at 3 ranks.

save (rank 0 prints 'OK <check>'):
  * broadcast_optimizer_state of a sharded optimizer: the root's hyperparameters, a no-op on
    an empty state; a ValueError on every rank where some rank (even one that is not the
    root) holds state; consolidate_state_dict at stage 0 checks ``to`` and changes nothing;
  * Checkpoint at stage 2: restore() without a file; SIGTERM on one rank mid-epoch stops every
    rank at the same step with Preempted (status 75), the file bitwise the one of stage 0;
  * a mid-epoch resume at stage 2 from the stage-2 file and from the stage-0 file, and at
    stage 0 from the stage-2 file, each ending bitwise as the uninterrupted stage-0 run.
restore (3 ranks): the 2-rank stage-2 preemption file restored at stage 2 holds, consolidated,
exactly the file's optimizer state (and at stage 0 too); both runs then finish alike.
"""
import os
import shutil
import signal
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import checks
import mpiddp
import mpiddp.torch.sharding.state
from mpiddp.checkpoint import EXIT_PREEMPTED, Preempted, ResumableSampler

torch.set_num_threads(1)
mpiddp.init()
RANK, SIZE = mpiddp.rank(), mpiddp.size()
MODE, DIRECTORY = sys.argv[1], sys.argv[2]
EPOCHS, BATCH = 2, 4
PREEMPT_AT = (1, 3)         # (epoch, step): the last rank signals itself there


def path(name: str) -> str:
    return os.path.join(DIRECTORY, name)


def make_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    return TensorDataset(torch.randn(64, 7, generator=g), torch.randint(0, 5, (64,), generator=g))


def make_optimizer(model, stage: int):
    return mpiddp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(),
                                       zero_stage=stage)


def checkpointed(stage: int, file: str):
    """A fresh model, optimizer and loader, and the ``Checkpoint(file)`` of them (not restored
    yet): (model, optimizer, loader, checkpoint)."""
    model = make_model()
    optimizer = make_optimizer(model, stage)
    data = dataset()
    sampler = ResumableSampler(data, num_replicas=SIZE, rank=RANK, seed=0)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    ckpt = mpiddp.Checkpoint(file, model=model, optimizer=optimizer, sampler=sampler)
    return model, optimizer, loader, ckpt


def train(stage: int, file: str, preempt_at=None):
    """Train to the end of EPOCHS through ``Checkpoint(file)`` (resuming what it holds);
    returns (the Checkpoint, whether restore() resumed, the Preempted raised or None)."""
    model, optimizer, loader, ckpt = checkpointed(stage, file)
    resumed = ckpt.restore()
    try:
        for epoch in ckpt.epochs(EPOCHS):
            for step, (x, y) in ckpt.batches(loader, epoch):
                if (epoch, step) == preempt_at and RANK == SIZE - 1:
                    os.kill(os.getpid(), signal.SIGTERM)       # acted on after the next step
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
            ckpt.save(epoch + 1)
    except Preempted as stop:
        return ckpt, resumed, stop
    return ckpt, resumed, None


def load(file: str) -> dict:
    return torch.load(file, weights_only=False)


def assert_same_optimizer(a: dict, b: dict, what: str) -> None:
    assert a["param_groups"] == b["param_groups"], (what, a["param_groups"], b["param_groups"])
    assert sorted(a["state"]) == sorted(b["state"]), what
    for index, values in a["state"].items():
        assert sorted(values) == sorted(b["state"][index]), (what, index)
        for key, value in values.items():
            assert torch.equal(value, b["state"][index][key]), (what, index, key)


def assert_same_checkpoint(a: dict, b: dict, what: str) -> None:
    assert (a["epoch"], a["step"]) == (b["epoch"], b["step"]), what
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), (what, name)
    assert_same_optimizer(a["optimizer"], b["optimizer"], what)


def check_broadcast_optimizer_state():
    model = make_model()
    sharded = mpiddp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1 * (RANK + 1), momentum=0.5 + RANK / 10),
        named_parameters=model.named_parameters(), zero_stage=1)
    mpiddp.broadcast_optimizer_state(sharded, root_rank=SIZE - 1)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in sharded.param_groups]
    assert groups[0]["lr"] == 0.1 * SIZE and groups[0]["momentum"] == 0.5 + (SIZE - 1) / 10
    assert not sharded.state
    everyone = mpiddp.allgather_object(groups)
    assert all(g == groups for g in everyone), everyone

    x, y = dataset().tensors
    F.cross_entropy(model(x[:8]), y[:8]).backward()
    sharded.step()                          # now every rank holds its shard's state
    for root in (0, SIZE - 1):
        checks.expect(ValueError, lambda: mpiddp.broadcast_optimizer_state(sharded, root),
                      "zero_stage=1", f"rank(s) {list(range(SIZE))} hold",
                      "optimizer.load_state_dict", "load_sharded_state_dict",
                      "mpiddp.Checkpoint")
    sharded.consolidate_state_dict(to=None)
    whole = sharded.state_dict()

    # Only the last rank holds state (it loaded the whole state on its own): the root's is
    # empty, yet every rank refuses alike.
    fresh = make_optimizer(make_model(), 2)
    if RANK == SIZE - 1:
        m = make_model()
        held = torch.optim.Adam(m.parameters(), lr=0.01)
        F.cross_entropy(m(x[:8]), y[:8]).backward()
        held.step()
        fresh.load_state_dict(held.state_dict())
    checks.expect(ValueError, lambda: mpiddp.broadcast_optimizer_state(fresh, 0),
                  "zero_stage=2", f"rank(s) {[SIZE - 1]} hold")

    # Stage 0: consolidate_state_dict exists, checks `to`, and changes nothing.
    m = make_model()
    unsharded = make_optimizer(m, 0)
    F.cross_entropy(m(x[:8]), y[:8]).backward()
    unsharded.step()
    before = unsharded.state_dict()
    for to in (0, SIZE - 1, None):
        unsharded.consolidate_state_dict(to=to)
    unsharded.consolidate_state_dict()
    for bad in (SIZE, -1, True, "0"):
        checks.expect(ValueError, lambda: unsharded.consolidate_state_dict(to=bad),
                      "consolidate_state_dict", f"0 to {SIZE - 1}")
        checks.expect(ValueError, lambda: sharded.consolidate_state_dict(to=bad),
                      "consolidate_state_dict", f"0 to {SIZE - 1}")
    assert_same_optimizer(before, unsharded.state_dict(), "stage 0 consolidate")
    mpiddp.broadcast_optimizer_state(unsharded, root_rank=0)        # stage 0 as before
    assert_same_optimizer(before, unsharded.state_dict(), "stage 0 broadcast")
    assert whole["state"], whole
    checks.ok("broadcast_optimizer_state: sharded, the root's hyperparameters and no state; "
              "refused on every rank where any holds state; consolidate_state_dict at "
              "stage 0", RANK)


def save_mode():
    if RANK == 0:
        os.makedirs(DIRECTORY, exist_ok=True)
        for name in os.listdir(DIRECTORY):
            os.unlink(path(name))
    mpiddp.barrier()
    check_broadcast_optimizer_state()

    reference, resumed, stop = train(0, path("reference.pt"))
    assert not resumed and stop is None
    stops = {}
    for stage in (0, 2):
        ckpt, resumed, stop = train(stage, path(f"preempted-{stage}.pt"), PREEMPT_AT)
        assert not resumed                                  # restore() without a file
        assert stop is not None and stop.code == EXIT_PREEMPTED == 75, stop
        assert stop.signum == signal.SIGTERM
        stops[stage] = (stop.epoch, stop.step)
    assert stops[0] == stops[2] == (PREEMPT_AT[0], PREEMPT_AT[1] + 1), stops
    everyone = mpiddp.allgather_object(stops)
    assert all(s == stops for s in everyone), everyone
    if RANK == 0:
        saved = {stage: load(path(f"preempted-{stage}.pt")) for stage in (0, 2)}
        assert (saved[2]["epoch"], saved[2]["step"], saved[2]["ranks"]) == \
            (PREEMPT_AT[0], PREEMPT_AT[1] + 1, SIZE)
        assert len(saved[2]["rng"]) == SIZE
        assert_same_checkpoint(saved[0], saved[2], "preempted: stage 2 against stage 0")
        shutil.copy(path("preempted-2.pt"), path("for-3-ranks.pt"))
        shutil.copy(path("preempted-2.pt"), path("stage2-into-stage0.pt"))
        shutil.copy(path("preempted-0.pt"), path("stage0-into-stage2.pt"))
    mpiddp.barrier()
    checks.ok("Checkpoint at stage 2: restore() without a file; SIGTERM on one rank stops "
              "every rank at the same step (status 75), the file bitwise stage 0's", RANK,
              stopped_at=stops[2])

    for stage, file in ((2, "preempted-2.pt"), (2, "stage0-into-stage2.pt"),
                        (0, "stage2-into-stage0.pt")):
        ckpt, resumed, stop = train(stage, path(file))
        assert resumed and stop is None and ckpt.ranks == SIZE
        if RANK == 0:
            assert_same_checkpoint(load(path("reference.pt")), load(path(file)),
                                   f"resumed at stage {stage} from {file}")
        mpiddp.barrier()
    checks.ok("mid-epoch resume: stage 2 from stage 2's and stage 0's files, stage 0 from "
              "stage 2's, each bitwise the uninterrupted stage-0 run", RANK)


def restore_mode():
    """The 2-rank stage-2 preemption file, restored at this rank count."""
    finished = {}
    # Many small chunks of the whole state in flight, not one.
    mpiddp.torch.sharding.state.BROADCAST_CHUNK_BYTES = 256
    for stage in (2, 0):
        file = path(f"for-3-ranks-{stage}.pt")
        if RANK == 0:
            shutil.copy(path("for-3-ranks.pt"), file)
        mpiddp.barrier()
        saved = load(file)                  # every rank reads it (one machine here)
        model, optimizer, loader, ckpt = checkpointed(stage, file)
        assert ckpt.restore() and ckpt.ranks == saved["ranks"] == 2 != SIZE
        assert (ckpt.epoch, ckpt.step) == (saved["epoch"], saved["step"] * 2 // SIZE)
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, saved["model"][name]), name
        optimizer.consolidate_state_dict(to=0)
        if RANK == 0:
            assert_same_optimizer(saved["optimizer"], optimizer.state_dict(),
                                  f"restored at stage {stage} on {SIZE} ranks")
        for epoch in ckpt.epochs(EPOCHS):
            for step, (x, y) in ckpt.batches(loader, epoch):
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
            ckpt.save(epoch + 1)
        finished[stage] = file
    if RANK == 0:
        a, b = load(finished[2]), load(finished[0])
        assert_same_checkpoint(a, b, f"finished on {SIZE} ranks: stage 2 against stage 0")
    mpiddp.barrier()
    checks.ok(f"a stage-2 checkpoint of 2 ranks restored on {SIZE} (stage 2 and 0): the "
              "optimizer state exactly the file's; both finish bitwise alike", RANK)


if MODE == "save":
    save_mode()
else:
    restore_mode()
mpiddp.shutdown()
