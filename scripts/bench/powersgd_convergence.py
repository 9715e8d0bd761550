"""Does PowerSGD cost convergence? Steps to a target training loss, uncompressed against
PowerSGD at ranks 1, 2 and 4, on a real task; and a learning-curve picture.

    mpiexec -n 2 python scripts/bench/powersgd_convergence.py \\
        --plot docs/img/powersgd_convergence.png

Every variant trains the same network (64-256-256-10, ReLU) on scikit-learn's handwritten
digits (1,437 training and 360 test images, split as examples/getting_started.py does; nothing
to download), from the same initial weights, on the same sample order: each step draws
``size x --batch`` training samples and each rank takes its slice. The optimizer is SGD with
momentum 0.9 and ``--lr`` times the number of ranks. PowerSGD variants average uncompressed for
the first ``--start-step`` steps (default: a tenth of ``--steps``), as
``Compression.powersgd(start_step=...)`` does, and send low-rank factors after.

The loss curve is each step's training loss (the batch the ranks trained on: the mean over the
ranks), smoothed by a trailing mean over ``--smooth`` steps. "Steps to target" is the first step
at which the smoothed loss is at or below ``--target`` ('-': not within ``--steps``). "Numbers
a step" counts what one rank contributes to the reductions of one step once compression runs:
``(n + m) r`` for each matrix compressed at rank r (``compression.matrix_rank``), the full size
for every other tensor. Each variant trains on ``--orders`` sample orders (seeds 1, 2, ...);
the table gives the median steps to target (each order's too) and the means of the rest, the
picture the mean curve (and each order's, faint). The variants run one after another in the
same launch; "ms a step" is rank 0's wall time, a rough figure on a shared machine. Prints a
table; ``--plot`` writes the picture, ``--json`` the curves and the table.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import mpiddp

HIDDEN = 256


def load_data():
    """(x_train, y_train, x_test, y_test): 1,437 and 360 8x8 digits, scikit-learn's bundle."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0      # pixels are 0..16
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = order[:360], order[360:]
    return x[train], y[train], x[test], y[test]


def make_model() -> nn.Module:
    torch.manual_seed(0)                # the same initial weights for every variant
    return nn.Sequential(nn.Linear(64, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, 10))


def numbers_sent(model: nn.Module, compression) -> int:
    """What one rank puts into the reductions of a compressed step."""
    total = 0
    for param in model.parameters():
        r = compression.matrix_rank(param.shape) if compression is not None else 0
        n = param.shape[0] if param.dim() else 1
        total += (n + param.numel() // n) * r if r else param.numel()
    return total


def smooth(values: list, window: int) -> list:
    """Trailing mean over ``window`` values (fewer at the start)."""
    out, running = [], 0.0
    for i, value in enumerate(values):
        running += value
        if i >= window:
            running -= values[i - window]
        out.append(running / min(i + 1, window))
    return out


def steps_to(curve: list, target: float):
    return next((step for step, loss in enumerate(curve) if loss <= target), None)


def train(label: str, rank: int, data, args, seed: int) -> dict:
    """One variant on one sample order: ``rank`` 0 is uncompressed; returns its curve and
    figures."""
    x_train, y_train, x_test, y_test = data
    me, size = mpiddp.rank(), mpiddp.size()
    model = make_model()
    compression = mpiddp.Compression.powersgd(rank=rank, start_step=args.start_step) \
        if rank else None
    if compression is not None:
        compressed = [tuple(p.shape) for p in model.parameters()
                      if compression.matrix_rank(p.shape)]
        if not compressed:
            raise SystemExit(f"{label}: PowerSGD compresses no parameter of this model")
    inner = torch.optim.SGD(model.parameters(), lr=args.lr * size, momentum=0.9)
    optimizer = mpiddp.DistributedOptimizer(
        inner, named_parameters=model.named_parameters(),
        **({"compression": compression} if compression is not None else {}))
    order = torch.Generator().manual_seed(seed)     # the same sample order for every variant
    losses = torch.zeros(args.steps, dtype=torch.float64)
    start = time.perf_counter()
    for step in range(args.steps):
        picks = torch.randint(0, len(y_train), (size * args.batch,), generator=order)
        mine = picks[me * args.batch:(me + 1) * args.batch]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x_train[mine]), y_train[mine])
        loss.backward()
        optimizer.step()
        losses[step] = loss.item()
    seconds = time.perf_counter() - start
    losses = mpiddp.allreduce(losses, op=mpiddp.Average, name=f"curve.{label}.{seed}")
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).double().mean().item()
    sums = mpiddp.allgather_object([p.double().sum().item() for p in model.parameters()])
    if any(s != sums[0] for s in sums):
        raise SystemExit(f"{label}: the replicas differ after training")
    curve = smooth(losses.tolist(), args.smooth)
    full = sum(p.numel() for p in model.parameters())
    sent = numbers_sent(model, compression)
    return {"seed": seed, "curve": curve, "steps_to_target": steps_to(curve, args.target),
            "final_loss": curve[-1], "test_accuracy": accuracy, "numbers_per_step": sent,
            "full_numbers": full, "ratio": full / sent,
            "ms_per_step": 1000 * seconds / args.steps}


