"""Tables and the picture of scripts/bench/scaling_benchmark.sh's results (docs/benchmarks.md,
"Scaling to 16 nodes").

    python scripts/bench/plot_scaling.py scaling-results/ [--png docs/img/scaling_efficiency.png]
        [--allreduce-png docs/img/scaling_allreduce.png] [--against HALF_RATE_RESULTS/]

Prints, per setting and regime, a Markdown table: for each node count, each variant's
samples/s per rank, scaling efficiency (the job's throughput over N x one process's) and the
mpiddp variants against DDP-gloo; and the CPU per step per rank. Draws efficiency against N,
one panel per setting and regime. From the all-reduce part: per size and node count, mpiddp's
automatic choice and gloo against MPI_Allreduce (bus bandwidth), their CPU per GB, and the
synchronous 4 KiB latency; draws bus bandwidth against size, a panel per node count, a row of
at most four per setting.
``--against`` compares each training step with the same run at half the link rate in another
directory (the scaling benchmark with ``LINK_SCALE=0.5``): a step the network limits grows
by the whole wire time added, one the CPU limits by less.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
from collections import defaultdict

RESULT = re.compile(r"(?P<setting>light|heavy)-(?P<model>sim-[a-z0-9]+)-(?P<regime>\w+)-"
                    r"(?P<nodes>\d+)x(?P<local>\d+)\.json$")
ALLREDUCE = re.compile(r"allreduce-(?P<setting>light|heavy)-(?P<nodes>\d+)x(?P<local>\d+)"
                       r"\.json$")
LINKS = {"light": "200 Mbit/s", "heavy": "1 Gbit/s"}
AUTO, MPI, GLOO = "mpiddp auto", "MPI_Allreduce", "torch gloo"
REGIMES = ("compute", "balanced", "wire")
LABELS = {"mpiddp": "mpiddp", "overlap": "mpiddp, forward overlap",
          "native": "mpiddp, MPI_Allreduce", "ddp": "DDP-gloo"}


def in_order(runs: dict) -> list:
    """``runs``' items by setting, model and regime (compute, balanced, wire)."""
    return sorted(runs.items(),
                  key=lambda item: (item[0][0], item[0][1], REGIMES.index(item[0][2])))


def pyplot():
    """matplotlib's pyplot, drawing to files only."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, path: str, top: float = 1.0) -> None:
    """Write ``fig`` to ``path``; ``top``: the share of the height left to the panels (a
    legend above them takes the rest)."""
    fig.tight_layout(rect=(0, 0, 1, top))
    fig.savefig(path, dpi=110)
    print(f"\npicture: {path}")


def results(directory: str, pattern: re.Pattern):
    """(match, parsed JSON) for each result file in ``directory`` whose name fits ``pattern``."""
    for path in glob.glob(os.path.join(directory, "*.json")):
        match = pattern.search(os.path.basename(path))
        if match:
            with open(path) as f:
                yield match, json.load(f)


def layout(match: re.Match) -> tuple[int, int]:
    """(nodes, ranks per node) of a result file's name (``NxG``)."""
    return int(match["nodes"]), int(match["local"])


def shape_text(shape: tuple[int, int]) -> str:
    """"4" for 4 nodes of one rank (the tables' label since the first runs), "4x2" else."""
    nodes, local = shape
    return str(nodes) if local == 1 else f"{nodes}x{local}"


def load(directory: str) -> dict:
    """{(setting, model, regime): {(nodes, ranks per node): result}}"""
    runs: dict = defaultdict(dict)
    for match, result in results(directory, RESULT):
        runs[match["setting"], match["model"], match["regime"]][layout(match)] = result
    return runs


def load_allreduce(directory: str) -> dict:
    """{setting: {(nodes, ranks per node): ({(bytes, method): row}, the 4 KiB latency)}}"""
    found: dict = defaultdict(dict)
    for match, result in results(directory, ALLREDUCE):
        rows = {(row["bytes"], row["method"]): row for row in result["rows"]}
        found[match["setting"]][layout(match)] = (rows, result["latency_4k_s"])
    return found


