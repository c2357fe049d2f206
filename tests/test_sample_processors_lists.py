"""The processors' list kernel on awkward lists, as the CUDA path takes them (no host check):
duplicates within and across lists, ids outside [0, V), offsets that break their rules (clamped
into the ids, never read out of bounds), empty lists and rows without lists, -inf / NaN logits, a
non-finite bias on a masked token, odd and tiny vocabularies. Each against
``reference/processors.py`` on the lists the kernel's rules make of the inputs.
"""

from __future__ import annotations

import pytest
import torch

from logitserve.kernels.reference.processors import process as reference_process
from logitserve.kernels.sampling.processors import Processors, process_logits
from test_sample_processors import bitmask, ragged

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def unchecked(**fields) -> Processors:
    """Processors built directly, as ``Processors.of`` leaves CUDA inputs: unchecked."""
    procs = Processors()
    for name, value in fields.items():
        setattr(procs, name, value)
    return procs


def kernel_lists(ids: list, offsets: list, n_cols: int) -> list:
    """Each row's list as the kernel reads it: the span clamped into the ids, bad ids dropped."""
    rows = []
    for r in range(len(offsets) - 1):
        lo = min(max(offsets[r], 0), len(ids))
        hi = min(max(offsets[r + 1], lo), len(ids))
        rows.append([t for t in ids[lo:hi] if 0 <= t < n_cols])
    return rows


def assert_processed(x, procs, want_procs):
    got = process_logits(x, procs, backend="interpret").double()
    want = reference_process(x, want_procs)
    assert torch.equal(torch.isinf(got) & (got < 0), torch.isinf(want) & (want < 0))
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-6, atol=1e-5)


def test_duplicates_within_and_across_lists(gen):
    x = torch.randn(3, 50, generator=gen) * 3
    prompt = ragged([[4, 4, 9, 4], [], [1, 2, 3]])
    output = ragged([[4, 9, 9, 9, 11], [7, 7], []])
    b_ids, b_off = ragged([[9, 4, 9, 30], [7, 8, 7], [2, 2, 2]])
    bias = (b_ids, b_off, torch.tensor([1.5, -0.5, 2.25, 3.0, -1.0, 0.5, 4.0, 0.125, -2.0, 0.75]))
    kw = dict(repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=-0.4, prompt=prompt, output=output,
              logit_bias=bias, grammar_bitmask=bitmask([range(0, 50, 2), range(50), range(1, 50)], 50))
    assert_processed(x, unchecked(**kw), unchecked(**kw))


def test_ids_outside_the_vocabulary_are_skipped(gen):
    v = 40
    x = torch.randn(2, v, generator=gen)
    lists = dict(prompt=[[-1, 3, v], [5]], output=[[3, v + 7, -9, 3], [2 ** 40, 6]], banned=[[v, 8], [-2]],
                 allowed=[[1, 3, 8, v, 12], [5, 6, -1, 7]])
    given = {name: ragged(rows) for name, rows in lists.items()}
    kept = {name: ragged([[t for t in row if 0 <= t < v] for row in rows]) for name, rows in lists.items()}
    b_given, b_kept = ragged([[v, 3, -4], [6]]), ragged([[3], [6]])
    pen = dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25)
    assert_processed(x, unchecked(**pen, **given, logit_bias=(*b_given, torch.tensor([9.0, 1.0, 9.0, -2.0]))),
                     unchecked(**pen, **kept, logit_bias=(*b_kept, torch.tensor([1.0, -2.0]))))


@pytest.mark.parametrize("offsets", [[0, 5, 3, 100], [-4, 2, 2, 1], [0, 0, 0, 0], [9, 9, 9, 9]])
def test_broken_offsets_are_clamped_into_the_ids(offsets, gen):
    v = 30
    x = torch.randn(3, v, generator=gen)
    ids = [3, 7, 7, 12, 3, 29]
    given = (torch.tensor(ids), torch.tensor(offsets))
    kept = ragged(kernel_lists(ids, offsets, v))
    pen = dict(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.5)
    assert_processed(x, unchecked(**pen, output=given, prompt=given, banned=given),
                     unchecked(**pen, output=kept, prompt=kept, banned=kept))
    values = torch.arange(len(ids), dtype=torch.float32)
    rows = [[i for i in range(min(max(offsets[r], 0), len(ids)), min(max(offsets[r + 1], max(offsets[r], 0)),
                                                                        len(ids)))] for r in range(3)]
    kept_values = torch.tensor([float(i) for row in rows for i in row])
    assert_processed(x, unchecked(logit_bias=(*given, values)),
                     unchecked(logit_bias=(*ragged([[ids[i] for i in row] for row in rows]), kept_values)))


def test_empty_lists_and_rows_without_lists(gen):
    x = torch.randn(4, 33, generator=gen)
    empty = ragged([[], [], [], []])
    kw = dict(repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=1.0, prompt=empty,
              output=ragged([[], [1, 1], [], []]), logit_bias=(*empty, torch.zeros(0)), banned=empty)
    assert_processed(x, unchecked(**kw), unchecked(**kw))
    # An empty allowed list masks the whole row.
    procs = unchecked(allowed=ragged([[], [4], [], [0, 32]]))
    assert_processed(x, procs, procs)


def test_non_finite_logits_and_bias_on_masked_tokens(gen):
    v = 37
    x = torch.randn(2, v, generator=gen)
    x[0, [1, 2]] = float("-inf")
    x[0, 3] = float("nan")
    x[1, 5] = float("inf")
    grammar = bitmask([[t for t in range(v) if t != 10], [t for t in range(v) if t != 11]], v)
    output = ragged([[1, 2, 3, 10, 10], [5, 11, 11]])
    pen = dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5, output=output,
               grammar_bitmask=grammar)
    # Finite biases on every listed token: -inf stays -inf, NaN stays NaN, +inf stays +inf.
    bias = (*ragged([[1, 3, 10], [5, 11]]), torch.tensor([4.0, 1.0, 2.0, -1.0, 3.0]))
    assert_processed(x, unchecked(**pen, logit_bias=bias), unchecked(**pen, logit_bias=bias))
    # A +inf or NaN bias (CUDA values are not checked) cannot bring a masked token back.
    bad = (*ragged([[10, 10], [11]]), torch.tensor([float("inf"), float("nan"), float("inf")]))
    got = process_logits(x, unchecked(**pen, logit_bias=bad), backend="interpret")
    assert got[0, 10] == float("-inf") and got[1, 11] == float("-inf")


@pytest.mark.parametrize("n_cols", [1, 31, 32, 33, 4097])
def test_odd_vocabularies_one_row(n_cols, gen):
    x = torch.randn(1, n_cols, generator=gen) * 2
    lists = [[t % n_cols for t in (0, 5, 5, 31, 32, 4096)]]
    kw = dict(repetition_penalty=0.8, frequency_penalty=-1.0, presence_penalty=2.0, prompt=ragged(lists),
              output=ragged(lists), logit_bias=(*ragged(lists), torch.linspace(-1, 1, 6)),
              grammar_bitmask=bitmask([range(0, n_cols, 3)], n_cols), banned=ragged([[n_cols - 1]]))
    assert_processed(x, unchecked(**kw), unchecked(**kw))
