"""scripts/ensure_env.sh with MPIDDP_NO_INSTALL=1: an environment used as it is, never installed
into (machines with no package index), and a clear refusal where it lacks mpiddp's needs."""
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def source_ensure_env(env_dir: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, MPIDDP_NO_INSTALL="1", MPIDDP_VENV=str(env_dir))
    env.pop("PYTHONPATH", None)     # the environment's own packages only
    return subprocess.run(
        ["bash", "-c", 'source scripts/ensure_env.sh && echo "python: $(command -v python)"'],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_an_environment_without_mpiddps_needs_is_refused_by_name(tmp_path: Path):
    bare = tmp_path / "bare"
    venv.create(bare, with_pip=False)
    result = source_ensure_env(bare)
    assert result.returncode != 0
    assert f"{bare} lacks torch mpi4py numpy" in result.stderr
    assert not (bare / ".mpiddp-stamp").exists()
    missing = source_ensure_env(tmp_path / "nowhere")
    assert missing.returncode != 0
    assert "no environment at" in missing.stderr


def test_the_running_environment_is_used_as_it_is(tmp_path: Path):
    prefix = Path(sys.prefix)   # the suite's own environment: torch, mpi4py and numpy
    if sys.prefix == sys.base_prefix or not os.access(prefix / "bin" / "python", os.X_OK):
        pytest.skip("the suite does not run in a virtual environment")
    stamp = prefix / ".mpiddp-stamp"
    before = stamp.stat().st_mtime_ns if stamp.exists() else None
    result = source_ensure_env(prefix)
    assert result.returncode == 0, result.stderr
    assert f"python: {prefix}/bin/python" in result.stdout
    assert "installing" not in result.stderr
    assert (stamp.stat().st_mtime_ns if stamp.exists() else None) == before


def shell_after_sourcing(env_dir: Path, options: str) -> subprocess.CompletedProcess:
    """Source the script, as a user does in their own shell, from a bash with ``options``;
    then print the shell's options and go on."""
    env = dict(os.environ, MPIDDP_NO_INSTALL="1", MPIDDP_VENV=str(env_dir))
    env.pop("PYTHONPATH", None)
    script = (f"{options}\nbefore=$(set +o; shopt -p)\nsource scripts/ensure_env.sh\n"
              'echo "status $?"\n[ "$before" = "$(set +o; shopt -p)" ] && echo "options kept"\n'
              "false\necho 'still here'\n")
    return subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)


def test_sourcing_leaves_the_users_shell_options_and_shell_alone(tmp_path: Path):
    """A user's shell keeps its options (no `set -euo pipefail` left behind: a later failing
    command, or a job's exit status 75, must not close it), on success and on failure."""
    prefix = Path(sys.prefix)
    if sys.prefix == sys.base_prefix:
        pytest.skip("the suite does not run in a virtual environment")
    for options in ("", "set -o noclobber"):
        ok = shell_after_sourcing(prefix, options)
        assert "status 0" in ok.stdout and "options kept" in ok.stdout, ok
        assert "still here" in ok.stdout
        failed = shell_after_sourcing(tmp_path / "nowhere", options)
        assert "status 1" in failed.stdout and "options kept" in failed.stdout, failed
        assert "still here" in failed.stdout and "no environment at" in failed.stderr


def test_a_strict_caller_stops_at_a_failure(tmp_path: Path):
    """scripts/test.sh sources it under `set -e`: a failure stops the script there."""
    env = dict(os.environ, MPIDDP_NO_INSTALL="1", MPIDDP_VENV=str(tmp_path / "nowhere"))
    result = subprocess.run(["bash", "-c", "set -e; source scripts/ensure_env.sh; echo past"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "past" not in result.stdout
    ran = subprocess.run(["bash", "scripts/ensure_env.sh"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert ran.returncode == 1 and "no environment at" in ran.stderr
