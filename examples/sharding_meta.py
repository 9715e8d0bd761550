"""A model built on the meta device and sharded as it gets memory (docs/sharding.md, "A model
too large to build whole"): no rank ever holds the whole model.

    mpiexec -n 2 python examples/sharding_meta.py
"""
# test-args: --min-accuracy 0.9
import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import mpiddp

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--min-accuracy", type=float, default=0.0)
args = parser.parse_args()


class Scale(nn.Module):
    """A module of our own, without reset_parameters(): param_init_fn initialises it."""

    def __init__(self, width):
        super().__init__()
        self.gain = nn.Parameter(torch.empty(width))

    def forward(self, x):
        return x * self.gain


def init(module):
    if isinstance(module, Scale):
        nn.init.ones_(module.gain)
    else:
        module.reset_parameters()       # what torch's own layers do when built


mpiddp.init()
digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
y = torch.tensor(digits.target)
data = TensorDataset(x, y)
sampler = DistributedSampler(data, num_replicas=mpiddp.size(), rank=mpiddp.rank())
loader = DataLoader(data, batch_size=32, sampler=sampler)

# Built on the meta device: shapes only, no memory. The optimizer gives the parameters memory
# a bucket at a time; the first rank initialises them (each module's reset_parameters(), or
# param_init_fn) and every rank keeps its chunk of them.
with torch.device("meta"):
    model = nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.GELU(), Scale(256),
                          nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))
optimizer = torch.optim.Adam(model.parameters(), lr=0.001 * mpiddp.size())
optimizer = mpiddp.DistributedOptimizer(optimizer, model=model, zero_stage=3,
                                        bucket_cap_mb=0.25, param_init_fn=init)

for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    for xb, yb in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        optimizer.step()

with torch.no_grad():
    accuracy = (model(x).argmax(1) == y).float().mean().item()
if mpiddp.rank() == 0:
    print(f"accuracy {accuracy:.3f}")
assert accuracy >= args.min_accuracy, f"accuracy {accuracy:.3f} < {args.min_accuracy}"
