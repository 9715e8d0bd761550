"""``Checkpoint.save`` called on rank 0 alone (under ``if rank == 0:``), on 2 ranks: every rank
ends with one error naming the call and the rank that skipped it, within seconds, at every
``zero_stage``.

Cases, one after another in this launch: at stages 0, 2 and 3 rank 1 trains on (its next
step's collectives) while rank 0 saves; at stage 2 rank 1 shuts down instead (the end of its
script). Last, at stage 2, rank 0 alone calls ``optimizer.consolidate_state_dict(to=0)`` (as under
``if rank == 0:`` before saving by hand). Each rank catches the error and prints ``OK <rank> <case> | {"seconds", "error"}``
(seconds since rank 0 called save, or rank 1 went past it); the engine has stopped on every
rank, so ``shutdown()`` and ``init()`` begin the next case. Default settings but for the
stage-3 case, which runs with ``MPIDDP_STALL_CHECK_TIME=2`` (the call's deadline then 2 s).
"""
import os
import shutil
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import checks
import mpiddp
from mpiddp.checkpoint import ResumableSampler
from mpiddp.errors import EngineShutdownError

torch.set_num_threads(1)
CASES = [(0, "trains"), (2, "trains"), (2, "shuts down"), (3, "trains"),
         (2, "goes on (consolidation)")]
DIRECTORY = tempfile.mkdtemp(prefix="mpiddp-misuse-")


def run_case(stage: int, rank1: str) -> None:
    rank = mpiddp.rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(32, 6)
    data = TensorDataset(x, torch.randint(0, 3, (32,)))
    sampler = ResumableSampler(data, num_replicas=mpiddp.size(), rank=rank)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    optimizer = mpiddp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
        zero_stage=stage, **({"model": model} if stage == 3 else {}))
    ckpt = mpiddp.Checkpoint(os.path.join(DIRECTORY, f"stage{stage}.pt"), model=model,
                             optimizer=optimizer, sampler=sampler)
    ckpt.restore()
    case, start = f"stage {stage}, rank 1 {rank1}", None
    try:
        for epoch in ckpt.epochs(3):
            for _, (xb, yb) in ckpt.batches(loader, epoch):
                optimizer.zero_grad()
                F.cross_entropy(model(xb), yb).backward()
                optimizer.step()
            start = start or time.monotonic()
            if rank == 0 and rank1.endswith("(consolidation)"):
                optimizer.consolidate_state_dict(to=0)      # the same mistake
            elif rank == 0:
                ckpt.save(epoch + 1)        # the mistake: on rank 0 alone
            elif rank1 == "shuts down":
                mpiddp.shutdown()
                checks.ok(case, rank, every_rank=True, seconds=time.monotonic() - start,
                          error="")
                return
            # else rank 1 trains on: its next collective fails
    except EngineShutdownError as exc:
        checks.ok(case, rank, every_rank=True, seconds=time.monotonic() - start,
                  error=str(exc))
        return
    raise AssertionError(f"rank {rank}: {case}: no error")


for stage, rank1 in CASES:
    if stage == 3:
        os.environ["MPIDDP_STALL_CHECK_TIME"] = "2"
    mpiddp.init()
    run_case(stage, rank1)
    mpiddp.shutdown()
shutil.rmtree(DIRECTORY, ignore_errors=True)
