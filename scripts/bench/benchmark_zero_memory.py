"""Memory per rank of ZeRO-style sharding on the CPU: mpiddp's ``DistributedOptimizer`` at
``zero_stage`` 0, 1 and 2 beside torch's ``ZeroRedundancyOptimizer`` (with
``DistributedDataParallel``) and FSDP2 (``fully_shard`` with ``reshard_after_forward=False``,
ZeRO-2 style, and with ``True``, ZeRO-3 style: the parameters sharded too), all over gloo, for
one float32 model trained with ``torch.optim.Adam``.

    python scripts/bench/benchmark_zero_memory.py --ranks 2 --json zero_memory.json
    python scripts/bench/benchmark_zero_memory.py --ranks 4 --layers 2 --width 256 --steps 2
    python scripts/bench/benchmark_zero_memory.py --configs mpiddp-zero3 fsdp2-reshard \
        --param-dtype bfloat16      # stage 3 and FSDP2 with the same mixed-precision policy

The script is the driver (run it without ``mpiexec``): each configuration is its own
``timeout ... mpiexec -n RANKS python -m mpi4py`` launch of this file in worker mode, so its
peak RSS is not polluted by earlier configurations (``MPIR_CVAR_ENABLE_HEAVY_YIELD=1`` when
the ranks outnumber the cores). The model is ``--layers`` ``nn.Linear(W, W)`` + tanh (12 x
2048: 50.4M parameters), a batch of ``--batch`` x W per rank (activations are negligible),
``--steps`` steps. Per rank it measures:

* optimizer state: the bytes of every tensor in the optimizer's ``state`` (mpiddp: the
  wrapped optimizer's, which holds this rank's shards only; ZeroRedundancyOptimizer: its
  local ``optim.state``; FSDP2: the local shards of the DTensor state);
* RSS: ``VmRSS`` just before the optimizer (and DDP / ``fully_shard``) is built -- the
  *baseline*: interpreter, torch, MPI, the model's parameters and the code the configuration
  runs (loaded first by a throwaway Adam step on a tiny layer: torch's first optimizer
  imports ~70 MiB of modules) -- and the peak
  (``VmHWM``, reset to the baseline through ``/proc/self/clear_refs`` when the kernel allows,
  else ``ru_maxrss``) after the steps. ``peak - baseline`` is what the method adds (gradients,
  optimizer state, communication buffers); the *model-state* memory is that plus the
  parameters' bytes (resident in the baseline), to compare with the ZeRO paper's formula for
  float32 Adam, 4 B parameters + 4 B gradients + 8 B optimizer state per parameter:
  stage 0 16 B, stage 1 4 + 4 + 8/N, stage 2 4 + (4 + 8)/N, stage 3 (4 + 4 + 8)/N
  (ZeroRedundancyOptimizer with DDP is compared with stage 1, FSDP2 without resharding after
  forward with stage 2, FSDP2 resharding after forward with stage 3). The JSON also has
  ``peak_rss_steps``, the peak over the training steps alone (reset after the wrapping,
  where the kernel allows; else null), to tell a wrapping transient (``fully_shard`` holds
  the whole parameters and their shards at once) from the training's peak;
* the ``param.grad`` bytes held after the last backward (mpiddp's stage 2 releases the
  full-size gradients; FSDP2's are its local shards);
* the final parameters: every rank's must agree, and mpiddp's stages 1 and 2 must end where
  stage 0 does (compared bit for bit; the mpiddp runs use the ring all-reduce,
  ``--algorithm``, in whose order the sharded reduce-scatter sums. From 3 ranks on, bits
  agree only where stage 0's all-reduces cut the gradients as stage 1's buckets do: with
  several buckets, run with ``MPIDDP_FUSION_THRESHOLD=0`` and ``--bucket-cap-mb 0``, as
  tests/test_zero.py does; otherwise the engine fuses stage 0's submissions and the largest
  difference is reported).

Workers set ``MALLOC_MMAP_THRESHOLD_`` (``--mmap-threshold``) so that every large tensor is
its own mapping, returned to the system when freed: glibc's adaptive threshold would otherwise
keep freed 16 MiB blocks in the heap and let fragmentation into the peak. Prints one row per
configuration (the largest value over the ranks) and writes every rank's numbers to
``--json``.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

MiB = 2 ** 20
LEARNING_RATE = 1e-3
# configuration -> (label, the ZeRO stage its formula is that of)
CONFIGS = {
    "mpiddp-zero0": ("mpiddp zero_stage=0", 0),
    "mpiddp-zero1": ("mpiddp zero_stage=1", 1),
    "mpiddp-zero2": ("mpiddp zero_stage=2", 2),
    "torch-zero-ddp": ("torch ZeRO + DDP", 1),
    "fsdp2": ("FSDP2 no reshard", 2),
    "fsdp2-reshard": ("FSDP2 reshard", 3),
    "mpiddp-zero3": ("mpiddp zero_stage=3", 3),
    # the model built on the meta device: no rank holds it whole (its values differ from the
    # reference's: each module initialised in bucket order)
    "mpiddp-zero3-meta": ("mpiddp stage 3, meta", 3),
}
META = "-meta"
# the modules each configuration's wrapping loads (imported before the baseline)
WRAPPER_MODULES = {**{c: ("mpiddp.torch.sharding.optimizer",) for c in CONFIGS if "mpiddp" in c},
                   "torch-zero-ddp": ("torch.distributed.optim", "torch.nn.parallel"),
                   "fsdp2": ("torch.distributed.fsdp",),
                   "fsdp2-reshard": ("torch.distributed.fsdp",)}
REFERENCE = "mpiddp-zero0"          # the others' final parameters are compared with its
_running: list = []                 # the driver's launch in progress (its own process session)


# ---- measurements (worker side) -----------------------------------------------------------
def proc_status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> bool:
    """Reset the peak RSS (``VmHWM``) to the current RSS; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """The peak RSS since the last reset (or since the start)."""
    try:
        return proc_status_bytes("VmHWM")
    except (OSError, RuntimeError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def tensor_bytes(tensor) -> int:
    """Bytes of this rank's part of ``tensor`` (a DTensor's local shard)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def state_bytes(state) -> int:
    """Bytes of every tensor in an optimizer's ``state`` (parameter -> dict of values)."""
    import torch
    return sum(tensor_bytes(value) for values in state.values() for value in values.values()
               if isinstance(value, torch.Tensor))


def grad_bytes(params) -> int:
    """Bytes of the ``.grad`` tensors the parameters hold now."""
    return sum(tensor_bytes(p.grad) for p in params if p.grad is not None)


def formula_bytes(stage: int, params: int, ranks: int, trainable: int | None = None) -> dict:
    """The ZeRO paper's model-state bytes per rank for float32 Adam at ``stage``
    (``trainable`` of the ``params`` have gradients and Adam state; default all)."""
    trainable = params if trainable is None else trainable
    weights = 4 * params / (ranks if stage >= 3 else 1)
    grads = 4 * trainable / (ranks if stage >= 2 else 1)
    optimizer = 8 * trainable / (ranks if stage >= 1 else 1)
    return {"params": weights, "grads": grads, "optimizer": optimizer,
            "total": weights + grads + optimizer}


# ---- model and data -------------------------------------------------------------------------
def build_model(layers: int, width: int, frozen: int = 0, device: str = "cpu"):
    """``layers`` x (``nn.Linear(width, width)``, tanh), the same on every rank (seed 0);
    the first ``frozen`` layers frozen (``requires_grad=False``); on ``device`` ("meta": no
    memory)."""
    import torch
    torch.manual_seed(0)
    with torch.device(device):
        return _layers(layers, width, frozen)


def _layers(layers: int, width: int, frozen: int):
    from torch import nn
    modules = []
    for index in range(layers):
        layer = nn.Linear(width, width)
        layer.requires_grad_(index >= frozen)
        modules += [layer, nn.Tanh()]
    return nn.Sequential(*modules)


def batch(rank: int, step: int, rows: int, width: int):
    """This rank's (input, target) of ``step``: different on each rank, the same in every
    configuration."""
    import torch
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(rows, width, generator=generator),
            torch.randn(rows, width, generator=generator))


