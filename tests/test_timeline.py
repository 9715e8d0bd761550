"""The timeline a user records while training, and the picture scripts/plot_timeline.py
draws from it (compute, reductions and the wait for them, per rank)."""
import json
import subprocess
import sys

import pytest

from mpi_launch import ROOT, assert_ok, run_mpi
from mpiddp.engine.timeline import Timeline

PLOT = ROOT / "scripts" / "plot_timeline.py"
COLUMNS = ("step", "compute", "reductions", "hidden", "waited",
           "reducing", "queued", "negotiating", "other", "handed")
# The worker's gradients: 4 x Linear(512, 512), 4 x 262,656 float32, and opt0.used (a byte per
# parameter), in MB (10^6 bytes) per step.
WORKER_GRADIENT_MB = (4 * 262656 * 4 + 8) / 1e6


def table(stdout: str) -> list[dict[str, float]]:
    """plot_timeline.py's table: a row per rank, {column: ms} (plus rank and steps)."""
    rows = []
    for line in stdout.splitlines()[1:]:
        fields = line.replace("|", " ").split()
        if len(fields) != 2 + len(COLUMNS) or not fields[0].isdigit():
            break
        rows.append({"rank": int(fields[0]), "steps": int(fields[1]),
                     **dict(zip(COLUMNS, map(float, fields[2:])))})
    return rows


def test_timeline_of_training_and_its_picture(tmp_path):
    result = run_mpi("timeline_worker.py", 2, timeout=90,
                     env={"MPIDDP_TIMELINE": str(tmp_path / "tl.json")})
    assert_ok(result)
    traces = [tmp_path / f"tl.rank{r}.json" for r in range(2)]
    picture = tmp_path / "overlap.png"
    plot = subprocess.run([sys.executable, str(PLOT), *map(str, traces), "-o", str(picture)],
                          capture_output=True, text=True, timeout=120)
    assert plot.returncode == 0, plot.stdout + plot.stderr
    rows = table(plot.stdout)
    assert [row["rank"] for row in rows] == [0, 1], plot.stdout
    for row in rows:
        assert row["steps"] == 3, plot.stdout                          # 3 whole steps
        assert 0 < row["compute"] < row["step"] and 0 < row["reductions"], plot.stdout
        assert 0 <= row["hidden"] <= row["reductions"], plot.stdout
        assert 0 <= row["waited"] < row["step"], plot.stdout
        for part in ("reducing", "queued", "negotiating", "other"):
            assert 0 <= row[part] <= row["waited"] + 0.1, (part, plot.stdout)
        assert row["handed"] == pytest.approx(WORKER_GRADIENT_MB, abs=6e-4), plot.stdout
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = json.loads(traces[0].read_text())["traceEvents"]
    spans = {event["name"] for event in events}
    assert {"NEGOTIATE", "QUEUE", "REDUCE", "COMPUTE", "WAIT", "STEP"} <= spans, spans
    # A tensor's spans carry its bytes: a 512 x 512 float32 weight's gradient, a bias's, the
    # usage vector's (a byte per parameter).
    sizes = {(e["tid"], e["name"]): e["args"]["bytes"] for e in events if "args" in e}
    assert sizes[("opt0.grad.0.weight", "REDUCE")] == 512 * 512 * 4
    assert sizes[("opt0.grad.0.bias", "NEGOTIATE")] == 512 * 4
    assert sizes[("opt0.used", "REDUCE")] == 8


def one_step(timeline: Timeline, t0: float) -> None:
    """A step of optimizer opt0, from the end of the previous one at t0 (seconds): gradient a
    is reduced under backward; gradient b is handed over just before backward ends and then
    waits 20 ms for agreement, 10 ms for the engine and 30 ms for its reduction; backward
    returns 10 ms after that. The wait (70 ms) splits into 30 reducing, 10 queued, 20
    negotiating and 10 other."""
    ms = lambda m: t0 + m / 1e3                                     # noqa: E731
    for name, phase, at in (("opt0.grad.a", "submit", 40), ("opt0.grad.a", "agreed", 42),
                            ("opt0.grad.a", "start", 42), ("opt0.grad.a", "end", 70),
                            ("opt0.grad.b", "submit", 85), ("opt0", "backward_end", 90),
                            ("opt0.grad.b", "agreed", 110), ("opt0.grad.b", "start", 120),
                            ("opt0.grad.b", "end", 150), ("opt0", "synchronized", 160),
                            ("opt0", "step_begin", 160), ("opt0", "step_end", 170)):
        timeline.record(name, phase, ms(at))
    timeline.record_bytes("opt0.grad.a", 1_000_000)          # 1.5 MB handed over a step
    timeline.record_bytes("opt0.grad.b", 500_000)


