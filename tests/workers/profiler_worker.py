"""``mpiddp.profile``: torch.profiler's Chrome trace with mpiddp's collectives and optimizer
steps on rows of their own, aligned with torch's own events (issue 67 item 2).

Usage: profiler_worker.py <output directory>. Prints 'OK ...' on rank 0.
"""
import glob
import gzip
import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import checks
import mpiddp

torch.set_num_threads(1)
mpiddp.init()
RANK = mpiddp.rank()
OUT = sys.argv[1]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 8))
opt = mpiddp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters())
GRAD_BYTES = sum(p.numel() * 4 for p in model.parameters())


def train(steps):
    for step in range(steps):
        opt.zero_grad()
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step * 10 + RANK))
        F.mse_loss(model(x), torch.zeros(16, 8)).backward()
        opt.step()


def load(path):
    with open(path) as f:
        return json.load(f)["traceEvents"]


def check_trace(events, steps):
    names = {e["args"]["name"]: e["tid"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    engine, optimizer = names["mpiddp engine (collectives)"], names["mpiddp optimizer"]
    collectives = [e for e in events if e.get("ph") == "X" and e.get("tid") == engine]
    stepped = [e for e in events if e.get("ph") == "X" and e.get("tid") == optimizer
               and e["name"] == "mpiddp: optimizer step"]
    assert collectives and len(stepped) == steps, (len(collectives), len(stepped))
    reduced = sum(e["args"]["bytes"] for e in collectives)
    assert reduced >= GRAD_BYTES * steps, (reduced, GRAD_BYTES)
    # Each tensor's span, hand-over to completion (async begin/end pairs), around its pass.
    begins = {e["id"]: e for e in events if e.get("ph") == "b" and e.get("cat") == "mpiddp"}
    ends = {e["id"]: e for e in events if e.get("ph") == "e" and e.get("cat") == "mpiddp"}
    assert begins and begins.keys() == ends.keys()
    weights = [e for e in begins.values() if e["name"].endswith("0.weight")]
    assert len(weights) == steps and all(e["args"]["bytes"] == 64 * 256 * 4 for e in weights)
    assert all(ends[i]["ts"] >= b["ts"] for i, b in begins.items())
    # Aligned with torch's clock: each step's collectives fall between torch's first
    # backward event and the end of the optimizer's step of that step.
    backward = [e for e in events if e.get("ph") == "X" and "autograd" in e.get("name", "")
                and e.get("tid") not in (engine, optimizer)]
    assert backward, "torch recorded no backward"
    first_backward = min(e["ts"] for e in backward)
    last_step_end = max(e["ts"] + e["dur"] for e in stepped)
    assert all(first_backward - 1e3 <= e["ts"] <= last_step_end for e in collectives), \
        (first_backward, last_step_end, [e["ts"] for e in collectives])
    return reduced


train(1)       # warm-up outside the profile: not in the trace
engine = mpiddp.runtime.require("test").engine
with mpiddp.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    train(3)
assert not engine.timeline.enabled          # recorded only while the profile ran
path = os.path.join(OUT, f"trace.rank{RANK}.json")
prof.export_chrome_trace(path)
reduced = check_trace(load(path), 3)
checks.ok("mpiddp.profile: the collectives and optimizer steps in torch's Chrome trace, "
          "aligned with its backward", RANK, bytes_per_step=reduced // 3)

# A timeline the script started keeps recording (and keeps what it had).
mpiddp.start_timeline()
train(1)
before = len(mpiddp.timeline_events())
handler = torch.profiler.tensorboard_trace_handler(os.path.join(OUT, f"tb{RANK}"),
                                                  use_gzip=True)
with mpiddp.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                    on_trace_ready=handler):
    train(2)
assert engine.timeline.enabled and len(mpiddp.timeline_events()) > before
mpiddp.stop_timeline()
(written,) = glob.glob(os.path.join(OUT, f"tb{RANK}", "*.json.gz"))
with gzip.open(written, "rt") as f:
    check_trace(json.load(f)["traceEvents"], 2)
checks.ok("mpiddp.profile with tensorboard_trace_handler (gzip), beside the script's own "
          "timeline",
          RANK)
mpiddp.shutdown()
