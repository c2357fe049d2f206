"""Sample's processors and logprobs through an in-process server: the answers equal the kernels'
(torch and interpret backends), bad fields answer INVALID_ARGUMENT naming the field and the rule."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from logitserve import kernels
from logitserve.client import LogitServeError
from logitserve.server import ServerConfig
from logitserve.server.testing import ServerThread
from test_sample_processors import bitmask, features, ragged

INVALID = grpc.StatusCode.INVALID_ARGUMENT
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


@pytest.fixture(scope="module", params=("torch", "interpret"))
def server(request):
    config = ServerConfig(host="127.0.0.1", port=0, device="cpu", backend=request.param, warmup_dtypes=(),
                          max_delay_us=1000, max_batch_rows=64)
    with ServerThread(config) as s:
        yield s


def test_answers_equal_the_kernels(server, client):
    gen = torch.Generator().manual_seed(3)
    n, v = 4, 90
    x = torch.randn(n, v, generator=gen) * 2
    kw = features(n, v, gen, allowed=True)
    seeds = [5, 6, 7, 8]
    result = client.sample(x, seed=seeds, top_k=30, top_p=0.95, logprobs=4, logprobs_mode="processed",
                           return_kept=True, **kw)
    tokens, lp = kernels.sample(x, seed=torch.tensor(seeds), top_k=torch.full((n,), 30),
                                top_p=torch.full((n,), 0.95), temperature=torch.ones(n), min_p=torch.zeros(n),
                                step=torch.zeros(n, dtype=torch.int64), logprobs=4, logprobs_mode="processed",
                                return_kept=True, backend=server.config.backend, **kw)
    np.testing.assert_array_equal(result.kept_bitmask, lp.kept_bitmask.numpy())
    np.testing.assert_array_equal(result.token_ids, tokens.numpy())
    np.testing.assert_array_equal(result.valid, tokens.numpy() >= 0)
    np.testing.assert_array_equal(result.token_logprobs, lp.token_logprob.numpy())
    np.testing.assert_array_equal(result.token_ranks, lp.token_rank.numpy())
    np.testing.assert_array_equal(result.top_token_ids, lp.top_token_ids.numpy())
    np.testing.assert_array_equal(result.top_logprobs, lp.top_logprobs.numpy())


def test_scalar_penalties_grammar_nothing_and_plain_neighbours(server, client):
    x = torch.randn(2, 40, generator=torch.Generator().manual_seed(1))
    out_ids, out_off = ragged([[1, 1, 2], []])
    result = client.sample(x, seed=3, repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.1,
                           output_token_ids=out_ids, output_offsets=out_off, grammar_bitmask=bitmask([[], [5, 6]], 40))
    assert result.token_ids[0] == -1 and not result.valid[0] and result.token_ids[1] in (5, 6)
    assert result.token_logprobs is None
    plain = client.sample(x, seed=3)
    np.testing.assert_array_equal(plain.token_ids, kernels.sample(x, seed=3, backend=server.config.backend).numpy())
    # Offsets alone: every row's list empty (the wire has no empty tensors).
    empty = client.sample(x, seed=3, banned_token_ids=np.zeros(0, np.int64), banned_offsets=[0, 0, 0], logprobs=0)
    np.testing.assert_array_equal(empty.token_ids, plain.token_ids)
    assert empty.top_token_ids is None and empty.token_ranks.shape == (2,)


@pytest.mark.parametrize("kw, field", [
    (dict(banned_token_ids=[1, 40], banned_offsets=[0, 1, 2]), "banned_token_ids: must be in [0, 40) (vocab_size), "
                                                              "got 40 in row 1"),
    (dict(allowed_token_ids=[1, 2], allowed_offsets=[0, 2, 1]), "allowed_offsets: must not decrease"),
    (dict(stop_token_ids=[1, 2], stop_offsets=[0, 1, 3]), "stop_offsets: must end at the ids' length 2"),
    (dict(prompt_token_ids=[1], prompt_offsets=[0, 1]), "prompt_offsets.shape: must be [3]"),
    (dict(grammar_bitmask=np.zeros((2, 1), np.int32)), "grammar_bitmask.shape: must be [2, 2]"),
    (dict(repetition_penalty=0.0), "repetition_penalty: must be finite and > 0"),
    (dict(frequency_penalty=[0.0, 2.5]), "frequency_penalty_rows[1]: must be in [-2, 2]"),
    (dict(presence_penalty=-3.0), "presence_penalty: must be in [-2, 2]"),
    (dict(logprobs=21), "logprobs: must be in [0, 20]"),
    (dict(logprobs=1, logprobs_mode="nope"), "logprobs_mode: must be one of"),
    (dict(logprobs=1, logprobs_mode="processed", random_val=0.5), "logprobs_mode: 'processed' does not apply"),
    (dict(logit_bias_ids=[1], logit_bias_offsets=[0, 1, 1], logit_bias_values=[1.0, 2.0]),
     "logit_bias_values.shape: must be [1]"),
    (dict(logit_bias_ids=[1], logit_bias_offsets=[0, 0, 1], logit_bias_values=[float("inf")]),
     "logit_bias_values[0]: must be finite in float32 (row 1)"),
])
def test_bad_fields(server, client, kw, field):
    with pytest.raises(LogitServeError) as info:
        client.sample(np.zeros((2, 40), np.float32), seed=1, **kw)
    assert info.value.code == INVALID
    assert field in info.value.details, info.value.details


@pytest.mark.parametrize("extra", [dict(logprobs=4, return_kept=True), dict(logprobs=0), dict(return_kept=True),
                                   dict(logprobs=2, logprobs_mode="processed")])
def test_answer_size_counts_the_logprobs_fields(server, extra):
    """The size the --max-message-bytes check uses (SampleCall.answer_size) is the answer's
    serialized size, logprobs and kept set included."""
    from logitserve.server.ops import SampleCall
    from logitserve.server.ops.limits import Limits
    from logitserve.v1 import logitserve_pb2 as pb

    x = np.random.default_rng(0).standard_normal((3, 70)).astype(np.float32)
    msg = pb.SampleRequest(logits=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[3, 70], data=x.tobytes()), seed=4, **extra)
    expected = SampleCall.from_pb(msg, Limits(max_rows=64, max_vocab=1 << 20)).answer_size
    with grpc.insecure_channel(server.target) as channel:
        raw = channel.unary_unary("/logitserve.v1.LogitServe/Sample")(msg.SerializeToString(), timeout=120)
    assert len(raw) == expected
