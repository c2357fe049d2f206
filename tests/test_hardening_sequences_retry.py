"""Issue 43, item 8: a Sample by sequence ids is safe to retry. The old code drew for a call the
client saw fail (DEADLINE_EXCEEDED while the launch ran), appending a token and advancing the
step, so the retry skipped a step. Now a call names the steps it expects (``sequence_steps``;
the client's Sequences fills them): a repeat of the step last drawn answers what was drawn then
(tokens, seeds, logprobs), a step not reached or passed further is FAILED_PRECONDITION naming
the sequence's step, and nothing is drawn twice: whether the server drew for the call its client
saw fail (a batch the worker had taken) or dropped it (a lone call cancelled before its launch).
On the torch backend and the interpreted Triton
kernels (the list table's path), and over KServe (``parameters[sequence_step]``).
"""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
import torch

from logitserve.client import Client, LogitServeError
from logitserve.kserve import grpc_service_pb2_grpc as kpb_grpc
from logitserve.server import ServerConfig
from logitserve.server.testing import ServerThread
from test_sequences_kserve import _request, _tokens

V = 48
PRECONDITION, INVALID = grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT


def _config(backend: str) -> ServerConfig:
    return ServerConfig(host="127.0.0.1", port=0, device="cpu", backend=backend, warmup_dtypes=(), busy_poll_us=0)


@pytest.fixture(scope="module", params=["torch", "interpret"])
def server(request):
    with ServerThread(_config(request.param)) as s:
        yield s


@pytest.fixture
def client(server):
    with Client(server.target, timeout=120) as c:
        yield c


def _error(fn, *args, **kwargs) -> LogitServeError:
    with pytest.raises(LogitServeError) as info:
        fn(*args, **kwargs)
    return info.value


def _logits(seed: int, rows: int = 1) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def _timed_out_while_held(server, seqs, logits) -> None:
    """A Sample by ``seqs`` whose launch is held (before_launch) until the client has seen it
    time out (DEADLINE_EXCEEDED); the hold is released when this returns."""
    entered, release = threading.Event(), threading.Event()

    def hold(_calls):  # the launch waits until the client has given up on the call
        entered.set()
        release.wait(30)

    server.service.handle.before_launch = hold
    try:
        err = _error(seqs.sample, logits, timeout=0.5)
        assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert entered.wait(30)
        # The server sees the deadline on its own clock: released only once it has let go of the call.
        _until(lambda: server.service.guard.running == 0, "the server never let go of the call")
    finally:
        server.service.handle.before_launch = None
        release.set()


