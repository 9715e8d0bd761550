"""Data-parallel training with mpiddp, written the way a user writes it.

    mpiexec -n 8 python scripts/train.py                 # train, print the test accuracy
    mpiexec -n 8 python scripts/train.py --resume        # go on from the last checkpoint

Every rank trains the same model on its own share of the data (DistributedSampler); the
DistributedOptimizer averages gradients across ranks while backward runs. The data is
scikit-learn's bundled handwritten-digits set (1797 8x8 images, 10 classes): nothing to
download. Progress bars and logs come from rank 0 only; evaluation metrics are summed
over every rank's share of the test set; rank 0 writes the checkpoint.

Any rank count works: the learning rate is scaled by the number of ranks (the global batch
grows with it) after a short warm-up, following Goyal et al., "Accurate, Large Minibatch SGD".

Batch jobs: SIGTERM or SIGUSR1 (a scheduler's warning before preemption or the time limit) on
any rank makes every rank stop at the same step boundary; rank 0 writes a checkpoint of the
exact position (epoch, batch, model, optimizer, every rank's random state) and the job exits
with status 75 (EX_TEMPFAIL) so that the job script can requeue it. ``--resume`` goes on from
there and, on the same number of ranks, ends with the same parameters, bit for bit, as a run
that was never interrupted.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset, TensorDataset

import mpiddp
from mpiddp.checkpoint import ResumableSampler


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--epochs", type=int, default=12, help="epochs to train in total")
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    p.add_argument("--base-lr", type=float, default=0.02,
                   help="learning rate for one rank; scaled by the number of ranks")
    p.add_argument("--warmup-epochs", type=float, default=1.0,
                   help="epochs of linear warm-up to the scaled learning rate")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--fp16-allreduce", action="store_true",
                   help="reduce gradients in float16 (Compression.fp16)")
    p.add_argument("--checkpoint", default="checkpoints/digits.pt",
                   help="checkpoint file (written by rank 0 after every epoch)")
    p.add_argument("--resume", action="store_true",
                   help="continue from --checkpoint if it exists")
    p.add_argument("--stop-after", type=int, default=None, metavar="N",
                   help="stop after N epochs in this run (to fit a job's time limit); the "
                        "next run with --resume goes on from the checkpoint")
    p.add_argument("--min-accuracy", type=float, default=None,
                   help="exit with status 2 if the final test accuracy is lower")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def load_digits_split(seed: int):
    """(train, test) tensors of scikit-learn's digits (bundled with scikit-learn)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0      # pixels are 0..16
    y = torch.tensor(digits.target, dtype=torch.int64)
    train_idx, test_idx = train_test_split(range(len(y)), test_size=0.2, random_state=seed,
                                           stratify=digits.target)
    return (x[train_idx], y[train_idx]), (x[test_idx], y[test_idx])


