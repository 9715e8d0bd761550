"""Trains until something breaks: the subject of the fault tests (a rank frozen, a node's
ranks killed, a node's link set down).

Usage: fault_worker.py DIR. Every rank writes its PID to DIR/pid.<rank>; rank 0 writes a
durable checkpoint (mpiddp.checkpoint.save_durably) to DIR/checkpoint.pt after every
step, holding the step number and the model. The job never ends by itself within the tests'
time (it stops after 10 minutes, in case nothing breaks).
"""
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import mpiddp

from mpiddp.checkpoint import save_durably

torch.set_num_threads(1)
mpiddp.init()
RANK = mpiddp.rank()
directory = Path(sys.argv[1])
(directory / f"pid.{RANK}").write_text(str(os.getpid()))

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
mpiddp.broadcast_parameters(model.state_dict(), root_rank=0)
optimizer = mpiddp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                        named_parameters=model.named_parameters())
generator = torch.Generator().manual_seed(RANK)
started = time.monotonic()
step = 0
while time.monotonic() - started < 600:
    x = torch.randn(32, 64, generator=generator)
    y = torch.randint(0, 10, (32,), generator=generator)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    step += 1
    if RANK == 0:
        save_durably(str(directory / "checkpoint.pt"),
                        {"step": step, "model": model.state_dict()})
    time.sleep(0.02)
