"""Elastic training: snapshots every few steps, resumed on whatever ranks are left.

    mpiexec -n 2 python examples/elastic_training.py --fresh
    python -m mpiddp.run --hosts localhost:1,127.0.0.1:1 --min-nodes 1 -- \\
        python examples/elastic_training.py --fresh --step-delay 0.05

Under `python -m mpiddp.run` a lost node ends the run and the launcher starts it again on the
nodes left; restore() then picks up the newest snapshot. docs/elastic.md explains each part.
"""
# test-args: --fresh --snapshots {tmp}/snapshots
import argparse
import os
import shutil
import time

import torch
import torch.nn.functional as F

import mpiddp
from mpiddp.elastic import ElasticSampler, State


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--snapshots", default="checkpoints/elastic_example")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--commit-every", type=int, default=10, help="steps between snapshots")
    p.add_argument("--step-delay", type=float, default=0.0,
                   help="seconds of extra work per step (time to kill a rank by hand)")
    p.add_argument("--fresh", action="store_true",
                   help="a new job: delete old snapshots at the first launch (not at relaunches)")
    args = p.parse_args()

    mpiddp.init()
    relaunch = int(os.environ.get("MPIDDP_ELASTIC_RESTART", "0"))   # set by mpiddp.run
    print(f"rank {mpiddp.rank()} of {mpiddp.size()}: pid {os.getpid()}, launch {relaunch}",
          flush=True)
    if args.fresh and relaunch == 0 and mpiddp.local_rank() == 0:
        shutil.rmtree(args.snapshots, ignore_errors=True)
    mpiddp.barrier()

    torch.manual_seed(0)                           # the same data set on every rank
    x = torch.randn(3000, 32)
    train_set = torch.utils.data.TensorDataset(x, (x[:, :4].sum(1) > 0).long())
    batch_size, epochs = 32, args.epochs
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * mpiddp.size(), momentum=0.9)
    optimizer = mpiddp.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    def train_step(batch):                         # batch: this rank's sample indices
        xb, yb = train_set[batch]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(xb), yb, reduction="sum") / max(1, len(batch))
        loss.backward()                            # an empty last batch adds zero gradients
        optimizer.step()
        time.sleep(args.step_delay)

    sampler = ElasticSampler(len(train_set), batch_size, seed=0)     # a batch sampler
    state = State(model, optimizer, sampler=sampler, directory=args.snapshots,
                  samples_done=0)                  # extras: any names
    state.restore()                                # collective: the newest snapshot, any ranks
    for epoch in range(state.epoch, epochs):
        state.epoch = epoch
        sampler.set_epoch(epoch, consumed=state.consumed)
        for batch in sampler:                      # indices of this rank's batch
            train_step(batch)
            state.samples_done += batch_size * mpiddp.size()
            state.step += 1
            if state.step % args.commit_every == 0:
                state.commit()                     # host copy now, durable write in the background
        state.epoch, state.consumed = epoch + 1, 0
        state.commit()                             # the end of an epoch
    state.wait()                                   # the last writes are done

    if mpiddp.rank() == 0:
        print(f"done: {state.epoch} epochs, {state.step} steps on {mpiddp.size()} rank(s), "
              f"{state.samples_done} samples")


if __name__ == "__main__":
    main()
