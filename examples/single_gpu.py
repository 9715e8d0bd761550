"""Train a small network on scikit-learn's handwritten digits on one GPU (or the CPU).

The plain single-process script that docs/getting-started.md converts into
examples/getting_started.py; `diff -u examples/single_gpu.py examples/getting_started.py`
shows every change.

    python examples/single_gpu.py      # about 0.98 test accuracy
"""
# test-launch: python
# test-ranks: 1
# test-args: --min-accuracy 0.95 --checkpoint {tmp}/single_gpu.pt
import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset


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
    """Accuracy on the whole test set."""
    model.eval()
    with torch.no_grad():
        x, y = (t.to(device) for t in dataset.tensors)
        correct = (model(x).argmax(1) == y).sum().item()
    model.train()
    return correct / len(y)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--checkpoint", default="checkpoints/digits.pt")
    p.add_argument("--min-accuracy", type=float, default=0.0,
                   help="exit with status 2 if the final test accuracy is lower")
    args = p.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    train_set, test_set = load_data()
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)

    model = Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    start_epoch = 0
    if os.path.exists(args.checkpoint):
        state = torch.load(args.checkpoint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"]
        print(f"resumed from {args.checkpoint} after epoch {start_epoch}")

    for epoch in range(start_epoch, args.epochs):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
        accuracy = evaluate(model, test_set, device)
        print(f"epoch {epoch + 1}/{args.epochs}: loss {loss.item():.4f} "
              f"test accuracy {accuracy:.4f}")
        os.makedirs(os.path.dirname(args.checkpoint) or ".", exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "epoch": epoch + 1}, args.checkpoint)

    accuracy = evaluate(model, test_set, device)
    print(f"final test accuracy {accuracy:.4f}")
    return 0 if accuracy >= args.min_accuracy else 2


if __name__ == "__main__":
    sys.exit(main())
