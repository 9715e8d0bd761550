"""Simulated accelerator models (scripts/bench/simulated_models.py) and their use in
scripts/bench/synthetic_benchmark.py: the shape tables against the published parameter counts and
FLOPs, the timing of a simulated step, its CPU use, and a 2-rank benchmark run."""
import json
import math
import subprocess
import sys
import threading
import time

import pytest
import torch

from mpi_launch import ROOT, assert_ok, run_mpi

sys.path.insert(0, str(ROOT / "scripts" / "bench"))
import simulated_models as sim  # noqa: E402
import synthetic_benchmark as bench  # noqa: E402

# Published figures: torchvision's model tables (parameters exactly; GFLOPs are
# multiply-accumulates at 224x224: ResNet-50 4.09, ResNet-18 1.81, VGG-16 15.47, ResNet-101
# 7.80, ResNet-152 11.51; Inception V3 5.71 at 299x299, its auxiliary classifier in the
# parameters) and BERT-base
# (Devlin et al.: 110 M parameters).
PARAMS = {"sim-resnet50": 25_557_032, "sim-resnet18": 11_689_512, "sim-vgg16": 138_357_544,
          "sim-resnet101": 44_549_160, "sim-resnet152": 60_192_808,
          "sim-inception3": 27_161_264}
GMACS = {"sim-resnet50": 4.09, "sim-resnet18": 1.81, "sim-vgg16": 15.47,
         "sim-resnet101": 7.80, "sim-resnet152": 11.51, "sim-inception3": 5.71}


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_cnn_tables_match_torchvision(name):
    layers = sim.MODELS[name]()
    assert sim.param_count(layers) == PARAMS[name]
    # The tables add one MAC per output element of each batch norm (under 0.4 %).
    assert sim.forward_macs(layers) / 1e9 == pytest.approx(GMACS[name], rel=0.005)


def test_a_profile_times_a_model_at_its_own_measured_rate_where_it_has_one():
    p100 = sim.PROFILES["p100-tf-fp32"]
    vgg, resnet101 = sim.MODELS["sim-vgg16"](), sim.MODELS["sim-resnet101"]()
    # VGG-16 measured at 154 images/s: not ResNet-50's MACs per second (3.8x its MACs).
    assert sim.profile_step_time(p100, vgg, 64, "sim-vgg16") == pytest.approx(64 / 154)
    assert sim.profile_step_time(p100, vgg, 64) == pytest.approx(
        64 / 219 * sim.train_macs(vgg) / sim.train_macs(sim.MODELS["sim-resnet50"]()))
    # A model it did not measure: its nearest relative's MACs per second.
    per_image = sim.profile_step_time(p100, resnet101, 1, "sim-resnet152")
    assert 1 / 91.8 * 0.6 < per_image < 1 / 91.8 * 0.75      # 7.8 against 11.5 GMACs


def test_bert_base_table():
    layers = sim.bert_base()
    params = sim.param_count(layers)
    assert 109e6 < params < 111e6
    # Hugging Face's bert-base-uncased has 109,482,240; the table adds a 2-class head.
    assert params == 109_482_240 + 768 * 2 + 2
    # Per encoder layer and 128-token sequence: Q, K, V, output (4 h^2), the feed-forward
    # (8 h^2) per token, and the two attention products (2 s^2 h).
    s, h = 128, 768
    expected = 12 * (s * 12 * h * h + 2 * s * s * h)
    assert sim.forward_macs(layers) == pytest.approx(expected, rel=0.01)
    assert len([layer for layer in layers if not layer.params]) == 12   # attention products


def test_model_layers_in_forward_order_with_real_shapes():
    model = sim.SimulatedModel("sim-resnet50")
    names = [name for name, _ in model.named_parameters()]
    assert names[:3] == ["layers.conv1.weight", "layers.bn1.weight", "layers.bn1.bias"]
    assert names[-2:] == ["layers.fc.weight", "layers.fc.bias"]
    assert len(names) == 161                       # torchvision's resnet50: 161 tensors
    shapes = dict(model.named_parameters())
    assert shapes["layers.layer4_2_conv3.weight"].shape == (2048, 512, 1, 1)
    assert sum(p.numel() for p in model.parameters()) == PARAMS["sim-resnet50"]
    small = sim.SimulatedModel("sim-resnet50", param_scale=0.01)
    assert small.layers["fc"].weight.shape == (10, 2048)
    assert sum(p.numel() for p in small.parameters()) == \
        sim.param_count(sim.MODELS["sim-resnet50"](), 0.01)


