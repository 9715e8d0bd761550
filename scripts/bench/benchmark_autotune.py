"""Autotune against a grid search over the same settings, side by side in one launch.

For each regime, on a simulated accelerator model (``simulated_models.py``: compute is a
GIL-free wait, so only mpiddp's own work uses the CPU):

1. Calibrate: the step's communication time on this machine with the default settings
   (a step with almost no compute); the regime sets the compute against it (balanced: as
   long, wire: half, compute: twice).
2. Grid: every combination of the grid's fusion thresholds, ring thresholds, cycle times (and
   hierarchical on/off where the layout allows it), each its own ``init()`` with the values
   pinned in the environment, ``--grid-warmup`` untimed then ``--grid-steps`` timed steps.
3. Autotune: ``init()`` with ``MPIDDP_AUTOTUNE=1`` (the search's log in ``--log-dir``), train
   until every rank has applied the search's final settings; the steps and seconds it took.
4. Final: the best grid point and the tuned settings (pinned), in ``--rounds`` interleaved
   rounds of ``--final-steps`` steps: the ratio of their median step times is the result
   (the grid's best was picked from one short measurement each, so it is timed again beside
   the tuned settings, under the same background load).

    mpiexec -n 2 python scripts/bench/benchmark_autotune.py --model sim-resnet18 \\
        --regimes balanced,wire --json autotune.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

import numpy as np

import mpiddp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import synthetic_benchmark as sb  # noqa: E402  (a sibling script, not a package)
from mpiddp.runtime import current  # noqa: E402

REGIMES = {"balanced": 1.0, "compute": 2.0, "wire": 0.5}   # compute / communication time
KNOB_ENV = {"fusion_threshold": "MPIDDP_FUSION_THRESHOLD", "cycle_time": "MPIDDP_CYCLE_TIME",
            "ring_threshold": "MPIDDP_RING_THRESHOLD",
            "hierarchical": "MPIDDP_HIERARCHICAL_ALLREDUCE"}
UNITS = {"K": 1024, "M": 1024 ** 2}


def size_list(text: str) -> list:
    """'64K,1M' -> [65536, 1048576]."""
    out = []
    for item in text.split(","):
        item = item.strip().upper()
        out.append(int(float(item[:-1]) * UNITS[item[-1]]) if item[-1] in UNITS else int(item))
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="sim-resnet18", help="a sim-* model")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--param-scale", type=float, default=1.0)
    p.add_argument("--bucket-cap-mb", type=float, default=0.0,
                   help="DistributedOptimizer(bucket_cap_mb=...): 0 sends every gradient on "
                        "its own, so fusion is the engine's (as in Horovod)")
    p.add_argument("--regimes", default="balanced,wire")
    p.add_argument("--fusion-grid", default="256K,1M,4M,16M,64M")
    p.add_argument("--ring-grid", default="64K,512K,4M,32M")
    p.add_argument("--cycle-grid", default="5,50", help="cycle times (ms)")
    p.add_argument("--grid-warmup", type=int, default=2)
    p.add_argument("--grid-steps", type=int, default=5, help="K: timed steps per grid point")
    p.add_argument("--calibration-steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3, help="interleaved final rounds")
    p.add_argument("--final-steps", type=int, default=6)
    p.add_argument("--max-samples", type=int, default=16, help="MPIDDP_AUTOTUNE_MAX_SAMPLES")
    p.add_argument("--steps-per-window", type=int, default=2,
                   help="MPIDDP_AUTOTUNE_STEPS_PER_WINDOW")
    p.add_argument("--windows", type=int, default=3, help="MPIDDP_AUTOTUNE_WINDOWS")
    p.add_argument("--warmup-windows", type=int, default=1,
                   help="MPIDDP_AUTOTUNE_WARMUP_WINDOWS")
    p.add_argument("--max-tune-steps", type=int, default=1000)
    p.add_argument("--log-dir", default=".", help="where the autotune CSV logs go")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def synthetic_args(args):
    """The argument namespace synthetic_benchmark's model builders read."""
    sargs = sb.parse_args(["--model", args.model, "--batch-size", str(args.batch_size),
                           "--param-scale", str(args.param_scale), "--step-time", "1"])
    sargs.is_straggler = False
    sb.configure_simulation(sargs, 1)
    return sargs


