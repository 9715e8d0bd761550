"""DataLoader worker processes in a data-parallel job: keep the training under a main guard.

    mpiexec -n 2 python examples/dataloader_workers.py                       # forkserver
    mpiexec -n 2 python examples/dataloader_workers.py --start-method spawn

A 'spawn' or 'forkserver' worker imports this file again; everything that trains (and
mpiddp.init()) must stay under `if __name__ == "__main__":`. docs/training.md, "DataLoader
workers".
"""
import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import mpiddp          # before anything that imports mpi4py.MPI


class Synthetic(Dataset):
    """A synthetic data set computed in the workers: sample i is made from seed i."""

    def __len__(self):
        return 1024

    def __getitem__(self, i):
        x = torch.randn(32, generator=torch.Generator().manual_seed(i))
        return x, int(x[:4].sum() > 0)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--start-method", choices=["fork", "spawn", "forkserver"],
                   default="forkserver")
    p.add_argument("--workers", type=int, default=1, help="worker processes per rank")
    args = p.parse_args()

    mpiddp.init()
    torch.manual_seed(0)
    dataset = Synthetic()
    sampler = DistributedSampler(dataset, num_replicas=mpiddp.size(), rank=mpiddp.rank())
    loader = DataLoader(dataset, batch_size=64, sampler=sampler, num_workers=args.workers,
                        multiprocessing_context=args.start_method, persistent_workers=True)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    mpiddp.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * mpiddp.size(), momentum=0.9)
    optimizer = mpiddp.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    if mpiddp.rank() == 0:
        print(f"trained with {args.workers} {args.start_method} workers per rank")


if __name__ == "__main__":      # a worker that imports this file must not train, nor init()
    main()
