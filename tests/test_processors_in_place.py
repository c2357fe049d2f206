"""A processors call whose lists are in CUDA regions (issue 45, item 3): one launch through a list
table computed from the offsets (server/ops/processors_in_place.py), which answers what the same
call with its lists as bytes answers (the ragged lists, eagerly), and a broken field is named as
on that path. No GPU here: a stand-in for the call's regions resolves every reference to a "CUDA"
lease viewing a CPU tensor, which reaches the call as a DeviceTensor as a client's CUDA memory
would; the Triton kernels run in the interpreter (the graph: tests/test_processors_in_place_cuda.py).
"""

from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from logitserve.client import messages
from logitserve.kernels.sampling.offsets_table import table_of_offsets
from logitserve.kernels.sampling.processors import TABLE_LISTS, Processors, process_logits
from logitserve.server.engine.device import DeviceHandle
from logitserve.server.engine.graphs import LaunchGraphs
from logitserve.server.ops import processors_in_place, sample
from logitserve.server.ops.limits import Limits
from logitserve.server.ops.sample import SampleCall
from logitserve.server.regions import CUDA
from logitserve.server.tensors import DeviceTensor
from logitserve.v1 import logitserve_pb2 as pb
from test_sample_processors import features, procs_of, ragged

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")

ROWS, VOCAB = 4, 96
IDS = {"prompt": "prompt_token_ids", "output": "output_token_ids", "logit_bias": "logit_bias_ids",
       "banned": "banned_token_ids", "stop": "stop_token_ids"}


class _Lease:
    kind, pinned = CUDA, False

    def __init__(self, view: torch.Tensor):
        self.view = view


class _DeviceRegions:
    """Each reference names one of ``tensors`` by region name (the field's own name)."""

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def resolve(self, ref, dtype, shape, name, writable=False):
        return _Lease(self.tensors[ref.region])


@pytest.fixture(scope="module")
def handle():
    h = DeviceHandle("cpu", backend="interpret")
    yield h
    h.close()


def _lists(gen) -> dict:
    """Every list kind the table holds, int64 (row 1's lists all empty), float32 bias values, a
    grammar bitmask, per-row penalties and min_tokens. Each kind has an id somewhere: one empty
    over the whole batch would be sent as its offsets alone, another call's shape."""
    kw = features(ROWS, VOCAB, gen)
    for name, ids_name in IDS.items():
        off_name = ids_name.replace("_token_ids", "_offsets").replace("_ids", "_offsets")
        ids, offsets = kw[ids_name], kw[off_name]
        rows = [ids[offsets[r]:offsets[r + 1]].tolist() if r != 1 else [] for r in range(ROWS)]
        if not any(rows):  # features() drew every row empty (a few runs in a hundred)
            rows[0] = [int(torch.randint(0, VOCAB, (), generator=gen))]
        if name == "logit_bias":
            values = [kw["logit_bias_values"][offsets[r]:offsets[r + 1]].tolist() if r != 1 else []
                      for r in range(ROWS)]
            if len(values[0]) < len(rows[0]):  # the id given above: its bias
                values[0] = [1.5]
            kw["logit_bias_values"] = torch.tensor([v for row in values for v in row], dtype=torch.float32)
        kw[ids_name], kw[off_name] = ragged(rows)
    kw["min_tokens"] = torch.tensor([0, 3, 40, 2])
    return {k: v.numpy() for k, v in kw.items()}


def _call(handle, lists: dict, in_regions: tuple[str, ...] = (), logits=None, **params) -> SampleCall:
    """The call of ``lists`` (as ``Client.sample`` sends them), the fields ``in_regions`` names
    in "CUDA regions" (the stand-in's), parsed and its host checks run as the server runs them."""
    if logits is None:
        logits = np.random.default_rng(7).standard_normal((ROWS, VOCAB)).astype(np.float32) * 3
    rows_params = {k: lists[k] for k in ("repetition_penalty", "frequency_penalty", "presence_penalty", "min_tokens")
                   if k in lists}
    tensors = {k: v for k, v in lists.items() if k not in rows_params}
    msg = messages.sample_request(logits, seed=np.arange(ROWS) + 5, step=2, top_k=30, **rows_params, **tensors,
                                  **params)
    held = {}
    for field in in_regions:
        rows_field = field if msg.HasField(field) else f"{field}_rows"
        sent = getattr(msg, rows_field)
        held[rows_field] = torch.from_numpy(np.asarray(lists[field]).copy())
        getattr(msg, rows_field).CopyFrom(pb.Tensor(dtype=sent.dtype, shape=sent.shape,
                                                    region=pb.RegionRef(region=rows_field)))

    async def parsed():
        call = SampleCall.from_pb(msg, Limits(64, 4096), regions=_DeviceRegions(held))
        await call.checked()
        return call

    return asyncio.run(parsed())


def _run(handle, call: SampleCall):
    async def run():
        return (await SampleCall.run_batch([call], handle))[0]

    return asyncio.run(run())


LIST_FIELDS = tuple(f for ids in IDS.values() for f in (ids, ids.replace("_token_ids", "_offsets")
                                                           .replace("_ids", "_offsets")))


