"""``Compression.powersgd`` (docs/powersgd.md): the math in one process against NumPy and
torch's own hook, the settings' checks, and one launch per rank count (2, 3, 4) of
tests/workers/powersgd_worker.py, which compares every step with the float64 reference of the
paper that simulates every rank (tests/workers/powersgd_reference.py), and one launch of
tests/workers/powersgd_ddp_worker.py, which trains alongside torch's DDP hook (gloo)."""
import sys

import numpy as np
import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_hook

import mpiddp
from mpiddp.torch.gradients.powersgd import orthogonalize_
from mpi_launch import WORKERS, assert_ok, run_mpi

sys.path.insert(0, str(WORKERS))
from powersgd_reference import gram_schmidt, matrix_rank  # noqa: E402


@pytest.mark.parametrize("epsilon", [0.0, 1e-3])
@pytest.mark.parametrize("shape", [(7, 1), (9, 3), (40, 4), (5, 5)])
def test_orthogonalization_matches_numpy_and_torchs_hook(shape, epsilon):
    if epsilon and shape[0] == shape[1]:
        pytest.skip("square: projections shrink the last columns below half (the second "
                    "pass), where torch's single pass with an epsilon is far from orthogonal")
    g = torch.Generator().manual_seed(shape[0] * 10 + shape[1])
    matrix = torch.randn(*shape, generator=g, dtype=torch.float64)
    ours = orthogonalize_(matrix.clone(), epsilon)
    theirs = matrix.clone().unsqueeze(0)
    torch_hook._orthogonalize_gram_schmidt(theirs, epsilon=epsilon)
    # (With an epsilon, a column that the projections shrink below half its length is
    # projected twice here, once there: they differ by about epsilon.)
    assert torch.allclose(ours, theirs[0], rtol=1e-12, atol=1e-12 + 10 * epsilon)
    assert np.allclose(ours.numpy(), gram_schmidt(matrix.numpy(), epsilon), rtol=1e-10,
                       atol=1e-12)
    if epsilon == 0:
        q, r = np.linalg.qr(matrix.numpy())
        assert np.allclose(ours.numpy(), q * np.sign(np.diag(r)), atol=1e-10)


def test_a_rank_deficient_p_still_gives_the_best_approximation():
    """A gradient of rank k < r (a batch smaller than r) makes P = MQ rank-deficient: one
    Gram-Schmidt pass (torch's) leaves the extra columns pointing along the first ones, and
    P P^T M then counts that part twice; the second pass keeps the result exact."""
    g = torch.Generator().manual_seed(0)
    worst_ours = worst_torch = 0.0
    for trial in range(40):
        k = 1 + trial % 2
        m = torch.randn(40, k, generator=g) @ torch.randn(k, 96, generator=g)
        p = m @ orthogonalize_(torch.randn(96, 3, generator=g), 0.0)
        ours = orthogonalize_(p.clone(), 0.0)
        theirs = p.clone().unsqueeze(0)
        torch_hook._orthogonalize_gram_schmidt(theirs)
        for basis, which in ((ours, "ours"), (theirs[0], "torch")):
            error = float((basis @ (basis.t() @ m) - m).norm() / m.norm())
            if which == "ours":
                worst_ours = max(worst_ours, error)
            else:
                worst_torch = max(worst_torch, error)
    assert worst_ours < 1e-5, worst_ours
    assert worst_torch > 0.1, worst_torch      # what the second pass is for


def test_a_zero_column_stays_zero_instead_of_nan():
    matrix = torch.randn(6, 3, dtype=torch.float64)
    matrix[:, 1] = 0
    out = orthogonalize_(matrix, 0.0)
    assert torch.isfinite(out).all() and not out[:, 1].any()


@pytest.mark.parametrize("rank", [1, 2, 4])
@pytest.mark.parametrize("rate", [0.5, 2, 3.5])
def test_which_tensors_are_compressed_is_torchs_rule(rank, rate):
    settings = mpiddp.Compression.powersgd(rank=rank, min_compression_rate=rate)
    for shape in [(10,), (3, 3), (3, 40), (40, 3), (64, 64), (6, 3, 3, 3), (1, 100),
                  (0, 5), (16, 8, 1, 1)]:
        n = shape[0]
        m = int(np.prod(shape[1:]))
        r = min(n, m, rank)
        want = r if len(shape) > 1 and torch_hook._should_compress(n, m, r, rate)[0] else 0
        assert settings.matrix_rank(torch.Size(shape)) == want, shape
        assert matrix_rank(shape, rank, rate) == want, shape


@pytest.mark.parametrize("bad", [dict(rank=0), dict(rank=2.0), dict(rank=True),
                                 dict(start_step=-1), dict(min_compression_rate=0),
                                 dict(min_compression_rate=float("nan")),
                                 dict(warm_start="yes"), dict(error_feedback=None),
                                 dict(orthogonalization_epsilon=-1e-8), dict(seed=1.5)])
def test_bad_settings_are_refused_when_made(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        mpiddp.Compression.powersgd(**bad)


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_matches_the_reference_of_the_paper_at_every_step(ranks):
    result = run_mpi("powersgd_worker.py", ranks, timeout=240)
    assert_ok(result, expect_lines=5 + (ranks >= 3))


def test_follows_torchs_ddp_hook_from_the_same_first_q():
    result = run_mpi("powersgd_ddp_worker.py", 2, timeout=180)
    assert_ok(result, expect_lines=2)       # rank 2 (torch: Gram-Schmidt) and 3 (QR)


def test_elastic_state_keeps_steps_and_q_and_resets_errors_at_another_rank_count(tmp_path):
    """elastic.State (docs/powersgd.md "Checkpoints and restarts"): 3 ranks commit snapshots
    and restore one in process, then 2 ranks restore the last: each time every rank gets the
    committed PowerSGD step count and every Q bitwise, with no error buffer, and the next steps
    match the float64 reference started from that Q and zero errors
    (tests/workers/powersgd_elastic_worker.py)."""
    from mpi_launch import reported

    first = run_mpi("powersgd_elastic_worker.py", 3, tmp_path, "first", timeout=90)
    assert_ok(first, expect_lines=2)
    in_process = reported(first, "restored in process")[0]
    assert in_process["steps"] == 4 and in_process["q"] == ["0.weight", "2.weight"], in_process
    assert reported(first, "reference matched")[0]["committed"] == 6
    second = run_mpi("powersgd_elastic_worker.py", 2, tmp_path, "second", timeout=90)
    assert_ok(second, expect_lines=2)
    restored = reported(second, "restored at 2 ranks")[0]
    assert restored["step"] == 6 and restored["steps"] == 6, restored
    finished = reported(second, "end of the epoch")[0]
    assert finished["steps_trained"] == 4 and finished["step"] == 10, finished
