"""Uneven data: each rank trains its own number of batches, then join().

    mpiexec -n 2 python examples/uneven_data.py

docs/training.md, "Uneven data and join()".
"""
import torch
import torch.nn.functional as F

import mpiddp


def main():
    mpiddp.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    optimizer = mpiddp.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    mpiddp.broadcast_parameters(model.state_dict(), root_rank=0)

    # Rank r has 10 + 3 r batches: a shard of a data set that does not split evenly.
    g = torch.Generator().manual_seed(1 + mpiddp.rank())
    count = 10 + 3 * mpiddp.rank()
    my_batches = [(x, (x[:, :4].sum(1) > 0).long())
                  for x in (torch.randn(32, 32, generator=g) for _ in range(count))]

    for x, y in my_batches:                        # a different number of batches on each rank
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    last = mpiddp.join()                           # out of data: answer the others with zeros
    mpiddp.broadcast_parameters(model.state_dict(), root_rank=last)   # replicas equal again
    mpiddp.broadcast_optimizer_state(optimizer, root_rank=last)

    sums = mpiddp.allgather_object([p.double().sum().item() for p in model.parameters()])
    assert all(s == sums[0] for s in sums), "replicas differ"
    if mpiddp.rank() == 0:
        print(f"rank {last} joined last; the replicas are equal again")


if __name__ == "__main__":
    main()
