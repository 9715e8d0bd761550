"""Record a timeline of a few training steps, one Chrome trace per rank.

    mpiexec -n 2 python examples/timeline_example.py       # timelines/example.rank<r>.json
    python scripts/plot_timeline.py timelines/example.rank*.json -o timeline.png
    mpiexec -n 2 python examples/timeline_example.py --straggler-ms 60   # rank 1 computes longer

docs/timeline.md explains the trace and the picture.
"""
# test-args: --output {tmp}/timeline
import argparse
import os
import time

import torch
import torch.nn.functional as F

import mpiddp


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", default="timelines/example",
                   help="rank r writes OUTPUT.rank<r>.json")
    p.add_argument("--steps", type=int, default=8, help="steps recorded, after 3 not recorded")
    p.add_argument("--straggler-ms", type=float, default=0.0,
                   help="the last rank sleeps this long before each backward pass")
    args = p.parse_args()

    mpiddp.init()
    torch.manual_seed(0)
    layers = [torch.nn.Linear(32, 512), torch.nn.ReLU()]
    for _ in range(6):
        layers += [torch.nn.Linear(512, 512), torch.nn.ReLU()]   # 1 MiB of gradient each
    model = torch.nn.Sequential(*layers, torch.nn.Linear(512, 2))
    mpiddp.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * mpiddp.size(), momentum=0.9)
    optimizer = mpiddp.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                            bucket_cap_mb=2)
    slow = mpiddp.rank() == mpiddp.size() - 1 and args.straggler_ms > 0
    g = torch.Generator().manual_seed(1 + mpiddp.rank())           # each rank its own data

    def train_step():
        x = torch.randn(256, 32, generator=g)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), (x[:, :4].sum(1) > 0).long())
        if slow:
            time.sleep(args.straggler_ms / 1000)       # a rank with more work than the others
        loss.backward()
        optimizer.step()

    for _ in range(3):                                 # warm-up, not recorded
        train_step()
    mpiddp.start_timeline()                            # record from here on (this rank)
    for _ in range(args.steps):
        train_step()
    path = f"{args.output}.rank{mpiddp.rank()}.json"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    mpiddp.stop_timeline(path)                         # write this rank's Chrome trace
    print(f"rank {mpiddp.rank()}: wrote {path}")


if __name__ == "__main__":
    main()
