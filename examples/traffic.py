"""How many bytes a training step puts on the wire, uncompressed, in fp16 and with PowerSGD,
read from the engine's counters (docs/tuning.md, "How to see the traffic").

    mpiexec -n 2 python examples/traffic.py
    MPIDDP_TRAFFIC_SUMMARY=1 mpiexec -n 2 python examples/traffic.py    # + a line per rank
"""
import torch
import torch.nn.functional as F

import mpiddp

mpiddp.init()
sent = {}
for name, compression in [("none", mpiddp.Compression.none),
                          ("fp16", mpiddp.Compression.fp16),
                          ("powersgd", mpiddp.Compression.powersgd(rank=2, start_step=0))]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    optimizer = mpiddp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(), compression=compression)
    for step in range(5):
        if step == 2:
            mpiddp.reset_engine_stats()     # count the last 3 steps (this rank's counters)
        optimizer.zero_grad()
        F.cross_entropy(model(torch.randn(32, 256)), torch.randint(0, 10, (32,))).backward()
        optimizer.step()
    stats = mpiddp.engine_stats()
    sent[name] = stats["sent_bytes"] / 3
    if mpiddp.rank() == 0:
        print(f"{name:>8}: {sent[name]:9,.0f} bytes sent a step ({sent[name] / sent['none']:.3f} "
              f"of none's), {stats['received_bytes'] / 3:9,.0f} received, "
              f"{stats['collectives'] / 3:.0f} collectives, {stats['wait_seconds']:.3f} s waited")
assert sent["fp16"] < sent["none"] / 1.9 and sent["powersgd"] < sent["none"] / 10
