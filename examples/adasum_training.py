"""Training with Adasum instead of averaging (docs/adasum.md): each rank steps on its own
gradient and the parameter deltas are combined by Adasum; no learning-rate scaling.

    mpiexec -n 2 python examples/adasum_training.py
"""
# test-args: --epochs 3 --min-accuracy 0.9
import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import mpiddp

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=5)
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

model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
mpiddp.broadcast_parameters(model.state_dict(), root_rank=0)
# Adasum: the learning rate of one rank, not scaled by size().
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
optimizer = mpiddp.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                        op=mpiddp.Adasum)

for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    for xb, yb in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        optimizer.step()

# The tensor collective takes it too: orthogonal tensors add, equal ones stay as they are.
direction = torch.ones(4)
combined = mpiddp.allreduce(direction, op=mpiddp.Adasum, name="example.adasum")
assert torch.allclose(combined, direction)

with torch.no_grad():
    accuracy = (model(x).argmax(1) == y).float().mean().item()
if mpiddp.rank() == 0:
    print(f"accuracy {accuracy:.3f} after {args.epochs} epochs on {mpiddp.size()} rank(s)")
assert accuracy >= args.min_accuracy, accuracy