@pytest.mark.parametrize("in_regions, params", [
    (LIST_FIELDS + ("logit_bias_values", "grammar_bitmask"), {}),
    # Offsets as bytes beside ids in regions; per-row penalties and min_tokens in regions; raw logprobs.
    (tuple(IDS.values()) + ("logit_bias_values", "repetition_penalty", "min_tokens"), dict(logprobs=3)),
])
def test_the_table_answers_what_the_ragged_lists_answer(handle, gen, in_regions, params, monkeypatch):
    lists = _lists(gen)
    by_bytes = _call(handle, lists, **params)
    in_place = _call(handle, lists, in_regions, **params)
    assert not processors_in_place.takes_table(by_bytes, handle)
    assert processors_in_place.takes_table(in_place, handle)
    want = _run(handle, by_bytes)
    assert (want.token_ids >= 0).all()
    monkeypatch.setattr(sample, "launch_processed", None)  # one path: the table's alone
    got = _run(handle, in_place)
    np.testing.assert_array_equal(got.token_ids, want.token_ids)
    assert (want.logprobs is None) == (got.logprobs is None)
    for w, g in zip(want.logprobs or (), got.logprobs or ()):
        assert (w is None and g is None) or torch.equal(w, g)


def test_lists_with_every_row_empty(handle, gen):
    """Lists sent as offsets alone (every row empty: no ids on the wire) beside one in a region."""
    lists = {"banned_token_ids": np.array([3, 4], dtype=np.int64), "banned_offsets": np.array([0, 0, 2, 2, 2]),
             "stop_offsets": np.zeros(ROWS + 1, dtype=np.int64), "output_offsets": np.zeros(ROWS + 1, dtype=np.int64),
             "min_tokens": np.array([5, 0, 5, 5]), "repetition_penalty": np.array([1.5, 1.0, 2.0, 1.2])}
    want = _run(handle, _call(handle, lists, temperature=0.0))
    in_place = _call(handle, lists, ("banned_token_ids", "banned_offsets", "stop_offsets"), temperature=0.0)
    assert processors_in_place.takes_table(in_place, handle)
    np.testing.assert_array_equal(_run(handle, in_place).token_ids, want.token_ids)


def test_what_the_table_cannot_hold_stays_ragged(handle, gen):
    lists = _lists(gen)
    # The other lists' ids as bytes: their lengths would be the staged sizes.
    assert not processors_in_place.takes_table(_call(handle, lists, ("prompt_token_ids",)), handle)
    int32 = {**lists, "banned_token_ids": lists["banned_token_ids"].astype(np.int32)}
    assert not processors_in_place.takes_table(_call(handle, int32, ("banned_token_ids",)), handle)
    allowed = {**lists, "allowed_token_ids": np.arange(8), "allowed_offsets": np.array([0, 2, 4, 6, 8])}
    assert not processors_in_place.takes_table(_call(handle, allowed, ("prompt_token_ids",)), handle)
    # A bias list in a region with its values as bytes: the values have no device address.
    assert not processors_in_place.takes_table(_call(handle, lists, ("logit_bias_ids",)), handle)


def _message(handle, lists: dict, in_regions: tuple[str, ...]) -> str:
    with pytest.raises(ValueError) as info:
        _run(handle, _call(handle, lists, in_regions))
    return str(info.value)


@pytest.mark.parametrize("field, value, words", [
    ("prompt_offsets", [0, 2, 10**12, 4, 5], "prompt_offsets: must not decrease, got 4 after 1000000000000 (row 2)"),
    ("prompt_offsets", [0, 2, 1, 4, 5], "prompt_offsets: must not decrease"),
    ("prompt_offsets", [1, 2, 3, 4, 5], "prompt_offsets: must start at 0, got 1"),
    ("prompt_offsets", [0, 1, 2, 3, 4], "prompt_offsets: must end at the ids' length 5, got 4"),
    ("prompt_offsets", [0, 1, 2, 3, -(2**40)], "prompt_offsets: must not decrease"),
    ("prompt_token_ids", [1, 2, VOCAB, 4, 5], f"prompt_token_ids: must be in [0, {VOCAB}) (vocab_size), got {VOCAB} "
                                              f"in row 1"),
    ("output_token_ids", [-3, 0, 1], f"output_token_ids: must be in [0, {VOCAB}) (vocab_size), got -3 in row 0"),
    ("logit_bias_values", [0.5, float("nan")], "logit_bias_values[1]: must be finite in float32 (row 3)"),
])
def test_a_broken_list_in_a_region_is_named_as_on_the_ragged_path(handle, field, value, words):
    """Every rule of a list in a region, checked in the table's launch: the message the eager
    path gives (a list as bytes: checked before the call queues), and the next call is served."""
    lists = {"prompt_token_ids": np.array([1, 2, 3, 4, 5]), "prompt_offsets": np.array([0, 2, 3, 4, 5]),
             "output_token_ids": np.array([7, 0, 1]), "output_offsets": np.array([0, 1, 1, 3, 3]),
             "logit_bias_ids": np.array([6, 9]), "logit_bias_offsets": np.array([0, 0, 0, 0, 2]),
             "logit_bias_values": np.array([0.5, 2.0], dtype=np.float32), "repetition_penalty": 1.3}
    broken = {**lists, field: np.array(value, dtype=lists[field].dtype)}
    in_regions = tuple(k for k in lists if k != "repetition_penalty")
    with pytest.raises(ValueError, match="^" + re.escape(words)):
        asyncio.run(_call_checked_as_bytes(broken))
    assert _message(handle, broken, in_regions).startswith(words)
    good = _call(handle, lists, in_regions)
    np.testing.assert_array_equal(_run(handle, good).token_ids, _run(handle, _call(handle, lists)).token_ids)


