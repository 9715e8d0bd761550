"""Parameters sharded too (docs/sharding.md, stage 3): each rank keeps its chunk of every
parameter, of its gradient and of Adam's state; the full parameters exist only while they
are used. Activation checkpointing, clipping, evaluation and both kinds of checkpoint.

    mpiexec -n 2 python examples/sharding_stage3.py --checkpoints /tmp/stage3
"""
# test-args: --checkpoints {tmp} --min-accuracy 0.9
import argparse
import os

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import mpiddp

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--checkpoints", default="checkpoints")
parser.add_argument("--min-accuracy", type=float, default=0.0)
args = parser.parse_args()


class Net(nn.Module):
    def __init__(self, width=256, blocks=4):
        super().__init__()
        self.embed = nn.Linear(64, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width),
                                                  nn.GELU()) for _ in range(blocks))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            # Recomputed in backward: stage 3 gathers the block's parameters again there.
            h = h + checkpoint(block, h, use_reentrant=False)
        return self.head(h)


mpiddp.init()
torch.manual_seed(0)
digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
y = torch.tensor(digits.target)
data = TensorDataset(x, y)
sampler = DistributedSampler(data, num_replicas=mpiddp.size(), rank=mpiddp.rank())
loader = DataLoader(data, batch_size=32, sampler=sampler)
model = Net()

# Stage 3: the parameters are sharded too. Construction gives every rank the first rank's
# parameters and keeps this rank's chunk of each; `bucket_cap_mb` is the unit gathered at
# once (small here, so that this small model has several).
optimizer = torch.optim.Adam(model.parameters(), lr=0.001 * mpiddp.size())
optimizer = mpiddp.DistributedOptimizer(optimizer, model=model, zero_stage=3,
                                        bucket_cap_mb=0.25)

for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    for xb, yb in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        optimizer.clip_grad_norm_(1.0)
        optimizer.step()

os.makedirs(args.checkpoints, exist_ok=True)
# A whole checkpoint (the file a zero_stage=0 job writes): consolidate on every rank, which
# gathers the parameters too, then save on rank 0, where model.state_dict() is whole.
optimizer.consolidate_state_dict(to=0)
if mpiddp.rank() == 0:
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
               os.path.join(args.checkpoints, "whole.pt"))
# A sharded checkpoint: each rank writes its chunks of the parameters and their state.
torch.save(optimizer.sharded_state_dict(),
           os.path.join(args.checkpoints, f"part-{mpiddp.rank()}.pt"))
mpiddp.barrier()

# Resuming (here, at once; in a new job, at any rank count): every rank loads the whole
# files and keeps its chunks ...
whole = torch.load(os.path.join(args.checkpoints, "whole.pt"))
model.load_state_dict(whole["model"])
optimizer.load_state_dict(whole["optimizer"])
# ... or reads every rank's part and keeps what its chunks need.
parts = [torch.load(os.path.join(args.checkpoints, f"part-{rank}.pt"), mmap=True)
         for rank in range(mpiddp.size())]
optimizer.load_sharded_state_dict(parts)

# Evaluation: each bucket is gathered as the forward reaches it, and released after.
with torch.no_grad():
    accuracy = (model(x).argmax(1) == y).float().mean().item()
if mpiddp.rank() == 0:
    print(f"accuracy {accuracy:.3f}")
assert accuracy >= args.min_accuracy, accuracy
mpiddp.shutdown()