def test_the_wait_splits_into_what_the_gradients_did(tmp_path):
    """The trace has a span per phase of a tensor (NEGOTIATE: handed over to agreed; QUEUE:
    agreed to started; REDUCE), and plot_timeline.py splits the wait at the end of backward
    by them (no MPI: a timeline of known times)."""
    timeline = Timeline(enabled=True)
    timeline.record("opt0", "step_begin", 0.0)
    timeline.record("opt0", "step_end", 0.010)
    for step in range(3):
        one_step(timeline, 0.010 + 0.170 * step)
    trace = tmp_path / "tl.rank0.json"
    timeline.write_chrome_trace(str(trace), rank=0)
    spans = {}
    for event in json.loads(trace.read_text())["traceEvents"]:
        spans.setdefault((event["tid"], event["name"]), []).append(event["dur"] / 1e3)
    assert spans[("opt0.grad.b", "NEGOTIATE")] == pytest.approx([25] * 3)
    assert spans[("opt0.grad.b", "QUEUE")] == pytest.approx([10] * 3)
    assert spans[("opt0.grad.b", "REDUCE")] == pytest.approx([30] * 3)
    assert spans[("opt0.grad.a", "QUEUE")] == pytest.approx([0] * 3)
    assert spans[("opt0", "WAIT")] == pytest.approx([70] * 3)

    plot = subprocess.run([sys.executable, str(PLOT), str(trace), "--no-plot", "--steps", "3"],
                          capture_output=True, text=True, timeout=60)
    assert plot.returncode == 0, plot.stdout + plot.stderr
    (row,) = table(plot.stdout)
    assert row["steps"] == 3, plot.stdout
    expected = {"step": 170, "compute": 90, "reductions": 58, "hidden": 28, "waited": 70,
                "reducing": 30, "queued": 10, "negotiating": 20, "other": 10, "handed": 1.5}
    assert {key: row[key] for key in expected} == pytest.approx(expected), plot.stdout


def test_horovods_start_timeline_with_a_file_path(tmp_path):
    """Horovod's form, ``start_timeline(file_path, mark_cycles)``: ``stop_timeline()`` writes
    every rank's trace to its own file, in a directory made for it; mark_cycles (no such
    markers here) is said, not lost."""
    script = tmp_path / "timeline_path.py"
    script.write_text(f"""
import torch, mpiddp
mpiddp.init()
mpiddp.start_timeline({str(tmp_path / 'new' / 'hvd.json')!r}, mark_cycles=True)
mpiddp.allreduce(torch.ones(4), name='x')
mpiddp.stop_timeline()
print('OK rank', mpiddp.rank(), flush=True)
""")
    result = run_mpi(str(script), 2, timeout=60)
    assert_ok(result, expect_lines=2)
    assert result.output.count("start_timeline(mark_cycles=True)") == 2, result.output
    for rank in (0, 1):
        trace = tmp_path / "new" / f"hvd.rank{rank}.json"
        assert trace.exists() and '"x"' in trace.read_text(), rank


def test_mpiddp_profile_puts_the_collectives_in_torch_profilers_trace(tmp_path):
    """Issue 67 item 2: ``mpiddp.profile`` is torch.profiler.profile whose Chrome trace (and
    tensorboard_trace_handler's) also holds each engine's collectives and the optimizer's
    steps, on the profiler's clock (tests/workers/profiler_worker.py)."""
    assert_ok(run_mpi("profiler_worker.py", 2, tmp_path, timeout=120), expect_lines=2)