class Net(nn.Module):
    """A small convolutional network for 8x8 grey images."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)
        self.dropout = nn.Dropout(0.2)

    def forward(self, x):
        x = x.view(-1, 1, 8, 8)
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.dropout(F.relu(self.fc1(x.flatten(1))))
        return self.fc2(x)


def threads_per_rank() -> int:
    """Ranks on one node share its cores: give each rank its share, never more (threads of
    different ranks fighting over the same cores slow everyone down)."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    total = os.cpu_count() or 1
    if cores is not None and cores < total:
        return cores                        # the launcher bound this rank to its own cores
    return max(1, total // mpiddp.local_size())


def evaluate(model, loader) -> tuple[float, float]:
    """(mean loss, accuracy) over the whole test set: each rank evaluates its share and the
    sums are all-reduced, so every rank gets the same exact numbers."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)       # loss sum, correct, count
    with torch.no_grad():
        for x, y in loader:
            out = model(x)
            totals[0] += F.cross_entropy(out, y, reduction="sum").item()
            totals[1] += (out.argmax(1) == y).sum().item()
            totals[2] += len(y)
    totals = mpiddp.allreduce(totals, op=mpiddp.Sum, name="eval.totals")
    model.train()
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def log(*args):
    if mpiddp.rank() == 0:
        print(*args, flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    mpiddp.init()
    rank, size = mpiddp.rank(), mpiddp.size()
    torch.set_num_threads(threads_per_rank())
    torch.manual_seed(args.seed)           # same initial weights (broadcast makes sure)

    # Rank 0 reads the data set and sends it to the others: importing scikit-learn costs each
    # process a second or two of CPU, which adds up with many ranks on few cores.
    data = load_digits_split(args.seed) if rank == 0 else None
    train_set, test_set = (TensorDataset(*tensors) for tensors in
                           mpiddp.broadcast_object(data, root_rank=0, name="dataset"))
    sampler = ResumableSampler(train_set, num_replicas=size, rank=rank, shuffle=True,
                               seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    # Test set: rank r takes every size-th sample (no padding, so the metrics are exact).
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), size)),
                             batch_size=256)

    model = Net()
    lr = args.base_lr * size                # the global batch is size x batch_size
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    optimizer = mpiddp.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=mpiddp.Compression.fp16 if args.fp16_allreduce else mpiddp.Compression.none)
    steps_per_epoch = len(train_loader)
    warmup_steps = max(1, int(args.warmup_epochs * steps_per_epoch))
    total_steps = args.epochs * steps_per_epoch

    def lr_factor(step: int) -> float:
        """Linear warm-up to the scaled rate, then cosine decay to zero at the last step."""
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    # Resume: rank 0 reads the checkpoint; everything it holds reaches the other ranks by
    # broadcast, so the file need not be on a shared file system. Without a checkpoint the
    # same broadcast gives every rank rank 0's initial weights.
    ckpt = mpiddp.Checkpoint(args.checkpoint, model=model, optimizer=optimizer, sampler=sampler)
    resumed = args.resume and ckpt.restore()
    if not args.resume:                     # a fresh start: every rank takes rank 0's weights
        mpiddp.broadcast_parameters(model.state_dict(), root_rank=0)
        mpiddp.broadcast_optimizer_state(optimizer, root_rank=0)
    if args.resume:
        log(f"resuming from {args.checkpoint}: {ckpt.epoch} epoch(s) "
            f"{'and ' + str(ckpt.step) + ' step(s) ' if ckpt.step else ''}done on "
            f"{ckpt.ranks} rank(s), test accuracy then {ckpt.extra['accuracy']:.4f}"
            if resumed else f"no checkpoint at {args.checkpoint}: starting from scratch")
    start_epoch, start_step = ckpt.epoch, ckpt.step

    # The schedule's position is rebuilt from the steps done and *this* run's rank count,
    # never restored from the checkpoint: with another number of ranks both the scaled rate
    # and the steps per epoch change, and a restored step count would put the cosine at the
    # wrong place (or past its end: lr 0 for the rest of the run).
    for group in optimizer.param_groups:
        group["initial_lr"] = lr
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_factor, last_epoch=start_epoch * steps_per_epoch + start_step - 1)
    if ckpt.ranks != size:
        log(f"the checkpoint was written on {ckpt.ranks} rank(s), this run has {size}: "
            f"learning rate rescaled to {lr:g} and the schedule continued at epoch "
            f"{start_epoch + 1} of {args.epochs} ({steps_per_epoch} steps per epoch now)"
            + ("; dropout masks are drawn afresh" if start_step else ""))

    log(f"training on {size} rank(s): {len(train_set)} train / {len(test_set)} test samples, "
        f"batch {args.batch_size} per rank ({args.batch_size * size} global), lr {lr:g}, "
        f"epochs {start_epoch + 1}..{args.epochs}")
    accuracy = ckpt.extra.get("accuracy", float("nan"))
    started = time.perf_counter()
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm
    last_epoch = args.epochs if args.stop_after is None else \
        min(args.epochs, start_epoch + args.stop_after)

    for epoch in ckpt.epochs(last_epoch):
        skip = start_step if epoch == start_epoch else 0
        torch.manual_seed(args.seed + 1000 * epoch + rank)   # dropout: per rank and epoch
        # A different shuffle every epoch, the same on all ranks; a resumed epoch skips the
        # samples it had trained on (and goes on with every rank's random state then).
        batches = ckpt.batches(train_loader, epoch)
        if rank == 0 and not args.no_progress:
            batches = tqdm(batches, desc=f"epoch {epoch + 1}/{args.epochs}", leave=False,
                           file=sys.stdout, dynamic_ncols=True, initial=skip,
                           total=steps_per_epoch)
        loss_sum = ckpt.extra.get("loss_sum", 0.0) if skip else 0.0
        try:
            for step, (x, y) in batches:
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                scheduler.step()
                loss_sum += loss.item()
                # Saved with a preemption checkpoint (the schedule only for the record: a
                # resumed run rebuilds it, above).
                ckpt.extra.update(loss_sum=loss_sum, scheduler=scheduler.state_dict())
        except mpiddp.checkpoint.Preempted as stop:
            log(f"{stop}; run again with --resume")
            return mpiddp.checkpoint.EXIT_PREEMPTED
        train_loss = mpiddp.allreduce(torch.tensor([loss_sum / steps_per_epoch],
                                                   dtype=torch.float64), name="train.loss").item()
        test_loss, accuracy = evaluate(model, test_loader)
        log(f"epoch {epoch + 1:3d}/{args.epochs}: train loss {train_loss:.4f}  "
            f"test loss {test_loss:.4f}  test accuracy {accuracy:.4f}  "
            f"lr {optimizer.param_groups[0]['lr']:.3g}  ({time.perf_counter() - started:.1f} s)")
        ckpt.save(epoch + 1, accuracy=accuracy, loss_sum=0.0)

    if start_epoch >= last_epoch:
        _, accuracy = evaluate(model, test_loader)
    if last_epoch < args.epochs:
        log(f"stopping after epoch {last_epoch} of {args.epochs} (--stop-after); test accuracy "
            f"{accuracy:.4f}; continue with --resume")
        return 0
    log(f"final test accuracy {accuracy:.4f} after {args.epochs} epochs on {size} rank(s) "
        f"({time.perf_counter() - started:.1f} s)")
    if args.min_accuracy is not None:
        reached = accuracy >= args.min_accuracy
        log(f"target accuracy {args.min_accuracy}: {'reached' if reached else 'MISSED'}")
        if not reached:
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
