"""VerifyDraft through an in-process server: answers equal ``kernels.verify``'s for the same seeds
(bit for bit: the server runs the very kernel), drawn seeds replay, batched calls answer as
alone, tensors and outputs in system shared memory, and INVALID_ARGUMENT naming the field and
the rule for every bad input.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch

from logitserve import kernels
from logitserve.client import AsyncClient, Client, regions
from logitserve.client.messages import verify_draft_request
from logitserve.server import ServerConfig
from logitserve.server.testing import ServerThread
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

BATCH_DELAY_US = 50_000


@pytest.fixture(scope="module", params=("torch", "interpret"))
def server(request):
    config = ServerConfig(host="127.0.0.1", port=0, device="cpu", backend=request.param, warmup_dtypes=(),
                          max_delay_us=BATCH_DELAY_US, max_batch_rows=64, max_rows=40)
    with ServerThread(config) as s:
        yield s


def inputs(seed: int, rows: int = 3, n: int = 2, vocab: int = 16):
    """(draft ids int64 [B, n], target logits f32 [B, n + 1, V], draft logits f32 [B, n, V], draft probs)."""
    g = np.random.default_rng(seed)
    target = (g.standard_normal((rows, n + 1, vocab)) * 2).astype(np.float32)
    draft_logits = (0.7 * target[:, :n] + g.standard_normal((rows, n, vocab))).astype(np.float32)
    q = torch.softmax(torch.from_numpy(draft_logits), -1).numpy()
    ids = np.stack([[g.choice(vocab, p=q[b, i] / q[b, i].sum()) for i in range(n)] for b in range(rows)])
    return ids.astype(np.int64), target, draft_logits, q


def direct(server, ids, target, **kw) -> kernels.VerifyResult:
    tensors = {k: torch.from_numpy(np.asarray(v)) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
    return kernels.verify(torch.from_numpy(ids), torch.from_numpy(target), backend=server.config.backend, **tensors)


def assert_equal(got, want) -> None:
    np.testing.assert_array_equal(got.token_ids, want.token_ids.numpy())
    np.testing.assert_array_equal(got.num_accepted, want.num_accepted.numpy())
    np.testing.assert_array_equal(got.valid, want.valid.numpy())


@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.0), dict(top_k=5, top_p=0.8, min_p=0.02),
                                dict(top_p=0.7, filter_order="joint")], ids=str)
def test_answers_equal_the_kernel(client, server, kw):
    ids, target, draft_logits, q = inputs(1)
    seeds = np.array([3, 4, 2**62], dtype=np.int64)
    got = client.verify_draft(ids, target, draft_probs=q, seed=seeds, step=7, **kw)
    assert_equal(got, direct(server, ids, target, draft_probs=q, seed=seeds, step=7, **kw))
    np.testing.assert_array_equal(got.seeds, seeds)
    per_row = dict(temperature=np.array([0.8, 0.0, 1.3]), top_k=np.array([0, 3, 6]), draft_temperature=0.9)
    got = client.verify_draft(ids.astype(np.int32), target, draft_logits=draft_logits, seed=11, **per_row)
    assert_equal(got, direct(server, ids.astype(np.int32), target, draft_logits=draft_logits, seed=11, **per_row))


def test_rows_without_filters_take_the_lean_launch_with_the_same_answer(client, server):
    # No row sets a filter: the server passes them to the kernels as off, which skips their
    # launches; the answer is the full launch's with every filter a per-row tensor that is off.
    ids, target, _, q = inputs(4, rows=4, n=3, vocab=40)
    rows = dict(temperature=np.array([0.8, 1.0, 0.0, 1.4], dtype=np.float32), seed=np.arange(4) + 21, step=5)
    got = client.verify_draft(ids, target, draft_probs=q, **rows, top_k=[0, 0, 40, 99])
    off = dict(top_k=np.array([0, 0, 40, 99]), top_p=np.ones(4, np.float32), min_p=np.zeros(4, np.float32))
    assert_equal(got, direct(server, ids, target, draft_probs=q, **rows, **off))


def test_drawn_seeds_replay(client):
    ids, target, _, q = inputs(2)
    first = client.verify_draft(ids, target, draft_probs=q, top_p=0.9)
    again = client.verify_draft(ids, target, draft_probs=q, top_p=0.9, seed=first.seeds)
    np.testing.assert_array_equal(first.token_ids, again.token_ids)
    assert first.valid.all() and (first.token_ids[np.arange(3), first.num_accepted] >= 0).all()


def test_batched_calls_answer_as_alone(server):
    # Calls arriving together share a launch (same dtypes, n, V, draft kind, filter order); each
    # answers what the kernel gives it alone.
    calls = [(inputs(10 + i, rows=1 + i % 2), dict(seed=i, top_k=4 + i, temperature=0.5 + 0.2 * i)) for i in range(4)]

    async def run():
        async with AsyncClient(server.target, timeout=120) as c:
            return await asyncio.gather(*(c.verify_draft(ids, target, draft_probs=q, **kw)
                                          for (ids, target, _, q), kw in calls))

    for ((ids, target, _, q), kw), got in zip(calls, server.run(run(), timeout=300)):
        assert_equal(got, direct(server, ids, target, draft_probs=q, **kw))


def test_tensors_and_outputs_in_system_shared_memory(server):
    ids, target, _, q = inputs(3)
    bufs = {"target": regions.shared_array(target.shape, "float32"), "q": regions.shared_array(q.shape, "float32"),
            "out": regions.shared_array((256,), "uint8")}
    bufs["target"].array[:] = target
    bufs["q"].array[:] = q
    out = bufs["out"].array
    slots = {"token_ids": out[0:72].view(np.int64).reshape(3, 3), "num_accepted": out[72:96].view(np.int64),
             "valid": out[96:99].view(np.bool_), "seeds": out[104:128].view(np.int64)}
    try:
        with Client(server.target, timeout=120) as c:
            for name, buf in bufs.items():
                c.register(name, buf)
            want = c.verify_draft(ids, target, draft_probs=q, seed=5, top_k=6)
            got = c.verify_draft(ids, bufs["target"].array, draft_probs=bufs["q"].array, seed=5, top_k=6, out=slots)
            assert got.token_ids is slots["token_ids"]
            for name in ("token_ids", "num_accepted", "valid", "seeds"):
                np.testing.assert_array_equal(slots[name], getattr(want, name))
    finally:
        for buf in bufs.values():
            buf.array = None
            buf.shm.close()
            buf.unlink()


IDS, TARGET, DRAFT_LOGITS, Q = inputs(4, rows=2, n=2, vocab=8)
BAD = {
    "id past V": (dict(draft_token_ids=np.array([[1, 2], [8, 0]])),
                  "draft_token_ids[1, 0]: must be in [0, V) with V = 8 (target_logits.shape[2]), got 8"),
    "negative id": (dict(draft_token_ids=np.array([[1, -3], [0, 0]])), "draft_token_ids[0, 1]: must be in [0, V)"),
    "target rows": (dict(target_logits=TARGET[:1]),
                    "target_logits.shape: must be [B, n + 1, V] = [2, 3, V] (B, n from draft_token_ids.shape), "
                    "got [1, 3, 8]"),
    "target positions": (dict(target_logits=TARGET[:, :2]), "target_logits.shape: must be [B, n + 1, V] = [2, 3, V]"),
    "draft vocabulary": (dict(draft_probs=Q[:, :, :7]),
                         "draft_probs.shape: must be [B, n, V] = [2, 2, 8] (B, n from draft_token_ids.shape, V from "
                         "target_logits.shape), got [2, 2, 7]"),
    "draft positions": (dict(draft_probs=None, draft_logits=DRAFT_LOGITS[:, :1]),
                        "draft_logits.shape: must be [B, n, V] = [2, 2, 8]"),
    "float ids": (dict(draft_token_ids=IDS.astype(np.float32)), "draft_token_ids.dtype: must be one of int32, int64"),
    "int target": (dict(target_logits=TARGET.astype(np.int32)), "target_logits.dtype: must be one of float16"),
    "bool draft": (dict(draft_probs=Q > 0.1), "draft_probs.dtype: must be one of float16"),
    "ids of rank 1": (dict(draft_token_ids=IDS[0]), "draft_token_ids.shape: rank must be 2"),
    "no draft": (dict(draft_probs=None), "draft_probs / draft_logits: exactly one must be set, got neither"),
    "both drafts": (dict(draft_logits=DRAFT_LOGITS),
                    "draft_probs / draft_logits: exactly one must be set, got draft_probs and draft_logits"),
    "draft temperature with probs": (dict(draft_temperature=0.5), "draft_temperature: applies only with draft_logits"),
    "draft temperature negative": (dict(draft_probs=None, draft_logits=DRAFT_LOGITS, draft_temperature=-1.0),
                                   "draft_temperature: must be finite and >= 0, got -1.0"),
    "top_p": (dict(top_p=1.5), "top_p: must be in (0, 1], got 1.5"),
    "temperature row": (dict(temperature=np.array([1.0, np.nan])), "temperature_rows[1]: must be finite and >= 0"),
    "top_k rows": (dict(top_k=np.array([1, 2, 3])), "top_k_rows.shape: must be [2] (one value per row), got [3]"),
    "negative seed": (dict(seed=-4), "seed: must be >= 0, got -4"),
}


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.LogitServeStub(channel)


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_invalid_argument_naming_the_field_and_the_rule(stub, case):
    change, message = BAD[case]
    kw = {**dict(draft_token_ids=IDS, target_logits=TARGET, draft_probs=Q), **change}
    request = verify_draft_request(kw.pop("draft_token_ids"), kw.pop("target_logits"), **kw)
    with pytest.raises(grpc.RpcError) as err:
        stub.VerifyDraft(request, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert message in err.value.details(), err.value.details()


def test_unknown_filter_order_and_too_many_rows(stub):
    request = verify_draft_request(IDS, TARGET, draft_probs=Q)
    request.filter_order = 9
    with pytest.raises(grpc.RpcError) as err:
        stub.VerifyDraft(request, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "filter_order: unknown value 9" in \
        err.value.details()
    ids, target, _, q = inputs(5, rows=14, n=2, vocab=4)  # 14 x 3 = 42 target rows, over --max-rows 40
    with pytest.raises(grpc.RpcError) as err:
        stub.VerifyDraft(verify_draft_request(ids, target, draft_probs=q), timeout=60)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "target_logits: 42 rows, over this server's limit of 40 (--max-rows)" in err.value.details()
