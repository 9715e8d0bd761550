"""DataLoader workers beside mpiddp, with each of multiprocessing's start methods: training
with workers gives the parameters training without them gives, bit for bit; workers that
'spawn' or 'forkserver' start from a rank import mpiddp without initialising MPI (before,
MPICH's ``PMI_Init`` failed there and aborted the job) and touch no GPU; a call that needs
MPI there says what the process is. (No ``from mpi4py import MPI`` at the top: a 'spawn'
worker imports this module again, and mpi4py imported before mpiddp would start MPI there,
docs/training.md.)"""
import os
import sys

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import mpiddp
from checks import expect, ok

torch.set_num_threads(1)


class Samples(Dataset):
    """A regression set whose items also say what the process that made them was like."""

    def __init__(self, count: int = 64):
        generator = torch.Generator().manual_seed(3)
        self.x = torch.randn(count, 8, generator=generator)
        self.y = self.x @ torch.linspace(-1, 1, 8)[:, None]

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        mpi = sys.modules.get("mpi4py.MPI")
        process = torch.tensor([os.getpid(), int(mpi is not None and mpi.Is_initialized()),
                                int(torch.cuda.is_initialized())])
        return self.x[index], self.y[index], process


def train(context, workers: int):
    """Two epochs of SGD on ``Samples``; (the parameters as one vector, every item's process
    row)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    mpiddp.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = mpiddp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                            named_parameters=model.named_parameters())
    data = Samples()
    sampler = DistributedSampler(data, num_replicas=mpiddp.size(), rank=mpiddp.rank(), seed=1)
    loader = DataLoader(data, batch_size=8, sampler=sampler, num_workers=workers,
                        multiprocessing_context=context, persistent_workers=workers > 0)
    processes = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y, process in loader:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            processes.append(process)
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach(), torch.cat(processes)


def call_mpi(worker_id):
    """A worker_init_fn that asks MPI four ways; each must say why it cannot."""
    said = []
    for call in (mpiddp.mpi_threads_supported, mpiddp.mpi_cuda_aware, mpiddp.init,
                 mpiddp.rank):
        try:
            call()
        except (mpiddp.LaunchError, mpiddp.NotInitializedError) as error:
            said.append(str(error))
    raise mpiddp.LaunchError(" | ".join(said))


def main():
    mpiddp.init()
    rank = mpiddp.rank()
    reference, _ = train(None, 0)
    for context in ("fork", "spawn", "forkserver"):
        params, processes = train(context, 2 if context != "spawn" else 1)
        assert torch.equal(params, reference), f"{context}: parameters differ from no workers"
        assert (processes[:, 0] != os.getpid()).all(), f"{context}: items not made by workers"
        mpi_initialised = sorted(set(processes[:, 1].tolist()))
        # A forked worker is a copy of the rank, MPI's state included (it makes no MPI call).
        assert mpi_initialised == ([1] if context == "fork" else [0]), (context, mpi_initialised)
        assert not processes[:, 2].any(), f"{context}: a worker initialised CUDA"
        ok(f"training with {context} workers", rank, mpiddp.barrier,
           worker_pids=len(set(processes[:, 0].tolist())))

    # MPI in a worker: from its worker_init_fn, and init() while a 'spawn' worker imports
    # the module of its dataset, which starts mpiddp at import (as an unguarded script does;
    # a 'spawn' worker is the rank's child, whose death the DataLoader hears of at once, a
    # forkserver worker's only at its next 5 s check).
    loader = DataLoader(Samples(), num_workers=1, multiprocessing_context="forkserver",
                        worker_init_fn=call_mpi)
    expect(mpiddp.LaunchError, lambda: next(iter(loader)), "DataLoader worker",
           "mpiddp.mpi_threads_supported() cannot run in process",
           "mpiddp.mpi_cuda_aware() cannot run in process", "mpiddp.init() cannot run in process",
           "mpiddp.rank() cannot run in process", "no rank of the MPI job")
    from init_at_import import Numbers
    loader = DataLoader(Numbers(), num_workers=1, multiprocessing_context="spawn")
    expect(RuntimeError, lambda: next(iter(loader)), "DataLoader worker", "exited unexpectedly")
    ok("init() in a worker", rank, mpiddp.barrier)


if __name__ == "__main__":
    main()