async def _call_checked_as_bytes(lists: dict):
    """The eager path's message for ``lists`` as bytes (their checks, before the call queues)."""
    logits = np.zeros((ROWS, VOCAB), np.float32)
    rows_params = {k: v for k, v in lists.items() if k == "repetition_penalty"}
    msg = messages.sample_request(logits, seed=1, **rows_params,
                                  **{k: v for k, v in lists.items() if k not in rows_params})
    await SampleCall.from_pb(msg, Limits(64, 4096)).checked()


def test_a_broken_penalty_row_in_a_region_is_named(handle):
    lists = {"banned_token_ids": np.array([1, 2]), "banned_offsets": np.array([0, 1, 2, 2, 2]),
             "frequency_penalty": np.array([0.0, 3.0, 0.0, 0.0], dtype=np.float32)}
    call = _call(handle, lists, ("banned_token_ids", "banned_offsets", "frequency_penalty"))
    launch = processors_in_place.OffsetsLaunch(call, handle, ("x",))
    assert launch.row_checks is not None  # the penalty's reductions run in the launch
    with pytest.raises(ValueError, match=r"^frequency_penalty_rows\[1\]: must be in \[-2, 2\]"):
        call.device_checks.run()


def test_table_of_offsets_equals_the_ragged_lists(gen):
    """The kernel alone: the table it computes gives the ragged lists' processed logits; a row's
    flag is set exactly where its lists break a rule."""
    x = torch.randn(ROWS, VOCAB, generator=gen) * 3
    kw = {k: torch.from_numpy(np.asarray(v)) for k, v in _lists(gen).items()}
    want = process_logits(x, procs_of(x, **kw), backend="interpret")
    offsets = {name: kw[ids.replace("_token_ids", "_offsets").replace("_ids", "_offsets")] for name, ids in IDS.items()}
    places = [v for name in TABLE_LISTS for v in (kw[IDS[name]].data_ptr(), kw[IDS[name]].numel())]
    places = torch.tensor([*places, kw["logit_bias_values"].data_ptr()], dtype=torch.int64)
    table, broken = table_of_offsets(offsets, places, VOCAB, kw["min_tokens"], backend="interpret")
    assert broken.tolist() == [0] * ROWS
    procs = Processors(**{k: kw[k] for k in ("repetition_penalty", "frequency_penalty", "presence_penalty")},
                       grammar_bitmask=torch.from_numpy(np.asarray(kw["grammar_bitmask"])), table=table)
    assert torch.equal(process_logits(x, procs, backend="interpret"), want)
    stop = offsets["stop"].clone()
    stop[2] = 10**9
    _, broken = table_of_offsets({**offsets, "stop": stop}, places, VOCAB, kw["min_tokens"], backend="interpret")
    assert broken.tolist() == [0, 0, 1, 0]  # row 2 starts past where it ends


def test_the_graph_key_holds_places_not_lengths(handle, gen):
    """Two calls whose lists differ in length (their ids at the same places) share a graph's key;
    the key follows where the offsets are read, and an output region's address."""
    graphed = SimpleNamespace(device=handle.device, backend=handle.backend,
                              graphs=LaunchGraphs(handle.device, None))
    fields = LIST_FIELDS + ("logit_bias_values", "grammar_bitmask")
    short, long = _lists(gen), _lists(gen)
    long["prompt_token_ids"] = np.concatenate([long["prompt_token_ids"], [1, 2, 3]])
    long["prompt_offsets"] = long["prompt_offsets"] + np.array([0, 3, 3, 3, 3])

    def key(lists, buffers):
        call = _call(handle, lists, ())
        for field in fields:  # each field at the start of its own buffer, as a client's region
            sent = call.processors[field].shape
            view = buffers[field][:int(np.prod(sent))].view(sent)
            call.processors[field] = DeviceTensor(view, view.dtype, tuple(sent))
        return processors_in_place.OffsetsLaunch(call, graphed, ("x",)).key()

    buffers = {f: torch.zeros(4096, dtype=torch.from_numpy(np.asarray(short[f])).dtype) for f in fields}
    assert key(short, buffers) is not None and key(short, buffers) == key(long, buffers)
    moved = {**buffers, "prompt_offsets": buffers["prompt_offsets"].clone()}
    assert key(short, moved) != key(short, buffers)
    moved_ids = {**buffers, "prompt_token_ids": buffers["prompt_token_ids"].clone()}
    assert key(short, moved_ids) == key(short, buffers)  # the ids' address is staged, not captured
