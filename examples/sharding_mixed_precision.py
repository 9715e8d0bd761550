"""Stage 3 with mixed precision (docs/sharding.md, "Mixed precision at stage 3"): the
gathered parameters, forward and backward are bfloat16 (gathers send half float32's bytes);
the shards the optimizer steps, checkpoints and model.state_dict() stay float32.

    mpiexec -n 2 python examples/sharding_mixed_precision.py
    mpiexec -n 2 python examples/sharding_mixed_precision.py --param-dtype float32   # baseline
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
parser.add_argument("--param-dtype", default="bfloat16", choices=["bfloat16", "float32"])
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
            h = h + block(h)
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

# Mixed precision at stage 3 (FSDP2's MixedPrecisionPolicy): the parameters are gathered
# and used in bfloat16, the gradients reduced in float32, and the optimizer steps the
# float32 shards. The model's floating-point inputs are cast to bfloat16 for it.
policy = mpiddp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
if args.param_dtype == "float32":
    policy = None           # (the baseline: float32 throughout)
optimizer = torch.optim.Adam(model.parameters(), lr=0.001 * mpiddp.size())
optimizer = mpiddp.DistributedOptimizer(optimizer, model=model, zero_stage=3,
                                        bucket_cap_mb=0.25, mixed_precision=policy)

steps, sent = 0, mpiddp.engine_stats()["sent_bytes"]
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    losses = []
    for xb, yb in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(xb).float(), yb)    # (the logits are bfloat16)
        loss.backward()
        optimizer.step()
        steps += 1
        losses.append(loss.item())
last_epoch = mpiddp.allreduce(torch.tensor(sum(losses) / len(losses)), name="loss").item()
sent = (mpiddp.engine_stats()["sent_bytes"] - sent) / steps

# model.state_dict() holds the float32 masters, whatever the policy.
assert all(value.dtype == torch.float32 for value in model.state_dict().values())

with torch.no_grad():
    before = mpiddp.engine_stats()["sent_bytes"]
    logits = model(x).float()       # (each bucket gathered once, then released)
    gathered = mpiddp.engine_stats()["sent_bytes"] - before
    final_loss = F.cross_entropy(logits, y).item()
    accuracy = (logits.argmax(1) == y).float().mean().item()
if mpiddp.rank() == 0:
    print(f"param_dtype {args.param_dtype}: last epoch's mean training loss {last_epoch:.4f}, "
          f"after it loss {final_loss:.4f} accuracy {accuracy:.3f}, "
          f"bytes sent per step {sent:.0f} gathered per forward {gathered}")
assert accuracy >= args.min_accuracy, accuracy
mpiddp.shutdown()
