"""sample's torch (CPU) reference after its fast paths (greedy rows answered from one max a row,
no sort without top-k or top-p, the noise hash multiplied in int64): the hash is exactly
murmur3's fmix32, and invalid rows come from the row max as documented. Its speed is
bench/cpu_sample.py's to measure, not a test's; the draws are pinned by the other
test_sample_* files.
"""

from __future__ import annotations

import random

import pytest
import torch

from logitserve.kernels import sample
from logitserve.kernels.reference import sample as reference

VOCAB = 32000


def test_the_hash_is_murmur3_fmix32_exactly():
    # fmix32 multiplies in int64 and lets the product wrap (its low 32 bits stay exact): checked
    # against Python's integers over edge values and an odd length (the vector loops' tails).
    def fmix32(h: int) -> int:
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & 0xFFFFFFFF
        return h ^ (h >> 16)

    rng = random.Random(0)
    values = [0, 1, 0xFFFF, 0x10000, 2**31 - 1, 2**31, 2**32 - 1] + [rng.getrandbits(32) for _ in range(4093)]
    given = torch.tensor(values, dtype=torch.int64)
    assert reference.fmix32(given).tolist() == [fmix32(v) for v in values]
    assert given.tolist() == values  # the argument is left as it was


@pytest.mark.parametrize("where", [0, 7, 17, VOCAB - 1])
def test_invalid_rows_from_the_row_max(where):
    # The invalid rows come from one max a row (NaN wherever a NaN is); a +inf max reads its row
    # again for a finite value.
    x = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(2))
    x[0, where] = float("nan")
    x[1] = float("-inf")
    x[2] = float("inf")
    x[3] = float("-inf")
    x[3, where] = float("inf")  # +inf and -inf only: no finite logit
    x[4, where] = float("inf")  # +inf beside finite logits: the +inf token
    for kw in (dict(temperature=0.0), dict(seed=5), dict(seed=5, top_k=40, top_p=0.9)):
        assert sample(x, backend="torch", **kw)[:5].tolist() == [-1, -1, -1, -1, where], kw