# ---- the configurations (worker side) ------------------------------------------------------
class Setup:
    """One configuration's training objects: the module to call, the optimizer, the
    optimizer-state dict to measure and how to read the final parameters."""

    def __init__(self, module, optimizer, state, full_params):
        self.module, self.optimizer, self.state = module, optimizer, state
        self.full_params = full_params          # () -> list of whole parameter tensors


def prepare(config: str, comm, args):
    """Start the communication library and build the model: ``(model, wrap)``; ``wrap()``
    builds what is measured (optimizer, DDP, ``fully_shard``) and returns a ``Setup``."""
    meta = config.endswith(META)
    model = build_model(args.layers, args.width, args.frozen_layers,
                        device="meta" if meta else "cpu")
    if config.startswith("mpiddp"):
        import mpiddp
        mpiddp.init()
        if not meta:
            mpiddp.broadcast_parameters(model.state_dict(), root_rank=0)
        stage = CONFIGS[config][1]
        return model, lambda: wrap_mpiddp(model, stage, args.bucket_cap_mb, args.param_dtype)
    from synthetic_benchmark import init_torch_distributed
    init_torch_distributed(single_node=True)
    if config == "torch-zero-ddp":
        return model, lambda: wrap_torch_zero(model)
    if config in ("fsdp2", "fsdp2-reshard"):
        return model, lambda: wrap_fsdp2(model, reshard=config == "fsdp2-reshard",
                                         param_dtype=args.param_dtype)
    raise ValueError(f"unknown configuration {config!r}")


