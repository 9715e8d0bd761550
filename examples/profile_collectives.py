# test-args: {tmp}
"""mpiddp's collectives in torch.profiler's trace: train a few steps under mpiddp.profile and
write each rank's Chrome trace (open it in https://ui.perfetto.dev or chrome://tracing).

    mpiexec -n 2 python examples/profile_collectives.py [output directory]
"""
import json
import os
import sys

import torch
import torch.nn.functional as F

import mpiddp

mpiddp.init()
out = sys.argv[1] if len(sys.argv) > 1 else "."
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
optimizer = mpiddp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                        named_parameters=model.named_parameters())
with mpiddp.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    for step in range(3):
        optimizer.zero_grad()
        F.cross_entropy(model(torch.randn(32, 256)), torch.randint(0, 10, (32,))).backward()
        optimizer.step()
path = os.path.join(out, f"trace.rank{mpiddp.rank()}.json")
prof.export_chrome_trace(path)

# What the trace holds beside torch's own rows: a row of the engine's collectives (one span a
# pass, with its tensors and bytes) and a row of the optimizer's waits and steps.
events = json.load(open(path))["traceEvents"]
rows = {e["args"]["name"]: e["tid"] for e in events
        if e.get("name") == "thread_name" and "mpiddp" in e["args"]["name"]}
collectives = [e for e in events
               if e.get("ph") == "X" and e.get("tid") == rows["mpiddp engine (collectives)"]]
steps = [e for e in events if e.get("ph") == "X" and e.get("tid") == rows["mpiddp optimizer"]]
if mpiddp.rank() == 0:
    first = collectives[0]
    print(f"{path}: {len(collectives)} collective passes, e.g. {first['name']!r} "
          f"({first['args']['bytes']} bytes, {first['dur']:.0f} us); "
          f"{len(steps)} optimizer spans")
assert collectives and steps
