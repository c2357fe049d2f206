"""The per-row sampling parameters packed in bulk (issue 45, item 5): a column at a time and
seeds drawn at once, equal to packing them a row at a time."""

from __future__ import annotations

import struct

import torch

from logitserve.kernels.sampling.params import SEED_BITS
from logitserve.server.ops.sample_params import draw_seeds, param_rows


def _row_by_row(columns: list, rows: int, code: str) -> bytes:
    """The packing param_rows replaced: each row's values in turn, by struct."""
    per_row = zip(*(c if type(c) is list else (c,) * rows for c in columns))
    values = [v for row in per_row for v in row]
    return struct.pack(f"<{len(values)}{code}", *values)


def test_float_columns_round_to_float32_as_struct_does():
    rows = 5
    columns = [0.7, [0.1, 1 / 3, 3.4e38, 1e-45, 2.0 ** -149 * 1.5], 0.0, [1.0, 0.9999999999, 5e-324, 1e-40, 7.25]]
    got = param_rows(columns, rows, torch.float32)
    assert got.shape == (rows, 4) and got.dtype == torch.float32
    assert bytes(got.data) == _row_by_row(columns, rows, "f")


def test_int_columns_keep_every_bit():
    rows = 4
    columns = [[2**62 + 1, 0, 2**63 - 1, 17], 50, [0, 1, 2, 3]]
    got = param_rows(columns, rows, torch.int64)
    assert bytes(got.data) == _row_by_row(columns, rows, "q")


def test_scalar_columns_alone():
    assert bytes(param_rows([1, 2], 3, torch.int64).data) == _row_by_row([1, 2], 3, "q")


def test_seeds_are_seed_bits_wide_and_random():
    seeds = draw_seeds(4096)
    assert len(seeds) == 4096 and all(type(s) is int and 0 <= s < 2**SEED_BITS for s in seeds)
    assert len(set(seeds)) == 4096
    # Every bit of the width is used: the top bit is set in about half of them.
    assert 1700 < sum(s >> (SEED_BITS - 1) for s in seeds) < 2400
    assert draw_seeds(0) == []
