"""Elastic training worker: train a tiny model with ElasticSampler and elastic.State.

    elastic_worker.py DIR EPOCHS [--stop-at STEP] [--die-at STEP] [--commit-every N]
                      [--zero-stage S[,S...]]

Restores from DIR, trains, commits every N steps, and appends every sample id a rank trains
to DIR/ids.<run>.<rank> (one per line, with the epoch). ``--stop-at`` commits and ends every
rank cleanly after that global step (a planned resize); ``--die-at`` SIGKILLs the last rank
after that step (a lost rank, for the launcher's relaunch; with ``--freeze`` it SIGSTOPs
itself: a rank that stops answering, found by the lost-peer watchdog). At the end it reports the
parameters' checksum on every rank. Several stages (``--zero-stage 0,2``) train side by side in
one launch, a step of each in turn, each from the same start in ``DIR/stage<S>``; their
reports name the stage (``restored stage 2``).
"""
import argparse
import os
import signal
import sys

import torch

import checks
import mpiddp
from mpiddp.elastic import ElasticSampler, State

DATASET = 103          # not a multiple of any rank count x batch: short last batches


def main():
    p = argparse.ArgumentParser()
    p.add_argument("directory")
    p.add_argument("epochs", type=int)
    p.add_argument("--stop-at", type=int)
    p.add_argument("--die-at", type=int)
    p.add_argument("--die-runs", type=int, default=1,
                   help="die in the first K runs, run k at step k x --die-at")
    p.add_argument("--freeze", action="store_true", help="--die-at freezes (SIGSTOP) instead")
    p.add_argument("--commit-every", type=int, default=1)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--zero-stage", default="0",
                   help="shard the optimizer state; a comma list trains each side by side")
    args = p.parse_args()
    mpiddp.init()
    stages = [int(stage) for stage in args.zero_stage.split(",")]
    trainings = [train(args, stage, "") for stage in stages] if len(stages) == 1 else \
        [train(args, stage, f" stage {stage}") for stage in stages]
    while trainings:                        # a step of each in turn
        for training in list(trainings):
            if next(training, None) is None:
                trainings.remove(training)
    return 0


def train(args, stage: int, tag: str):
    """One training (a generator: it yields after each step); ``tag`` ends its reports' names
    and chooses its directory (``DIR/stage<S>`` when there are several)."""
    directory = args.directory if not tag else os.path.join(args.directory, f"stage{stage}")
    os.makedirs(directory, exist_ok=True)
    rank, size = mpiddp.rank(), mpiddp.size()
    torch.manual_seed(rank)                 # different until restore/sync makes them equal
    data = torch.randn(DATASET, 5, generator=torch.Generator().manual_seed(0))
    target = data.sum(1, keepdim=True)
    model = torch.nn.Linear(5, 1)
    optimizer = mpiddp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01 * size, momentum=0.9),
        named_parameters=model.named_parameters(), zero_stage=stage)
    sampler = ElasticSampler(DATASET, args.batch, seed=7)
    state = State(model, optimizer, sampler=sampler, directory=directory, runs=0)
    restored = state.restore()
    state.runs += 1
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    everywhere = mpiddp.allgather(flat.unsqueeze(0), name=f"check.params{tag}")
    assert all(torch.equal(row, flat) for row in everywhere), \
        f"rank {rank}: parameters differ across ranks after restore: {everywhere}"
    if stage:
        optimizer.consolidate_state_dict(to=None)
    momentum = [s["momentum_buffer"] for s in optimizer.state_dict()["state"].values()]
    if momentum:
        mom = torch.cat([m.flatten() for m in momentum])
        gathered = mpiddp.allgather(mom.unsqueeze(0), name=f"check.momentum{tag}")
        assert all(torch.equal(row, mom) for row in gathered), \
            f"rank {rank}: optimizer momentum differs across ranks after restore"
    checks.ok(f"restored{tag}", rank, restored=restored, epoch=state.epoch, step=state.step,
              consumed=state.consumed, size=size, runs=state.runs)
    ids = open(os.path.join(directory, f"ids.{state.runs}.{rank}"), "w")
    start_epoch = state.epoch
    for epoch in range(start_epoch, args.epochs):
        state.epoch = epoch
        sampler.set_epoch(epoch, consumed=state.consumed if epoch == start_epoch else 0)
        for batch in sampler:
            x, y = data[batch], target[batch]
            optimizer.zero_grad()
            loss = ((model(x) - y) ** 2).sum() / max(1, len(batch))
            loss.backward()
            optimizer.step()
            ids.write("".join(f"{epoch} {i}\n" for i in batch))
            ids.flush()
            state.step += 1
            if state.step % args.commit_every == 0:
                state.commit()
            if args.stop_at is not None and state.step == args.stop_at:
                state.commit()
                state.wait()
                mpiddp.barrier()
                checks.ok(f"stopped{tag}", rank, step=state.step, consumed=state.consumed)
                return
            if args.die_at is not None and state.runs <= args.die_runs and \
                    state.step == args.die_at * state.runs:
                state.wait()
                mpiddp.barrier()
                if rank == size - 1:
                    os.kill(os.getpid(), signal.SIGSTOP if args.freeze else signal.SIGKILL)
            yield True
        state.consumed = 0
    state.epoch = args.epochs
    state.commit()
    state.wait()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    checks.ok(f"finished{tag}", rank, every_rank=True, params=flat.tolist(), step=state.step)


if __name__ == "__main__":
    sys.exit(main())
