"""Sample's processors and logprobs through an in-process server: the answers equal the kernels'
(torch and interpret backends), bad fields answer INVALID_ARGUMENT naming the field and the rule.
Long lists (10^6 ids) are checked in bulk off the event loop (issue 33): a tiny call is answered
while a long list's check is still running; lists in a Step, in a system shared-memory region,
of int32 and int64 ids."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch

from logitserve import kernels
from logitserve.client import Client, LogitServeError, regions
from logitserve.server import ServerConfig
from logitserve.server.ops import processor_checks
from logitserve.server.testing import ServerThread
from test_sample_processors import bitmask, features, ragged

INVALID = grpc.StatusCode.INVALID_ARGUMENT
LONG = 10**6  # ids in the long lists
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


@pytest.fixture(scope="module", params=("torch", "interpret"))
def server(request):
    config = ServerConfig(host="127.0.0.1", port=0, device="cpu", backend=request.param, warmup_dtypes=(),
                          max_delay_us=1000, max_batch_rows=64)
    with ServerThread(config) as s:
        yield s


@pytest.fixture(scope="module")
def torch_server():
    """A torch-backend server alone, for the long lists (the interpreter would take minutes on them)."""
    config = ServerConfig(host="127.0.0.1", port=0, device="cpu", backend="torch", warmup_dtypes=())
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
    np.testing.assert_array_equal(result.token_logprobs, lp.token_logprobs.numpy())
    np.testing.assert_array_equal(result.token_ranks, lp.token_ranks.numpy())
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
    # Every rule of the checks made in bulk off the loop (processor_checks.py), with its message.
    (dict(banned_token_ids=[1, 2], banned_offsets=[1, 1, 2]), "banned_offsets: must start at 0, got 1"),
    (dict(allowed_token_ids=[1, 2], allowed_offsets=[0, 2, 1]), "allowed_offsets: must not decrease, got 1 after 2 "
                                                                "(row 1)"),
    (dict(output_offsets=[0, 0, 1]), "output_offsets: must end at the ids' length 0, got 1"),  # offsets alone
    # The first offending id, its row found past an empty row.
    (dict(prompt_token_ids=[1, 2, -3, 50], prompt_offsets=[0, 0, 4]),
     "prompt_token_ids: must be in [0, 40) (vocab_size), got -3 in row 1"),
    (dict(stop_token_ids=np.array([39, 40], np.int32), stop_offsets=np.array([0, 2, 2], np.int32)),
     "stop_token_ids: must be in [0, 40) (vocab_size), got 40 in row 0"),
    (dict(logit_bias_ids=[1, 2], logit_bias_offsets=[0, 1, 2], logit_bias_values=np.array([1.0, 1e300])),
     "logit_bias_values[1]: must be finite in float32 (row 1), got inf"),
    (dict(logit_bias_ids=[1, 2], logit_bias_offsets=[0, 2, 2], logit_bias_values=[float("nan"), 1.0]),
     "logit_bias_values[0]: must be finite in float32 (row 0), got nan"),
    (dict(repetition_penalty=np.array([1.0, 1e300])),
     "repetition_penalty_rows[1]: must be finite and > 0 in float32, the precision the kernels use, got 1e+300"),
    (dict(presence_penalty=[float("nan"), 0.0]), "presence_penalty_rows[0]: must be in [-2, 2], got nan"),
    (dict(min_tokens=[0, -1]), "min_tokens_rows[1]: must be >= 0, got -1"),
    (dict(repetition_penalty=[1.0, 1.0, 1.0]), "repetition_penalty_rows.shape: must be [2] (one value per row)"),
    # Several broken fields: the first in field order is named (per-row values, then the lists).
    (dict(frequency_penalty=[3.0, 0.0], banned_token_ids=[99], banned_offsets=[0, 0, 1]),
     "frequency_penalty_rows[0]: must be in [-2, 2], got 3.0"),
    (dict(prompt_token_ids=[99], prompt_offsets=[0, 1, 1], banned_token_ids=[1], banned_offsets=[0, 0, 2]),
     "prompt_token_ids: must be in [0, 40) (vocab_size), got 99 in row 0"),
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


def test_lists_of_either_int_dtype_and_offsets_alone_equal_the_kernels(server, client):
    """int32 ids with int64 offsets and the reverse, float64 bias values, a list sent as its
    offsets alone: the answer is the kernels' on the same lists (launched as int64 and float32)."""
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(4)) * 2
    prompt = ragged([[1, 2, 2], [], [7]])
    banned = ragged([[3], [4, 5], []])
    bias = ragged([[6, 6], [8], [9]])
    values = np.array([1.5, -0.25, 3.0, 2.0])
    kw = dict(seed=[4, 5, 6], repetition_penalty=1.4, frequency_penalty=0.3, logprobs=3)
    got = client.sample(x, **kw, prompt_token_ids=prompt[0].int().numpy(), prompt_offsets=prompt[1].numpy(),
                        banned_token_ids=banned[0].numpy(), banned_offsets=banned[1].int().numpy(),
                        logit_bias_ids=bias[0].int().numpy(), logit_bias_offsets=bias[1].int().numpy(),
                        logit_bias_values=values, output_offsets=np.zeros(4, np.int64))
    tokens, lp = kernels.sample(x, seed=torch.tensor(kw["seed"]), repetition_penalty=1.4, frequency_penalty=0.3,
                                logprobs=3, prompt_token_ids=prompt[0], prompt_offsets=prompt[1],
                                banned_token_ids=banned[0], banned_offsets=banned[1], logit_bias_ids=bias[0],
                                logit_bias_offsets=bias[1], logit_bias_values=torch.from_numpy(values).float(),
                                output_token_ids=torch.zeros(0, dtype=torch.int64),
                                output_offsets=torch.zeros(4, dtype=torch.int64), backend=server.config.backend)
    np.testing.assert_array_equal(got.token_ids, tokens.numpy())
    np.testing.assert_array_equal(got.top_logprobs, lp.top_logprobs.numpy())


