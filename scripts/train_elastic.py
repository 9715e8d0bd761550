"""scripts/train.py's training, elastic: snapshots every N steps, resumable on any rank count.

    python -m mpiddp.run --hosts n1:1,n2:1,n3:1 --min-nodes 2 -- \\
        python scripts/train_elastic.py --snapshots /shared/snap --commit-every 50

Every run restores the newest snapshot in ``--snapshots`` (none: from scratch) and goes on:
the interrupted epoch trains exactly the samples it had not trained (``ElasticSampler``),
parameters and optimizer state come from the snapshot on every rank. With another rank count:

* ``--batch-rule per-rank`` (default): the batch per rank stays, the global batch follows the
  rank count and the learning rate is scaled linearly with it (Goyal et al.);
* ``--batch-rule global``: the global batch stays (``--batch-size`` x the ranks of the first
  run, split over the ranks of this one), and so does the learning rate.

The schedule's position is counted in samples trained, which a resize does not change.
Model, data, evaluation: scripts/train.py (imported, not copied).
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset, TensorDataset

import mpiddp
from mpiddp.elastic import ElasticSampler, State
from train import Net, evaluate, load_digits_split, log, threads_per_rank


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--snapshots", default="checkpoints/elastic", help="snapshot directory")
    p.add_argument("--commit-every", type=int, default=50, help="steps between commits "
                   "(0: only at the end of each epoch)")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    p.add_argument("--batch-rule", choices=["per-rank", "global"], default="per-rank")
    p.add_argument("--base-lr", type=float, default=0.02)
    p.add_argument("--warmup-epochs", type=float, default=1.0)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--min-accuracy", type=float, default=None)
    p.add_argument("--step-delay", type=float, default=0.0,
                   help="seconds of extra work per step (tests: time to break a node)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    mpiddp.init()
    rank, size = mpiddp.rank(), mpiddp.size()
    torch.set_num_threads(threads_per_rank())
    data = load_digits_split(args.seed) if rank == 0 else None
    train_set, test_set = (TensorDataset(*t) for t in
                           mpiddp.broadcast_object(data, root_rank=0, name="dataset"))
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), size)), batch_size=256)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.base_lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    optimizer = mpiddp.DistributedOptimizer(optimizer,
                                            named_parameters=model.named_parameters())
    sampler = ElasticSampler(len(train_set), args.batch_size, seed=args.seed)
    state = State(model, optimizer, sampler=sampler, directory=args.snapshots,
                  samples_done=0, first_size=size, accuracy=float("nan"))
    before_restore = time.perf_counter()
    restored = state.restore()
    restore_s = time.perf_counter() - before_restore
    if args.batch_rule == "global":
        global_batch = args.batch_size * state.first_size
        sampler.batch_size = max(1, global_batch // size)
        lr = args.base_lr * global_batch
    else:
        lr = args.base_lr * size * args.batch_size / 16       # base-lr is for batch 16
    step_samples = sampler.batch_size * size
    total = args.epochs * len(train_set)
    warmup = max(1, int(args.warmup_epochs * len(train_set)))

    def lr_at(samples: int) -> float:
        """Linear warm-up, then cosine decay to zero, in samples trained (resize-proof)."""
        if samples < warmup:
            return lr * (samples + step_samples) / warmup
        return lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (samples - warmup) /
                                                     max(1, total - warmup))))

    log(f"{'restored' if restored else 'no snapshot: starting'} at epoch {state.epoch + 1} "
        f"sample {state.consumed} (commit {state.commits}) in {restore_s:.2f} s; "
        f"{size} rank(s), batch {sampler.batch_size} per rank, lr {lr:g}; "
        f"training again {time.perf_counter() - started:.2f} s after start, at "
        f"{time.strftime('%H:%M:%S')}.{int(time.time() * 1000) % 1000:03d}")
    step_times, commit_times = [], []
    for epoch in range(state.epoch, args.epochs):
        state.epoch = epoch
        sampler.set_epoch(epoch, consumed=state.consumed)
        torch.manual_seed(args.seed + 1000 * epoch + rank + 7919 * state.commits)
        loss_sum, steps = 0.0, 0
        for batch in sampler:
            t0 = time.perf_counter()
            x, y = train_set.tensors[0][batch], train_set.tensors[1][batch]
            for group in optimizer.param_groups:
                group["lr"] = lr_at(state.samples_done)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y, reduction="sum") / max(1, len(batch))
            loss.backward()
            optimizer.step()
            if args.step_delay:
                time.sleep(args.step_delay)
            loss_sum += loss.item()
            steps += 1
            state.samples_done += step_samples
            state.step += 1
            t1 = time.perf_counter()
            if args.commit_every and state.step % args.commit_every == 0:
                state.commit()
                commit_times.append(time.perf_counter() - t1)
            step_times.append(t1 - t0)
        _, accuracy = evaluate(model, test_loader)
        state.accuracy, state.consumed = accuracy, 0
        state.epoch = epoch + 1
        state.commit()
        log(f"epoch {epoch + 1:3d}/{args.epochs}: train loss {loss_sum / max(1, steps):.4f} "
            f"test accuracy {accuracy:.4f} ({time.perf_counter() - started:.1f} s)")
    state.wait()
    accuracy = state.accuracy
    mean_step = sum(step_times) / max(1, len(step_times))
    commit_share = sum(commit_times) / max(1e-9, sum(step_times))
    log(f"final test accuracy {accuracy:.4f} on {size} rank(s); mean step "
        f"{1e3 * mean_step:.2f} ms; commits {len(commit_times)} took "
        f"{1e3 * sum(commit_times) / max(1, len(commit_times)):.2f} ms each on the training "
        f"thread = {100 * commit_share:.2f}% of the step time")
    if args.min_accuracy is not None and not accuracy >= args.min_accuracy:
        log(f"target accuracy {args.min_accuracy}: MISSED")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
