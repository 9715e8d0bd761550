"""torch.compile with DistributedOptimizer: compile the model as usual.

    mpiexec -n 2 python examples/compiled_model.py                   # inductor (the default)
    mpiexec -n 2 python examples/compiled_model.py --backend aot_eager

docs/training.md, "torch.compile". Inductor compiles C++ on a CPU: the first step takes a
while. The tests run it with --backend aot_eager, which compiles nothing.
"""
# test-args: --backend aot_eager
import argparse

import torch
import torch.nn.functional as F

import mpiddp


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="inductor")
    args = p.parse_args()

    mpiddp.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    mpiddp.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    optimizer = mpiddp.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    model = torch.compile(model, backend=args.backend)     # before or after wrapping: either
    g = torch.Generator().manual_seed(1 + mpiddp.rank())     # each rank its own data
    for step in range(10):
        x = torch.randn(32, 32, generator=g)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), (x[:, :4].sum(1) > 0).long())
        loss.backward()                            # gradients reduced as for an eager model
        optimizer.step()

    sums = mpiddp.allgather_object([p.double().sum().item() for p in model.parameters()])
    assert all(s == sums[0] for s in sums), "replicas differ"
    if mpiddp.rank() == 0:
        print(f"compiled with {args.backend}: loss {loss.item():.4f}, replicas equal")


if __name__ == "__main__":
    main()
