"""Autotune: the Gaussian process and its proposals, the scoring windows, the search over a
known score, explicitly set values left alone, every fake rank applying the same settings at
the same point of the order, and a real 2-rank run with exact results."""
from __future__ import annotations

import csv
import math
from dataclasses import replace

import numpy as np
import pytest

from mpiddp.config import Settings, read_settings
from mpiddp.engine import bayes
from mpiddp.engine.autotune import RANGES, Autotuner, Knobs, Retune, Window, tuned_knobs
from mpiddp.engine.request import ALLREDUCE, Request, Response
from mpi_launch import assert_ok, reported, run_mpi
from protocol_fakes import FakeCluster, entry
from test_protocol import assert_same_order, run_ranks

START = Knobs(fusion_threshold=1 << 20, cycle_time=50.0, ring_threshold=2 << 20,
              hierarchical=True)
FAST = Settings(autotune=True, autotune_warmup_windows=0, autotune_steps_per_window=1,
                autotune_windows=1, autotune_max_samples=12)


# ---- the Gaussian process -----------------------------------------------------------------
def test_the_process_matches_scikit_learn():
    sklearn = pytest.importorskip("sklearn.gaussian_process")
    kernels = pytest.importorskip("sklearn.gaussian_process.kernels")
    rng = np.random.default_rng(3)
    x, points = rng.random((9, 3)), rng.random((25, 3))
    y = np.sin(4 * x[:, 0]) + x[:, 1] ** 2 - x[:, 2]
    ours = bayes.GaussianProcess(0.35, 0.03).fit(x, y)
    theirs = sklearn.GaussianProcessRegressor(
        kernels.Matern(length_scale=0.35, length_scale_bounds="fixed", nu=2.5),
        alpha=0.03, optimizer=None, normalize_y=True).fit(x, y)
    mean, std = ours.predict(points)
    want_mean, want_std = theirs.predict(points, return_std=True)
    np.testing.assert_allclose(mean, want_mean, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(std, want_std, rtol=1e-5, atol=1e-9)


def test_expected_improvement_is_zero_where_nothing_can_improve():
    ei = bayes.expected_improvement(np.array([0.0, 1.0, 2.0]), np.array([1e-9, 0.5, 0.5]),
                                    best=1.0, scale=1.0, xi=0.0)
    assert ei[0] == pytest.approx(0.0, abs=1e-12)
    assert ei[2] > ei[1] > 0


def test_proposals_are_deterministic_and_find_a_peak():
    def score(p):                           # a peak at (0.7, 0.2), best with the switch on
        return -((p[0] - 0.7) ** 2 + (p[1] - 0.2) ** 2) + 0.3 * p[2]

    def search(seed):
        rng = np.random.default_rng(seed)
        x = [list(p) + [float(i % 2)] for i, p in enumerate(bayes.latin_hypercube(5, 2, rng))]
        y = [score(p) for p in x]
        for _ in range(15):
            point = bayes.propose(x, y, 2, [(0.0, 1.0)], rng)
            x.append(list(point))
            y.append(score(point))
        return x, y

    x, y = search(0)
    assert search(0) == (x, y)                       # same samples, same proposals
    best = x[bayes.best_sampled(x, y)]
    assert best[2] == 1.0 and math.hypot(best[0] - 0.7, best[1] - 0.2) < 0.1


# ---- windows and the search ---------------------------------------------------------------
def response(name: str, numel: int) -> Response:
    return Response(Request(name, ALLREDUCE, "float32", (numel,)))


def test_a_window_is_whole_steps_of_bytes():
    window = Window()
    assert window.add(["a", "b"], 2000, steps=2, now=0.0) is None  # 2000 bytes a step
    assert window.add(["a", "b"], 2000, steps=2, now=0.001) is None
    # The third step's first cycle closes the window: 4000 bytes in 2 ms.
    assert window.add(["a"], 1000, steps=2, now=0.002) == pytest.approx(2.0)
    assert window.bytes == 1000 and window.start == 0.002


def simulate(tuner: Autotuner, step_time, steps: int = 2000):
    """Drive ``tuner`` as the engine does, with a step of ``step_time(knobs)`` seconds of two
    all-reduces; returns the applied Retunes."""
    now, applied = 0.0, []
    names = [response("g.0", 1000), response("g.1", 3000)]
    for _ in range(steps):
        retune = tuner.observe(names, now)
        if retune is not None:
            now += 1e-4
            tuner.applied(retune)            # the next cycle: rank 0's plan
            applied.append(retune)
            if retune.final:
                break
        now += step_time(tuner.current)
    return applied


def synthetic_step(knobs: Knobs) -> float:
    """A step that is fastest with 8 MiB fusion, a 256 KiB ring threshold, hierarchical off."""
    f = math.log2(knobs.fusion_threshold / (8 << 20))
    r = math.log2(knobs.ring_threshold / (256 << 10))
    return 0.1 * (1 + 0.02 * f * f + 0.01 * r * r + (0.05 if knobs.hierarchical else 0))


def test_the_search_ends_with_its_best_sample_and_logs_every_sample(tmp_path):
    path = tmp_path / "autotune.csv"
    tuner = Autotuner(replace(FAST, autotune_log=str(path)), START)
    applied = simulate(tuner, synthetic_step)
    assert [r.sample for r in applied[:-1]] == list(range(1, 12)) and applied[-1].final
    rows = list(csv.DictReader(path.open()))
    assert [row["kind"] for row in rows] == ["start"] + ["sample"] * 11 + ["best"]
    assert [float(row["score_bytes_per_us"]) for row in rows[:-1]] == \
        pytest.approx(tuner.scores, rel=1e-3)
    best = applied[-1].knobs
    assert rows[-1]["fusion_threshold"] == str(best.fusion_threshold)
    # Within 5% of the best step on a fine grid of the same space.
    grid = min(synthetic_step(Knobs(int(f), 50.0, int(r), h))
               for f in np.geomspace(64 << 10, 64 << 20, 25)
               for r in np.geomspace(16 << 10, 64 << 20, 25) for h in (False, True))
    assert synthetic_step(best) <= 1.05 * grid
    assert best.pin().startswith(f"MPIDDP_FUSION_THRESHOLD={best.fusion_threshold} "
                                 "MPIDDP_CYCLE_TIME=")
    assert "MPIDDP_HIERARCHICAL_ALLREDUCE=0" in best.pin()
    # After the end it stays quiet.
    assert tuner.observe([response("g.0", 1000)] * 3, 1e6) is None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noisy_scores_still_end_within_5_percent(seed):
    """3% noise on every sample's score (seeded: deterministic), 16 samples, a landscape
    where the ring threshold matters most (as on one node: the ring for nearly everything)."""
    def landscape(k):
        f = math.log2(k.fusion_threshold / (4 << 20))
        r = math.log2(k.ring_threshold / (64 << 10))
        return 0.1 * (1 + 0.01 * f * f + 0.03 * max(r, 0) ** 1.5
                      + 0.02 * abs(math.log(k.cycle_time / 20)))

    noise = np.random.default_rng(100 + seed)
    tuner = Autotuner(replace(FAST, autotune_max_samples=16),
                      replace(START, hierarchical=None), seed=seed)
    applied = simulate(tuner, lambda k: landscape(k) * (1 + 0.03 * noise.standard_normal()))
    grid = min(landscape(Knobs(int(f), float(c), int(r)))
               for f in np.geomspace(64 << 10, 64 << 20, 12)
               for r in np.geomspace(16 << 10, 64 << 20, 12) for c in np.geomspace(1, 100, 6))
    assert landscape(applied[-1].knobs) <= 1.05 * grid


def test_explicit_and_inapplicable_knobs_are_not_searched():
    settings = read_settings({"MPIDDP_AUTOTUNE": "1", "MPIDDP_FUSION_THRESHOLD": "1048576",
                              "MPIDDP_AUTOTUNE_WARMUP_WINDOWS": "0",
                              "MPIDDP_AUTOTUNE_STEPS_PER_WINDOW": "1",
                              "MPIDDP_AUTOTUNE_WINDOWS": "1",
                              "MPIDDP_AUTOTUNE_MAX_SAMPLES": "8"})
    assert settings.explicit >= {"fusion_threshold", "autotune"}
    start = replace(START, hierarchical=None)            # one node: no hierarchical switch
    assert tuned_knobs(start, settings) == (["cycle_time", "ring_threshold"], [])
    applied = simulate(Autotuner(settings, start), synthetic_step)
    assert len(applied) == 8 and applied[-1].final
    assert {r.knobs.fusion_threshold for r in applied} == {1 << 20}
    assert {r.knobs.hierarchical for r in applied} == {None}
    assert len({r.knobs.ring_threshold for r in applied}) > 4   # the others do move
    assert all(RANGES["cycle_time"].low <= r.knobs.cycle_time <= 100 for r in applied)


def test_only_switches_try_each_value_once():
    settings = read_settings({"MPIDDP_FUSION_THRESHOLD": "1", "MPIDDP_CYCLE_TIME": "5",
                              "MPIDDP_RING_THRESHOLD": "1"})
    settings = replace(settings, **{k: getattr(FAST, k) for k in (
        "autotune", "autotune_warmup_windows", "autotune_steps_per_window", "autotune_windows")})
    applied = simulate(Autotuner(settings, START), synthetic_step)
    assert [(r.knobs.hierarchical, r.final) for r in applied] == [(False, False), (False, True)]


def test_nothing_to_tune_ends_at_once():
    settings = read_settings({"MPIDDP_AUTOTUNE": "1", "MPIDDP_FUSION_THRESHOLD": "1",
                              "MPIDDP_CYCLE_TIME": "5"})
    tuner = Autotuner(settings, Knobs(1, 5.0))
    assert tuner.finished and simulate(tuner, lambda knobs: 0.1, steps=50) == []


# ---- agreement across ranks ---------------------------------------------------------------
@pytest.mark.parametrize("size", [2, 3])
def test_every_fake_rank_applies_the_same_settings_at_the_same_point(size):
    cluster = FakeCluster(size, autotune=True, autotune_warmup_windows=0,
                          autotune_steps_per_window=1, autotune_windows=1,
                          autotune_max_samples=5)

    def work(rank, engine):
        for step in range(40):
            # Submitted in a rank-dependent order, in two groups: cycles differ in content.
            names = [f"g.{i}" for i in range(4)]
            if rank % 2:
                names.reverse()
            handles = [h for group in (names[:2], names[2:])
                       for h in engine.submit_many([entry(n, shape=(1000,)) for n in group])]
            for handle in handles:
                handle.wait()
        return [(cycle, r) for cycle, r in engine.retunes]

    try:
        retunes = run_ranks(cluster, work)
        order = assert_same_order(cluster)         # the markers sit at the same place too
    finally:
        cluster.shutdown()
    assert all(r == retunes[0] for r in retunes), "ranks applied different settings or cycles"
    assert len(retunes[0]) == 5 and retunes[0][-1][1].final
    assert sum(1 for item in order if item[0] == "#retune") == 5
    assert cluster.engines[0].tuner.finished
    assert all(e.tuner is None for e in cluster.engines[1:])


# ---- a real 2-rank run --------------------------------------------------------------------
def test_two_ranks_tune_together_with_exact_results(tmp_path):
    """Identical settings at identical cycles on both ranks, exact sums all along, the log's
    samples and best, the explicit cycle time left alone."""
    path = tmp_path / "autotune.csv"
    env = {"MPIDDP_AUTOTUNE": "1", "MPIDDP_AUTOTUNE_LOG": str(path),
           "MPIDDP_AUTOTUNE_WARMUP_WINDOWS": "0", "MPIDDP_AUTOTUNE_STEPS_PER_WINDOW": "2",
           "MPIDDP_AUTOTUNE_WINDOWS": "1", "MPIDDP_AUTOTUNE_MAX_SAMPLES": "6",
           "MPIDDP_CYCLE_TIME": "7"}           # set explicitly: never changed
    result = run_mpi("autotune_worker.py", 2, 300, env=env, timeout=180)
    assert_ok(result, expect_lines=1)
    ranks = reported(result, "autotune")[0]["ranks"]
    assert len(ranks) == 2
    assert ranks[0]["retunes"] == ranks[1]["retunes"], "ranks applied different settings"
    assert ranks[0]["applied"] == ranks[1]["applied"]
    retunes = ranks[0]["retunes"]
    assert len(retunes) == 6 and retunes[-1][2]        # five samples after the start, the end
    assert len({(r[3], r[5]) for r in retunes}) > 2     # settings did change
    assert {r[4] for r in retunes} == {7.0}
    rows = list(csv.DictReader(path.open()))
    assert [row["kind"] for row in rows] == ["start"] + ["sample"] * 5 + ["best"]
    best = rows[-1]
    assert [int(best["fusion_threshold"]), float(best["cycle_time_ms"]),
            int(best["ring_threshold"])] == pytest.approx(retunes[-1][3:6])
    assert ranks[0]["applied"] == pytest.approx(retunes[-1][3:6])
    assert "To pin it: MPIDDP_FUSION_THRESHOLD=" in result.output