def run_steps(model, optimizer, steps, batch):
    data = torch.zeros(batch, 1)
    for _ in range(steps):
        optimizer.zero_grad()
        model(data).sum().backward()
        optimizer.step()


@pytest.mark.alone          # wall-clock bounds on a step
def test_step_takes_the_requested_time_and_little_cpu():
    step, batch = 0.25, 32
    model = sim.SimulatedModel("sim-bert", param_scale=0.02)
    per_param = sim.optimizer_seconds_per_param(900)
    optimizer_s = sim.param_count(model.specs) * per_param
    model.set_step_time(step, batch, optimizer_s)
    optimizer = sim.SimulatedOptimizer(model.parameters(), model.device, per_param)
    run_steps(model, optimizer, 1, batch)          # first step: gradient memory faulted in
    busy = model.device.busy
    start, cpu = time.perf_counter(), time.thread_time()
    run_steps(model, optimizer, 3, batch)
    elapsed, cpu = (time.perf_counter() - start) / 3, (time.thread_time() - cpu) / 3
    # The device time asked for is exactly the step; the wall time within 15 % of it.
    assert (model.device.busy - busy) / 3 == pytest.approx(step, rel=1e-9)
    assert step * 0.98 <= elapsed <= step * 1.15, elapsed
    # The stepping thread's own CPU: the waits use none (measured: about 5-8 % of the step).
    assert cpu < 0.25 * step, cpu
    for param in model.parameters():
        assert param.grad is not None and param.grad.shape == param.shape


def test_waits_release_the_gil():
    """Another Python thread runs while the device works (a wait holding the GIL would stop
    it for the whole wait; a Python loop counts about 10^6-10^7 a second)."""
    device = sim.SimulatedDevice()
    counter = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            counter[0] += 1
    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        cpu = time.thread_time()
        device.run(0.3)
        cpu = time.thread_time() - cpu
    finally:
        stop.set()
        spinner.join()
    assert counter[0] > 10_000, counter[0]
    assert cpu < 0.05, cpu


def test_gradients_cost_no_copy_and_are_steady():
    model = sim.SimulatedModel("sim-resnet18")
    model.set_step_time(0.01, 4)
    optimizer = sim.SimulatedOptimizer(model.parameters(), model.device, 0.0)
    run_steps(model, optimizer, 1, 4)
    fc = model.layers["fc"].weight
    first = fc.grad.data_ptr()
    values = {float(p.grad.flatten()[0]) for p in model.parameters()}
    run_steps(model, optimizer, 2, 4)
    assert fc.grad.data_ptr() == first                 # reused, not reallocated or copied
    assert float(fc.grad.min()) == float(fc.grad.max())   # one value per tensor, every step
    assert {float(p.grad.flatten()[0]) for p in model.parameters()} == values


def test_partial_optimizer_step_takes_its_share():
    model = sim.SimulatedModel("sim-resnet18", param_scale=0.1)
    model.set_step_time(0.01, 4)
    optimizer = sim.SimulatedOptimizer(model.parameters(), model.device, 1e-9)
    run_steps(model, optimizer, 1, 4)
    params = optimizer.param_groups[0]["params"]
    busy = model.device.busy
    optimizer.param_groups[0]["params"] = params[:2]   # as forward overlap's subsets do
    optimizer.step()
    real = math.prod(model.specs[0].params[0][1]) + math.prod(model.specs[1].params[0][1])
    assert real == 64 * 3 * 7 * 7 + 64                 # conv1.weight, bn1.weight
    assert model.device.busy - busy == pytest.approx(real * 1e-9)   # real sizes, not scaled


def simulation_args(*argv, nodes=2):
    args = bench.parse_args(["--model", "sim-resnet50", *argv])
    how = bench.configure_simulation(args, nodes)
    return args, how


