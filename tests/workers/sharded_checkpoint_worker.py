"""``mpiddp.Checkpoint(..., sharded=True)``: every rank writes its part, the manifest last.

Run with ``MPIDDP_ALLREDUCE_ALGORITHM=ring``. The model (tests/workers/zero_model.py, plus a
buffer the loop changes): a frozen layer, a tied weight, a layer used on even steps only.
Arguments: MODE DIR [STAGE].

save DIR STAGE (4 ranks): an uninterrupted whole-file run; a sharded run that SIGTERM on the
  last rank stops mid-epoch (status 75, the manifest naming that save and the epoch's end
  save before it), and the whole file of that same state beside it (for the converter, run by
  the test); the sharded checkpoint resumed at 4 ranks ends bitwise as the uninterrupted run.
resume DIR STAGE (3 ranks): the 4-rank preemption state resumed from the whole file and from
  the sharded checkpoint: both hold the whole file's state exactly, and end bitwise alike;
  (stage 3) the sharded save restored at stages 0 and 2 holds it too.
kill DIR (3 ranks): a complete sharded save at the end of epoch 1 (and its whole file); at the
  next save rank 1 kills itself (SIGKILL) once its part is on disk, before the manifest.
after-kill DIR (2 ranks): the manifest still names the first save, which resumes exactly; the
  next save removes the crashed one; with a part of the newest save gone, restore falls back
  to the one before; a rank that cannot write its part fails the save on every rank.
"""
import json
import os
import shutil
import signal
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import checks
import mpiddp
import zero_model
from mpiddp import checkpoint_files
from mpiddp.checkpoint import EXIT_PREEMPTED, Preempted, ResumableSampler

torch.set_num_threads(1)
mpiddp.init()
RANK, SIZE = mpiddp.rank(), mpiddp.size()
MODE, DIRECTORY = sys.argv[1], sys.argv[2]
STAGE = int(sys.argv[3]) if len(sys.argv) > 3 else 2
EPOCHS, BATCH = 2, 3
PREEMPT_AT = (1, 2)         # (epoch, step): the last rank signals itself there


def path(*names: str) -> str:
    return os.path.join(DIRECTORY, *names)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    return TensorDataset(torch.randint(0, zero_model.VOCAB, (72, 4), generator=g),
                         torch.randint(0, zero_model.VOCAB, (72,), generator=g))


def make(stage: int, file: str, sharded: bool):
    """A fresh model (with a buffer), its optimizer and loader, and ``Checkpoint(file)``."""
    model, optimizer = zero_model.pair(stage, "adam")
    model.register_buffer("seen", torch.zeros(3))
    model.register_buffer("scratch", torch.zeros(2), persistent=False)
    data = dataset()
    sampler = ResumableSampler(data, num_replicas=SIZE, rank=RANK, seed=0)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    ckpt = mpiddp.Checkpoint(file, model=model, optimizer=optimizer, sampler=sampler,
                             sharded=sharded)
    return model, optimizer, loader, ckpt


def train(model, optimizer, loader, ckpt, preempt_at=None):
    """Train to the end of EPOCHS from where ``ckpt`` is (restored or not), saving at each
    epoch's end; returns the Preempted raised, or None."""
    try:
        for epoch in ckpt.epochs(EPOCHS):
            for step, (tokens, labels) in ckpt.batches(loader, epoch):
                if (epoch, step) == preempt_at and RANK == SIZE - 1:
                    os.kill(os.getpid(), signal.SIGTERM)       # acted on after this step
                optimizer.zero_grad()
                F.cross_entropy(model(tokens, step), labels).backward()
                optimizer.step()
                model.seen += 1
                ckpt.extra["steps"] = ckpt.extra.get("steps", 0) + 1
            ckpt.save(epoch + 1)
    except Preempted as stop:
        return stop
    return None


def whole_state(model, optimizer):
    """Rank 0: (model state, optimizer state), consolidated (None elsewhere)."""
    if not mpiddp.torch.core.sharded_registry.zero_stage_of(optimizer):
        return model.state_dict(), optimizer.state_dict()
    with mpiddp.torch.sharding.optimizer.consolidated(optimizer, to=0):
        if RANK == 0:
            return ({k: v.clone() for k, v in model.state_dict().items()},
                    optimizer.state_dict())
    return None


def assert_same(a, b, what: str) -> None:
    """Bitwise equal (model state, optimizer state) pairs."""
    (model_a, opt_a), (model_b, opt_b) = a, b
    assert sorted(model_a) == sorted(model_b), (what, sorted(model_a), sorted(model_b))
    for key, tensor in model_a.items():
        assert torch.equal(tensor, model_b[key]), (what, key)
    assert opt_a["param_groups"] == opt_b["param_groups"], what
    assert sorted(opt_a["state"]) == sorted(opt_b["state"]), what
    for index, values in opt_a["state"].items():
        assert sorted(values) == sorted(opt_b["state"][index]), (what, index)
        for key, value in values.items():
            assert torch.equal(value, opt_b["state"][index][key]), (what, index, key)


