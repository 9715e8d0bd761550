"""SyncBatchNorm: batch-norm statistics over every rank's batch, not each rank's alone.

    mpiexec -n 2 python examples/sync_batchnorm.py

docs/training.md, "SyncBatchNorm".
"""
import torch
import torch.nn.functional as F

import mpiddp


def main():
    mpiddp.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1),
        mpiddp.SyncBatchNorm(8),                   # in place of torch.nn.BatchNorm2d(8)
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 8 * 8, 2))
    mpiddp.broadcast_parameters(model.state_dict(), root_rank=0)   # buffers too
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * mpiddp.size(), momentum=0.9)
    optimizer = mpiddp.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    g = torch.Generator().manual_seed(1 + mpiddp.rank())          # each rank its own data
    for step in range(10):
        x = torch.randn(8, 1, 8, 8, generator=g) + mpiddp.rank()  # the ranks' data differ
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), (x.mean((1, 2, 3)) > 0.5).long())
        loss.backward()
        optimizer.step()

    # The running statistics were computed from every rank's batch: equal on every rank.
    means = mpiddp.allgather_object(model[1].running_mean.tolist())
    assert all(torch.allclose(torch.tensor(m), torch.tensor(means[0])) for m in means)
    if mpiddp.rank() == 0:
        print(f"running mean {model[1].running_mean[0].item():.3f}, equal on every rank")


if __name__ == "__main__":
    main()
