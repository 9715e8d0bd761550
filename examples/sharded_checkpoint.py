"""Sharded checkpoints (docs/checkpointing.md, "Sharded checkpoints"): a stage-3 job whose
ranks each write their own part of the checkpoint at once; it resumes at any rank count, and
its checkpoint becomes one whole file for plain torch, offline.

    mpiexec -n 4 python examples/sharded_checkpoint.py --preempt-after 30; echo "exit $?"
    mpiexec -n 2 python examples/sharded_checkpoint.py     # goes on, at 2 ranks
    python -m mpiddp.checkpoint_convert checkpoints/sharded.pt checkpoints/whole.pt
"""
# test-args: --checkpoint {tmp}/sharded.pt --min-accuracy 0.9
import argparse
import os
import signal
import sys

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mpiddp
import mpiddp.checkpoint_convert
from mpiddp.checkpoint import Preempted, ResumableSampler

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--checkpoint", default="checkpoints/sharded.pt")
parser.add_argument("--preempt-after", type=int, default=0, metavar="N",
                    help="rank 0 sends itself SIGUSR1 after N steps of this run (0: never)")
parser.add_argument("--min-accuracy", type=float, default=0.0)
args = parser.parse_args()


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.GELU(),
                         nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))


def main() -> None:
    mpiddp.init()
    torch.manual_seed(0)
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    data = TensorDataset(x, y)
    sampler = ResumableSampler(data, num_replicas=mpiddp.size(), rank=mpiddp.rank())
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001 * mpiddp.size())
    optimizer = mpiddp.DistributedOptimizer(optimizer, model=model, zero_stage=3,
                                            bucket_cap_mb=0.25)

    # Every rank writes its own part of each save; the file at args.checkpoint becomes a small
    # manifest naming the newest complete one. Keep it where every rank can read and write.
    ckpt = mpiddp.Checkpoint(args.checkpoint, model=model, optimizer=optimizer,
                             sampler=sampler, sharded=True)
    if ckpt.restore() and mpiddp.rank() == 0:
        print(f"resumed in epoch {ckpt.epoch + 1} after step {ckpt.step} (saved by "
              f"{ckpt.ranks} rank(s))", flush=True)

    steps = 0
    for epoch in ckpt.epochs(args.epochs):
        for step, (xb, yb) in ckpt.batches(loader, epoch):
            optimizer.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            optimizer.step()
            steps += 1
            if steps == args.preempt_after and mpiddp.rank() == 0:
                os.kill(os.getpid(), signal.SIGUSR1)   # as the scheduler's warning would
        ckpt.save(epoch + 1)

    with torch.no_grad():                   # (every rank: each bucket is gathered in turn)
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    if mpiddp.rank() == 0:
        # Offline, any time later: one whole file, loaded by plain torch (no mpiddp needed).
        whole = os.path.join(os.path.dirname(args.checkpoint) or ".", "model.pt")
        mpiddp.checkpoint_convert.convert(args.checkpoint, whole, model_only=True)
        plain = make_model()
        plain.load_state_dict(torch.load(whole))
        with torch.no_grad():
            plain_accuracy = (plain(x).argmax(1) == y).float().mean().item()
        print(f"accuracy {accuracy:.3f} (the converted model: {plain_accuracy:.3f})")
        assert plain_accuracy == accuracy >= args.min_accuracy, (plain_accuracy, accuracy)
    mpiddp.shutdown()


if __name__ == "__main__":
    try:
        main()
    except Preempted as stop:               # SIGTERM or SIGUSR1: every rank saved its part
        if mpiddp.rank() == 0:
            print(stop, flush=True)
        sys.exit(stop.code)
