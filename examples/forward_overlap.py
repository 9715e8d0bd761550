"""Forward overlap: the reductions of one step run while the next forward computes.

    mpiexec -n 2 python examples/forward_overlap.py                 # overlap_forward=True
    mpiexec -n 2 python examples/forward_overlap.py --overlap auto  # measure, keep the faster
    MPIDDP_OVERLAP_FORWARD=1 mpiexec -n 2 python examples/forward_overlap.py --overlap unset

docs/training.md, "Forward overlap".
"""
import argparse

import torch
import torch.nn.functional as F

import mpiddp


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--overlap", choices=["on", "auto", "unset"], default="on",
                   help="unset: take MPIDDP_OVERLAP_FORWARD from the environment")
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()

    mpiddp.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 2))
    mpiddp.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3 * mpiddp.size())
    if args.overlap == "unset":
        optimizer = mpiddp.DistributedOptimizer(optimizer,
                                                named_parameters=model.named_parameters())
    else:
        overlap = True if args.overlap == "on" else "auto"
        optimizer = mpiddp.DistributedOptimizer(optimizer,
                                                named_parameters=model.named_parameters(),
                                                overlap_forward=overlap)   # True or "auto"
    g = torch.Generator().manual_seed(1 + mpiddp.rank())     # each rank its own data
    for step in range(args.steps):
        x = torch.randn(64, 32, generator=g)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), (x[:, :4].sum(1) > 0).long())   # waits per layer
        loss.backward()                            # returns without waiting for reductions
        optimizer.step()                           # returns at once: the update is deferred

    state = model.state_dict()                     # a read completes the deferred update
    sums = mpiddp.allgather_object([t.double().sum().item() for t in state.values()])
    assert all(s == sums[0] for s in sums), "replicas differ"
    if mpiddp.rank() == 0:
        print(f"overlap {args.overlap}: loss {loss.item():.4f}, replicas equal")


if __name__ == "__main__":
    main()
