"""The timeline a user records while training, and the picture scripts/plot_timeline.py
draws from it (compute, reductions and the wait for them, per rank)."""
import subprocess
import sys

from mpi_launch import ROOT, assert_ok, run_mpi


def test_timeline_of_training_and_its_picture(tmp_path):
    result = run_mpi("timeline_worker.py", 2, timeout=90,
                     env={"MPIDDP_TIMELINE": str(tmp_path / "tl.json")})
    assert_ok(result)
    traces = [tmp_path / f"tl.rank{r}.json" for r in range(2)]
    picture = tmp_path / "overlap.png"
    plot = subprocess.run([sys.executable, str(ROOT / "scripts" / "plot_timeline.py"),
                           *map(str, traces), "-o", str(picture)],
                          capture_output=True, text=True, timeout=120)
    assert plot.returncode == 0, plot.stdout + plot.stderr
    rows = [line.split() for line in plot.stdout.splitlines()[1:3]]
    for rank, row in enumerate(rows):
        assert int(row[0]) == rank and int(row[1]) == 3, plot.stdout   # 3 whole steps
        step, compute, reduced, hidden, waited = map(float, row[2:])
        assert 0 < compute < step and 0 < reduced and 0 <= hidden <= reduced, plot.stdout
        assert 0 <= waited < step, plot.stdout
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
