"""``mpiddp.Checkpoint(..., sharded=True)`` (tests/workers/sharded_checkpoint_worker.py): saved
by 4 ranks at stages 2 and 3, stopped by SIGTERM and resumed; resumed at 3 ranks bitwise as
from the whole file; a save killed with SIGKILL before its manifest leaves the previous
checkpoint; and ``python -m mpiddp.checkpoint_convert``, whose whole file is the consolidated
one and loads into plain torch."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mpi_launch import ROOT, WORKERS, assert_ok, run_mpi

RING = {"MPIDDP_ALLREDUCE_ALGORITHM": "ring"}


def same_tensors(a: dict, b: dict, what: str) -> None:
    assert sorted(a) == sorted(b), what
    for key, value in a.items():
        assert torch.equal(value, b[key]), (what, key)


def convert(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "mpiddp.checkpoint_convert", *args],
                          capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def plain_model() -> torch.nn.Module:
    """The workers' model, built by plain torch (no mpiddp)."""
    sys.path.insert(0, str(WORKERS))
    try:
        import zero_model
    finally:
        sys.path.remove(str(WORKERS))
    model = zero_model.Net()
    model.register_buffer("seen", torch.zeros(3))
    return model


def check_converter(preempted: Path, tmp_path: Path) -> None:
    """The converted whole file is the whole file of the same state, bitwise; it loads into
    a plain torch model and Adam; ``--model-only`` is the model's state dict."""
    out, model_only = tmp_path / "converted.pt", tmp_path / "model.pt"
    assert "model and optimizer" in convert(str(preempted / "sharded.pt"), str(out))
    convert(str(preempted / "sharded.pt"), str(model_only), "--model-only")
    got = torch.load(out, weights_only=False)
    whole = torch.load(preempted / "whole.pt", weights_only=False)
    for key in ("epoch", "step", "ranks", "extra"):
        assert got[key] == whole[key], key
    for rank, state in enumerate(whole["rng"]):
        assert torch.equal(got["rng"][rank]["cpu"], state["cpu"]), rank
    same_tensors(got["model"], whole["model"], "model")
    same_tensors(torch.load(model_only), whole["model"], "--model-only")
    assert got["optimizer"]["param_groups"] == whole["optimizer"]["param_groups"]
    assert sorted(got["optimizer"]["state"]) == sorted(whole["optimizer"]["state"])
    for index, values in whole["optimizer"]["state"].items():
        same_tensors(got["optimizer"]["state"][index], values, f"optimizer state {index}")
    model = plain_model()
    model.load_state_dict(torch.load(model_only))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    optimizer.load_state_dict(got["optimizer"])
    assert model.out.weight is model.emb.weight


@pytest.mark.parametrize("stage", [2, 3])
def test_sharded_save_at_4_ranks_resumes_at_3_bitwise_and_converts(tmp_path: Path, stage: int):
    directory = str(tmp_path / "run")
    saved = run_mpi("sharded_checkpoint_worker.py", 4, "save", directory, str(stage),
                    timeout=300, env=RING)
    assert_ok(saved, expect_lines=2)
    check_converter(tmp_path / "run" / "preempted", tmp_path)
    resumed = run_mpi("sharded_checkpoint_worker.py", 3, "resume", directory, str(stage),
                      timeout=300, env=RING)
    assert_ok(resumed, expect_lines=2 if stage == 3 else 1)


def test_a_save_killed_before_its_manifest_leaves_the_previous_checkpoint(tmp_path: Path):
    directory = str(tmp_path / "run")
    killed = run_mpi("sharded_checkpoint_worker.py", 3, "kill", directory, timeout=200,
                     env=RING)
    assert not killed.timed_out and killed.returncode != 0, killed.output
    assert killed.output.count("OK ") == 1, killed.output
    assert "rank 1: wrote its part of save-2, killing itself" in killed.output, killed.output
    resumed = run_mpi("sharded_checkpoint_worker.py", 2, "after-kill", directory, timeout=200,
                      env=RING)
    assert_ok(resumed, expect_lines=3)
    assert "the newest save is incomplete" in resumed.output, resumed.output


def test_the_converter_refuses_what_is_not_a_sharded_checkpoint(tmp_path: Path):
    whole = tmp_path / "whole.pt"
    torch.save({"model": {}}, whole)
    done = subprocess.run([sys.executable, "-m", "mpiddp.checkpoint_convert", str(whole),
                           str(tmp_path / "out.pt")], capture_output=True, text=True,
                          timeout=120, cwd=str(ROOT))
    assert done.returncode == 1 and "is a whole checkpoint already" in done.stderr, done.stderr
    assert not (tmp_path / "out.pt").exists()