def from_file(file: str):
    saved = torch.load(file, weights_only=False)
    return saved["model"], saved["optimizer"]


def manifest(file: str) -> dict:
    with open(file) as f:
        return json.load(f)


def clear():
    if RANK == 0:
        shutil.rmtree(DIRECTORY, ignore_errors=True)
        os.makedirs(DIRECTORY)
    mpiddp.barrier()


def save_mode():
    clear()
    model, optimizer, loader, ckpt = make(STAGE, path("reference.pt"), False)
    assert not ckpt.restore()
    assert train(model, optimizer, loader, ckpt) is None
    reference = whole_state(model, optimizer)

    os.makedirs(path("preempted"), exist_ok=True)
    model, optimizer, loader, ckpt = make(STAGE, path("preempted", "sharded.pt"), True)
    assert not ckpt.restore()
    stop = train(model, optimizer, loader, ckpt, PREEMPT_AT)
    assert stop is not None and stop.code == EXIT_PREEMPTED == 75, stop
    assert (stop.epoch, stop.step) == (PREEMPT_AT[0], PREEMPT_AT[1] + 1), stop
    # The whole file of the same state (nothing random happened since: the same rng).
    whole = mpiddp.Checkpoint(path("preempted", "whole.pt"), model=model,
                              optimizer=optimizer)
    whole.extra = dict(ckpt.extra)
    whole.save(stop.epoch, stop.step)
    state = whole_state(model, optimizer)
    if RANK == 0:
        saved = manifest(path("preempted", "sharded.pt"))
        assert [s["directory"] for s in saved["saves"]] == \
            ["sharded.pt.parts/save-2", "sharded.pt.parts/save-1"], saved
        assert saved["saves"][0]["world_size"] == SIZE and saved["step"] == stop.step
        assert sorted(os.listdir(path("preempted", "sharded.pt.parts", "save-2"))) == \
            [f"rank-{r}.pt" for r in range(SIZE)]
        assert_same(from_file(path("preempted", "whole.pt")), state, "the whole file")
        shutil.copytree(path("preempted"), path("resume-4"))
    mpiddp.barrier()
    checks.ok(f"stage {STAGE}: SIGTERM stops a sharded run at the same step on every rank "
              "(status 75); every rank wrote its part, the manifest names it and the save "
              "before", RANK, stopped_at=[stop.epoch, stop.step])

    model, optimizer, loader, ckpt = make(STAGE, path("resume-4", "sharded.pt"), True)
    assert ckpt.restore() and ckpt.ranks == SIZE and (ckpt.epoch, ckpt.step) == \
        (stop.epoch, stop.step)
    assert train(model, optimizer, loader, ckpt) is None
    final = whole_state(model, optimizer)
    if RANK == 0:
        assert_same(reference, final, "resumed at the same rank count")
        assert ckpt.extra["steps"] == reference_steps()
    mpiddp.barrier()
    checks.ok(f"stage {STAGE}: the sharded checkpoint resumed at {SIZE} ranks ends bitwise as "
              "the uninterrupted run", RANK)


def reference_steps() -> int:
    return torch.load(path("reference.pt"), weights_only=False)["extra"]["steps"]


