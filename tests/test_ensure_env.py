"""scripts/ensure_env.sh with MPIDDP_NO_INSTALL=1: an environment used as it is, never installed
into (machines with no package index), and a clear refusal where it lacks mpiddp's needs; and,
with a stand-in pip (no index either), the reinstall of mpiddp alone in an environment whose
mpiddp is another checkout's."""
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


# `python -m pip` of a stand-in environment: logs its arguments, and for `install -e DIR` makes
# DIR's mpiddp the importable one, with a .pth file as an editable install does. No index.
PIP_STANDIN = """import os, sys, sysconfig
args = sys.argv[1:]
with open(os.path.join(sys.prefix, "pip-calls.log"), "a") as log:
    log.write(" ".join(args) + "\\n")
if "-e" in args:
    with open(os.path.join(sysconfig.get_paths()["purelib"], "mpiddp-editable.pth"), "w") as f:
        f.write(args[args.index("-e") + 1] + "\\n")
"""


def standin_environment(tmp_path: Path) -> tuple[Path, Path]:
    """A virtual environment whose pip is PIP_STANDIN and whose torch, mpi4py and numpy are
    empty packages: (the environment, its site-packages)."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    site = Path(subprocess.run(
        [str(env_dir / "bin" / "python"), "-c",
         "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, timeout=60).stdout.strip())
    for package, text in (("pip", ""), ("torch", ""), ("mpi4py", ""), ("numpy", "")):
        (site / package).mkdir()
        (site / package / "__init__.py").write_text(text)
    (site / "pip" / "__main__.py").write_text(PIP_STANDIN)
    return env_dir, site


def run_ensure_env(env_dir: Path, no_install: bool = False) -> tuple[subprocess.CompletedProcess,
                                                                       list[str]]:
    """Run the script for ``env_dir`` from another directory (this checkout's mpiddp must not
    be found by being in the current one); (its result, the pip calls it made)."""
    log = env_dir / "pip-calls.log"
    log.unlink(missing_ok=True)
    env = dict(os.environ, MPIDDP_VENV=str(env_dir), MPIDDP_NO_INSTALL="1" if no_install else "0")
    env.pop("PYTHONPATH", None)
    result = subprocess.run(["bash", str(ROOT / "scripts" / "ensure_env.sh")], cwd=env_dir,
                            env=env, capture_output=True, text=True, timeout=60)
    return result, (log.read_text().splitlines() if log.exists() else [])


def test_an_environment_copied_from_another_checkout_gets_this_checkouts_mpiddp(tmp_path):
    """A checkout copied with its .venv: the stamp matches, but the editable install of mpiddp
    points at the old tree. The script notices and reinstalls mpiddp alone (``--no-deps``)."""
    env_dir, site = standin_environment(tmp_path)
    editable = f"-q --disable-pip-version-check --no-deps -e {ROOT}"
    first, calls = run_ensure_env(env_dir)                      # a new environment: everything
    assert first.returncode == 0, first.stderr
    assert calls == [f"install -q --disable-pip-version-check -r {ROOT}/requirements-dev.txt",
                     f"install {editable}"], calls
    again, calls = run_ensure_env(env_dir)
    assert again.returncode == 0 and calls == [], (again.stderr, calls)

    old_tree = tmp_path / "old-checkout"
    (old_tree / "mpiddp").mkdir(parents=True)
    (old_tree / "mpiddp" / "__init__.py").write_text("")
    (site / "mpiddp-editable.pth").write_text(f"{old_tree}\n")  # as the copy left it
    moved, calls = run_ensure_env(env_dir)
    assert moved.returncode == 0, moved.stderr
    assert f"mpiddp is {old_tree}/mpiddp, not this checkout's ({ROOT}/mpiddp)" in moved.stderr
    assert calls == [f"install {editable}"], calls
    settled, calls = run_ensure_env(env_dir)
    assert settled.returncode == 0 and calls == [], (settled.stderr, calls)

    (site / "mpiddp-editable.pth").unlink()                     # the old tree deleted: none
    gone, calls = run_ensure_env(env_dir)
    assert "mpiddp is missing" in gone.stderr and calls == [f"install {editable}"], gone.stderr

    # MPIDDP_NO_INSTALL=1 never installs: it says so, and goes on.
    (site / "mpiddp-editable.pth").write_text(f"{old_tree}\n")
    kept, calls = run_ensure_env(env_dir, no_install=True)
    assert kept.returncode == 0 and calls == [], (kept.stderr, calls)
    assert f"warning: {env_dir}'s mpiddp is {old_tree}/mpiddp" in kept.stderr
