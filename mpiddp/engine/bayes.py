"""Bayesian optimisation for autotune: a Gaussian process over the unit cube and the
expected improvement of a candidate, in NumPy.

Why not a library: the search has at most four dimensions and a few dozen samples, so the
process is a Cholesky factorisation of a matrix of that size; scikit-learn's
``GaussianProcessRegressor`` would do the same sum but brings SciPy, joblib and
threadpoolctl into every training job for it (``tests/test_autotune.py`` checks this
process against scikit-learn's where the dev environment has it). The kernel's length scale
and the noise are picked from a small grid by the marginal likelihood (no gradient search),
and the expected improvement is maximised over seeded random candidates, so the same samples
always give the same proposal.

Points are vectors in [0, 1]^d. Categorical dimensions are coded as values in [0, 1] too
(0 and 1 for a switch) and are never sampled at random: ``propose`` enumerates their
combinations and searches the continuous dimensions for each.
"""
from __future__ import annotations

import itertools
import math

import numpy as np

# The grid the kernel's hyperparameters are chosen from (scores normalised to mean 0, std 1).
LENGTH_SCALES = (0.1, 0.2, 0.35, 0.6, 1.0)
NOISES = (1e-3, 0.03, 0.1, 0.3)
# Candidates per combination of categorical values: uniform ones and ones near the best.
RANDOM_CANDIDATES = 1000
LOCAL_CANDIDATES = 200
LOCAL_SPREAD = 0.08
EXPLORATION = 0.01      # xi of the expected improvement (in normalised score units)


def matern52(a: np.ndarray, b: np.ndarray, length_scale: float) -> np.ndarray:
    """The Matern 5/2 kernel (unit variance) between the rows of ``a`` and of ``b``."""
    d = np.sqrt(np.maximum(((a[:, None, :] - b[None, :, :]) ** 2).sum(-1), 0.0))
    r = math.sqrt(5.0) * d / length_scale
    return (1.0 + r + r * r / 3.0) * np.exp(-r)


class GaussianProcess:
    """A Gaussian process with the Matern 5/2 kernel, fitted to (points, scores): scores are
    normalised, ``noise`` is added to the diagonal (the samples' variance, normalised)."""

    def __init__(self, length_scale: float, noise: float):
        self.length_scale, self.noise = length_scale, noise

    def fit(self, x: np.ndarray, y: np.ndarray) -> "GaussianProcess":
        self.x = np.asarray(x, float)
        y = np.asarray(y, float)
        self.mean = y.mean()
        self.scale = y.std() or 1.0
        self.z = (y - self.mean) / self.scale
        k = matern52(self.x, self.x, self.length_scale) + self.noise * np.eye(len(self.x))
        self.chol = np.linalg.cholesky(k)
        self.alpha = np.linalg.solve(self.chol.T, np.linalg.solve(self.chol, self.z))
        return self

    def log_marginal_likelihood(self) -> float:
        """Of the normalised scores (the fit's quality, to choose hyperparameters by)."""
        return float(-0.5 * self.z @ self.alpha - np.log(np.diag(self.chol)).sum()
                     - 0.5 * len(self.z) * math.log(2 * math.pi))

    def predict(self, points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Posterior mean and standard deviation of the score (noise-free) at ``points``."""
        ks = matern52(np.asarray(points, float), self.x, self.length_scale)
        mean = ks @ self.alpha
        v = np.linalg.solve(self.chol, ks.T)
        var = np.maximum(1.0 - (v * v).sum(0), 1e-12)
        return self.mean + self.scale * mean, self.scale * np.sqrt(var)


def fit_process(x, y) -> GaussianProcess:
    """The process whose hyperparameters (from the grid) explain the scores best."""
    fits = [GaussianProcess(length, noise).fit(x, y)
            for length in LENGTH_SCALES for noise in NOISES]
    return max(fits, key=lambda gp: gp.log_marginal_likelihood())


def _normal_pdf(z):
    return np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


def _normal_cdf(z):
    return 0.5 * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0)))


def expected_improvement(mean, std, best: float, scale: float,
                         xi: float = EXPLORATION) -> np.ndarray:
    """How much a candidate is expected to beat ``best`` (maximising); ``xi`` in units of
    ``scale`` (the scores' spread) asks for a little more than a tie."""
    improvement = mean - best - xi * scale
    z = improvement / std
    return improvement * _normal_cdf(z) + std * _normal_pdf(z)


def propose(x, y, continuous: int, categories: list, rng: np.random.Generator) -> np.ndarray:
    """The next point to sample, given the samples so far (``x``: points, ``y``: scores to
    maximise). A point holds ``continuous`` coordinates in [0, 1], then one per entry of
    ``categories`` (each the tuple of its allowed codes)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    gp = fit_process(x, y)
    best = int(np.argmax(y))
    tried = []
    for combination in itertools.product(*categories) if categories else [()]:
        uniform = rng.random((RANDOM_CANDIDATES, continuous))
        near = x[best, :continuous] + LOCAL_SPREAD * rng.standard_normal(
            (LOCAL_CANDIDATES, continuous))
        candidates = np.clip(np.vstack([uniform, near]), 0.0, 1.0)
        fixed = np.tile(np.asarray(combination, float), (len(candidates), 1))
        tried.append(np.hstack([candidates, fixed]))
    candidates = np.vstack(tried)
    mean, std = gp.predict(candidates)
    ei = expected_improvement(mean, std, float(y.max()), gp.scale)
    return candidates[int(np.argmax(ei))]


def best_sampled(x, y) -> int:
    """The index of the sample the process believes best: the highest posterior mean among
    the sampled points (one lucky window does not win over a consistently good setting)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(y) < 3:
        return int(np.argmax(y))
    mean, _ = fit_process(x, y).predict(x)
    return int(np.argmax(mean))


def latin_hypercube(count: int, dimensions: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` points in [0, 1]^d spread over the cube (one per row and column stratum)."""
    if dimensions == 0:
        return np.zeros((count, 0))
    strata = np.stack([rng.permutation(count) for _ in range(dimensions)], axis=1)
    return (strata + rng.random((count, dimensions))) / count