def test_processor_fields_in_a_step_are_checked_with_their_path(server, client):
    x = np.zeros((2, 40), np.float32)
    with pytest.raises(LogitServeError) as info:
        client.step(sample={"logits": x, "seed": 1, "banned_token_ids": [1, 2, 40], "banned_offsets": [0, 1, 3]})
    assert info.value.code == INVALID
    assert "sample.banned_token_ids: must be in [0, 40) (vocab_size), got 40 in row 1" in info.value.details
    got = client.step(sample={"logits": x, "seed": 1, "allowed_token_ids": [5, 9], "allowed_offsets": [0, 1, 2]})
    assert got.sample.token_ids.tolist() == [5, 9]


def _all_but(token: int, vocab: int, n: int) -> np.ndarray:
    """``n`` ids banning every token of ``vocab`` but ``token`` (each many times)."""
    others = np.delete(np.arange(vocab, dtype=np.int64), token)
    return np.resize(others, n)


def test_a_long_list_is_checked_in_bulk(torch_server):
    """10^6 banned ids: valid, every token but one banned; one past the vocabulary at the end,
    named with its row."""
    ids = _all_but(7, 40, LONG)
    with Client(torch_server.target, timeout=120) as c:
        got = c.sample(np.zeros((2, 40), np.float32), seed=1, banned_token_ids=ids, banned_offsets=[0, LONG // 2, LONG])
        assert got.token_ids.tolist() == [7, 7]
        ids[-1] = 40
        with pytest.raises(LogitServeError) as info:
            c.sample(np.zeros((2, 40), np.float32), seed=1, banned_token_ids=ids, banned_offsets=[0, 10, LONG])
        assert info.value.code == INVALID
        assert "banned_token_ids: must be in [0, 40) (vocab_size), got 40 in row 1" in info.value.details


@pytest.fixture
def held_checks(monkeypatch):
    """Every call's bulk checks wait, once started, until the test lets them go: ``(started, release)``."""
    started, release = threading.Event(), threading.Event()
    run = processor_checks.BulkChecks.run

    def held(checks):
        started.set()
        assert release.wait(60), "the test never let the checks go"
        run(checks)

    monkeypatch.setattr(processor_checks.BulkChecks, "run", held)
    yield started, release
    release.set()


def test_a_tiny_call_is_answered_while_a_long_list_is_checked(torch_server, held_checks):
    """The checks of a 10^6-entry list run off the event loop and before the call queues: a tiny
    call sent while they are still running (held at their start) is answered before they end.
    Checked on the loop (the old code), the tiny call waited for them all."""
    started, release = held_checks
    ids = _all_but(0, 40, LONG)
    with Client(torch_server.target, timeout=120) as big, Client(torch_server.target) as small, \
            ThreadPoolExecutor(1) as pool:
        pending = pool.submit(big.sample, np.zeros((1, 40), np.float32), seed=1, banned_token_ids=ids,
                              banned_offsets=[0, LONG])
        assert started.wait(60)
        tiny = small.sample(np.zeros((1, 8), np.float32), temperature=0, timeout=20)
        assert tiny.token_ids.tolist() == [0] and not pending.done()
        release.set()
        assert pending.result(60).token_ids.tolist() == [0]


def test_a_call_that_leaves_during_its_checks(torch_server, held_checks):
    """A client whose deadline passes while its lists are being checked gets DEADLINE_EXCEEDED;
    the server waits for the checks' thread (it reads the call's tensors) and serves on."""
    started, release = held_checks
    with Client(torch_server.target, timeout=120) as c:
        threading.Timer(1.5, release.set).start()
        with pytest.raises(LogitServeError) as info:
            c.sample(np.zeros((1, 40), np.float32), seed=1, banned_token_ids=[1], banned_offsets=[0, 1], timeout=0.5)
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and started.is_set()
        got = c.sample(np.zeros((1, 40), np.float32), temperature=0, banned_token_ids=[0], banned_offsets=[0, 1])
        assert got.token_ids.tolist() == [1]


def test_lists_in_a_system_region(torch_server):
    """Lists and offsets in a registered system shared-memory region are checked where they lie:
    a valid call equals the byte path, a bad id is named with its row."""
    buf = regions.shared_array((LONG + 8,), "int64")
    try:
        ids, offsets = buf.array[:LONG], buf.array[LONG:LONG + 3]
        ids[:] = _all_but(3, 40, LONG)
        offsets[:] = [0, LONG // 2, LONG]
        x = np.zeros((2, 40), np.float32)
        with Client(torch_server.target, timeout=120) as c:
            c.register("lists", buf)
            assert c.sample(x, seed=1, banned_token_ids=ids, banned_offsets=offsets).token_ids.tolist() == [3, 3]
            ids[LONG - 1] = -2
            with pytest.raises(LogitServeError) as info:
                c.sample(x, seed=1, banned_token_ids=ids, banned_offsets=offsets)
            assert info.value.code == INVALID
            assert "banned_token_ids: must be in [0, 40) (vocab_size), got -2 in row 1" in info.value.details
    finally:
        buf.array = None
        buf.shm.close()
        buf.unlink()
