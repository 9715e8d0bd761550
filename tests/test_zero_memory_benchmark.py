"""scripts/bench/benchmark_zero_memory.py at 2 ranks on a small model: it runs every
configuration (FSDP2 with and without resharding after forward among them, and stage 3 from a
model on the meta device), prints its table, writes its JSON, and ZeRO stage 1 holds half of
stage 0's optimizer state per rank."""
import json
import os
import signal
import subprocess
import sys

from mpi_launch import ROOT, descendants

SCRIPT = ROOT / "scripts" / "bench" / "benchmark_zero_memory.py"
TIMEOUT = 300
PADDING = 4096          # per-shard scalars (Adam's 'step') and uneven chunk bounds


def run_benchmark(*args: str) -> tuple[int, str]:
    """Run the driver in a session of its own; on timeout stop it (it kills its launch),
    then kill its process group and everything it started."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if 2 * int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1)) > (os.cpu_count() or 1):
        env["MPIR_CVAR_ENABLE_HEAVY_YIELD"] = "1"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=str(ROOT),
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        started = descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        for pid in started:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        raise AssertionError(f"benchmark_zero_memory.py timed out after {TIMEOUT} s:\n{output}")


def test_zero_memory_benchmark_two_ranks(tmp_path):
    out = tmp_path / "zero_memory.json"
    code, output = run_benchmark("--ranks", "2", "--layers", "2", "--width", "256",
                                 "--steps", "2", "--timeout", "240", "--json", str(out))
    assert code == 0, output
    results = json.loads(out.read_text())
    rows = {row["config"]: row for row in results["results"]}
    assert set(rows) == {"mpiddp-zero0", "mpiddp-zero1", "mpiddp-zero2", "torch-zero-ddp",
                         "fsdp2", "fsdp2-reshard", "mpiddp-zero3", "mpiddp-zero3-meta"}, output
    for config in ("mpiddp-zero0", "mpiddp-zero1", "mpiddp-zero2", "mpiddp-zero3",
                   "mpiddp-zero3-meta"):
        row = rows[config]
        assert row["error"] is None, output
        assert len(row["per_rank"]) == 2 and row["ranks_agree"], output
        assert row["label"] in output, output          # its row in the table
    params = 2 * (256 * 256 + 256)
    assert rows["mpiddp-zero0"]["params"] == params, output
    # Adam: exp_avg and exp_avg_sq, 8 bytes per parameter (and a 'step' scalar each).
    zero0 = rows["mpiddp-zero0"]["optimizer_state_bytes"]
    assert 8 * params <= zero0 <= 8 * params + PADDING, output
    for rank in rows["mpiddp-zero1"]["per_rank"]:
        assert rank["optimizer_state_bytes"] <= 1.05 * (zero0 / 2) + PADDING, output
    # Stage 2 holds no full-size gradient after backward; stages 1 and 2 end where 0 does.
    assert rows["mpiddp-zero2"]["full_grad_bytes_after_backward"] == 0, output
    assert rows["mpiddp-zero1"]["full_grad_bytes_after_backward"] == 4 * params, output
    for config in ("mpiddp-zero1", "mpiddp-zero2", "mpiddp-zero3"):
        assert rows[config]["vs_reference"]["equal"], output
    assert rows["mpiddp-zero3"]["formula"]["total"] == 16 * params / 2, output
    # Built on the meta device: its own values (no comparison), the construction peak read.
    assert "vs_reference" not in rows["mpiddp-zero3-meta"], output
    assert all(row["construction_bytes"] is None or row["construction_bytes"] > 0
               for row in rows.values() if row["error"] is None), output
    # FSDP2 resharding after forward is set against ZeRO-3's formula: everything sharded.
    assert rows["fsdp2-reshard"]["formula_stage"] == 3
    if rows["fsdp2-reshard"]["error"] is None:
        assert rows["fsdp2-reshard"]["formula"]["total"] == 16 * params / 2, output
        assert "FSDP2 reshard " in output, output
    for row in rows.values():
        if row["error"] is None:
            assert row["peak_rss"] >= row["baseline_rss"] > 0, output
            assert row["formula"]["total"] > 0 and row["ratio"] > 0, output
        else:
            assert f"ERROR: {row['error']}" in output, output
