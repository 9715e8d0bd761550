"""Checkpoint, preemption and resume with mpiddp.Checkpoint (docs/checkpointing.md).

Trains a small classifier on synthetic data with a warm-up + cosine learning-rate schedule
and keeps values of its own in the checkpoint. `--preempt-after N` makes rank 0 send itself
SIGUSR1 after N steps, as a scheduler would before the time limit: every rank stops at the
same step, the checkpoint is written and the job exits with status 75. Run it again to go on
from there, on the same or another number of ranks.

    mpiexec -n 2 python examples/checkpoint_resume.py --preempt-after 40; echo "exit $?"
    mpiexec -n 2 python examples/checkpoint_resume.py      # goes on where it stopped
"""
# test-args: --checkpoint {tmp}/checkpoint_resume.pt
import argparse
import math
import os
import signal
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import mpiddp
from mpiddp.checkpoint import EXIT_PREEMPTED, Preempted, ResumableSampler


def synthetic_data(n: int, seed: int) -> TensorDataset:
    """n samples of 32 features, labelled by a fixed random linear teacher (10 classes)."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(n, 32, generator=g)
    return TensorDataset(x, (x @ teacher).argmax(1))


def learning_rate(args, epoch: int, step: int, steps_per_epoch: int) -> float:
    """Warm-up over the first epoch, then cosine decay to zero. A function of the position in
    epochs (not of a step counter), so it continues correctly at another rank count; the peak
    is scaled by this run's number of ranks."""
    done = epoch + step / steps_per_epoch                       # epochs done, fractional
    peak = args.lr * mpiddp.size()
    if done < 1:
        return peak * max(done, 1 / steps_per_epoch)
    return peak * 0.5 * (1 + math.cos(math.pi * (done - 1) / max(1, args.epochs - 1)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank and step")
    p.add_argument("--lr", type=float, default=0.05, help="peak for one rank; x size()")
    p.add_argument("--checkpoint", default="checkpoints/checkpoint_resume.pt")
    p.add_argument("--preempt-after", type=int, default=0, metavar="N",
                   help="rank 0 sends itself SIGUSR1 after N steps of this run (0: never)")
    args = p.parse_args()

    mpiddp.init()
    torch.manual_seed(0)
    train_set, test_set = synthetic_data(4096, seed=0), synthetic_data(1024, seed=1)
    sampler = ResumableSampler(train_set, num_replicas=mpiddp.size(), rank=mpiddp.rank())
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    steps_per_epoch = len(loader)

    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(),
                                torch.nn.Dropout(0.1), torch.nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    optimizer = mpiddp.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    ckpt = mpiddp.Checkpoint(args.checkpoint, model=model, optimizer=optimizer, sampler=sampler)
    if ckpt.restore() and mpiddp.rank() == 0:
        print(f"resumed in epoch {ckpt.epoch + 1} after step {ckpt.step} of {steps_per_epoch} "
              f"(checkpoint written by {ckpt.ranks} rank(s); best accuracy so far "
              f"{ckpt.extra.get('best', 0.0):.4f})", flush=True)

    steps_this_run = 0
    for epoch in ckpt.epochs(args.epochs):
        # The epoch's loss so far: rank 0's sum and step count (0 unless resumed part-way).
        loss_sum, losses = (ckpt.extra.get("loss_sum", 0.0), ckpt.extra.get("losses", 0)) \
            if ckpt.step else (0.0, 0)
        for step, (x, y) in ckpt.batches(loader, epoch):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(args, epoch, step - 1, steps_per_epoch)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            loss_sum, losses = loss_sum + loss.item(), losses + 1
            ckpt.extra.update(loss_sum=loss_sum, losses=losses)   # saved if preempted
            steps_this_run += 1
            if steps_this_run == args.preempt_after and mpiddp.rank() == 0:
                os.kill(os.getpid(), signal.SIGUSR1)  # as `scancel --signal=USR1` would

        model.eval()
        with torch.no_grad():
            x, y = test_set.tensors
            accuracy = (model(x).argmax(1) == y).float().mean().item()
        model.train()
        best = max(accuracy, ckpt.extra.get("best", 0.0))
        ckpt.save(epoch + 1, accuracy=accuracy, best=best, loss_sum=0.0, losses=0)
        if mpiddp.rank() == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: mean loss {loss_sum / losses:.4f} "
                  f"(rank 0), test accuracy {accuracy:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Preempted as stop:
        if mpiddp.rank() == 0:
            print(stop, flush=True)
        sys.exit(EXIT_PREEMPTED)