def wrap_mpiddp(model, stage: int, bucket_cap_mb: float | None,
                param_dtype: str = "float32") -> Setup:
    """``mpiddp.DistributedOptimizer(Adam, zero_stage=stage)`` (at stage 3 with
    ``--param-dtype bfloat16``: ``mixed_precision=MixedPrecisionPolicy(bfloat16, float32)``)."""
    import torch

    import mpiddp
    policy = mpiddp.MixedPrecisionPolicy(param_dtype=getattr(torch, param_dtype),
                                         reduce_dtype=torch.float32) \
        if stage == 3 and param_dtype != "float32" else None
    optimizer = mpiddp.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=LEARNING_RATE),
        named_parameters=model.named_parameters(), zero_stage=stage,
        bucket_cap_mb=bucket_cap_mb, model=model if stage == 3 else None,
        mixed_precision=policy)
    # (At stage 3 reading a parameter gathers its bucket, and the copy is taken before
    # another read may release it.)
    if policy is not None:      # (the parameters are bf16: the float32 masters instead)
        return Setup(model, optimizer, optimizer.state,
                     lambda: [model.state_dict()[name] for name, _ in model.named_parameters()])
    return Setup(model, optimizer, optimizer.state,
                 lambda: [p.detach().clone() for p in model.parameters()])


def wrap_torch_zero(model) -> Setup:
    """``DistributedDataParallel`` + ``ZeroRedundancyOptimizer(Adam)``."""
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel
    ddp = DistributedDataParallel(model)
    optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam,
                                        lr=LEARNING_RATE)
    return Setup(ddp, optimizer, optimizer.optim.state,
                 lambda: [p.detach() for p in model.parameters()])