def test_regimes_and_profiles_set_the_step():
    wire = 25_557_032 * 4 / (1e9 / 8)              # 2 nodes: each link carries all bytes once
    balanced, how = simulation_args("--regime", "balanced", "--link-gbit", "1")
    assert balanced.sim_step_s == pytest.approx(wire)
    assert "wire time" in how
    compute, _ = simulation_args("--regime", "compute", "--link-gbit", "1")
    wire_bound, _ = simulation_args("--regime", "wire", "--link-gbit", "1", "--compression",
                                    "fp16")
    assert compute.sim_step_s == pytest.approx(2 * wire)
    assert wire_bound.sim_step_s == pytest.approx(0.5 * wire / 2)   # fp16: half the bytes
    four, _ = simulation_args("--regime", "balanced", "--link-gbit", "0.5", nodes=4)
    assert four.sim_step_s == pytest.approx(wire * 2 * 1.5)         # 2 (n-1)/n at 4 nodes
    profile, how = simulation_args("--device-profile", "v100-amp", "--batch-size", "256")
    assert profile.sim_step_s == pytest.approx(256 / 1200)
    assert "DeepLearningExamples" in how
    fixed, _ = simulation_args("--step-time", "0.3")
    assert fixed.sim_step_s == 0.3
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", "sim-resnet50", "--regime", "balanced"])  # no link
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", "cnn", "--step-time", "0.2"])


def test_overlap_forward_refused_or_passed_through(monkeypatch):
    monkeypatch.setattr(bench, "supports_overlap_forward", lambda: False)
    with pytest.raises(SystemExit, match="overlap_forward"):
        bench.main(["--model", "sim-resnet18", "--overlap-forward"])
    seen = {}

    def fake(optimizer, **kwargs):
        seen.update(kwargs)
        return optimizer
    monkeypatch.setattr(bench.mpiddp, "DistributedOptimizer", fake)
    monkeypatch.setattr(bench.mpiddp, "broadcast_parameters", lambda *a, **k: None)
    args, _ = simulation_args("--param-scale", "0.01")
    variant = bench.make_mpiddp(args, 4.0, "overlap", overlap=True)
    assert seen["overlap_forward"] is True and variant.overlap
    seen.clear()
    bench.make_mpiddp(args, 4.0, "mpiddp")
    assert "overlap_forward" not in seen              # the standard path on any mpiddp


@pytest.mark.alone          # wall-clock bounds on a step
def test_benchmark_two_ranks(tmp_path):
    out = tmp_path / "result.json"
    # Forward overlap too where this mpiddp has it (the refusal is tested above).
    names = ["mpiddp", "ddp", "single"] + (["overlap"] if bench.supports_overlap_forward()
                                           else [])
    result = run_mpi(str(ROOT / "scripts" / "bench" / "synthetic_benchmark.py"), 2,
                     "--model", "sim-resnet18", "--param-scale", "0.05", "--step-time", "0.1",
                     "--iters", "2", "--steps", "2", "--warmup", "1", "--link-gbit", "1",
                     "--variants", ",".join(names), "--json", out, timeout=150)
    assert_ok(result)
    assert "SIMULATED accelerator (ResNet-18" in result.output, result.output
    data = json.loads(out.read_text())
    variants = data["variants"]
    assert set(variants) == set(names)
    assert data["simulation"]["step_s"] == 0.1
    assert 0.095 <= variants["single"]["step_s"] <= 0.15, variants["single"]
    for name in set(names) - {"single"}:
        # 2.3 MB of gradients on one node: a small share of a 0.1 s step.
        assert variants[name]["efficiency"] > 0.4, (name, variants[name])
        # Host CPU per step and rank well under the step (the device's time is sleep).
        assert variants[name]["cpu_ms_per_step"] < 100, (name, variants[name])
    assert "bound" in data and data["bound"]["wire_s"] == 0.0    # one node: no wire


@pytest.mark.alone          # wall-clock bounds on a step
def test_benchmark_straggler_and_native_variant(tmp_path):
    """--straggler slows the last node's ranks only (the one-process baseline keeps the nominal
    step), the job runs at the straggler's pace without a stall report, and the 'native'
    variant sends every reduction through MPI_Allreduce."""
    out = tmp_path / "result.json"
    result = run_mpi(str(ROOT / "scripts" / "bench" / "synthetic_benchmark.py"), 2,
                     "--model", "sim-resnet18", "--param-scale", "0.05", "--step-time", "0.1",
                     "--iters", "1", "--steps", "3", "--warmup", "1", "--straggler", "1.5",
                     "--variants", "mpiddp,native,single", "--json", out, timeout=150)
    assert_ok(result)
    assert "STRAGGLER: the last node's ranks compute 1.5x slower" in result.output
    assert "stall" not in result.output.lower(), result.output
    data = json.loads(out.read_text())
    assert data["simulation"]["straggler"] == 1.5
    variants = data["variants"]
    assert 0.095 <= variants["single"]["step_s"] <= 0.14, variants["single"]
    for name in ("mpiddp", "native"):       # paced by the slow ranks' 0.15 s
        assert variants[name]["step_s"] >= 0.145, (name, variants[name])
    assert "native engine on rank 0" in result.output