def agreed(flag: bool) -> bool:
    """True when ``flag`` is true on every rank (waits without spinning)."""
    from mpi4py import MPI
    send, recv = np.array([int(flag)], "i4"), np.zeros(1, "i4")
    request = MPI.COMM_WORLD.Iallreduce(send, recv, op=MPI.MIN)
    sb.wait_quietly(request)
    return bool(recv[0])


def timed_steps(variant, steps: int) -> float:
    """Seconds per step over ``steps`` steps, between two barriers (rank 0's clock,
    broadcast so every rank has it)."""
    from mpi4py import MPI
    sb.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        variant.step()
    sb.barrier()
    return MPI.COMM_WORLD.bcast((time.perf_counter() - start) / steps, root=0)


def run_pinned(variant, knobs: dict, warmup: int, steps: int) -> float:
    """Step time with ``knobs`` pinned in the environment (its own init ... shutdown)."""
    saved = {env: os.environ.get(env) for env in KNOB_ENV.values()}
    for name, value in knobs.items():
        if value is not None:
            os.environ[KNOB_ENV[name]] = str(value)
    try:
        mpiddp.init()
        for _ in range(warmup):
            variant.step()
        return timed_steps(variant, steps)
    finally:
        mpiddp.shutdown()
        for env, value in saved.items():
            if value is None:
                os.environ.pop(env, None)
            else:
                os.environ[env] = value


def autotune(args, variant, log_path: str) -> dict:
    """Train with MPIDDP_AUTOTUNE=1 until every rank has applied the final settings."""
    env = {"MPIDDP_AUTOTUNE": "1", "MPIDDP_AUTOTUNE_LOG": log_path,
           "MPIDDP_AUTOTUNE_MAX_SAMPLES": str(args.max_samples),
           "MPIDDP_AUTOTUNE_STEPS_PER_WINDOW": str(args.steps_per_window),
           "MPIDDP_AUTOTUNE_WINDOWS": str(args.windows),
           "MPIDDP_AUTOTUNE_WARMUP_WINDOWS": str(args.warmup_windows)}
    os.environ.update(env)
    try:
        mpiddp.init()
        engine = current.require("benchmark").engine
        sb.barrier()
        start, steps = time.perf_counter(), 0
        while steps < args.max_tune_steps:
            variant.step()
            steps += 1
            if agreed(engine.autotune_finished):
                break
        seconds = time.perf_counter() - start
        if not engine.autotune_finished:
            raise SystemExit(f"autotune did not finish within {steps} steps")
        knobs = engine.retunes[-1][1].knobs
        after = timed_steps(variant, args.final_steps)     # still in the tuned job
    finally:
        mpiddp.shutdown()
        for key in env:
            os.environ.pop(key, None)
    return {"knobs": {name: getattr(knobs, name) for name in KNOB_ENV}, "steps": steps,
            "seconds": seconds, "step_after": after, "pin": knobs.pin()}


def env_value(name: str, value):
    if name == "hierarchical" and value is not None:
        return "auto" if value else "0"
    return value