def wrap_fsdp2(model, reshard: bool = False, param_dtype: str = "float32") -> Setup:
    """FSDP2: ``fully_shard`` on each linear layer and the root, without resharding after
    forward (ZeRO-2 style) or, with ``reshard``, resharding after forward (ZeRO-3 style: the
    parameters freed after each layer's forward and all-gathered again for its backward),
    then Adam on the sharded parameters."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, param_dtype),
                                  reduce_dtype=torch.float32) \
        if param_dtype != "float32" else MixedPrecisionPolicy()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, reshard_after_forward=reshard, mp_policy=policy)
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    return Setup(model, optimizer, optimizer.state,
                 lambda: [p.full_tensor().detach() for p in model.parameters()])


def train(setup: Setup, model, rank: int, args) -> int:
    """``args.steps`` Adam steps; returns the ``param.grad`` bytes the model's parameters hold
    after the last backward (before its step)."""
    import torch.nn.functional as F
    held = 0
    for step in range(args.steps):
        x, y = batch(rank, step, args.batch, args.width)
        setup.optimizer.zero_grad()
        F.mse_loss(setup.module(x).float(), y).backward()   # (bf16 logits: --param-dtype)
        held = grad_bytes(model.parameters())
        setup.optimizer.step()
    return held


def finish(config: str) -> None:
    """Stop the communication library."""
    if config.startswith("mpiddp"):
        import mpiddp
        mpiddp.shutdown()
    else:
        import torch.distributed as dist
        dist.destroy_process_group()


def warm_up(config: str) -> None:
    """Load the code the configuration runs before the baseline is taken: its wrapper's
    modules and a throwaway Adam step on a tiny layer (torch's first optimizer imports some
    800 modules, ~70 MiB of RSS that no configuration should be charged for)."""
    import importlib

    import torch
    import torch.nn.functional as F
    for module in WRAPPER_MODULES[config]:
        importlib.import_module(module)
    layer = torch.nn.Linear(8, 8)
    optimizer = torch.optim.Adam(layer.parameters())
    F.mse_loss(layer(torch.ones(2, 8)), torch.zeros(2, 8)).backward()
    optimizer.step()


def measure(config: str, comm, outdir: Path, args) -> dict:
    """Run one configuration on this rank and return its numbers; rank 0 also saves the final
    parameters to ``outdir`` for the driver's comparison."""
    import torch
    torch.set_num_threads(1)
    warm_up(config)
    rss_before_model = proc_status_bytes("VmRSS")
    model, wrap = prepare(config, comm, args)
    params = sum(p.numel() for p in model.parameters())
    gc.collect()
    baseline = proc_status_bytes("VmRSS")
    hwm_reset = reset_peak_rss()
    start = time.perf_counter()
    setup = wrap()
    peak_wrap = peak_rss_bytes()
    construction = peak_wrap - rss_before_model     # building the model and wrapping it
    steps_reset = hwm_reset and reset_peak_rss()
    held = train(setup, model, comm.rank, args)
    seconds = time.perf_counter() - start
    peak_steps = peak_rss_bytes()
    peak = max(peak_wrap, peak_steps)
    result = {"config": config, "rank": comm.rank, "ranks": comm.size, "params": params,
              "rss_before_model": rss_before_model, "baseline_rss": baseline, "peak_rss": peak,
              "peak_rss_steps": peak_steps if steps_reset else None,
              "construction_bytes": construction if hwm_reset else None,
              "rss_after": proc_status_bytes("VmRSS"), "hwm_reset": hwm_reset,
              "optimizer_state_bytes": state_bytes(setup.state),
              "full_grad_bytes_after_backward": held, "seconds": seconds}
    final = [t.contiguous().cpu() for t in setup.full_params()]
    digest = hashlib.sha256()
    for tensor in final:
        digest.update(tensor.numpy().tobytes())
    result["params_sha256"] = digest.hexdigest()
    if comm.rank == 0:
        torch.save(final, outdir / f"{config}.params.pt")
    del setup, final
    finish(config)
    return result


