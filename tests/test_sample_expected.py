"""An independent float64 NumPy statement of ``sample``'s semantics (DESIGN.md), and its own checks.

The other sample tests hold the kernels to these functions: ``kept_probabilities`` (the
distribution a draw must follow) and ``infinicore_random_sample`` (InfiniCore's algorithm,
sort-based and plain). Written from the specification, not from kernels/reference.
"""

from __future__ import annotations

import numpy as np
import pytest


def _descending(x: np.ndarray) -> np.ndarray:
    """Indices by descending value, ties by ascending index."""
    return np.lexsort((np.arange(len(x)), -x))


def kept_probabilities(row, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                       filter_order: str = "top_k_first") -> np.ndarray:
    """Probability of each token under the filters (0 outside the kept set), in float64."""
    x = np.asarray(row, dtype=np.float64)
    n = len(x)
    w = np.exp((x - x.max()) / temperature)
    order = _descending(x)
    kept = np.ones(n, dtype=bool)
    if 0 < top_k < n:
        kept &= x >= x[order[top_k - 1]]
    if top_p < 1:
        ref = np.where(kept, w, 0.0) if filter_order == "top_k_first" else w
        cum, boundary = 0.0, None
        for i in order:  # the token whose cumulative mass crosses top_p is kept
            cum += ref[i]
            if cum >= top_p * ref.sum():
                boundary = x[i]
                break
        kept &= x >= boundary
    kept &= w >= min_p  # p >= min_p * max(p)
    p = np.where(kept, w, 0.0)
    return p / p.sum()


def infinicore_random_sample(row, temperature: float, top_k: int, top_p: float, random_val: float,
                             with_margin: bool = False):
    """InfiniCore random_sample: descending order, cumulative softmax, threshold, first crossing.

    ``with_margin``: also return how far (in probability) the threshold lies from the nearest
    cumulative boundary: below float32 rounding, no float32 implementation decides the token.
    """
    x = np.asarray(row, dtype=np.float64)
    if temperature == 0 or top_k == 1:
        return (int(np.argmax(x)), np.inf) if with_margin else int(np.argmax(x))
    order = _descending(x)
    p = np.exp((x[order] - x.max()) / temperature)
    c = np.cumsum(p / p.sum())
    k = len(x) if top_k == 0 or top_k > len(x) else top_k
    threshold = random_val * min(top_p, c[k - 1])
    position = min(int(np.searchsorted(c, threshold, side="left")), len(x) - 1)  # first c >= threshold
    margin = min(c[position] - threshold, threshold - c[position - 1] if position else np.inf)
    return (int(order[position]), margin) if with_margin else int(order[position])


def test_kept_probabilities_by_hand():
    # p = softmax([3, 2, 1, 0]) ~ [0.644, 0.237, 0.087, 0.032]
    row = [1.0, 3.0, 0.0, 2.0]
    assert np.count_nonzero(kept_probabilities(row, 1.0, top_k=2)) == 2
    assert kept_probabilities(row, 1.0, top_p=0.5)[1] == 1.0  # 0.644 alone reaches 0.5
    assert np.flatnonzero(kept_probabilities(row, 1.0, top_p=0.7)).tolist() == [1, 3]  # 0.644 + 0.237 crosses 0.7
    # top_k_first renormalises over {3, 2}: 0.731 reaches 0.7 alone; joint: 0.644 does not.
    assert np.flatnonzero(kept_probabilities(row, 1.0, top_k=2, top_p=0.7)).tolist() == [1]
    assert np.flatnonzero(kept_probabilities(row, 1.0, top_k=2, top_p=0.7, filter_order="joint")).tolist() == [1, 3]
    assert np.flatnonzero(kept_probabilities(row, 1.0, min_p=0.3)).tolist() == [1, 3]  # 0.237 / 0.644 = 0.37
    assert kept_probabilities(row, 1.0).sum() == pytest.approx(1.0)


def test_kept_probabilities_keeps_ties():
    row = [2.0, 1.0, 2.0, 1.0, 0.0]
    assert np.flatnonzero(kept_probabilities(row, 1.0, top_k=3)).tolist() == [0, 1, 2, 3]
    assert np.flatnonzero(kept_probabilities(row, 1.0, top_p=0.1)).tolist() == [0, 2]


def test_infinicore_by_hand():
    row = [1.0, 3.0, 0.0, 2.0]  # order 1, 3, 0, 2; c ~ [0.644, 0.881, 0.968, 1.0]
    assert infinicore_random_sample(row, 1.0, 0, 1.0, 0.0) == 1
    assert infinicore_random_sample(row, 1.0, 0, 1.0, 0.7) == 3
    assert infinicore_random_sample(row, 1.0, 0, 1.0, 0.99) == 2
    assert infinicore_random_sample(row, 1.0, 2, 1.0, 0.99) == 3  # threshold 0.99 * 0.881
    assert infinicore_random_sample(row, 1.0, 0, 0.5, 0.99) == 1  # threshold 0.495
    assert infinicore_random_sample(row, 0.0, 0, 1.0, 0.99) == 1