def main(argv=None) -> int:
    args = parse_args(argv)
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_size = node.Get_size()
    node.Free()
    import torch
    torch.set_num_threads(1)
    hierarchical = [True, False] if 1 < local_size < size else [None]
    for name in KNOB_ENV.values():          # the grid and the search set these themselves
        os.environ.pop(name, None)
    sargs = synthetic_args(args)
    mpiddp.init()
    variant = sb.make_mpiddp(sargs, args.bucket_cap_mb, "mpiddp")
    mpiddp.shutdown()
    model = variant.model
    params = sum(p.numel() for p in model.parameters())
    grid = [dict(zip(KNOB_ENV, point)) for point in itertools.product(
        size_list(args.fusion_grid), [float(c) for c in args.cycle_grid.split(",")],
        size_list(args.ring_grid), hierarchical)]
    if rank == 0:
        print(f"{args.model}: {params / 1e6:.1f} M parameters ({params * 4 / 1e6:.0f} MB of "
              f"gradients), batch {args.batch_size}, bucket_cap_mb {args.bucket_cap_mb:g}, "
              f"{size} ranks ({local_size} per node); grid of {len(grid)} points x "
              f"{args.grid_steps} steps; autotune: {args.max_samples} samples of "
              f"{args.warmup_windows}+{args.windows} windows of {args.steps_per_window} steps",
              flush=True)
    results = {"model": args.model, "ranks": size, "local_size": local_size,
               "argv": sys.argv[1:], "regimes": {}}
    for regime in args.regimes.split(","):
        # 1. calibrate: a step of (almost) only communication, default settings
        tiny = 3 * sargs.sim_optimizer_s + 1e-3
        model.set_step_time(tiny, args.batch_size, sargs.sim_optimizer_s)
        comm_s = max(run_pinned(variant, {}, 2, args.calibration_steps) - tiny, 1e-3)
        step_s = REGIMES[regime] * comm_s
        model.set_step_time(max(step_s, tiny), args.batch_size, sargs.sim_optimizer_s)
        if rank == 0:
            print(f"\n== {regime}: communication {comm_s * 1e3:.0f} ms per step with the "
                  f"defaults, compute {step_s * 1e3:.0f} ms", flush=True)
        # 2. the grid
        timings = []
        for point in grid:
            pinned = {k: env_value(k, v) for k, v in point.items()}
            timings.append(run_pinned(variant, pinned, args.grid_warmup, args.grid_steps))
        best = int(np.argmin(timings))
        if rank == 0:
            order = np.argsort(timings)
            print(f"grid: best {timings[best] * 1e3:.1f} ms at {grid[best]}, median "
                  f"{statistics.median(timings) * 1e3:.1f} ms, worst "
                  f"{max(timings) * 1e3:.1f} ms at {grid[int(order[-1])]}", flush=True)
        # 3. autotune
        log_path = os.path.join(args.log_dir, f"autotune-{args.model}-{regime}-{size}.csv")
        tuned = autotune(args, variant, log_path)
        if rank == 0:
            print(f"autotune: {tuned['steps']} steps ({tuned['seconds']:.1f} s) to finish; "
                  f"then {tuned['step_after'] * 1e3:.1f} ms per step; {tuned['pin']}",
                  flush=True)
        # 4. the best grid point and the tuned settings, interleaved
        tuned_env = {k: env_value(k, v) for k, v in tuned["knobs"].items()}
        best_env = {k: env_value(k, v) for k, v in grid[best].items()}
        final = {"grid": [], "tuned": []}
        for r in range(args.rounds):
            pair = [("grid", best_env), ("tuned", tuned_env)]
            for label, knobs in (pair if r % 2 == 0 else pair[::-1]):
                final[label].append(run_pinned(variant, knobs, 1, args.final_steps))
        grid_s, tuned_s = (statistics.median(final[k]) for k in ("grid", "tuned"))
        ratio = tuned_s / grid_s
        if rank == 0:
            print(f"final ({args.rounds} interleaved rounds of {args.final_steps} steps): best "
                  f"grid point {grid_s * 1e3:.1f} ms, tuned {tuned_s * 1e3:.1f} ms per step: "
                  f"tuned / grid = {ratio:.3f} ({'within' if ratio <= 1.05 else 'NOT within'} "
                  f"5%)", flush=True)
        results["regimes"][regime] = {
            "comm_s": comm_s, "compute_s": step_s,
            "grid": [{"knobs": p, "step_s": t} for p, t in zip(grid, timings)],
            "grid_best": grid[best], "grid_best_step_s": timings[best],
            "autotune": tuned, "final": final, "final_grid_s": grid_s,
            "final_tuned_s": tuned_s, "ratio": ratio, "log": log_path}
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
