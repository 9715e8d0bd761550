"""Train a small network on scikit-learn's handwritten digits, data-parallel with mpiddp.

examples/single_gpu.py converted to one process (rank) per GPU, or per group of CPU cores, as
docs/getting-started.md explains step by step; `diff -u examples/single_gpu.py
examples/getting_started.py` shows every change.

    mpiexec -n 2 python examples/getting_started.py      # about 0.97 test accuracy
"""
# test-ranks: 1,2
# test-args: --min-accuracy 0.95 --checkpoint {tmp}/getting_started.pt
import argparse
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

import mpiddp
from mpiddp.checkpoint import ResumableSampler


def load_data():
    """(train, test) datasets: 1437 and 360 8x8 images of digits, bundled with scikit-learn."""
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0      # pixels are 0..16
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = order[:360], order[360:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


class Net(nn.Module):
    """A small convolutional network for 8x8 grey images."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv(x.view(-1, 1, 8, 8))), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def evaluate(model, dataset, device) -> float:
    """Accuracy on the whole test set: each rank scores every size()-th sample and the
    counts are summed over the ranks, so every rank gets the same exact number."""
    model.eval()
    with torch.no_grad():
        x, y = (t[mpiddp.rank()::mpiddp.size()].to(device) for t in dataset.tensors)
        correct = (model(x).argmax(1) == y).sum().item()
    model.train()
    counts = mpiddp.allreduce(torch.tensor([correct, len(y)], dtype=torch.float64),
                              op=mpiddp.Sum, name="eval.counts")
    return (counts[0] / counts[1]).item()


def log(*args) -> None:
    """Print on rank 0 only."""
    if mpiddp.rank() == 0:
        print(*args, flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank and step")
    p.add_argument("--lr", type=float, default=0.05, help="for one rank; scaled by size()")
    p.add_argument("--checkpoint", default="checkpoints/digits.pt")
    p.add_argument("--min-accuracy", type=float, default=0.0,
                   help="exit with status 2 if the final test accuracy is lower")
    args = p.parse_args()

    mpiddp.init()
    if torch.cuda.is_available():   # one GPU per rank, picked by the rank's place on its node
        device = torch.device("cuda", mpiddp.local_rank() % torch.cuda.device_count())
    else:
        device = torch.device("cpu")
    torch.manual_seed(0)
    train_set, test_set = load_data()
    sampler = ResumableSampler(train_set, num_replicas=mpiddp.size(), rank=mpiddp.rank())
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    model = Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * mpiddp.size(), momentum=0.9)
    optimizer = mpiddp.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    ckpt = mpiddp.Checkpoint(args.checkpoint, model=model, optimizer=optimizer, sampler=sampler)
    if ckpt.restore():              # also gives every rank rank 0's weights and optimizer state
        log(f"resumed from {args.checkpoint}: {ckpt.epoch} epoch(s) and {ckpt.step} step(s) "
            f"done (written by {ckpt.ranks} rank(s))")

    for epoch in ckpt.epochs(args.epochs):
        for step, (x, y) in ckpt.batches(loader, epoch):
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
        accuracy = evaluate(model, test_set, device)
        log(f"epoch {epoch + 1}/{args.epochs}: loss {loss.item():.4f} "
            f"test accuracy {accuracy:.4f}")
        ckpt.save(epoch + 1, accuracy=accuracy)

    accuracy = evaluate(model, test_set, device)
    log(f"final test accuracy {accuracy:.4f} on {mpiddp.size()} rank(s)")
    return 0 if accuracy >= args.min_accuracy else 2


if __name__ == "__main__":
    try:
        sys.exit(main())
    except mpiddp.checkpoint.Preempted as stop:     # SIGTERM or SIGUSR1: checkpoint written
        log(stop)
        raise                                       # exit status 75: requeue the job