def test_fsdp2_units_are_the_models_blocks():
    """The fsdp2 variant's fully_shard units: a transformer layer or residual block each
    (a simulated block's layers as one list), the MLP one per Linear."""
    units = bench.fsdp_units(sim.SimulatedModel("sim-bert", 0.01))
    assert len(units) == 15          # embeddings, 12 encoder layers, pooler, classifier
    assert [layer.spec.name for layer in units[0]] == [
        "embeddings.word_embeddings", "embeddings.position_embeddings",
        "embeddings.token_type_embeddings", "embeddings.LayerNorm"]
    assert all(bench.fsdp_block(layer.spec.name) == "encoder.layer.0" for layer in units[1])
    assert len(units[1]) == 8    # Q, K, V, attention output + norm, intermediate, output + norm
    resnet = bench.fsdp_units(bench.ResNet18())
    assert [type(u).__name__ for u in resnet] == ["Conv2d", "BatchNorm2d"] + \
        ["BasicBlock"] * 8 + ["Linear"]
    assert [type(u).__name__ for u in bench.fsdp_units(bench.mlp(8, 3))] == ["Linear"] * 3


def test_benchmark_fsdp2_variant_two_ranks(tmp_path):
    """The fsdp2 peer (FSDP2 fully_shard over gloo, reshard_after_forward=True) trains a
    simulated model (its layers a custom autograd Function taking the parameters as inputs)
    and a real one beside mpiddp, and is a denominator of the ratios."""
    out = tmp_path / "result.json"
    result = run_mpi(str(ROOT / "scripts" / "bench" / "synthetic_benchmark.py"), 2,
                     "--threads", "1", "--model", "sim-resnet18", "--param-scale", "0.02",
                     "--step-time", "0.05", "--iters", "1", "--steps", "1", "--warmup", "1",
                     "--variants", "mpiddp,fsdp2", "--json", out, timeout=60)
    assert_ok(result)
    data = json.loads(out.read_text())
    assert set(data["variants"]) == {"mpiddp", "fsdp2"}
    assert data["variants"]["fsdp2"]["step_s"] > 0
    assert "mpiddp / fsdp2" in data["ratios"], result.output
    result = run_mpi(str(ROOT / "scripts" / "bench" / "synthetic_benchmark.py"), 2,
                     "--threads", "1", "--model", "mlp", "--width", "64", "--depth", "2",
                     "--batch-size", "4", "--iters", "1", "--steps", "1", "--warmup", "1",
                     "--variants", "fsdp2", timeout=60)
    assert_ok(result)
    assert "fsdp2 " in result.output, result.output


def test_allreduce_benchmark_times_single_tensors_and_lists(tmp_path):
    """scripts/bench/benchmark_allreduce.py checks every method's sums before timing it (a wrong
    result ends the run), then reports the CPU per GB with its user-space share; --pieces adds
    lists of tensors handed over at once."""
    out = tmp_path / "allreduce.json"
    result = run_mpi(str(ROOT / "scripts" / "bench" / "benchmark_allreduce.py"), 2,
                     "--min-size", "4K", "--max-size", "16K", "--seconds", "0.02",
                     "--min-iters", "2", "--no-gloo", "--pieces", "4", "--json", out,
                     timeout=150)
    assert_ok(result)
    assert "4 tensors of each size at once" in result.output, result.output
    data = json.loads(out.read_text())
    singles = {(r["bytes"], r["method"]) for r in data["rows"]}
    assert singles == {(n, m) for n in (4096, 16384) for m in (
        "mpiddp ring", "mpiddp halving-doubling", "mpiddp auto", "MPI_Allreduce")}
    lists = {(r["bytes"], r["method"]) for r in data["piece_rows"]}
    assert lists == {(n, m) for n in (4096, 16384) for m in (
        "mpiddp, 4 allreduce_async_", "mpiddp, grouped_allreduce_ of 4", "MPI_Allreduce x 4",
        "MPI_Iallreduce x 4, Waitall")}
    assert data["pieces"] == 4
    for row in data["rows"] + data["piece_rows"]:
        assert row["seconds"] > 0 and row["cpu_s_per_gb"] > 0, row
        assert 0.0 <= row["cpu_user_share"] <= 1.0, row


