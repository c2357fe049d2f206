"""The processors' list table (issue 33): each row's lists held by address, as a server keeps its
sequences' lists, give the processed logits the ragged lists give, and ``append_tokens`` stores
each drawn token after its row's output. The Triton kernels, interpreted here (on the GPU:
tests/test_sequences_cuda.py).
"""

from __future__ import annotations

import pytest
import torch

from logitserve.kernels.sampling.process_kernels import TABLE_COLUMNS
from logitserve.kernels import sample
from logitserve.kernels.sampling.processors import ListTable, Processors, append_tokens, process_logits
from test_sample_processors import features, procs_of, ragged

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")

# process_kernels.py's columns, by list: (address, length) pairs, then bias values, min_tokens, capacity.
COLUMNS = {"prompt": 0, "output": 2, "logit_bias": 4, "banned": 7, "stop": 9}


def split(ids, offsets):
    """A ragged list as one int64 tensor a row (each its own allocation, as a sequence's are)."""
    return [ids[offsets[r]:offsets[r + 1]].to(torch.int64).clone() for r in range(offsets.shape[0] - 1)]


def table_of(kw, n_rows, capacity_extra=0):
    """``kw``'s lists (test_sample_processors.features) as per-row tensors and their list table;
    the tensors are returned too (the table holds only their addresses)."""
    rows = torch.zeros(n_rows, TABLE_COLUMNS.value, dtype=torch.int64)
    held = []
    for name, (ids_key, off_key) in {"prompt": ("prompt_token_ids", "prompt_offsets"),
                                     "output": ("output_token_ids", "output_offsets"),
                                     "logit_bias": ("logit_bias_ids", "logit_bias_offsets"),
                                     "banned": ("banned_token_ids", "banned_offsets"),
                                     "stop": ("stop_token_ids", "stop_offsets")}.items():
        parts = split(kw[ids_key], kw[off_key])
        for r, part in enumerate(parts):
            if name == "output":  # room to append
                part = torch.cat([part, torch.full((capacity_extra,), -7, dtype=torch.int64)])
            held.append(part)
            rows[r, COLUMNS[name]] = part.data_ptr()
            rows[r, COLUMNS[name] + 1] = part.shape[0] - (capacity_extra if name == "output" else 0)
            if name == "output":
                rows[r, 12] = part.shape[0]
    values = split(kw["logit_bias_values"].view(torch.int32), kw["logit_bias_offsets"])
    for r, v in enumerate(values):
        v = v.to(torch.int32).view(torch.float32).clone()
        held.append(v)
        rows[r, 6] = v.data_ptr()
    rows[:, 11] = kw["min_tokens"]
    return rows, held


def test_table_gives_the_ragged_lists_processed_logits(gen):
    n_rows, n_cols = 5, 300
    x = torch.randn(n_rows, n_cols, generator=gen) * 3
    kw = features(n_rows, n_cols, gen)
    want = process_logits(x, procs_of(x, **kw), backend="interpret")
    rows, held = table_of(kw, n_rows)
    procs = Processors(repetition_penalty=kw["repetition_penalty"], frequency_penalty=kw["frequency_penalty"],
                       presence_penalty=kw["presence_penalty"], grammar_bitmask=kw["grammar_bitmask"],
                       table=ListTable(rows, frozenset(COLUMNS)))
    got = process_logits(x, procs, backend="interpret")
    assert torch.equal(got, want)
    # Lists the table does not name are not read: without the bias, the bias is off.
    no_bias = {k: v for k, v in kw.items() if not k.startswith("logit_bias")}
    want = process_logits(x, procs_of(x, **no_bias), backend="interpret")
    procs.table = ListTable(rows, frozenset(COLUMNS) - {"logit_bias"})
    assert torch.equal(process_logits(x, procs, backend="interpret"), want)


def test_sample_takes_a_list_table(gen):
    n_rows, n_cols = 4, 200
    x = torch.randn(n_rows, n_cols, generator=gen) * 3
    kw = features(n_rows, n_cols, gen)
    rows, held = table_of(kw, n_rows)
    common = dict(seed=torch.arange(n_rows) + 5, step=3, top_k=30, repetition_penalty=kw["repetition_penalty"],
                  frequency_penalty=kw["frequency_penalty"], presence_penalty=kw["presence_penalty"],
                  grammar_bitmask=kw["grammar_bitmask"], logprobs=2, backend="interpret")
    lists = {k: v for k, v in kw.items() if k not in common}
    want_tokens, want_lp = sample(x, **common, **lists)
    got_tokens, got_lp = sample(x, **common, list_table=ListTable(rows, frozenset(COLUMNS)))
    assert torch.equal(got_tokens, want_tokens)
    assert torch.equal(got_lp.token_logprobs, want_lp.token_logprobs)  # raw: of the logits as given
    with pytest.raises(ValueError, match="must not also be given ragged"):
        sample(x, **common, list_table=ListTable(rows, frozenset(COLUMNS)), banned_token_ids=lists["banned_token_ids"],
               banned_offsets=lists["banned_offsets"])
    with pytest.raises(ValueError, match="min_tokens: unset with list_table"):
        sample(x, **common, list_table=ListTable(rows, frozenset(COLUMNS)), min_tokens=2)


def test_table_is_refused_by_the_torch_backend(gen):
    rows = torch.zeros(1, TABLE_COLUMNS.value, dtype=torch.int64)
    procs = Processors(banned=None, table=ListTable(rows, frozenset({"banned"})))
    with pytest.raises(ValueError, match="Triton kernels only"):
        process_logits(torch.zeros(1, 8), procs, backend="torch")


def test_list_table_layout_is_checked():
    with pytest.raises(ValueError, match="contiguous int64"):
        ListTable(torch.zeros(2, 5, dtype=torch.int64), frozenset())
    with pytest.raises(ValueError, match="holds lists of"):
        ListTable(torch.zeros(2, TABLE_COLUMNS.value, dtype=torch.int64), frozenset({"allowed"}))


def test_append_stores_each_drawn_token_after_its_output():
    ids, offsets = ragged([[1, 2], [], [3], [4, 5, 6]])
    kw = {"output_token_ids": ids, "output_offsets": offsets}
    for name in ("prompt", "logit_bias", "banned", "stop"):
        kw[f"{name}_token_ids" if name != "logit_bias" else "logit_bias_ids"] = torch.zeros(0, dtype=torch.int64)
        kw[f"{name}_offsets"] = torch.zeros(5, dtype=torch.int64)
    kw["logit_bias_values"] = torch.zeros(0)
    kw["min_tokens"] = torch.zeros(4, dtype=torch.int64)
    rows, held = table_of(kw, 4, capacity_extra=1)
    outputs = held[4:8]
    rows[3, 3] = 4  # row 3 is full: its token does not fit
    append_tokens(ListTable(rows, frozenset({"output"})), torch.tensor([9, 8, -1, 7]), backend="interpret")
    assert [o.tolist() for o in outputs] == [[1, 2, 9], [8], [3, -7], [4, 5, 6, -7]]
