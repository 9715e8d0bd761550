"""The README's example: data-parallel training on one GPU per rank (or the CPU without one).

    mpiexec -n 2 python examples/readme_example.py
"""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import mpiddp

mpiddp.init()
device = (torch.device("cuda", mpiddp.local_rank() % torch.cuda.device_count())
          if torch.cuda.is_available() else torch.device("cpu"))    # one GPU per rank

torch.manual_seed(0)               # the same synthetic data set on every rank
x = torch.randn(4096, 32)
data = TensorDataset(x, (x[:, :4].sum(1) > 0).long())
sampler = DistributedSampler(data, num_replicas=mpiddp.size(), rank=mpiddp.rank())
loader = DataLoader(data, batch_size=64, sampler=sampler)      # each rank gets its share

model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * mpiddp.size(), momentum=0.9)
optimizer = mpiddp.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
mpiddp.broadcast_parameters(model.state_dict(), root_rank=0)   # every rank starts the same
mpiddp.broadcast_optimizer_state(optimizer, root_rank=0)

for epoch in range(5):
    sampler.set_epoch(epoch)       # a new shuffle each epoch, the same on every rank
    for xb, yb in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(xb.to(device)), yb.to(device))
        loss.backward()            # gradients are averaged across the ranks meanwhile
        optimizer.step()
    if mpiddp.rank() == 0:
        print(f"epoch {epoch + 1}: loss {loss.item():.4f}")