def size_text(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def allreduce_tables(found: dict) -> None:
    for setting, by_nodes in sorted(found.items()):
        nodes = sorted(by_nodes)
        sizes = sorted({b for rows, _ in by_nodes.values() for b, _ in rows})
        head = "| size | " + " | ".join(f"{shape_text(n)} nodes" for n in nodes) + " |"
        rule = "|---:|" + "---|" * len(nodes)

        def table(title, cell):
            print(f"\n**All-reduce, {LINKS[setting]} links: {title}**\n")
            print(head)
            print(rule)
            for size in sizes:
                print(f"| {size_text(size)} | " + " | ".join(
                    cell(by_nodes[n][0], size) for n in nodes) + " |")

        def against_mpi(method):
            def cell(rows, size):
                row, mpi = rows.get((size, method)), rows.get((size, MPI))
                if row is None or mpi is None:
                    return "-"
                return f"{row['vs_mpi']:.2f}x ({row['seconds'] * 1e6:,.0f} / " \
                       f"{mpi['seconds'] * 1e6:,.0f} us)"
            return cell

        def cpu(rows, size):
            auto, gloo = rows.get((size, AUTO)), rows.get((size, GLOO))
            if auto is None:
                return "-"
            return f"{auto['cpu_s_per_gb']:.2f}" + (
                f" / {gloo['cpu_s_per_gb']:.2f}" if gloo else "")

        table("mpiddp auto against MPI_Allreduce (busbw ratio; time per all-reduce, auto / "
              "MPI)", against_mpi(AUTO))
        table("torch gloo against MPI_Allreduce (busbw ratio; gloo / MPI)", against_mpi(GLOO))
        table("CPU seconds per GB all-reduced, mpiddp auto / gloo (whole process, mean over "
              "ranks)", cpu)
        print("\nSynchronous 4 KiB `mpiddp.allreduce` (negotiation included), median of the "
              "slowest rank: " + ", ".join(
                  f"{shape_text(n)} nodes {by_nodes[n][1]['median'] * 1e6:,.0f} us"
                  for n in nodes))


# Panels to a row in the all-reduce picture: 4 keeps it about 1300 px wide (at 110 dpi).
ALLREDUCE_COLUMNS = 4


def allreduce_picture(found: dict, path: str) -> None:
    """Bus bandwidth against size: a row of panels per setting (links), a panel per node
    layout, at most ALLREDUCE_COLUMNS to a row, one legend above them all."""
    plt = pyplot()
    rows = []
    for setting in sorted(found):
        shapes = sorted(found[setting])
        rows += [[(setting, shape) for shape in shapes[i:i + ALLREDUCE_COLUMNS]]
                 for i in range(0, len(shapes), ALLREDUCE_COLUMNS)]
    columns = max(len(row) for row in rows)
    fig, axes = plt.subplots(len(rows), columns, figsize=(3.0 * columns, 2.6 * len(rows)),
                             squeeze=False, sharey=True)
    lines = {}
    for row, panels in zip(axes, rows):
        for ax in row[len(panels):]:
            ax.set_visible(False)
        for ax, (setting, nodes) in zip(row, panels):
            found_rows = found[setting][nodes][0]
            for method in sorted({m for _, m in found_rows}):
                points = sorted((b, r["busbw_gb_s"]) for (b, m), r in found_rows.items()
                                if m == method)
                line, = ax.plot([b for b, _ in points], [bw for _, bw in points], marker=".",
                                label=method, linestyle="--" if method == MPI else "-")
                lines.setdefault(method, line)
            ax.set_title(f"{shape_text(nodes)} nodes, {LINKS[setting]}", fontsize=9)
            ax.set_xscale("log", base=2)
            ticks = [1 << 12, 1 << 16, 1 << 20, 1 << 24]
            ax.set_xticks(ticks, [size_text(t) for t in ticks])
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
            ax.set_xlabel("all-reduce size", fontsize=8)
        row[0].set_ylabel("bus bandwidth (GB/s)", fontsize=8)
    across = min(len(lines), 2 * columns)            # legend entries to a line
    fig.legend(list(lines.values()), list(lines), loc="upper center", ncol=across,
               fontsize=8, frameon=False)
    legend_inches = 0.1 + 0.25 * -(-len(lines) // across)
    save(fig, path, top=1 - legend_inches / (2.6 * len(rows)))


# The one-process step as a multiple of the gradients' wire time, per regime.
REGIME_FACTOR = {"compute": 2.0, "balanced": 1.0, "wire": 0.5}


def against(runs: dict, half: dict) -> None:
    """Each step here against the same run in ``half``, whose links ran at half the rate:
    the wire time doubles, so a step the network limits grows by the whole wire time, and one
    the CPU limits by less. Cores busy: every rank's CPU per step over the step."""
    print("\n**The same runs at half the link rate** (step s; its growth over the wire time "
          "that was added; cores' worth of CPU busy during the step, all ranks: nominal -> "
          "half)\n")
    print("| setting, regime | nodes | wire time (s) | variant | step (s) | growth / wire "
          "added | CPU ms/step/rank | cores busy |")
    print("|---|---:|---:|---|---|---:|---|---|")
    for (setting, model, regime), by_nodes in in_order(runs):
        for shape, result in sorted(by_nodes.items()):
            there = half.get((setting, model, regime), {}).get(shape)
            if there is None:
                continue
            wire = result["simulation"]["step_s"] / REGIME_FACTOR[regime]
            for v in LABELS:
                a, b = result["variants"].get(v), there["variants"].get(v)
                if a and b:
                    ranks = shape[0] * shape[1]
                    busy = [ranks * x["cpu_ms_per_step"] / 1e3 / x["step_s"] for x in (a, b)]
                    print(f"| {setting}, {regime} | {shape_text(shape)} | {wire:.3f} | {v} | "
                          f"{a['step_s']:.3f} -> {b['step_s']:.3f} | "
                          f"{(b['step_s'] - a['step_s']) / wire:.0%} | "
                          f"{a['cpu_ms_per_step']:.0f} -> {b['cpu_ms_per_step']:.0f} | "
                          f"{busy[0]:.2f} -> {busy[1]:.2f} |")


def tables(runs: dict) -> None:
    for (setting, model, regime), by_nodes in in_order(runs):
        variants = [v for v in LABELS if any(v in r["variants"] for r in by_nodes.values())]
        print(f"\n**{setting}, {model}, {regime}** (efficiency; samples/s per rank; CPU ms per "
              "step per rank)\n")
        print("| nodes | one process step (s) | " + " | ".join(LABELS[v] for v in variants)
              + " | " + " | ".join(f"{v} / DDP" for v in variants if v != "ddp") + " |")
        print("|---:|---:|" + "---|" * len(variants) + "---:|" * (len(variants) - 1))
        for shape, result in sorted(by_nodes.items()):
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
            print(f"| {shape_text(shape)} | {result['simulation']['step_s']:.3f} | "
                  + " | ".join(cells)
                  + " | " + " | ".join(ratios) + " |")


def picture(runs: dict, path: str) -> None:
    plt = pyplot()
    panels = sorted({(s, r) for s, _, r in runs}, key=lambda p: (p[0], REGIMES.index(p[1])))
    settings = sorted({s for s, _ in panels})
    fig, axes = plt.subplots(len(settings), len(REGIMES), figsize=(4 * len(REGIMES),
                                                                   3.2 * len(settings)),
                             squeeze=False, sharey=True)
    ranks_per_node = sorted({local for by_nodes in runs.values() for _, local in by_nodes})
    for (setting, model, regime), by_nodes in runs.items():
        ax = axes[settings.index(setting)][REGIMES.index(regime)]
        nodes = sorted({n for n, _ in by_nodes})
        for (v, label), local in ((item, local) for item in LABELS.items()
                                  for local in ranks_per_node):
            points = [(n, by_nodes[n, local]["variants"][v]["efficiency"]) for n in nodes
                      if v in by_nodes.get((n, local), {}).get("variants", {})]
            if points:
                ax.plot([n for n, _ in points], [100 * e for _, e in points], marker="o",
                        label=label if local == 1 else f"{label}, {local} ranks per node",
                        linestyle="-" if local == 1 else "--")
        ax.set_title(f"{setting}: {model}, {regime}", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xticks(nodes, [str(n) for n in nodes])
        ax.set_ylim(0, 105)
        ax.grid(alpha=0.3)
        ax.set_xlabel("nodes" + (" (1 rank each)" if ranks_per_node == [1] else ""))
    for row in axes:
        row[0].set_ylabel("scaling efficiency (%)")
    axes[0][0].legend(fontsize=7, loc="lower left")
    save(fig, path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("directory")
    p.add_argument("--png", default=None, help="draw efficiency against N to this file")
    p.add_argument("--allreduce-png", default=None,
                   help="draw the all-reduce's bus bandwidth against size to this file")
    p.add_argument("--against", default=None, metavar="DIRECTORY",
                   help="compare each training step with the same run at half the link rate "
                        "in DIRECTORY (scaling_benchmark.sh with LINK_SCALE=0.5)")
    args = p.parse_args(argv)
    runs = load(args.directory)
    tables(runs)
    if args.png and runs:
        picture(runs, args.png)
    found = load_allreduce(args.directory)
    if found:
        allreduce_tables(found)
        if args.allreduce_png:
            allreduce_picture(found, args.allreduce_png)
    if args.against:
        against(runs, load(args.against))


if __name__ == "__main__":
    main()