def resume_mode():
    saved_from = torch.load(path("preempted", "whole.pt"), weights_only=False)
    finals = {}
    for form in ("whole", "sharded"):
        directory = path(f"resume-{SIZE}-{form}")
        if RANK == 0:
            shutil.rmtree(directory, ignore_errors=True)
            shutil.copytree(path("preempted"), directory)
        mpiddp.barrier()
        model, optimizer, loader, ckpt = make(STAGE, os.path.join(directory, f"{form}.pt"),
                                              form == "sharded")
        assert ckpt.restore() and ckpt.ranks == saved_from["ranks"] != SIZE
        assert (ckpt.epoch, ckpt.step) == (saved_from["epoch"],
                                           saved_from["step"] * saved_from["ranks"] // SIZE)
        assert ckpt.extra == saved_from["extra"], (ckpt.extra, saved_from["extra"])
        restored = whole_state(model, optimizer)
        if RANK == 0:
            assert_same((saved_from["model"], saved_from["optimizer"]), restored,
                        f"restored from the {form} checkpoint at {SIZE} ranks")
        assert train(model, optimizer, loader, ckpt) is None
        finals[form] = whole_state(model, optimizer)
    if RANK == 0:
        assert_same(finals["whole"], finals["sharded"], f"finished at {SIZE} ranks")
        assert manifest(path(f"resume-{SIZE}-sharded", "sharded.pt"))["saves"][0][
            "world_size"] == SIZE
    mpiddp.barrier()
    checks.ok(f"stage {STAGE}: the {saved_from['ranks']}-rank state resumed at {SIZE} ranks "
              "from the sharded checkpoint holds the whole file's exactly and ends bitwise as "
              "from the whole file", RANK)
    if STAGE != 3:
        return
    for stage in (0, 2):
        model, optimizer, _, ckpt = make(stage, path("preempted", "sharded.pt"), True)
        assert ckpt.restore()
        restored = whole_state(model, optimizer)
        if RANK == 0:
            assert_same((saved_from["model"], saved_from["optimizer"]), restored,
                        f"the stage-3 sharded save restored at stage {stage}")
        mpiddp.barrier()
    checks.ok("the stage-3 sharded save restored at stages 0 and 2 holds the whole file's state",
              RANK)


def kill_mode():
    clear()
    model, optimizer, loader, ckpt = make(2, path("run.pt"), True)
    whole = mpiddp.Checkpoint(path("epoch-1.pt"), model=model, optimizer=optimizer)
    assert not ckpt.restore()
    write_part, saves = checkpoint_files.write_part, []

    def write_then_die(directory, rank, part):
        write_part(directory, rank, part)
        saves.append(directory)
        if len(saves) == 2 and RANK == 1:
            print(f"rank 1: wrote its part of {os.path.basename(directory)}, killing itself",
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint_files.write_part = write_then_die
    original_save = ckpt.save

    def save_both(epoch, step=0, **extra):
        if epoch == 1:
            whole.save(epoch)
        original_save(epoch, step, **extra)
        checks.ok(f"the sharded save of epoch {epoch} complete", RANK)   # (the first only)
    ckpt.save = save_both
    train(model, optimizer, loader, ckpt)
    raise AssertionError("the job should have died in the second save")


def after_kill_mode():
    run = path("run.pt")
    if RANK == 0:
        saved = manifest(run)
        assert [s["directory"] for s in saved["saves"]] == ["run.pt.parts/save-1"], saved
        assert "rank-1.pt" in os.listdir(path("run.pt.parts", "save-2"))
    mpiddp.barrier()
    expected = from_file(path("epoch-1.pt"))
    model, optimizer, loader, ckpt = make(2, run, True)
    assert ckpt.restore() and (ckpt.epoch, ckpt.step, ckpt.ranks) == (1, 0, 3)
    restored = whole_state(model, optimizer)
    if RANK == 0:
        assert_same(expected, restored, "resumed after the killed save")
    assert train(model, optimizer, loader, ckpt) is None
    if RANK == 0:
        saved = manifest(run)
        assert [s["directory"] for s in saved["saves"]] == \
            ["run.pt.parts/save-3", "run.pt.parts/save-1"], saved
        assert sorted(os.listdir(path("run.pt.parts"))) == ["save-1", "save-3"]
    mpiddp.barrier()
    checks.ok("a save killed before its manifest: the previous checkpoint resumes exactly; "
              "the next save removes the crashed one", RANK)

    if RANK == 0:
        os.unlink(path("run.pt.parts", "save-3", "rank-1.pt"))
    mpiddp.barrier()
    model, optimizer, loader, ckpt = make(2, run, True)
    assert ckpt.restore() and (ckpt.epoch, ckpt.ranks) == (1, 3)
    restored = whole_state(model, optimizer)
    if RANK == 0:
        assert_same(expected, restored, "fell back to the save before")
    mpiddp.barrier()
    checks.ok("a part of the newest save missing: restore falls back to the save before", RANK)

    # A rank that cannot write its part: OSError on every rank, the manifest as it was.
    before = open(run).read() if RANK == 0 else None
    write_part = checkpoint_files.write_part

    def full_disk(directory, rank, part):
        if rank == 1:
            raise OSError(28, "No space left on device")
        write_part(directory, rank, part)
    checkpoint_files.write_part = full_disk
    checks.expect(OSError, lambda: ckpt.save(2), "rank 1: [Errno 28] No space left",
                  "still names the previous checkpoint")
    checkpoint_files.write_part = write_part
    if RANK == 0:
        assert open(run).read() == before
    mpiddp.barrier()
    checks.ok("a rank that cannot write its part: OSError on every rank, the checkpoint as "
              "it was", RANK)


{"save": save_mode, "resume": resume_mode, "kill": kill_mode,
 "after-kill": after_kill_mode}[MODE]()
mpiddp.shutdown()