def test_cache_benchmark_compares_a_grown_cache_with_a_fixed_one():
    """scripts/bench/benchmark_cache.py: with more parameters than the cache's 1,024 places, the
    cache mpiddp sizes needs no slow cycle once grown, as one set large from the start; the
    fixed one needs some every step."""
    result = run_mpi(str(ROOT / "scripts" / "bench" / "benchmark_cache.py"), 2, "--params", "1100",
                     "--elements", "1", "--warmup", "4", "--steps", "2", "--rounds", "1",
                     timeout=150)
    assert_ok(result)
    rows = {line.split("|")[1].strip(): line.split("|")[2:5] for line in
            result.output.splitlines() if line.startswith("| ") and "ms" not in line}
    assert set(rows) == {"grows (unset)", "fixed 1024", "set 4096"}, result.output
    slow = {name: float(cells[2]) for name, cells in rows.items()}
    assert slow["grows (unset)"] == slow["set 4096"] == 0 < slow["fixed 1024"], result.output
    # Rank 0's work in a slow cycle, in one process: a row per rank count, more bytes with
    # more ranks.
    work = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "benchmark_cache.py"),
                           "--rank0-work", "2,8", "--params", "20"], capture_output=True,
                          text=True, timeout=120, check=True).stdout
    gathered = [float(line.split("|")[3]) for line in work.splitlines()
                if line.startswith("| 2 ") or line.startswith("| 8 ")]
    assert len(gathered) == 2 and gathered[0] < gathered[1], work


def test_scaling_report_reads_allreduce_and_half_rate_runs(tmp_path, capsys):
    """scripts/bench/plot_scaling.py: the all-reduce tables at each node count and the comparison
    with the same training runs at half the link rate, from result files as the scaling
    benchmark writes them."""
    import plot_scaling

    def training(directory, step_s, cpu_ms, shape="2x1"):
        directory.mkdir(exist_ok=True)
        result = {"simulation": {"step_s": 0.2},
                  "variants": {"mpiddp": {"step_s": step_s, "cpu_ms_per_step": cpu_ms,
                                          "efficiency": 0.5, "per_rank": 10.0, "total": 20.0},
                               "ddp": {"step_s": step_s, "cpu_ms_per_step": cpu_ms,
                                       "efficiency": 0.5, "per_rank": 10.0, "total": 20.0}}}
        (directory / f"heavy-sim-resnet50-balanced-{shape}.json").write_text(
            json.dumps(result))

    nominal, half = tmp_path / "nominal", tmp_path / "half"
    training(nominal, 0.3, 60.0)
    training(half, 0.5, 66.0)
    training(nominal, 0.3, 60.0, "2x2")       # 2 nodes of 2 ranks each
    training(half, 0.5, 66.0, "2x2")
    rows = [{"bytes": 4096, "method": m, "seconds": s, "busbw_gb_s": 0.1, "vs_mpi": v,
             "cpu_s_per_gb": c}
            for m, s, v, c in (("mpiddp auto", 1e-4, 0.35, 25.0),
                               ("MPI_Allreduce", 3.5e-5, 1.0, 8.5),
                               ("torch gloo", 6e-4, 0.06, 94.0))]
    (nominal / "allreduce-heavy-2x1.json").write_text(json.dumps(
        {"ranks": 2, "rows": rows, "latency_4k_s": {"median": 9e-5, "mean": 9.5e-5}}))
    plot_scaling.main([str(nominal), "--against", str(half)])
    out = capsys.readouterr().out
    # The step grew by the whole wire time added (0.2 s: the balanced regime's one-process
    # step); two ranks at 60 ms of CPU per 0.3 s step keep 0.4 cores busy.
    assert "| heavy, balanced | 2 | 0.200 | mpiddp | 0.300 -> 0.500 | 100% | 60 -> 66 | " \
           "0.40 -> 0.26 |" in out
    # Two ranks per node: labelled by layout, twice the ranks' CPU.
    assert "| heavy, balanced | 2x2 | 0.200 | mpiddp | 0.300 -> 0.500 | 100% | 60 -> 66 | " \
           "0.80 -> 0.53 |" in out
    assert "| 2x2 | 0.200 | 50%; 10.0; 60 |" in out
    assert "| 4 KiB | 0.35x (100 / 35 us) |" in out            # auto against MPI_Allreduce
    assert "| 4 KiB | 0.06x (600 / 35 us) |" in out            # gloo against MPI_Allreduce
    assert "| 4 KiB | 25.00 / 94.00 |" in out                  # CPU s/GB, auto / gloo
    assert "2 nodes 90 us" in out                               # synchronous 4 KiB latency
