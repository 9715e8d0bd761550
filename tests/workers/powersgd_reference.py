"""PowerSGD in one process, in float64 NumPy, written from the paper (Vogels, Karimireddy and
Jaggi 2019, Algorithm 1 with error feedback and warm start), simulating every rank.

Given each rank's local gradients of a step it returns what every rank's ``param.grad``
must hold after the reduction, and keeps each rank's error buffer and the warm-started Q, so
that a test can compare all three after every step. Per matrix (a gradient viewed as
``shape[0]`` x the rest, compressed where ``(n + m) r * min_compression_rate < n m``)::

    M_i = g_i + e_i
    P = mean_i(M_i Q)                 Q: last step's (warm start) or the seeded draw
    P = orthogonalize(P)              Gram-Schmidt
    Q = mean_i(M_i^T P)
    grad = P Q^T,  e_i = M_i - P Q^T,  memory Q = Q

The paper multiplies by the warm Q as it is; mpiddp (like torch's hook) orthogonalizes it
first. With ``orthogonalization_epsilon`` 0, Gram-Schmidt of P is the same either way
(orthogonalizing Q multiplies P on the right by an upper-triangular matrix with a positive
diagonal, which Gram-Schmidt undoes), so this reference multiplies as the paper does and checks
that too; with an epsilon the result depends slightly on P's scale, and the reference
orthogonalizes Q first, as the definition mpiddp follows (torch's) does. Only the seeded
draw of the first Q is shared with the code under test (``initial_q``): it is part of the
definition (the same on every rank).

Tensors that are not compressed, and every tensor before ``start_step``, are averaged. A
parameter no rank has a gradient for gets none and its memories stay. A non-finite P or Q
leaves the memories as they were.
"""
from __future__ import annotations

import numpy as np
import torch

from mpiddp.torch.gradients.powersgd import initial_q


def gram_schmidt(matrix: np.ndarray, epsilon: float = 0.0) -> np.ndarray:
    """Orthonormal columns, in order: each column minus its projections on the earlier ones,
    divided by its norm (+ epsilon). Where that left less than half of the column's length
    the projections are removed once more (mpiddp's rule against a rank-deficient P; in
    exact arithmetic, with epsilon 0, the second pass changes nothing)."""
    out = np.array(matrix, dtype=np.float64)
    for j in range(out.shape[1]):
        v = out[:, j].copy()
        length = np.linalg.norm(v)
        for attempt in range(2):
            for k in range(j):
                v -= (out[:, k] @ v) * out[:, k]
            if j == 0 or np.linalg.norm(v) >= 0.5 * length:
                break
        norm = np.linalg.norm(v)
        out[:, j] = v / (norm + epsilon) if (epsilon or norm > 0) else v
    return out


def matrix_rank(shape, rank: int, min_compression_rate: float) -> int:
    if len(shape) < 2:
        return 0
    n, m = shape[0], int(np.prod(shape[1:]))
    r = min(n, m, rank)
    return r if (n + m) * r * min_compression_rate < n * m else 0


class Reference:
    """Every rank's PowerSGD state, stepped with every rank's gradients."""

    def __init__(self, shapes: dict, size: int, rank: int = 1, start_step: int = 1000,
                 min_compression_rate: float = 2, warm_start: bool = True,
                 error_feedback: bool = True, orthogonalization_epsilon: float = 0.0,
                 seed: int = 0):
        self.shapes, self.size = dict(shapes), size
        self.rank, self.start_step = rank, start_step
        self.min_compression_rate = min_compression_rate
        self.warm_start, self.error_feedback = warm_start, error_feedback
        self.epsilon, self.seed = orthogonalization_epsilon, seed
        self.steps = 0
        self.q: dict = {}
        self.errors: dict = {}          # name -> [each rank's error]

    def compressed(self, name: str) -> int:
        return matrix_rank(self.shapes[name], self.rank, self.min_compression_rate)

    def reset_errors(self) -> None:
        self.errors = {}

    def step(self, grads: list) -> dict:
        """``grads``: per rank, {name: ndarray or None}. Returns {name: the averaged
        gradient, or None}."""
        assert len(grads) == self.size
        result = {}
        for name, shape in self.shapes.items():
            local = [g.get(name) for g in grads]
            if all(g is None for g in local):
                result[name] = None
                continue
            local = [np.zeros(shape) if g is None else np.asarray(g, dtype=np.float64)
                     for g in local]
            r = self.compressed(name)
            if not r or self.steps < self.start_step:
                result[name] = sum(local) / self.size
                continue
            n, m = shape[0], int(np.prod(shape[1:]))
            errors = self.errors.get(name) or [np.zeros((n, m)) for _ in range(self.size)]
            ms = [g.reshape(n, m) + (e if self.error_feedback else 0)
                  for g, e in zip(local, errors)]
            q = self.q.get(name) if self.warm_start else None
            if q is None or q.shape != (m, r):
                q = initial_q(self.seed, name, self.steps, m, r, torch.float64, "cpu").numpy()
            if self.epsilon:
                # torch's (and mpiddp's) form: the epsilon makes Gram-Schmidt depend a little
                # on P's scale, so the Q it starts from must be orthonormal as theirs is
                q = gram_schmidt(q, self.epsilon)
            p = sum(mi @ q for mi in ms) / self.size
            p = gram_schmidt(p, self.epsilon)
            q = sum(mi.T @ p for mi in ms) / self.size
            approx = p @ q.T
            if np.isfinite(p).all() and np.isfinite(q).all():
                if self.warm_start:
                    self.q[name] = q
                if self.error_feedback:
                    self.errors[name] = [mi - approx for mi in ms]
            result[name] = approx.reshape(shape)
        self.steps += 1
        return result
