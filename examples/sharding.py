"""Sharded optimizer state and gradients (docs/sharding.md): Adam with zero_stage=2, mixed
precision's GradScaler, clipping by the global norm, and the two kinds of checkpoint.

    mpiexec -n 2 python examples/sharding.py --checkpoints /tmp/sharding
"""
# test-args: --checkpoints {tmp} --min-accuracy 0.9
import argparse
import os

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import mpiddp

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--checkpoints", default="checkpoints")
parser.add_argument("--min-accuracy", type=float, default=0.0)
args = parser.parse_args()

mpiddp.init()
torch.manual_seed(0)
digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
y = torch.tensor(digits.target)
data = TensorDataset(x, y)
sampler = DistributedSampler(data, num_replicas=mpiddp.size(), rank=mpiddp.rank())
loader = DataLoader(data, batch_size=32, sampler=sampler)
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
mpiddp.broadcast_parameters(model.state_dict(), root_rank=0)

# Each rank keeps the Adam state of its shard of the parameters only (about 1/size of it),
# and (stage 2) only its shard of the averaged gradients.
optimizer = torch.optim.Adam(model.parameters(), lr=0.002 * mpiddp.size())
optimizer = mpiddp.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                        zero_stage=2)
scaler = torch.amp.GradScaler("cpu")

for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    for xb, yb in loader:
        optimizer.zero_grad()
        scaler.scale(F.cross_entropy(model(xb), yb)).backward()
        scaler.unscale_(optimizer)
        # The global norm, from every rank's shard (torch.nn.utils.clip_grad_norm_ would
        # see this rank's shard only, and refuses).
        optimizer.clip_grad_norm_(1.0)
        scaler.step(optimizer)
        scaler.update()

os.makedirs(args.checkpoints, exist_ok=True)
# A whole checkpoint, loadable at any rank count (and by a plain torch optimizer):
# consolidate on every rank, save on rank 0.
optimizer.consolidate_state_dict(to=0)
if mpiddp.rank() == 0:
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
               os.path.join(args.checkpoints, "whole.pt"))
# A sharded checkpoint: each rank writes its own part, nothing is gathered.
torch.save(optimizer.sharded_state_dict(),
           os.path.join(args.checkpoints, f"optimizer-{mpiddp.rank()}.pt"))
mpiddp.barrier()

# Resuming (here, at once; in a new job, at any rank count): every rank loads the whole
# state and keeps its shard ...
whole = torch.load(os.path.join(args.checkpoints, "whole.pt"))
optimizer.load_state_dict(whole["optimizer"])
# ... or reads every rank's part, memory-mapped, and keeps what its shard needs.
parts = [torch.load(os.path.join(args.checkpoints, f"optimizer-{rank}.pt"), mmap=True)
         for rank in range(mpiddp.size())]
optimizer.load_sharded_state_dict(parts)

with torch.no_grad():
    accuracy = (model(x).argmax(1) == y).float().mean().item()
if mpiddp.rank() == 0:
    print(f"accuracy {accuracy:.3f}")
assert accuracy >= args.min_accuracy, accuracy
mpiddp.shutdown()
