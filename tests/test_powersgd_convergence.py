"""scripts/bench/powersgd_convergence.py at 2 ranks, a few steps: it trains every variant,
prints its table, counts what PowerSGD sends, and writes the picture and the JSON."""
import json
import re

from mpi_launch import ROOT, assert_ok, run_mpi

SCRIPT = ROOT / "scripts" / "bench" / "powersgd_convergence.py"
# The digits MLP 64-256-256-10: its parameters, and what rank r sends (three matrices as
# (n + m) r, the biases whole).
FULL = 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
BIASES = 256 + 256 + 10


def sent(r: int) -> int:
    return ((256 + 64) + (256 + 256) + (10 + 256)) * r + BIASES


def test_convergence_study_two_ranks(tmp_path):
    picture, record = tmp_path / "curves.png", tmp_path / "curves.json"
    result = run_mpi(str(SCRIPT), 2, "--steps", "30", "--start-step", "5", "--orders", "2",
                     "--ranks", "1", "4", "--target", "2.0", "--smooth", "5",
                     "--plot", picture, "--json", record, timeout=90)
    assert_ok(result)
    out = result.output
    assert "2 ranks x 32 samples a step" in out and "PowerSGD from step 5" in out, out
    rows = {}
    for label in ("uncompressed", "PowerSGD rank 1", "PowerSGD rank 4"):
        match = re.search(rf"^{label} +([\d.]+|-) +([\d,-]+) +([\d.]+) +([\d.]+) +([\d,]+) "
                          rf"+([\d.]+)x +([\d.]+)$", out, re.MULTILINE)
        assert match, f"no row for {label}:\n{out}"
        rows[label] = match.groups()
    assert rows["uncompressed"][4] == f"{FULL:,}" and rows["uncompressed"][5] == "1.0", out
    assert rows["PowerSGD rank 1"][4] == f"{sent(1):,}", out
    assert rows["PowerSGD rank 4"][4] == f"{sent(4):,}", out
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {picture}" in out, out

    saved = json.loads(record.read_text())
    assert saved["settings"]["ranks"] == 2 and saved["settings"]["start_step"] == 5
    results = {r["variant"]: r for r in saved["results"]}
    assert list(results) == ["uncompressed", "PowerSGD rank 1", "PowerSGD rank 4"]
    for r in results.values():
        assert len(r["curve"]) == 30 and len(r["runs"]) == 2, r["variant"]
        assert 0 <= r["test_accuracy"] <= 1 and r["final_loss"] > 0, r["variant"]
        # Uncompressed until start_step: every variant starts on the same curve.
        assert r["runs"][0]["curve"][:5] == results["uncompressed"]["runs"][0]["curve"][:5]
    # The loss starts at about ln 10 and a 2.0 target is reached in a few steps.
    assert results["uncompressed"]["steps_to_target"] is not None, out
    assert results["PowerSGD rank 1"]["ratio"] == FULL / sent(1)
