"""Gradient accumulation: several backward passes per optimizer step, one reduction.

    mpiexec -n 2 python examples/accumulation.py

docs/training.md, "Gradient accumulation".
"""
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import mpiddp


def main():
    mpiddp.init()
    torch.manual_seed(0)
    x = torch.randn(2000, 32)
    dataset = TensorDataset(x, (x[:, :4].sum(1) > 0).long())
    sampler = DistributedSampler(dataset, num_replicas=mpiddp.size(), rank=mpiddp.rank())
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * mpiddp.size(), momentum=0.9)
    mpiddp.broadcast_parameters(model.state_dict(), root_rank=0)

    accumulate = 4                                 # micro-batches per optimizer step
    optimizer = mpiddp.DistributedOptimizer(optimizer,
                                            named_parameters=model.named_parameters(),
                                            backward_passes_per_step=accumulate)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        optimizer.zero_grad()
        for i, (x, y) in enumerate(loader):
            loss = F.cross_entropy(model(x), y) / accumulate   # average over the micro-batches
            loss.backward()                        # reduced only at every 4th pass
            if (i + 1) % accumulate == 0 or i + 1 == len(loader):
                optimizer.step()                   # a short last group is reduced here
                optimizer.zero_grad()
        if mpiddp.rank() == 0:
            print(f"epoch {epoch + 1}: loss {accumulate * loss.item():.4f}")

    sums = mpiddp.allgather_object([p.double().sum().item() for p in model.parameters()])
    assert all(s == sums[0] for s in sums), "replicas differ"


if __name__ == "__main__":
    main()
