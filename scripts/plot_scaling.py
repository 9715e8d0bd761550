"""Tables and the picture of scripts/scaling_benchmark.sh's results (docs/benchmarks.md,
"Scaling to 16 nodes").

    python scripts/plot_scaling.py scaling-results/ [--png docs/img/scaling_efficiency.png]

Prints, per setting and regime, a Markdown table: for each node count, each variant's
samples/s per rank, scaling efficiency (the job's throughput over N x one process's) and the
mpiddp variants against DDP-gloo; and the CPU per step per rank. Draws efficiency against N,
one panel per setting and regime.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
from collections import defaultdict

RESULT = re.compile(r"(?P<setting>light|heavy)-(?P<model>sim-[a-z0-9]+)-(?P<regime>\w+)-"
                    r"(?P<nodes>\d+)x1\.json$")
REGIMES = ("compute", "balanced", "wire")
LABELS = {"mpiddp": "mpiddp", "overlap": "mpiddp, forward overlap",
          "native": "mpiddp, MPI_Allreduce", "ddp": "DDP-gloo"}


def load(directory: str) -> dict:
    """{(setting, model, regime): {nodes: result}}"""
    runs: dict = defaultdict(dict)
    for path in glob.glob(os.path.join(directory, "*.json")):
        match = RESULT.search(os.path.basename(path))
        if match:
            with open(path) as f:
                runs[match["setting"], match["model"], match["regime"]][int(match["nodes"])] = \
                    json.load(f)
    return runs


def tables(runs: dict) -> None:
    for (setting, model, regime), by_nodes in sorted(
            runs.items(), key=lambda item: (item[0][0], item[0][1], REGIMES.index(item[0][2]))):
        variants = [v for v in LABELS if any(v in r["variants"] for r in by_nodes.values())]
        print(f"\n**{setting}, {model}, {regime}** (efficiency; samples/s per rank; CPU ms per "
              "step per rank)\n")
        print("| nodes | one process step (s) | " + " | ".join(LABELS[v] for v in variants)
              + " | " + " | ".join(f"{v} / DDP" for v in variants if v != "ddp") + " |")
        print("|---:|---:|" + "---|" * len(variants) + "---:|" * (len(variants) - 1))
        for nodes, result in sorted(by_nodes.items()):
            cells = []
            for v in variants:
                r = result["variants"].get(v)
                cells.append("-" if r is None else
                             f"{100 * r['efficiency']:.0f}%; {r['per_rank']:.1f}; "
                             f"{r['cpu_ms_per_step']:.0f}")
            ddp = result["variants"].get("ddp")
            ratios = [f"{result['variants'][v]['total'] / ddp['total']:.2f}x"
                      if ddp and v in result["variants"] else "-"
                      for v in variants if v != "ddp"]
            print(f"| {nodes} | {result['simulation']['step_s']:.3f} | " + " | ".join(cells)
                  + " | " + " | ".join(ratios) + " |")


def picture(runs: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(s, r) for s, _, r in runs}, key=lambda p: (p[0], REGIMES.index(p[1])))
    settings = sorted({s for s, _ in panels})
    fig, axes = plt.subplots(len(settings), len(REGIMES), figsize=(4 * len(REGIMES),
                                                                   3.2 * len(settings)),
                             squeeze=False, sharey=True)
    for (setting, model, regime), by_nodes in runs.items():
        ax = axes[settings.index(setting)][REGIMES.index(regime)]
        nodes = sorted(by_nodes)
        for v, label in LABELS.items():
            points = [(n, by_nodes[n]["variants"][v]["efficiency"]) for n in nodes
                      if v in by_nodes[n]["variants"]]
            if points:
                ax.plot([n for n, _ in points], [100 * e for _, e in points], marker="o",
                        label=label)
        ax.set_title(f"{setting}: {model}, {regime}", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xticks(nodes, [str(n) for n in nodes])
        ax.set_ylim(0, 105)
        ax.grid(alpha=0.3)
        ax.set_xlabel("nodes (1 rank each)")
    for row in axes:
        row[0].set_ylabel("scaling efficiency (%)")
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\npicture: {path}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("directory")
    p.add_argument("--png", default=None, help="draw efficiency against N to this file")
    args = p.parse_args(argv)
    runs = load(args.directory)
    tables(runs)
    if args.png:
        picture(runs, args.png)


if __name__ == "__main__":
    main()
