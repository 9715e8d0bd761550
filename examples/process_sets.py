"""Process sets: two independent trainings in one job, each averaging within its own ranks.

    mpiexec -n 2 python examples/process_sets.py      # sets {0} and {1}
    mpiexec -n 4 python examples/process_sets.py      # sets {0, 2} and {1, 3}

docs/training.md, "Process sets".
"""
import torch
import torch.nn.functional as F

import mpiddp


def main():
    mpiddp.init()
    even = mpiddp.add_process_set([r for r in range(mpiddp.size()) if r % 2 == 0])
    odd = mpiddp.add_process_set([r for r in range(mpiddp.size()) if r % 2 == 1])
    mine = even if even.included() else odd         # every rank created both, in one order
    lr = 0.05 if mine is even else 0.01                # one experiment per set
    leader = mine.ranks[0]                             # root_rank is a global rank

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    mpiddp.broadcast_parameters(model.state_dict(), root_rank=leader, process_set=mine)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr * mine.size(), momentum=0.9)
    optimizer = mpiddp.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                            process_set=mine)   # averages within the set
    g = torch.Generator().manual_seed(1 + mpiddp.rank())      # each rank its own data
    for step in range(20):
        x = torch.randn(32, 32, generator=g)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), (x[:, :4].sum(1) > 0).long())
        loss.backward()
        optimizer.step()
    losses = mpiddp.allgather_object((lr, loss.item()))     # every rank: the global set
    if mpiddp.rank() == 0:
        for r, (rate, value) in enumerate(losses):
            print(f"rank {r}: lr {rate}, last loss {value:.4f}")


if __name__ == "__main__":
    main()