def summarize(label: str, rank: int, runs: list) -> dict:
    """A variant over its sample orders: the median steps to target (None counts as never),
    the means of the rest, and the mean curve."""
    reached = sorted(run["steps_to_target"] if run["steps_to_target"] is not None
                     else float("inf") for run in runs)
    median = reached[len(reached) // 2] if len(reached) % 2 else \
        (reached[len(reached) // 2 - 1] + reached[len(reached) // 2]) / 2
    mean = lambda key: sum(run[key] for run in runs) / len(runs)    # noqa: E731
    curve = [sum(values) / len(runs) for values in zip(*(run["curve"] for run in runs))]
    return {"variant": label, "powersgd_rank": rank,
            "steps_to_target": None if median == float("inf") else median,
            "steps_to_target_each": [run["steps_to_target"] for run in runs],
            "final_loss": mean("final_loss"), "test_accuracy": mean("test_accuracy"),
            "numbers_per_step": runs[0]["numbers_per_step"],
            "full_numbers": runs[0]["full_numbers"], "ratio": runs[0]["ratio"],
            "ms_per_step": mean("ms_per_step"), "curve": curve, "runs": runs}


def show_steps(value) -> str:
    return "-" if value is None else f"{value:g}"


def plot(results: list, args, size: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = ["#333333", "#c44e52", "#dd8452", "#4c72b0", "#55a868", "#8172b2"]
    fig, ax = plt.subplots(figsize=(8.5, 5))
    for color, result in zip(colors, results):
        steps = range(len(result["curve"]))
        if len(result["runs"]) > 1:
            for run in result["runs"]:
                ax.plot(steps, run["curve"], color=color, alpha=0.15, linewidth=0.8)
        fewer = f"{result['ratio']:.0f}x fewer numbers, " if result["powersgd_rank"] else ""
        ax.plot(steps, result["curve"], color=color, linewidth=1.8,
                label=f"{result['variant']} ({fewer}target at step "
                      f"{show_steps(result['steps_to_target'])})")
    ax.axhline(args.target, color="grey", linestyle="--", linewidth=1)
    ax.text(args.steps, args.target, f"target {args.target:g} ", va="bottom", ha="right",
            fontsize=8, color="grey")
    ax.set_yscale("log")
    if 0 < args.start_step < args.steps:
        ax.axvline(args.start_step, color="grey", linestyle=":", linewidth=1)
        ax.annotate("PowerSGD starts", (args.start_step, 1), xycoords=("data", "axes fraction"),
                    xytext=(3, -4), textcoords="offset points", va="top", fontsize=8,
                    color="grey")
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (mean over ranks,\ntrailing mean of {args.smooth} steps)")
    orders = len(results[0]["runs"])
    ax.set_title(f"Digits MLP 64-{HIDDEN}-{HIDDEN}-10, {size} ranks x {args.batch} samples a "
                 f"step, SGD lr {args.lr * size:g} momentum 0.9\n"
                 + (f"bold: mean of {orders} sample orders (faint: each); target step: median"
                    if orders > 1 else "one sample order"), fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=100)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--start-step", type=int, default=None,
                   help="uncompressed steps before PowerSGD starts (default: steps // 10)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4],
                   help="PowerSGD ranks to compare with uncompressed")
    p.add_argument("--target", type=float, default=0.1, help="smoothed training loss to reach")
    p.add_argument("--lr", type=float, default=0.05, help="one rank's (x the number of ranks)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--smooth", type=int, default=20, help="steps in the trailing mean")
    p.add_argument("--orders", type=int, default=3,
                   help="sample orders (seeds 1, 2, ...) each variant is trained on")
    p.add_argument("--plot", type=Path, default=None, help="the picture (PNG)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.start_step is None:
        args.start_step = args.steps // 10

    torch.set_num_threads(1)
    mpiddp.init()
    size = mpiddp.size()
    data = load_data()
    variants = [("uncompressed", 0)] + [(f"PowerSGD rank {r}", r) for r in args.ranks]
    results = [summarize(label, r, [train(label, r, data, args, seed)
                                    for seed in range(1, args.orders + 1)])
               for label, r in variants]
    if mpiddp.rank() == 0:
        print(f"digits MLP 64-{HIDDEN}-{HIDDEN}-10, {size} ranks x {args.batch} samples a step, "
              f"SGD lr {args.lr * size:g} momentum 0.9, {args.steps} steps, PowerSGD from step "
              f"{args.start_step}; loss: trailing mean of {args.smooth} steps; "
              f"{args.orders} sample order(s): median steps, mean of the rest")
        print(f"{'variant':<17} {'steps to ' + format(args.target, 'g'):>14} {'each':>15} "
              f"{'final loss':>10} {'test acc':>8} {'numbers a step':>14} {'fewer':>6} "
              f"{'ms a step':>9}")
        for r in results:
            each = ",".join(show_steps(v) for v in r["steps_to_target_each"])
            print(f"{r['variant']:<17} {show_steps(r['steps_to_target']):>14} {each:>15} "
                  f"{r['final_loss']:>10.4f} {r['test_accuracy']:>8.3f} "
                  f"{r['numbers_per_step']:>14,} {r['ratio']:>5.1f}x {r['ms_per_step']:>9.1f}",
                  flush=True)
        if args.json:
            args.json.write_text(json.dumps({"settings": {
                "ranks": size, "steps": args.steps, "start_step": args.start_step,
                "target": args.target, "lr": args.lr * size, "batch": args.batch,
                "smooth": args.smooth, "orders": args.orders}, "results": results}))
        if args.plot:
            plot(results, args, size)
            print(f"wrote {args.plot}")
    mpiddp.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
