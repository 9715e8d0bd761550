"""Trains an MLP for a few steps with MPIDDP_TIMELINE set (by the test): each rank's trace is
written at shutdown, for scripts/plot_timeline.py."""
import torch
import torch.nn as nn
import torch.nn.functional as F

import mpiddp

torch.set_num_threads(1)
mpiddp.init()
torch.manual_seed(0)
model = nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(512, 512), nn.ReLU())])
mpiddp.broadcast_parameters(model.state_dict(), root_rank=0)
optimizer = mpiddp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                        named_parameters=model.named_parameters(),
                                        bucket_cap_mb=1)
generator = torch.Generator().manual_seed(mpiddp.rank())
for step in range(8):
    optimizer.zero_grad()
    F.mse_loss(model(torch.randn(64, 512, generator=generator)),
               torch.zeros(64, 512)).backward()
    optimizer.step()
mpiddp.shutdown()