def worker(args) -> int:
    """Worker mode (under mpiexec): measure ``args.worker`` and write this rank's JSON; on an
    error write it there too and re-raise (``python -m mpi4py`` then aborts every rank)."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    outdir = Path(args.outdir)
    path = outdir / f"{args.worker}.rank{comm.rank}.json"
    try:
        result = measure(args.worker, comm, outdir, args)
    except BaseException as exc:
        message = f"{type(exc).__name__}: {exc}".strip()
        path.write_text(json.dumps({"config": args.worker, "rank": comm.rank,
                                    "error": message.splitlines()[0][:500],
                                    "traceback": traceback.format_exc()}))
        raise
    path.write_text(json.dumps(result))
    return 0


# ---- the driver -----------------------------------------------------------------------------
def mpiexec_command(config: str, outdir: Path, args) -> list:
    """The ``timeout ... mpiexec ... python -m mpi4py this --worker config`` command."""
    candidate = Path(sys.executable).parent / "mpiexec"
    mpiexec = str(candidate) if candidate.exists() else "mpiexec"
    return ["timeout", "-k", "10", str(args.timeout), mpiexec, "-n", str(args.ranks),
            sys.executable, "-m", "mpi4py", os.path.abspath(__file__), "--worker", config,
            "--outdir", str(outdir), "--layers", str(args.layers), "--width", str(args.width),
            "--steps", str(args.steps), "--batch", str(args.batch),
            "--frozen-layers", str(args.frozen_layers), "--param-dtype", args.param_dtype,
            *(["--bucket-cap-mb", str(args.bucket_cap_mb)]
              if args.bucket_cap_mb is not None else [])]


def worker_env(config: str, args) -> dict:
    """The workers' environment (see the module docstring)."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    if args.mmap_threshold > 0:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    if args.ranks > (os.cpu_count() or 1):
        env["MPIR_CVAR_ENABLE_HEAVY_YIELD"] = "1"
    if config.startswith("mpiddp") and args.algorithm:
        env["MPIDDP_ALLREDUCE_ALGORITHM"] = args.algorithm
    return env


