"""Gradient clipping with DistributedOptimizer, and Horovod's synchronize() recipe.

    mpiexec -n 2 python examples/clipping.py

docs/training.md, "Gradient clipping".
"""
import torch
import torch.nn.functional as F

import mpiddp


def setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * mpiddp.size(), momentum=0.9)
    optimizer = mpiddp.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    mpiddp.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(1 + mpiddp.rank())          # each rank its own data
    loader = [(x, (x[:, :4].sum(1) > 0).long())
              for x in (torch.randn(32, 32, generator=g) for _ in range(10))]
    return model, optimizer, loader


def clip_after_backward(model, optimizer, loader):
    norms = []
    for x, y in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()                    # the gradients are averaged when backward() returns
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        norms.append(norm.item())
    return norms


def clip_horovod_style(model, optimizer, loader):
    norms = []
    for x, y in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.synchronize()            # nothing left to wait for: backward() did it
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        with optimizer.skip_synchronize():
            optimizer.step()
        norms.append(norm.item())
    return norms


def hand_made_gradients(model, optimizer, steps=3):
    for step in range(steps):
        optimizer.zero_grad()
        for p in model.parameters():
            p.grad = torch.full_like(p, float(mpiddp.rank()))   # not from backward()
        optimizer.synchronize()            # averages them across the ranks
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        with optimizer.skip_synchronize():
            optimizer.step()


def main():
    mpiddp.init()
    for recipe in (clip_after_backward, clip_horovod_style):
        model, optimizer, loader = setup()
        norms = recipe(model, optimizer, loader)
        # The norm is computed from the averaged gradients: the same on every rank.
        assert all(n == norms for n in mpiddp.allgather_object(norms)), recipe.__name__
        if mpiddp.rank() == 0:
            print(f"{recipe.__name__}: gradient norms {norms[0]:.3f} ... {norms[-1]:.3f}, "
                  "the same on every rank")
    model, optimizer, _ = setup()
    hand_made_gradients(model, optimizer)
    sums = mpiddp.allgather_object([p.double().sum().item() for p in model.parameters()])
    assert all(s == sums[0] for s in sums), "replicas differ"
    if mpiddp.rank() == 0:
        print("hand-made gradients: averaged by synchronize(), replicas equal")


if __name__ == "__main__":
    main()
