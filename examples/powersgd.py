"""PowerSGD: send each gradient matrix as two thin low-rank factors, with error feedback.

    mpiexec -n 2 python examples/powersgd.py
    mpiexec -n 4 python examples/powersgd.py --rank 4 --start-step 20

docs/powersgd.md.
"""
import argparse

import torch
import torch.nn.functional as F

import mpiddp


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, default=2, help="the approximation's rank")
    p.add_argument("--start-step", type=int, default=10, help="plain steps first")
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()

    mpiddp.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 4))
    mpiddp.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02 * mpiddp.size(), momentum=0.9)
    compression = mpiddp.Compression.powersgd(
        rank=args.rank,                 # the factors' rank: 1, 2, 4, ... (torch's default: 1)
        start_step=args.start_step)     # plain averaging for the first steps (warm-up)
    optimizer = mpiddp.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), compression=compression)

    g = torch.Generator().manual_seed(1 + mpiddp.rank())          # each rank its own data
    target = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    losses = []
    for step in range(args.steps):
        x = torch.randn(32, 64, generator=g)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), (x @ target).argmax(1))
        loss.backward()                 # the factors travel while backward runs
        optimizer.step()
        losses.append(loss.item())

    # What a step sends: each compressible matrix as (n + m) * r numbers instead of n * m.
    sent = full = 0
    for param in model.parameters():
        r = compression.matrix_rank(param.shape)
        full += param.numel()
        sent += (param.shape[0] + param.numel() // param.shape[0]) * r if r else param.numel()
    sums = mpiddp.allgather_object([p.double().sum().item() for p in model.parameters()])
    assert all(s == sums[0] for s in sums), "replicas differ"
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first, (first, last)
    if mpiddp.rank() == 0:
        print(f"PowerSGD rank {args.rank}: loss {first:.3f} -> {last:.3f}; {sent} of {full} "
              f"numbers a step on the wire ({full / sent:.0f}x fewer); replicas equal")


if __name__ == "__main__":
    main()
