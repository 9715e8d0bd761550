"""The cost model of a training step (scripts/bench/scaling_model.py, docs/scaling.md): the engine's
cycles as the model forms them, and what the shared cores of the emulated cluster add to a
cycle and bound a step by, from the all-reduce benchmark's CPU per call."""
import json
import sys
from dataclasses import replace

import pytest

from mpi_launch import ROOT

sys.path.insert(0, str(ROOT / "scripts" / "bench"))
import scaling_model as model  # noqa: E402
import simulated_models as sim  # noqa: E402
from mpiddp.collectives.cost_model import (RING_STEP_OVERHEAD_S, LinkCosts,  # noqa: E402
                                           shared_link)

KIB, MIB = 1 << 10, 1 << 20


def benchmark_rows(cpu_ms: dict) -> list:
    """Rows as scripts/bench/benchmark_allreduce.py writes them, from CPU ms per call by method
    at 4 KiB and 1 MiB."""
    return [{"bytes": nbytes, "method": method, "seconds": 1e-3,
             "cpu_s_per_gb": ms * 1e-3 / nbytes * 1e9}
            for method, by_size in cpu_ms.items() for nbytes, ms in by_size.items()]


CPU_MS = {"mpiddp auto": {4 * KIB: 0.5, MIB: 3.0},
          "MPI_Allreduce": {4 * KIB: 0.2, MIB: 2.0},
          "mpiddp ring": {4 * KIB: 0.6, MIB: 4.0},
          "mpiddp halving-doubling": {4 * KIB: 0.5, MIB: 3.5}}


def test_machine_cpu_interpolates_and_charges_the_engine_once():
    cpu = model.MachineCpu.from_benchmark(benchmark_rows(CPU_MS), ranks=16, cores=2)
    assert cpu.share == 8
    middle = (4 * KIB + MIB) // 2
    assert cpu.call_s("MPI_Allreduce", middle) == pytest.approx(1.1e-3)
    assert cpu.call_s("mpiddp ring", 4 * MIB) == pytest.approx(16e-3)   # its CPU per byte
    # The engine's part of a cycle: a small call through it against MPI_Allreduce's.
    assert cpu.engine_cpu_s() == pytest.approx(0.3e-3)
    # One cycle of a ring buffer and a native one: the engine's part once.
    assert cpu.cycle_cpu_s([("ring", MIB), ("native", MIB)]) == pytest.approx(
        0.3e-3 + (4.0e-3 - 0.3e-3) + 2.0e-3)
    # A rank with cores of its own shares none.
    assert model.MachineCpu.from_benchmark(benchmark_rows(CPU_MS), 2, 2).share == 1


def job(nodes=16, cpu=None, gbit=100.0, scale=0.05):
    return model.Job(sim.MODELS["sim-resnet18"](), scale, 0.2, nodes,
                     LinkCosts.from_rate(gbit, 5.0), bucket_bytes=int(4 * scale * MIB),
                     machine_cpu=cpu)