def _until(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = threading.Event()
    timer = threading.Timer(timeout_s, deadline.set)
    timer.start()
    try:
        while not predicate():
            assert not deadline.wait(0.01), what
    finally:
        timer.cancel()


def test_a_call_the_client_saw_time_out_is_answered_again_not_drawn_again(server, client):
    """The call was taken by the batcher's worker (a batching delay: no lone launch), which
    launches it though its client has gone: the server draws for a call the client saw fail."""
    table = server.service.sequences
    batcher = server.service.batcher
    with client.open_sequences([{"id": 1, "seed": 5, "prompt_token_ids": [3, 4]}]) as seqs:
        batcher.max_delay_s = 0.001
        try:
            _timed_out_while_held(server, seqs, _logits(0))
        finally:
            batcher.max_delay_s = 0.0
        seq = table.lookup(None, [1])[0]
        _until(lambda: seq.step == 1, "the server never finished the draw the client no longer waits for")
        assert seqs.steps == [0]  # the failed call left the client's steps as they were
        first = seq.last.token
        again = seqs.sample(_logits(1))  # the retry: other logits, the same step: the draw of then
        assert again.token_ids.tolist() == [first] and again.seeds.tolist() == [5]
        assert seq.step == 1 and seq.output_len == (first >= 0) and seqs.steps == [1]
        assert seqs.sample(_logits(2)).token_ids.tolist() == client.sample(_logits(2), seed=5, step=1).token_ids.tolist()
        assert seqs.steps == [2] and seq.step == 2


def test_a_lone_call_the_client_saw_time_out_before_its_launch_is_not_drawn(server, client):
    """A lone call launches from its handler's task: cancelled (the client's deadline) before the
    launch ran, it is dropped, and the retry of the same step draws it, once."""
    table = server.service.sequences
    with client.open_sequences([{"id": 3, "seed": 5, "prompt_token_ids": [3, 4]}]) as seqs:
        _timed_out_while_held(server, seqs, _logits(0))
        seq = table.lookup(None, [3])[0]
        _until(lambda: not server.service.handle.thread_busy, "the held launch never ended")
        assert seq.step == 0 and seqs.steps == [0]
        again = seqs.sample(_logits(1))
        assert again.token_ids.tolist() == client.sample(_logits(1), seed=5, step=0).token_ids.tolist()
        assert seq.step == 1 and seqs.steps == [1]


def test_a_repeat_answers_the_logprobs_it_answered_and_must_ask_the_same(server, client):
    with client.open_sequences([{"id": 2, "seed": 7}]) as seqs:
        before = client.server_info().stats["sequence_bytes"]
        first = client.sample(_logits(3), sequence_ids=[2], sequence_steps=[0], logprobs=3)
        kept = 4 + 8 + 3 * (8 + 4)  # the logprobs of the answer it keeps, beside its output's room
        assert client.server_info().stats["sequence_bytes"] == before + 16 * 8 + kept
        again = client.sample(_logits(4), sequence_ids=[2], sequence_steps=[0], logprobs=3)
        for name in ("token_ids", "seeds", "token_logprobs", "token_ranks", "top_token_ids", "top_logprobs"):
            np.testing.assert_array_equal(getattr(again, name), getattr(first, name), err_msg=name)
        err = _error(client.sample, _logits(4), sequence_ids=[2], sequence_steps=[0])
        assert err.code == PRECONDITION, err.details
        assert ("sequence_steps[0]: step 0 of sequence 2 was drawn by a call that asked logprobs=3, "
                "logprobs_mode='raw', return_kept=False; a retry must ask what the call it repeats asked, this one "
                "asks logprobs=None") in err.details
        seqs.steps = [1]
        assert seqs.sample(_logits(5)).token_ids.tolist() == client.sample(_logits(5), seed=7, step=1).token_ids.tolist()


def test_a_step_not_reached_or_passed_is_refused_naming_the_sequences_step(server, client):
    with client.open_sequences([{"id": 3, "seed": 1, "step": 10}, {"id": 4, "seed": 2}]) as seqs:
        err = _error(client.sample, _logits(6, 2), sequence_ids=[3, 4], sequence_steps=[9, 0])
        assert err.code == PRECONDITION
        assert ("sequence_steps[0]: sequence 3 is past step 9: its next draw is step 10, and it has drawn nothing "
                "since it opened (nothing was drawn)") in err.details
        seqs.sample(_logits(6, 2))
        seqs.sample(_logits(7, 2))
        assert seqs.steps == [12, 2]
        for steps, message in (
                ([14, 2], "sequence_steps[0]: sequence 3 has not reached step 14: its next draw is step 12"),
                ([10, 2], "sequence_steps[0]: sequence 3 is past step 10: its next draw is step 12, and only its last "
                          "draw (step 11) can be repeated"),
                ([11, 2], "sequence_steps[1]: step 2 is sequence 4's next draw, while sequence_steps[0] repeats "
                          "sequence 3's last: a call either repeats the last draw of every row (a retry) or draws "
                          "the next of every row")):
            err = _error(client.sample, _logits(8, 2), sequence_ids=[3, 4], sequence_steps=steps)
            assert err.code == PRECONDITION and message in err.details, err.details
        assert client.update_sequences([{"id": 3}, {"id": 4}]) == [12, 2]  # nothing drawn by a refused call


@pytest.mark.parametrize("case, message", [
    (dict(sequence_ids=[5], sequence_steps=[0, 1]), "sequence_steps: must have one step per logits row (1), got 2"),
    (dict(sequence_ids=[5], sequence_steps=[-1]), "sequence_steps[0]: must be >= 0"),
    (dict(sequence_steps=[0]), "sequence_steps: only with sequence_ids"),
])
def test_bad_steps(server, client, case, message):
    with client.open_sequences([{"id": 5}]):
        err = _error(client.sample, _logits(9), **case)
    assert err.code == INVALID and message in err.details, err.details


def test_a_kserve_retry_names_its_step(server, client):
    x = np.asarray(_logits(10), np.float32)
    with grpc.insecure_channel(server.target) as channel:
        kserve = kpb_grpc.GRPCInferenceServiceStub(channel)
        first = _tokens(kserve.ModelInfer(_request(x, 6, start=True, seed=3, sequence_step=0), timeout=120))
        again = _tokens(kserve.ModelInfer(_request(x * 0, 6, sequence_step=0), timeout=120))
        assert again == first
        with pytest.raises(grpc.RpcError) as info:
            kserve.ModelInfer(_request(x, 6, sequence_step=4), timeout=120)
        assert info.value.code() == PRECONDITION
        assert info.value.details().startswith("parameters[sequence_step]: sequence 6 has not reached step 4: its "
                                               "next draw is step 1"), info.value.details()
        nxt = _tokens(kserve.ModelInfer(_request(x, 6, end=True, sequence_step=1), timeout=120))
    assert nxt == client.sample(torch.from_numpy(x), seed=3, step=1).token_ids.tolist()
