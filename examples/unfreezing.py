"""Gradual unfreezing: train the head first, then unfreeze the body, one optimizer throughout.

    mpiexec -n 2 python examples/unfreezing.py

docs/training.md, "Gradual unfreezing".
"""
import torch
import torch.nn.functional as F

import mpiddp


def main():
    mpiddp.init()
    torch.manual_seed(0)
    body = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU())
    head = torch.nn.Linear(64, 2)
    model = torch.nn.Sequential(body, head)
    mpiddp.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(1 + mpiddp.rank())          # each rank its own data
    loader = [(x, (x[:, :4].sum(1) > 0).long())
              for x in (torch.randn(32, 32, generator=g) for _ in range(8))]

    for p in body.parameters():
        p.requires_grad_(False)                    # frozen: not reduced, costs nothing
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)   # over all of them
    optimizer = mpiddp.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    before = [p.clone() for p in body.parameters()]
    for epoch in range(3):
        if epoch == 1:                             # on every rank, at the same step
            for p in body.parameters():
                p.requires_grad_(True)             # averaged from the next backward on
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        if epoch == 0:
            assert all(torch.equal(a, b) for a, b in zip(before, body.parameters()))

    sums = mpiddp.allgather_object([p.double().sum().item() for p in model.parameters()])
    assert all(s == sums[0] for s in sums), "replicas differ"
    if mpiddp.rank() == 0:
        print("body frozen for one epoch, then trained; replicas equal")


if __name__ == "__main__":
    main()
