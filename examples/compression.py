"""Gradient compression: reduce the gradients in 16 bits, half the bytes on the wire.

    mpiexec -n 2 python examples/compression.py --compression bf16
    mpiexec -n 2 python examples/compression.py --compression fp16

docs/training.md, "Gradient compression".
"""
import argparse

import torch
import torch.nn.functional as F

import mpiddp


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compression", choices=["none", "fp16", "bf16"], default="bf16")
    args = p.parse_args()

    mpiddp.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    mpiddp.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * mpiddp.size(), momentum=0.9)
    compression = getattr(mpiddp.Compression, args.compression)   # e.g. Compression.bf16
    optimizer = mpiddp.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=compression,                  # Compression.fp16 or .bf16
        gradient_predivide_factor=1.0)            # > 1 keeps large float16 sums in range
    g = torch.Generator().manual_seed(1 + mpiddp.rank())          # each rank its own data
    for step in range(20):
        x = torch.randn(32, 32, generator=g)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), (x[:, :4].sum(1) > 0).long())
        loss.backward()                            # gradients come back in float32
        optimizer.step()

    sums = mpiddp.allgather_object([p.double().sum().item() for p in model.parameters()])
    assert all(s == sums[0] for s in sums), "replicas differ"
    if mpiddp.rank() == 0:
        print(f"compression {args.compression}: loss {loss.item():.4f}, replicas equal")


if __name__ == "__main__":
    main()
