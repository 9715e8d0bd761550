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
