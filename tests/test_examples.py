"""Every program in examples/ runs, as the pages that show it say (tests/test_docs.py checks
that their code blocks are these files): at 2 ranks under mpiexec by default. A header line
of the file can say otherwise:

    # test-ranks: 1,2            rank counts to run it at
    # test-args: --epochs 2      arguments (e.g. a target the run must reach)
    # test-launch: python        one plain process, no MPI launcher (a single-GPU script)

GPU code runs on the CPU here: the examples fall back to it when CUDA is not available.
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from mpi_launch import ROOT, mpi_command, run_command

EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def header(example: Path, key: str, default: str) -> str:
    for line in example.read_text().splitlines()[:40]:
        if line.startswith(f"# {key}:"):
            return line.split(":", 1)[1].strip()
    return default


def cases():
    for example in EXAMPLES:
        for ranks in header(example, "test-ranks", "2").split(","):
            yield pytest.param(example, int(ranks), id=f"{example.stem}-{ranks}ranks")


@pytest.mark.parametrize("example,ranks", list(cases()))
def test_example_runs(example: Path, ranks: int, tmp_path: Path):
    args = [arg.replace("{tmp}", str(tmp_path))
            for arg in shlex.split(header(example, "test-args", ""))]
    if header(example, "test-launch", "mpiexec") == "python":
        cmd, env = mpi_command(str(example), 1, *args, mpi4py_run=False)
        cmd = [sys.executable, str(example), *args]
    else:
        cmd, env = mpi_command(str(example), ranks, *args)
    env = dict(env, PYTHONPATH=str(ROOT))        # only the package, as a user has it
    result = run_command(cmd, env, timeout=240)
    assert not result.timed_out, f"{example.name} timed out:\n{result.output[-4000:]}"
    assert result.returncode == 0, f"{example.name} at {ranks} rank(s):\n{result.output[-4000:]}"
