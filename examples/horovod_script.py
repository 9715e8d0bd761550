"""A Horovod PyTorch training script, run by mpiddp: the import is the only change.

    mpiexec -n 2 python examples/horovod_script.py

It keeps Horovod's names (hvd.init, hvd.DistributedOptimizer, hvd.Compression, ...) and
Horovod's habits (metric averaging with a named allreduce, synchronize() before clipping).
docs/horovod.md lists what differs.
"""
import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import mpiddp as hvd       # was: import horovod.torch as hvd


def metric_average(value, name):
    tensor = torch.tensor(value)
    return hvd.allreduce(tensor, name=name).item()      # op=hvd.Average by default


def main():
    parser = argparse.ArgumentParser(description="Horovod-style training")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--fp16-allreduce", action="store_true")
    parser.add_argument("--batches-per-allreduce", type=int, default=1)
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(42)
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())
    torch.set_num_threads(1)

    x = torch.randn(2048, 32)
    dataset = TensorDataset(x, (x[:, :4].sum(1) > 0).long())
    sampler = DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank())
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    if torch.cuda.is_available():
        model.cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         backward_passes_per_step=args.batches_per_allreduce,
                                         op=hvd.Average)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for data, target in loader:
            if torch.cuda.is_available():
                data, target = data.cuda(), target.cuda()
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.synchronize()                 # Horovod's clipping recipe: still right
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with optimizer.skip_synchronize():
                optimizer.step()
        avg = metric_average(loss.item(), "avg_loss")
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1}: loss averaged over {hvd.size()} ranks {avg:.4f}")


if __name__ == "__main__":
    main()
