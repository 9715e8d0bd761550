"""Adasum in float64 NumPy, written from its definition (Maleki et al., 2021; Horovod's
``op=Adasum``), independent of mpiddp's code: the reference the Adasum checks compare with.

    pair(a, b) = a (1 - a.b / (2 |a|^2)) + b (1 - a.b / (2 |b|^2)),

a coefficient 1 where its squared norm is below sqrt(DBL_MIN), per tensor. Ranks combine as
a tree: neighbours first, ((r0 + r1) + (r2 + r3)) ...; with N ranks not a power of two and P
the power of two below, the first 2 (N - P) ranks are paired first (rank 2i with 2i + 1),
the rest enter the tree as they are.
"""
import math
import sys

import numpy as np

FLOOR = math.sqrt(sys.float_info.min)


def pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    ab, aa, bb = float(a @ b), float(a @ a), float(b @ b)
    ca = 1.0 - ab / (2 * aa) if aa >= FLOOR else 1.0
    cb = 1.0 - ab / (2 * bb) if bb >= FLOOR else 1.0
    return ca * a + cb * b


def adasum(vectors: list) -> np.ndarray:
    """The Adasum of one tensor's float64 values on every rank (``vectors[r]``: rank r's)."""
    vectors = [np.asarray(v, dtype=np.float64).ravel() for v in vectors]
    size = len(vectors)
    pof2 = 1 << (size.bit_length() - 1)
    extra = size - pof2
    level = [pair(vectors[2 * i], vectors[2 * i + 1]) for i in range(extra)] + \
        vectors[2 * extra:]
    while len(level) > 1:
        level = [pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def node_average_adasum(vectors: list, local_size: int) -> np.ndarray:
    """The hierarchical form: Adasum across nodes of each node's average (ranks numbered
    node by node, ``local_size`` to a node)."""
    nodes = [np.mean(np.stack(vectors[n:n + local_size]), axis=0)
             for n in range(0, len(vectors), local_size)]
    return adasum(nodes)