def test_a_cycle_waits_for_the_other_ranks_of_its_core():
    cpu = model.MachineCpu.from_benchmark(benchmark_rows(CPU_MS), ranks=16, cores=2)
    fast_links, shared = job(), job(cpu=cpu)
    buffers = [MIB, MIB // 2]
    on_links = fast_links.cycle_s(buffers)
    assert fast_links.cycle_cpu_s(buffers) == 0.0
    # In lockstep, the 7 other ranks of a core run their part of the cycle while this one
    # waits: the links' time plus theirs (its own is in the links' step overhead).
    assert shared.cycle_s(buffers) == pytest.approx(on_links + 7 * shared.cycle_cpu_s(buffers))
    # With a core each, nobody waits: the links decide.
    own = model.MachineCpu.from_benchmark(benchmark_rows(CPU_MS), ranks=16, cores=16)
    assert job(cpu=own, gbit=0.1).cycle_s(buffers) == pytest.approx(
        job(gbit=0.1).cycle_s(buffers))


def test_over_the_engines_sockets_the_negotiation_and_small_buffers_go_by_recursive_doubling():
    over_mpi = model.Job([], 1.0, 0.0, 16, LinkCosts.from_rate(1.0, 30.0))
    over_sockets = model.Job([], 1.0, 0.0, 16, LinkCosts.from_rate(1.0, 30.0),
                             over_sockets=True)
    assert over_mpi.chosen([4 * KIB, 4 * MIB], "auto")[0][0] == "native"
    assert [name for name, _ in over_sockets.chosen([4 * KIB, 4 * MIB], "auto")] == \
        ["recursive_doubling", "ring"]
    # An empty cycle is its own work and the negotiation: the library's recursive doubling,
    # or ours with its Python cost per step (log2 16 = 4 steps).
    link = over_mpi.link
    assert over_mpi.cycle_s([]) == pytest.approx(
        model.ENGINE_CYCLE_S + model.native_seconds(model.NEGOTIATION_BYTES, 16, link))
    assert over_sockets.cycle_s([]) - over_mpi.cycle_s([]) == pytest.approx(
        4 * RING_STEP_OVERHEAD_S)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_step_grows_with_the_ranks_per_core_once_the_cores_are_the_limit(overlap):
    one_core_each = model.MachineCpu.from_benchmark(benchmark_rows(CPU_MS), 16, 16,
                                                    compute_s=0.01)
    shared = model.MachineCpu.from_benchmark(benchmark_rows(CPU_MS), 16, 2, compute_s=0.01)
    links_only = model.step_seconds(job(), overlap)
    own = model.step_seconds(job(cpu=one_core_each), overlap)
    crowded_job = job(cpu=shared)
    crowded = model.step_seconds(crowded_job, overlap)
    assert links_only <= own < crowded
    # No less than eight ranks' CPU per core for the least CPU the gradients can cost (all
    # in one cycle) and the compute beside them.
    gradients = [n for tensors, _ in model.buckets(crowded_job) for n in tensors]
    least = crowded_job.cycle_cpu_s(model.fused_buffers(gradients, crowded_job.fusion_bytes))
    assert crowded >= model.cores_bound_s(crowded_job, overlap, least) > 8 * least


def test_cycles_take_what_is_ready_as_the_engine_does():
    plan = [([MIB], [5, 4]), ([2 * MIB], [3]), ([MIB], [1, 2]), ([MIB], [0])]
    # The standard path: every ready submission in one cycle, in order.
    assert model.cycle_submissions(plan, [3, 0, 2], False, MIB) == [0, 2, 3]
    # Forward overlap: the earliest layers first, up to the cycle budget, at least one.
    assert model.cycle_submissions(plan, [0, 1, 2, 3], True, 2 * MIB) == [3, 2]
    assert model.cycle_submissions(plan, [1, 0], True, MIB) == [1]


def training_result(mpiddp_cpu_ms: float = 60.0, single_cpu_ms: float = 10.0) -> dict:
    """A training launch's JSON as scripts/bench/synthetic_benchmark.py writes it: a 0.2 s step of
    ResNet-18's layers scaled by 0.05, mpiddp measured at 0.5 s."""
    return {"bucket_cap_mb": 0.2,
            "simulation": {"param_scale": 0.05, "step_s": 0.2, "optimizer_s": 0.0},
            "variants": {"mpiddp": {"step_s": 0.5, "cpu_ms_per_step": mpiddp_cpu_ms},
                         "single": {"step_s": 0.2, "cpu_ms_per_step": single_cpu_ms}}}


def test_validate_compares_both_models_with_the_measurements(tmp_path, capsys):
    result = training_result()
    (tmp_path / "heavy-sim-resnet18-balanced-16x1.json").write_text(json.dumps(result))
    (tmp_path / "heavy-sim-resnet18-balanced-8x1.json").write_text(json.dumps(result))
    (tmp_path / "allreduce-heavy-16x1.json").write_text(json.dumps(
        {"ranks": 16, "rows": benchmark_rows(CPU_MS)}))
    model.main(["validate", str(tmp_path), "--cores", "2"])
    out = capsys.readouterr().out
    rows = {line.split("|")[3].strip(): line for line in out.splitlines()
            if line.startswith("| heavy | balanced")}
    with_cores = rows["16"].split("|")[8].strip()
    assert float(with_cores) > float(rows["16"].split("|")[6])     # the cores add time
    assert rows["8"].split("|")[8].strip() == ""                   # no benchmark at 8 nodes
    assert "heavy, model with the links: mean |error|" in out
    assert "of 1 within 15%" in out.split("model with the cores")[1]
    # Each algorithm against the all-reduce benchmark; the latency is solved from the
    # smallest MPI_Allreduce, which the model then takes exactly.
    assert "| heavy | 16 | MPI_Allreduce | +0% / " in out
    assert "| heavy | 16 | mpiddp halving-doubling |" in out


def test_the_latency_is_the_one_at_which_the_model_takes_the_measured_small_all_reduce(tmp_path):
    rows = benchmark_rows(CPU_MS)
    for row in rows:
        if row["method"] == "MPI_Allreduce" and row["bytes"] == 4 * KIB:
            row["seconds"] = 2.3e-3
    (tmp_path / "allreduce-heavy-16x1.json").write_text(json.dumps({"ranks": 16, "rows": rows}))
    def latency(nodes, default_us):
        return model.measured_latency_s(model.allreduce_rows(str(tmp_path), "heavy", nodes),
                                        model.SETTINGS["heavy"], nodes, default_us)

    assert model.native_seconds(4 * KIB, 16, LinkCosts.from_rate(1.0, latency(16, None) * 1e6)) \
        == pytest.approx(2.3e-3)
    assert latency(8, None) == pytest.approx(100e-6)       # no benchmark at 8 nodes
    assert latency(16, 30.0) == pytest.approx(30e-6)
    # With 8 ranks per core, what the other 7 spent on the call (0.2 ms each) is taken out
    # of the time first: the model with the cores adds it back.
    shared = model.measured_latency_s(model.allreduce_rows(str(tmp_path), "heavy", 16),
                                      model.SETTINGS["heavy"], 16, None, share=8)
    assert model.native_seconds(4 * KIB, 16, LinkCosts.from_rate(1.0, shared * 1e6)) \
        == pytest.approx(2.3e-3 - 7 * 0.2e-3)


# ---- several GPUs per node -----------------------------------------------------------------
FREE = LinkCosts(0.0, 0.0)        # a node-local link that costs nothing


def test_the_library_across_nodes_of_several_ranks_moves_each_byte_across_once():
    network = LinkCosts.from_rate(25.0, 5.0)
    for nbytes in (4 * KIB, 64 * MIB):
        # One rank per node: the plain model.
        assert model.native_seconds(nbytes, 16, network, 1, None) == \
            model.native_seconds(nbytes, 16, network)
    # 4 ranks on each of 8 nodes over a free node-local link: the network carries what it
    # carries for one rank per node (each rank a quarter of the buffer, all four at once
    # through the node's interface).
    assert model.native_seconds(64 * MIB, 32, network, 4, FREE) == pytest.approx(
        model.native_seconds(64 * MIB, 8, network))
    # A real node-local link adds its own halving and doubling: 2 (G-1)/G of the buffer.
    pcie = LinkCosts.from_rate(80.0, 10.0)
    assert model.native_seconds(64 * MIB, 32, network, 4, pcie) == pytest.approx(
        model.native_seconds(64 * MIB, 8, network) + model.native_seconds(64 * MIB, 4, pcie))


def test_the_hierarchical_all_reduce_is_the_node_ring_and_the_chunks_across():
    network = LinkCosts.from_rate(1.0, 30.0)
    n = 64 * MIB
    # Over a free node-local link, the chunks of the 4 ranks across 8 nodes at once cost
    # what the whole buffer does with one rank per node: the ring above the cross-node
    # threshold, the library's below it.
    assert model.hierarchical_seconds(n, 8, 4, network, FREE, 0, step_overhead_s=0.0) == \
        pytest.approx(model.ring_seconds(n, 8, network, step_overhead_s=0.0))
    assert model.hierarchical_seconds(n, 8, 4, network, FREE, n, step_overhead_s=0.0) == \
        pytest.approx(model.native_seconds(n, 8, network))
    shm = LinkCosts.from_rate(40.0, 1.0)
    assert model.hierarchical_seconds(n, 8, 4, network, shm, 0) == pytest.approx(
        model.ring_seconds(n, 4, shm) + model.ring_seconds(n // 4, 8, shared_link(network, 4)))


def test_the_model_chooses_as_the_engine_does_with_several_ranks_per_node():
    slow = model.Job([], 1.0, 0.0, 4, LinkCosts.from_rate(1.0, 30.0), local_size=2,
                     local_link=LinkCosts.from_rate(40.0, 1.0))
    assert [name for name, _ in slow.chosen([4 * KIB, 16 * MIB], "auto")] == \
        ["native", "hierarchical"]
    fast = replace(slow, link=LinkCosts.from_rate(100.0, 5.0))
    assert [name for name, _ in fast.chosen([4 * KIB, 16 * MIB], "auto")] == \
        ["native", "native"]
    assert slow.ranks == 8
    # The negotiation is the library's small all-reduce over every rank (the engine's
    # sockets serve one rank per node), even where they carry the transfers.
    assert replace(slow, over_sockets=True).cycle_s([]) == pytest.approx(slow.cycle_s([]))


def test_gpus_sharing_a_network_interface_cost_only_their_node_local_steps():
    vgg = sim.MODELS["sim-vgg16"]()
    step = 0.4
    one_each = model.efficiencies(model.Cluster(25.0), vgg, step, 16)
    # 4 GPUs on each of the 16 nodes: each node's interface carries what it carries for one
    # GPU per node (the hierarchical all-reduce, or the library's, sends every byte across
    # once per node), so with a node-local link that costs nothing, the same efficiency.
    fast_inside = model.Cluster(25.0, gpus_per_node=4, intra_gb_per_s=1000.0,
                                intra_latency_us=1.0)
    assert model.efficiencies(fast_inside, vgg, step, 16) == pytest.approx(one_each, abs=0.01)
    # What they cost is the node-local reduce-scatter and all-gather: over PCIe (10 GB/s),
    # more over a slower link.
    pcie = model.efficiencies(replace(fast_inside, intra_gb_per_s=10.0), vgg, step, 16)
    slower = model.efficiencies(replace(fast_inside, intra_gb_per_s=2.0), vgg, step, 16)
    assert slower[0] < pcie[0] < one_each[0] - 0.05
    assert slower[1] < pcie[1] < one_each[1] - 0.05


def test_horovod_and_predict_print_their_tables(capsys):
    model.main(["horovod"])
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line.split("|") for line in out.splitlines()
            if line.startswith(("| ResNet-101", "| Inception V3", "| VGG-16"))}
    resnet, inception, vgg = rows["ResNet-101"], rows["Inception V3"], rows["VGG-16"]
    # 512 GPUs, the standard path (the next to last two cells: std, fo; then Horovod's).
    assert float(resnet[-4].strip(" %")) >= 90 and resnet[-2].strip() == "90%"
    assert float(inception[-4].strip(" %")) >= 90 and inception[-2].strip() == "90%"
    assert 50 <= float(vgg[-4].strip(" %")) <= 85 and vgg[-2].strip() == "68%"
    model.main(["predict", "--model", "sim-bert", "--batch", "32", "--step-s", "0.1",
                "--gradient-mb", "100", "--gbit", "100", "--gpus-per-node", "8",
                "--intra-gb-per-s", "150", "--nodes", "2", "64"])
    out = capsys.readouterr().out
    assert "100 MB of gradients" in out
    lines = [line.split("|") for line in out.splitlines() if line.startswith("| 64 |")]
    assert lines and lines[0][2].strip() == "512"
    # Settings that describe no cluster are refused, naming the argument.
    for bad in (["--gpus-per-node", "0"], ["--gbit", "-1"], ["--latency-us", "-5"]):
        with pytest.raises(SystemExit):
            model.main(["predict", *bad])
        assert f"argument {bad[0]}: must" in capsys.readouterr().err


def test_predict_takes_the_links_from_an_engine_log(tmp_path, capsys):
    """The INFO line rank 0 logs at start (engine/executor.py): with several ranks per node
    each measured its share of the interface, so the node's rate is that times the ranks."""
    log = tmp_path / "job.log"
    log.write_text(
        "[mpiddp INFO] mpiddp: links between the 2 nodes: latency 10 us, 1.22 Gbit/s; ...\n"
        "[mpiddp INFO] mpiddp: links between the 2 nodes (4 ranks per node exchanging at "
        "once), each: latency 28 us, 12.5 Gbit/s; transfers across nodes of 30 KiB ...\n")
    args = ["predict", "--links-from", str(log), "--step-s", "0.2", "--nodes", "2"]
    model.main(args)
    out = capsys.readouterr().out
    assert "latency 28 us, 50 Gbit/s per node (4 rank(s) per node" in out    # the last line
    assert "50 Gbit/s" in out and "network latency 28 us" in out
    model.main(args + ["--gbit", "100", "--latency-us", "3"])       # given values stay
    out = capsys.readouterr().out.split("\n\n", 1)[1]
    assert "100 Gbit/s" in out and "network latency 3 us" in out
    # The same model with the values typed in gives the same table.
    model.main(["predict", "--gbit", "50", "--latency-us", "28", "--step-s", "0.2",
                "--nodes", "2"])
    typed = capsys.readouterr().out
    model.main(args)
    assert capsys.readouterr().out.split("\n\n", 1)[1] == typed
    log.write_text("[mpiddp INFO] mpiddp initialised: rank 0 of 2\n")
    with pytest.raises(SystemExit, match="MPIDDP_LOG_LEVEL=info"):
        model.main(args)


def test_validate_nodes_fits_the_node_link_and_recovers_the_model(tmp_path, capsys):
    shm = LinkCosts(2e-6, 1 / 4e9, model.HOST_REDUCE_SECONDS_PER_BYTE)
    network = LinkCosts.from_rate(0.2, 40.0, 7.0)
    sizes = [4 * KIB, 64 * KIB, MIB, 16 * MIB]

    def rows(method_seconds):
        return [{"bytes": n, "method": m, "seconds": f(n), "cpu_s_per_gb": 1.0}
                for m, f in method_seconds.items() for n in sizes]

    def write(name, method_seconds):
        (tmp_path / name).write_text(json.dumps({"rows": rows(method_seconds)}))

    write("allreduce-light-1x2.json",
          {"MPI_Allreduce": lambda n: model.native_seconds(n, 2, shm)})
    write("allreduce-light-2x1.json",
          {"MPI_Allreduce": lambda n: model.native_seconds(n, 2, network)})
    write("allreduce-light-2x2.json", {m: (lambda n, m=m: model.nodes_model_s(
        m, n, 2, 2, network, shm, RING_STEP_OVERHEAD_S)) for m in model.NODE_ROWS})
    fitted = model.fit_local_link(rows({"MPI_Allreduce": lambda n: model.native_seconds(
        n, 2, shm)}), 2)
    assert fitted.latency_s == pytest.approx(shm.latency_s, rel=1e-6)
    assert fitted.seconds_per_byte == pytest.approx(shm.seconds_per_byte, rel=1e-6)
    # 3 ranks on a node: the library folds the third in and out; the fit knows.
    three = model.fit_local_link(rows({"MPI_Allreduce": lambda n: model.native_seconds(
        n, 3, shm)}), 3)
    assert (three.latency_s, three.seconds_per_byte) == pytest.approx(
        (shm.latency_s, shm.seconds_per_byte), rel=1e-6)
    model.main(["validate-nodes", str(tmp_path)])
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| light | 2x2 |")]
    assert len(table) == 3
    assert all(cell.strip() == "+0%" for line in table for cell in line.split("|")[4:-1])
    # A cluster of your own: its files named after it, its rate given.
    for old_name in ("1x2", "2x2"):
        (tmp_path / f"allreduce-light-{old_name}.json").rename(
            tmp_path / f"allreduce-mine-{old_name}.json")
    model.main(["validate-nodes", str(tmp_path)])
    assert "give --gbit; skipped" in capsys.readouterr().out
    model.main(["validate-nodes", str(tmp_path), "--gbit", "0.2"])
    out = capsys.readouterr().out
    assert len([line for line in out.splitlines() if line.startswith("| mine | 2x2 |")]) == 3


def test_validate_takes_training_runs_with_several_ranks_per_node(tmp_path, capsys):
    # A step whose own CPU (100 ms of its 0.2 s) the shared cores must run for every rank.
    result = training_result(mpiddp_cpu_ms=160.0, single_cpu_ms=100.0)
    (tmp_path / "heavy-sim-resnet18-balanced-2x2.json").write_text(json.dumps(result))
    rows = benchmark_rows(dict(CPU_MS, **{"mpiddp hierarchical": {4 * KIB: 0.5, MIB: 2.5}}))
    (tmp_path / "allreduce-heavy-2x2.json").write_text(json.dumps({"rows": rows}))
    model.main(["validate", str(tmp_path), "--cores", "2"])
    out = capsys.readouterr().out
    row = [line for line in out.splitlines() if line.startswith("| heavy | balanced | 2x2 |")]
    # Both models (the node-local link: the emulated cluster's, no 1x2 run to fit it from).
    assert row and all(cell.strip() for cell in row[0].split("|")[6:10])
    links, cores = float(row[0].split("|")[6]), float(row[0].split("|")[8])
    assert cores >= links
    # On one core, the 4 ranks' CPU takes longer than the step.
    model.main(["validate", str(tmp_path), "--cores", "1"])
    row = [line for line in capsys.readouterr().out.splitlines()
           if line.startswith("| heavy | balanced | 2x2 |")]
    assert float(row[0].split("|")[8]) > cores