def launch(config: str, outdir: Path, args) -> dict:
    """Run one configuration in a fresh launch; ``{"per_rank": [...], "error": ...}``. The
    launch runs in its own session, killed as a whole if it outlives ``args.timeout``."""
    proc = subprocess.Popen(mpiexec_command(config, outdir, args), env=worker_env(config, args),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    _running.append(proc)
    try:
        output, _ = proc.communicate(timeout=args.timeout + 30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    finally:
        _running.remove(proc)
    per_rank, errors = [], []
    for rank in range(args.ranks):
        path = outdir / f"{config}.rank{rank}.json"
        if path.exists():
            data = json.loads(path.read_text())
            (errors if "error" in data else per_rank).append(data)
    error = None
    if errors:
        error = errors[0]["error"]
    elif proc.returncode != 0 or len(per_rank) != args.ranks:
        why = "timed out" if proc.returncode in (124, 137, -9) else f"exit {proc.returncode}"
        error = f"launch {why}"
    if error is not None:
        sys.stderr.write(f"--- {config} failed ({error}); output:\n{output[-4000:]}\n")
    return {"per_rank": sorted(per_rank, key=lambda r: r["rank"]), "error": error,
            "traceback": errors[0]["traceback"] if errors else None}


def stop_on_signal(signum, frame) -> None:
    """SIGTERM / SIGINT to the driver: kill the launch in progress (a session of its own,
    which a signal to the driver's process group does not reach), then exit."""
    for proc in list(_running):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    raise SystemExit(128 + signum)


def summarize(config: str, run: dict, args) -> dict:
    """One configuration's row: each value the largest over the ranks."""
    label, stage = CONFIGS[config]
    row = {"config": config, "label": label, "formula_stage": stage, "error": run["error"],
           "per_rank": run["per_rank"]}
    if run["error"] is not None:
        row["traceback"] = run["traceback"]
        return row
    ranks = run["per_rank"]
    params = ranks[0]["params"]
    formula = formula_bytes(stage, params, args.ranks,
                            params * (args.layers - args.frozen_layers) // args.layers)
    above = max(r["peak_rss"] - r["baseline_rss"] for r in ranks)
    # (A meta model's parameters are not in the baseline: they are the wrapping's.)
    resident = 0 if config.endswith(META) else 4 * params
    row.update(
        params=params,
        optimizer_state_bytes=max(r["optimizer_state_bytes"] for r in ranks),
        baseline_rss=max(r["baseline_rss"] for r in ranks),
        peak_rss=max(r["peak_rss"] for r in ranks),
        above_baseline_bytes=above,
        model_state_bytes=above + resident,
        construction_bytes=None if any(r.get("construction_bytes") is None for r in ranks)
        else max(r["construction_bytes"] for r in ranks),
        full_grad_bytes_after_backward=max(r["full_grad_bytes_after_backward"] for r in ranks),
        formula=formula,
        ranks_agree=len({r["params_sha256"] for r in ranks}) == 1,
        hwm_reset=all(r["hwm_reset"] for r in ranks),
        peak_rss_steps=None if any(r.get("peak_rss_steps") is None for r in ranks)
        else max(r["peak_rss_steps"] for r in ranks),
        seconds=max(r["seconds"] for r in ranks))
    row["ratio"] = row["model_state_bytes"] / formula["total"]
    # The same over the training steps alone: at stage 3 the model built whole before the
    # wrapping (in the baseline) can be the run's peak, which hides the training's.
    row["model_state_steps_bytes"] = None if row["peak_rss_steps"] is None else \
        row["peak_rss_steps"] - row["baseline_rss"] + resident
    row["optimizer_ratio"] = row["optimizer_state_bytes"] / formula["optimizer"]
    return row


def compare_params(config: str, outdir: Path) -> dict | None:
    """Final parameters of ``config`` (rank 0) against the reference configuration's:
    bitwise equality and the largest absolute difference; None when either is missing."""
    import torch
    mine, reference = outdir / f"{config}.params.pt", outdir / f"{REFERENCE}.params.pt"
    if not (mine.exists() and reference.exists()):
        return None
    a, b = torch.load(mine), torch.load(reference)
    equal = len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    diff = max(float((x - y).abs().max()) for x, y in zip(a, b)) if len(a) == len(b) else None
    return {"equal": equal, "max_abs_diff": diff}


def print_table(rows: list, args) -> None:
    """The results table (MiB per rank, the largest over the ranks)."""
    params = next((row["params"] for row in rows if "params" in row), 0)
    frozen = f" (the first {args.frozen_layers} frozen)" if args.frozen_layers else ""
    print(f"\n{args.ranks} ranks, {args.layers} x Linear({args.width}, {args.width}){frozen} = "
          f"{params / 1e6:.1f}M float32 parameters, Adam, batch "
          f"{args.batch}x{args.width}, {args.steps} steps; MiB per rank (largest over ranks)")
    print("model state = peak RSS - baseline RSS + parameter bytes (resident in the baseline); "
          "formula: 4 B params + 4 B grads + 8 B Adam state per parameter, sharded per stage")
    head = (f"{'configuration':<22}{'formula':>8}{'opt state':>10}{'(formula)':>10}"
            f"{'baseline':>9}{'peak':>8}{'peak-base':>10}{'model st.':>10}{'formula':>9}"
            f"{'ratio':>7}{'in steps':>9}{'built':>7}{'grads held':>11}  final params vs zero0")
    print(head)
    print("-" * len(head))
    for row in rows:
        if row["error"] is not None:
            print(f"{row['label']:<22}  ERROR: {row['error']}")
            continue
        f = row["formula"]
        check = row.get("vs_reference")
        if row["config"] == REFERENCE:
            vs = "(reference)"
        elif check is None:
            vs = "-"
        else:
            vs = "bitwise equal" if check["equal"] else f"max |diff| {check['max_abs_diff']:.2e}"
        if not row["ranks_agree"]:
            vs += "; RANKS DIFFER"
        steps = "-" if row["model_state_steps_bytes"] is None else \
            f"{row['model_state_steps_bytes'] / MiB:.1f}"
        built = "-" if row["construction_bytes"] is None else \
            f"{row['construction_bytes'] / MiB:.0f}"
        print(f"{row['label']:<22}{'ZeRO-' + str(row['formula_stage']):>8}"
              f"{row['optimizer_state_bytes'] / MiB:>10.1f}{f['optimizer'] / MiB:>10.1f}"
              f"{row['baseline_rss'] / MiB:>9.0f}{row['peak_rss'] / MiB:>8.0f}"
              f"{row['above_baseline_bytes'] / MiB:>10.1f}{row['model_state_bytes'] / MiB:>10.1f}"
              f"{f['total'] / MiB:>9.1f}{row['ratio']:>7.2f}{steps:>9}{built:>7}"
              f"{row['full_grad_bytes_after_backward'] / MiB:>11.1f}  {vs}")
    print("'in steps': the model state over the training steps alone (the peak reset after "
          "the wrapping); 'built': the peak while building the model and wrapping it, above "
          "the RSS before the model")
    print("'grads held': param.grad bytes after the last backward, before its step (FSDP2: "
          "its local gradient shards; mpiddp stage 2 none: its averaged shards live on the "
          "optimizer's shard tensors)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="ranks per launch (default 2)")
    p.add_argument("--layers", type=int, default=12, help="Linear layers (default 12)")
    p.add_argument("--width", type=int, default=2048, help="their width (default 2048)")
    p.add_argument("--steps", type=int, default=3, help="Adam steps (default 3)")
    p.add_argument("--batch", type=int, default=4, help="rows per rank (default 4)")
    p.add_argument("--frozen-layers", type=int, default=0,
                   help="freeze the first N layers (a frozen base under trainable ones; "
                        "default 0); the formula counts gradients and Adam state for the "
                        "trainable ones only")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS),
                   default=list(CONFIGS), help="configurations to run (default: all)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--timeout", type=int, default=600,
                   help="seconds per launch before it is killed (default 600)")
    p.add_argument("--algorithm", default="ring",
                   help="MPIDDP_ALLREDUCE_ALGORITHM of the mpiddp runs (default ring; '' "
                        "leaves the setting as it is)")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="the mpiddp runs' bucket_cap_mb (default: each stage's own default)")
    p.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="stage 3 (mpiddp's MixedPrecisionPolicy) and FSDP2 (its mp_policy): "
                        "the gathered parameters' dtype, gradients reduced in float32 "
                        "(default float32: no policy)")
    p.add_argument("--mmap-threshold", type=int, default=128 * 1024,
                   help="the workers' MALLOC_MMAP_THRESHOLD_ (default 131072; 0: glibc's "
                        "adaptive default)")
    p.add_argument("--worker", choices=list(CONFIGS), default=None, help=argparse.SUPPRESS)
    p.add_argument("--outdir", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop_on_signal)
    configs = list(args.configs)
    if REFERENCE in configs:                       # first: the others compare with it
        configs.remove(REFERENCE)
        configs.insert(0, REFERENCE)
    rows = []
    with tempfile.TemporaryDirectory(prefix="zero_memory_") as tmp:
        outdir = Path(tmp)
        for config in configs:
            print(f"running {config} on {args.ranks} ranks ...", flush=True)
            row = summarize(config, launch(config, outdir, args), args)
            if row["error"] is None and config != REFERENCE and not config.endswith(META):
                row["vs_reference"] = compare_params(config, outdir)
                (outdir / f"{config}.params.pt").unlink(missing_ok=True)
            rows.append(row)
    print_table(rows, args)
    if args.json:
        args.json.write_text(json.dumps(
            {"ranks": args.ranks, "layers": args.layers, "width": args.width,
             "frozen_layers": args.frozen_layers,
             "steps": args.steps, "batch": args.batch, "reference": REFERENCE,
             "results": rows}, indent=1))
    return 1 if any(row["error"] is not None and row["config"].startswith("mpiddp")
                    for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
