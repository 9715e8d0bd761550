"""One GPU per rank: which device each rank uses, and whether MPI reads GPU memory itself.

    mpiexec -n 2 python examples/gpu_pinning.py
    MPIDDP_LOG_LEVEL=info mpiexec -n 2 python examples/gpu_pinning.py    # init()'s GPU line

Without a GPU it runs on the CPU. docs/gpu.md explains the rule.
"""
import socket

import torch

import mpiddp          # import it before mpi4py.MPI: it picks the GPU before MPI starts


def main():
    mpiddp.init()
    if torch.cuda.is_available():  # local rank k uses visible GPU k (round-robin if fewer)
        device = torch.device("cuda", mpiddp.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)      # init() made it current already; this keeps it so
    else:
        device = torch.device("cpu")
    model = torch.nn.Linear(32, 2).to(device)

    total = mpiddp.allreduce(torch.ones(4, device=device), op=mpiddp.Sum)
    assert total.device == device and torch.all(total == mpiddp.size())
    line = (f"rank {mpiddp.rank()} (local rank {mpiddp.local_rank()} on "
            f"{socket.gethostname()}): {device}, model on {next(model.parameters()).device}")
    lines = mpiddp.allgather_object(line)
    if mpiddp.rank() == 0:
        print("\n".join(lines))
        print(f"CUDA-aware MPI: {mpiddp.mpi_cuda_aware()}")


if __name__ == "__main__":
    main()
