"""Does Adasum help? Steps to a target loss, averaging (learning rate scaled by the rank count)
against Adasum (the learning rate of one rank), for SGD with momentum and for Adam, at several
rank counts; and a learning-curve picture.

    python scripts/bench/benchmark_adasum.py --ranks 1 2 4 8 -o docs/img/adasum_convergence.png

``--sgd-lr`` and ``--adam-lr`` set one rank's learning rates (defaults: those that suit one
rank); larger ones make the problem harder for averaging, whose learning rate grows with the
ranks.

Every run trains the same small network (64-128-128-10, tanh) on scikit-learn's handwritten
digits (1,797 images, nothing to download) with 32 samples per rank per step, so the global
batch grows with the ranks, as in data-parallel training; every run starts from the same
weights and sees the same sample order. The loss is the training loss over the whole data set,
every ``--every`` steps. "Steps to target" is the first step at which it falls to ``--target``
(none: never within ``--steps``). Each run is its own ``mpiexec`` launch (the bundled MPICH
wheel; ``MPIR_CVAR_ENABLE_HEAVY_YIELD=1`` when ranks outnumber cores), so runs do not share
state. Prints a table and writes ``--json`` if given.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

SETTINGS = {"sgd": 0.05, "adam": 0.004}       # one rank's learning rate


def worker(args) -> None:
    import torch
    import torch.nn.functional as F
    from sklearn.datasets import load_digits
    from torch import nn

    import mpiddp

    torch.set_num_threads(1)
    mpiddp.init()
    rank, size = mpiddp.rank(), mpiddp.size()
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(),
                          nn.Linear(128, 10))
    adasum = args.op == "adasum"
    lr = args.lr * (1 if adasum else size)
    inner = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9) \
        if args.optimizer == "sgd" else torch.optim.Adam(model.parameters(), lr=lr)
    optimizer = mpiddp.DistributedOptimizer(
        inner, named_parameters=model.named_parameters(),
        op=mpiddp.Adasum if adasum else mpiddp.Average)
    order = torch.Generator().manual_seed(1)
    per_rank = 32
    curve = []
    for step in range(args.steps + 1):
        if step % args.every == 0:
            with torch.no_grad():
                curve.append((step, float(F.cross_entropy(model(x), y))))
        if step == args.steps:
            break
        picks = torch.randint(0, len(y), (size * per_rank,), generator=order)
        mine = picks[rank * per_rank:(rank + 1) * per_rank]
        optimizer.zero_grad()
        F.cross_entropy(model(x[mine]), y[mine]).backward()
        optimizer.step()
    if rank == 0:
        print("CURVE " + json.dumps(curve), flush=True)
    mpiddp.shutdown()


def run(ranks: int, optimizer: str, op: str, args) -> list:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if ranks > (os.cpu_count() or 1):
        env["MPIR_CVAR_ENABLE_HEAVY_YIELD"] = "1"
    cmd = [str(mpiexec) if mpiexec.exists() else "mpiexec", "-n", str(ranks), sys.executable,
           __file__, "--worker", "--optimizer", optimizer, "--op", op,
           "--lr", str(args.learning_rates[optimizer]),
           "--steps", str(args.steps), "--every", str(args.every)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900,
                         start_new_session=True)
    for line in out.stdout.splitlines():
        if line.startswith("CURVE "):
            return json.loads(line[len("CURVE "):])
    raise RuntimeError(f"run {ranks} {optimizer} {op} failed:\n{out.stdout[-2000:]}"
                       f"{out.stderr[-2000:]}")


def steps_to(curve: list, target: float):
    return next((step for step, loss in curve if loss <= target), None)


def plot(results: dict, output: Path, ranks: list, learning_rates: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    colors = dict(zip(ranks, ["#4c72b0", "#55a868", "#dd8452", "#c44e52", "#8172b2"]))
    for ax, optimizer in zip(axes, SETTINGS):
        for (n, opt, op), curve in results.items():
            if opt != optimizer:
                continue
            steps, losses = zip(*curve)
            ax.plot(steps, losses, color=colors[n], linestyle="-" if op == "adasum" else "--",
                    label=f"{n} rank(s), {op}")
        ax.set_title(f"{optimizer.upper()} (lr {learning_rates[optimizer]:g}): solid Adasum "
                     "(one rank's lr), dashed average (lr x N)", fontsize=10)
        ax.set_xlabel("step")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("training loss (whole data set)")
    axes[1].legend(fontsize=8, ncol=2)
    fig.suptitle("Digits MLP, 32 samples per rank per step", fontsize=10)
    fig.tight_layout()
    fig.savefig(output, dpi=100)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--target", type=float, default=0.1, help="training loss to reach")
    p.add_argument("-o", "--output", type=Path, default=None, help="the picture (PNG)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--sgd-lr", type=float, default=SETTINGS["sgd"], help="one rank's (SGD)")
    p.add_argument("--adam-lr", type=float, default=SETTINGS["adam"], help="one rank's (Adam)")
    p.add_argument("--lr", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--optimizer", choices=list(SETTINGS), default="sgd", help=argparse.SUPPRESS)
    p.add_argument("--op", choices=["average", "adasum"], default="average",
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.learning_rates = {"sgd": args.sgd_lr, "adam": args.adam_lr}
    if args.worker:
        worker(args)
        return 0
    results = {}
    print(f"steps to a training loss of {args.target} (of {args.steps}; '-': not reached); "
          f"one rank's lr: SGD {args.sgd_lr:g}, Adam {args.adam_lr:g}")
    print(f"{'ranks':>5} {'optimizer':>9} {'average (lr x N)':>17} {'adasum':>7}")
    for n in args.ranks:
        for optimizer in SETTINGS:
            row = {}
            for op in ("average", "adasum"):
                results[(n, optimizer, op)] = run(n, optimizer, op, args)
                row[op] = steps_to(results[(n, optimizer, op)], args.target)
            show = {op: "-" if v is None else str(v) for op, v in row.items()}
            print(f"{n:>5} {optimizer:>9} {show['average']:>17} {show['adasum']:>7}", flush=True)
    if args.json:
        args.json.write_text(json.dumps([{"ranks": n, "optimizer": o, "op": op, "curve": c}
                                          for (n, o, op), c in results.items()]))
    if args.output:
        plot(results, args.output, args.ranks, args.learning_rates)
    return 0


if __name__ == "__main__":
    sys.exit(main())
