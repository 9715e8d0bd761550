"""Draw where a training step's time goes, per rank: compute, reductions, and the wait for them.

    MPIDDP_TIMELINE=/tmp/tl.json mpiexec -n 2 python train.py      # one trace per rank
    python scripts/plot_timeline.py /tmp/tl.rank*.json -o overlap.png [--steps 3]

Input: the Chrome traces mpiddp writes (``MPIDDP_TIMELINE=path``, or
``mpiddp.stop_timeline(path)``) while a ``DistributedOptimizer`` trains. For each rank, over the
last ``--steps`` steps, the picture has four lanes:

* forward + backward (from the end of one step to the end of the next backward pass),
* reductions (the engine reducing fused gradient buffers; ticks mark when backward handed
  each gradient over): a ``DistributedOptimizer``'s own reductions only (rows ``opt<i>.*``),
  not other collectives of the script (a checkpoint's per-step preemption flag, metrics),
  which would count as hidden gradient traffic,
* waiting for reductions at the end of backward (communication that was *not* hidden),
* the optimizer step.

It also prints, per rank, the median per step of: step time, compute, reduction time, the part
of the reductions that ran while backward still computed (hidden), and the wait, split by what
the gradients were doing meanwhile: a reduction running (reducing), else a gradient agreed on by
every rank but its reduction not yet started (queued: the engine busy, or without a core), else
a gradient not yet agreed on (negotiating: another rank had not handed it over yet, or the
engine's next negotiation had not come), else none of these (other); and the megabytes
(10^6 bytes) of gradients handed to the engine (the bytes the REDUCE spans carry). Each rank is
drawn on its own clock, from the end of its first step shown (clocks of different nodes are not
comparable). Needs matplotlib (``pip install matplotlib``) for the picture; ``--no-plot`` only
prints.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

LANES = [("COMPUTE", "forward + backward", "#4c72b0"),
         ("REDUCE", "reductions", "#dd8452"),
         ("WAIT", "waiting for reductions", "#c44e52"),
         ("STEP", "optimizer step", "#55a868")]
# The rows of a DistributedOptimizer (its gradients, its phases): ``opt<i>`` and ``opt<i>.*``.
OPTIMIZER_ROW = re.compile(r"^opt\d+(\.|$)")


def load(path: Path) -> tuple[int, dict[str, list[tuple[float, float]]]]:
    """(rank, {span name: [(begin s, end s), ...]}) from one rank's Chrome trace; under
    ``"BYTES"``, (begin s, bytes) of each REDUCE span that carries its tensor's bytes."""
    events = json.loads(path.read_text())["traceEvents"]
    rank = events[0]["pid"] if events else 0
    spans: dict[str, list[tuple[float, float]]] = {}
    for event in events:
        if not OPTIMIZER_ROW.match(str(event.get("tid", ""))):
            continue                # another collective of the script: not the gradients'
        begin = event["ts"] / 1e6
        spans.setdefault(event["name"], []).append((begin, begin + event["dur"] / 1e6))
        if event["name"] == "REDUCE" and "bytes" in event.get("args", {}):
            spans.setdefault("BYTES", []).append((begin, event["args"]["bytes"]))
    for name in spans:
        spans[name].sort()
    return rank, spans


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for begin, end in sorted(intervals):
        if out and begin <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([begin, end])
    return [(b, e) for b, e in out]


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sets of disjoint intervals."""
    return length(intersect(a, b))


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - begin for begin, end in intervals)


def intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]
              ) -> list[tuple[float, float]]:
    """The parts of the disjoint intervals ``a`` inside the disjoint intervals ``b``."""
    return merged([(max(begin, b_begin), min(end, b_end)) for begin, end in a
                   for b_begin, b_end in b if min(end, b_end) > max(begin, b_begin)])


def subtract(a: list[tuple[float, float]], b: list[tuple[float, float]]
             ) -> list[tuple[float, float]]:
    """The parts of the disjoint intervals ``a`` outside the intervals ``b``."""
    out = []
    for begin, end in a:
        for b_begin, b_end in merged(b):
            if b_end <= begin or b_begin >= end:
                continue
            if b_begin > begin:
                out.append((begin, b_begin))
            begin = max(begin, b_end)
            if begin >= end:
                break
        if begin < end:
            out.append((begin, end))
    return out


def clip(intervals, start: float, stop: float) -> list[tuple[float, float]]:
    return [(max(b, start), min(e, stop)) for b, e in intervals if e > start and b < stop]


def window(spans: dict, steps: int) -> tuple[float, float, int]:
    """(start, stop, steps) covering the last ``steps`` whole steps: from the end of one step
    to the end of the step ``steps`` later."""
    ends = [end for _, end in spans.get("STEP", [])]
    if len(ends) < 2:
        raise SystemExit("the trace holds fewer than 2 optimizer steps: record a timeline "
                         "while a DistributedOptimizer trains for a few steps")
    steps = min(steps, len(ends) - 1)
    return ends[-steps - 1], ends[-1], steps


# The parts of the wait, in the order they claim a moment of it: what the gradients were doing.
WAIT_PARTS = (("reducing", "REDUCE"), ("queued", "QUEUE"), ("negotiating", "NEGOTIATE"))


def summarize(spans: dict, start: float, stop: float, steps: int) -> dict[str, float]:
    """Per-step medians (ms) inside the window."""
    step_ends = [end for _, end in spans["STEP"] if start <= end <= stop]
    keys = ("step", "compute", "reduce", "hidden", "wait", *(k for k, _ in WAIT_PARTS), "other",
            "handed")
    rows = {key: [] for key in keys}
    for begin, end in zip(step_ends, step_ends[1:]):
        compute = merged(clip(spans.get("COMPUTE", []), begin, end))
        reduce_ = merged(clip(spans.get("REDUCE", []), begin, end))
        wait = merged(clip(spans.get("WAIT", []), begin, end))
        rows["step"].append(end - begin)
        rows["compute"].append(length(compute))
        rows["reduce"].append(length(reduce_))
        rows["hidden"].append(overlap(reduce_, compute))
        rows["wait"].append(length(wait))
        rest = wait                 # each moment of the wait goes to the first part that runs
        for key, span in WAIT_PARTS:
            running = merged(clip(spans.get(span, []), begin, end))
            rows[key].append(overlap(rest, running))
            rest = subtract(rest, running)
        rows["other"].append(length(rest))
        # MB handed over (x 1e3 like the rest, undone below): the REDUCE spans begun this step
        rows["handed"].append(sum(n for at, n in spans.get("BYTES", []) if begin <= at < end)
                              / 1e9)
    return {key: 1e3 * statistics.median(values) for key, values in rows.items()}


def plot(traces: list, steps: int, output: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("drawing needs matplotlib: pip install matplotlib (or use --no-plot)")
    fig, axes = plt.subplots(len(traces), 1, figsize=(12, 1.2 + 1.1 * len(traces)),
                             sharex=True, squeeze=False)
    for ax, (rank, spans) in zip(axes[:, 0], traces):
        start, stop, _ = window(spans, steps)
        for lane, (name, label, color) in enumerate(LANES):
            bars = [(b - start, e - b) for b, e in clip(spans.get(name, []), start, stop)]
            ax.broken_barh([(1e3 * b, 1e3 * w) for b, w in bars], (lane - 0.4, 0.8),
                           facecolors=color, label=label)
        submits = [b - start for b, _ in spans.get("NEGOTIATE", []) if start <= b <= stop]
        ax.plot([1e3 * t for t in submits], [1] * len(submits), "|", color="black",
                markersize=10, label="gradient handed over")
        ax.set_yticks(range(len(LANES)), [label for _, label, _ in LANES])
        ax.set_ylim(-0.6, len(LANES) - 0.4)
        ax.invert_yaxis()
        ax.set_title(f"rank {rank}", loc="left", fontsize=10)
    axes[-1, 0].set_xlabel("ms from the end of the first step shown (each rank's own clock)")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", ncol=5, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(output, dpi=110)
    print(f"wrote {output}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", type=Path, help="Chrome traces, one per rank")
    p.add_argument("-o", "--output", type=Path, default=Path("timeline.png"))
    p.add_argument("--steps", type=int, default=3, help="how many of the last steps to show")
    p.add_argument("--no-plot", action="store_true", help="only print the summary")
    args = p.parse_args(argv)
    traces = sorted((load(path) for path in args.traces), key=lambda trace: trace[0])
    print("rank  steps  step ms  compute ms  reductions ms  hidden ms  waited ms  "
          "| reducing  queued  negotiating  other  | handed MB")
    for rank, spans in traces:
        start, stop, steps = window(spans, args.steps)
        s = summarize(spans, start, stop, steps)
        print(f"{rank:4d}  {steps:5d}  {s['step']:7.1f}  {s['compute']:10.1f}  "
              f"{s['reduce']:13.1f}  {s['hidden']:9.1f}  {s['wait']:9.1f}  "
              f"| {s['reducing']:8.1f}  {s['queued']:6.1f}  {s['negotiating']:11.1f}  "
              f"{s['other']:5.1f}  | {s['handed']:9.3f}")
    if not args.no_plot:
        plot(traces, args.steps, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
