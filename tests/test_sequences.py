"""Sequences (issue 33, item 3): sampling state held on the server, through an in-process CPU
server (torch backend, small vocabulary).

A sequence's tokens equal the stateless Sample's with the same values and lists, step by step,
over a 50-step decode whose rows open and close at different steps; a bearer token sees only its
own sequences; idle expiry, --max-sequences, a restart, a sequence closed while its call waits,
and bad input answer the right code and message.
"""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
import torch

from logitserve.client import Client, LogitServeError
from logitserve.client.sequences import Sequences
from logitserve.server import ServerConfig
from logitserve.server.testing import ServerThread
from test_sample_processors import bitmask, ragged

V = 48
NOT_FOUND, INVALID = grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT


def _config(**changes) -> ServerConfig:
    return ServerConfig(**{"host": "127.0.0.1", "port": 0, "device": "cpu", "backend": "torch", "warmup_dtypes": (),
                           **changes})


@pytest.fixture(scope="module")
def server():
    with ServerThread(_config()) as s:
        yield s


def _error(fn, *args, **kwargs) -> LogitServeError:
    with pytest.raises(LogitServeError) as info:
        fn(*args, **kwargs)
    return info.value


# Each row of the decode: the step it opens at and the step it closes at, and its state.
ROWS = [
    (0, 50, dict(temperature=0.8, top_k=10, seed=11, repetition_penalty=1.5, frequency_penalty=0.4,
                 presence_penalty=0.3, prompt_token_ids=[1, 2, 3, 3, 40], logit_bias={5: 3.0, 6: -2.0},
                 banned_token_ids=[0, 7], min_tokens=12, stop_token_ids=[8, 9])),
    (3, 31, dict(temperature=1.3, top_p=0.9, seed=22, frequency_penalty=1.0, prompt_token_ids=[4] * 9,
                 min_tokens=5, stop_token_ids=[10])),
    (8, 50, dict(min_p=0.05, seed=33, step=100, output_token_ids=[12, 12, 13], presence_penalty=-0.5,
                 logit_bias={12: 1.5})),
    (20, 44, dict(temperature=0.0, repetition_penalty=0.7, banned_token_ids=list(range(20)))),  # greedy, no seed
    (25, 50, dict(seed=55)),  # plain: no processor
]


def _stateless(client, logits, states, grammar):
    """The Sample without sequences that sends each row's values and lists."""
    def column(name, default):
        return [s.get(name, default) for s in states]

    def lists(rows):  # an empty list over the whole batch goes as its offsets alone
        ids, offsets = ragged(rows)
        return (ids if ids.numel() else None), offsets

    prompt_ids, prompt_off = lists([s.get("prompt_token_ids", []) for s in states])
    out_ids, out_off = lists([s["output"] for s in states])
    bias = [s.get("logit_bias", {}) for s in states]
    bias_ids, bias_off = lists([list(b) for b in bias])
    banned_ids, banned_off = lists([s.get("banned_token_ids", []) for s in states])
    stop_ids, stop_off = lists([s.get("stop_token_ids", []) for s in states])
    return client.sample(
        logits, temperature=column("temperature", 1.0), top_k=column("top_k", 0), top_p=column("top_p", 1.0),
        min_p=column("min_p", 0.0), seed=column("seed", None), step=[s["step"] for s in states],
        repetition_penalty=column("repetition_penalty", 1.0), frequency_penalty=column("frequency_penalty", 0.0),
        presence_penalty=column("presence_penalty", 0.0), min_tokens=column("min_tokens", 0),
        prompt_token_ids=prompt_ids, prompt_offsets=prompt_off, output_token_ids=out_ids, output_offsets=out_off,
        logit_bias_ids=bias_ids, logit_bias_values=None if bias_ids is None else [v for b in bias for v in b.values()],
        logit_bias_offsets=bias_off, banned_token_ids=banned_ids, banned_offsets=banned_off,
        stop_token_ids=stop_ids, stop_offsets=stop_off, grammar_bitmask=grammar)


@pytest.fixture(scope="module")
def interpreted():
    """A server on the Triton kernels (interpreted): sequences go through the list table."""
    with ServerThread(_config(backend="interpret")) as s:
        yield s


@pytest.fixture(scope="module")
def on_cuda():
    """A server on the compiled Triton kernels: the list table's launches replay CUDA graphs."""
    with ServerThread(_config(device="cuda:0", backend="triton")) as s:
        yield s


@pytest.mark.parametrize("backend", ["torch", "interpret", pytest.param("triton", marks=pytest.mark.cuda)])
def test_a_decode_equals_the_stateless_calls_step_by_step(request, backend):
    target = request.getfixturevalue({"torch": "server", "interpret": "interpreted", "triton": "on_cuda"}[backend])
    with Client(target.target, timeout=300) as client:
        decode(client, steps=50)
        if backend == "triton":  # every step after the first of each batch size replayed a graph
            assert target.service.handle.graphs.replays > 0


def decode(client, steps):
    """A decode of ROWS by sequence ids, each step's tokens checked against the stateless call's."""
    gen = torch.Generator().manual_seed(5)
    states: dict[int, dict] = {}  # open row -> its state as the test follows it
    drawn = {row: [] for row in range(len(ROWS))}
    for step in range(steps):
        for row, (start, end, spec) in enumerate(ROWS):
            if step == start:
                opened = client.open_sequences([{"id": 1000 + row, **spec}])
                assert opened.ids == [1000 + row]
                states[row] = {**spec, "seed": opened.seeds[0], "step": spec.get("step", 0),
                               "output": list(spec.get("output_token_ids", []))}
            if step == end:
                assert client.close_sequences([1000 + row]) == [1000 + row]
                del states[row]
        order = sorted(states, key=lambda r: (r * 7 + step) % 5)  # rows in a different order each step
        logits = torch.randn(len(order), V, generator=gen) * 3
        grammar = bitmask([[t for t in range(V) if (t + step + r) % 3] for r in order], V) if step % 7 == 3 else None
        options = {} if grammar is None else {"grammar_bitmask": grammar}
        got = client.sample(logits, sequence_ids=[1000 + r for r in order], **options)
        want = _stateless(client, logits, [states[r] for r in order], grammar)
        np.testing.assert_array_equal(got.token_ids, want.token_ids, err_msg=f"step {step}, rows {order}")
        np.testing.assert_array_equal(got.seeds, [states[r]["seed"] for r in order])
        for r, token in zip(order, got.token_ids.tolist()):
            states[r]["step"] += 1
            drawn[r].append(token)
            if token >= 0:
                states[r]["output"].append(token)
    # The features did something: min_tokens held the stops back, bans held, the greedy row is greedy.
    assert all(t not in (0, 7) for t in drawn[0]) and all(t not in (8, 9) for t in drawn[0][:12])
    assert all(t >= 20 for t in drawn[3])
    assert sorted(client.close_sequences([1000 + r for r in states])) == sorted(1000 + r for r in states)
    assert client.server_info().stats["open_sequences"] == 0


def test_a_bearer_token_sees_only_its_own_sequences(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("alice-token\nbob-token\n")
    with ServerThread(_config(auth_token_file=str(path))) as s, \
            Client(s.target, token="alice-token", timeout=30) as alice, \
            Client(s.target, token="bob-token", timeout=30) as bob:
        x = torch.randn(1, V, generator=torch.Generator().manual_seed(1))
        alice.open_sequences([{"id": 1, "seed": 3, "banned_token_ids": list(range(V - 1))}])  # draws V - 1 only
        err = _error(bob.sample, x, sequence_ids=[1])
        assert err.code == NOT_FOUND and "no open sequence 1 for this caller" in err.details
        assert bob.close_sequences([1]) == []  # not bob's to close
        bob.open_sequences([{"id": 1, "seed": 3}])  # the same id, apart from alice's
        assert alice.sample(x, sequence_ids=[1]).token_ids.tolist() == [V - 1]
        assert bob.sample(x, sequence_ids=[1]).token_ids.tolist() == \
            bob.sample(x, seed=3, step=0).token_ids.tolist()
        assert bob.close_sequences([1, 2]) == [1]
        assert alice.sample(x, sequence_ids=[1]).token_ids.tolist() == [V - 1]  # alice's still open


def test_an_idle_sequence_expires(server, client):
    table = server.service.sequences
    now = [1000.0]
    table.clock = lambda: now[0]
    try:
        client.open_sequences([{"id": 1, "seed": 1}, {"id": 2, "seed": 2}])
        x = torch.randn(1, V)
        for _ in range(3):  # a sequence a call names keeps living
            now[0] += table.idle_s * 0.6
            client.sample(x, sequence_ids=[2])
        info = client.server_info().stats
        assert info["open_sequences"] == 1 and info["sequence_bytes"] > 0
        err = _error(client.sample, x, sequence_ids=[1])
        assert err.code == NOT_FOUND and "idle past --sequence-idle-s" in err.details
        assert "open it first with OpenSequences" in err.details
        now[0] += table.idle_s
        assert client.server_info().stats == {**info, "open_sequences": 0, "sequence_bytes": 0,
                                               "launches": info["launches"],
                                               "batched_requests": info["batched_requests"]}
    finally:
        table.clock = __import__("time").monotonic
        client.close_sequences([1, 2])


def test_max_sequences_opens_all_or_none():
    with ServerThread(_config(max_sequences=3)) as s, Client(s.target, timeout=30) as c:
        c.open_sequences([{"id": 1}, {"id": 2}])
        err = _error(c.open_sequences, [{"id": 3}, {"id": 4}])
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-sequences 3" in err.details
        assert c.server_info().stats["open_sequences"] == 2  # neither opened
        assert c.server_info().limits["max_sequences"] == 3
        c.close_sequences([1])
        c.open_sequences([{"id": 3}, {"id": 4}])
    with ServerThread(_config(max_sequences=0)) as s, Client(s.target, timeout=30) as c:
        err = _error(c.open_sequences, [{"id": 1}])
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-sequences 0" in err.details


def test_a_restarted_server_knows_no_sequence():
    x = torch.randn(1, V)
    with ServerThread(_config()) as s, Client(s.target, timeout=30) as c:
        c.open_sequences([{"id": 9, "seed": 1}])
        c.sample(x, sequence_ids=[9])
    with ServerThread(_config()) as s, Client(s.target, timeout=30) as c:
        err = _error(c.sample, x, sequence_ids=[9])
        assert err.code == NOT_FOUND and "opened before the server restarted" in err.details


def test_a_sequence_closed_while_its_call_waits_is_not_found(server, client):
    client.open_sequences([{"id": 1, "seed": 1}])
    entered, release = threading.Event(), threading.Event()
    handle = server.service.handle

    def hold(_calls):
        entered.set()
        release.wait(10)

    handle.before_launch = hold
    answer = {}
    caller = threading.Thread(target=lambda: answer.update(err=_error(client.sample, torch.randn(1, V),
                                                                      sequence_ids=[1])))
    try:
        caller.start()
        assert entered.wait(10)
        assert client.close_sequences([1]) == [1]
    finally:
        handle.before_launch = None
        release.set()
        caller.join(10)
    assert answer["err"].code == NOT_FOUND
    assert "sequence 1 was closed while this call waited for its launch" in answer["err"].details


@pytest.mark.parametrize("case, code, message", [
    (dict(sequence_ids=[1, 77]), NOT_FOUND, "sequence_ids[1]: no open sequence 77 for this caller"),
    (dict(sequence_ids=[1, 1]), INVALID, "sequence_ids[1]: sequence 1 is named twice in one call"),
    (dict(sequence_ids=[1]), INVALID, "sequence_ids: must have one id per logits row (2), got 1"),
    (dict(sequence_ids=[1, 2], temperature=0.5), INVALID, "temperature: must be unset with sequence_ids"),
    (dict(sequence_ids=[1, 2], banned_token_ids=[1], banned_offsets=[0, 1, 1]), INVALID,
     "banned_token_ids: must be unset with sequence_ids"),
])
def test_bad_sample_calls(server, client, case, code, message):
    with client.open_sequences([{"id": 1}, {"id": 2}]):
        err = _error(client.sample, torch.randn(2, V), **case)
    assert err.code == code and message in err.details, err.details


def test_bad_sequences_and_closed_ones(server, client):
    x = torch.randn(1, V)
    with client.open_sequences([{"id": 1, "prompt_token_ids": [V + 5]}]) as seqs:
        assert isinstance(seqs, Sequences)
        err = _error(seqs.sample, x)
        assert err.code == INVALID and f"holds token id {V + 5}, not below this call's vocabulary" in err.details
        err = _error(client.open_sequences, [{"id": 1}])
        assert err.code == grpc.StatusCode.ALREADY_EXISTS and "sequence 1 is open already" in err.details
    err = _error(client.sample, x, sequence_ids=[1])  # closed by the with block
    assert err.code == NOT_FOUND and "open it first with OpenSequences" in err.details
    for specs, message in (([{"id": 1}, {"id": 1}], "sequences[1].id: 1 appears twice in this request"),
                           ([{"id": 1}, {"id": 2, "top_p": 0.0}], "sequences[1].top_p: must be in (0, 1]"),
                           ([{"id": 1, "temperature": 1e300}], "sequences[0].temperature: must be finite"),
                           ([{"id": 1, "banned_token_ids": [3, -1]}], "sequences[0].banned_token_ids[1]: must be a "
                                                                       "token id in [0, 262144)"),
                           ([{"id": 1, "logit_bias": {3: 1e39}}], "sequences[0].logit_bias_values[0]: must be "
                                                                   "finite in float32")):
        err = _error(client.open_sequences, specs)
        assert err.code == INVALID and message in err.details, err.details
    assert client.server_info().stats["open_sequences"] == 0  # nothing of a refused request opened
    err = _error(client.step, sample={"logits": x, "sequence_ids": [1]})
    assert err.code == INVALID and "only the Sample RPC takes sequence ids" in err.details


def test_the_bytes_a_sequence_holds_are_counted(server, client):
    before = client.server_info().stats["sequence_bytes"]
    spec = {"id": 5, "prompt_token_ids": list(range(40)) * 2, "logit_bias": {1: 1.0, 2: 2.0},
            "banned_token_ids": [3, 4, 5], "stop_token_ids": [6]}
    with client.open_sequences([spec]) as seqs:
        held = 8 * (80 + 2 + 3 + 1) + 4 * 2  # int64 ids, float32 bias values
        assert client.server_info().stats["sequence_bytes"] == before + held
        for _ in range(17):  # the output's room: 16 tokens, then 32
            seqs.sample(torch.randn(1, V))
        assert client.server_info().stats["sequence_bytes"] == before + held + 8 * 32
    assert client.server_info().stats["sequence_bytes"] == before


def test_the_async_client(server):
    import asyncio

    from logitserve.client import AsyncClient

    async def decode():
        async with AsyncClient(server.target, timeout=30) as c:
            async with await c.open_sequences([{"id": 7, "seed": 4}, {"id": 8, "seed": 5}]) as seqs:
                x = torch.randn(2, V, generator=torch.Generator().manual_seed(2))
                first = (await seqs.sample(x)).token_ids.tolist()
                again = (await c.sample(x, seed=[4, 5], step=[0, 0])).token_ids.tolist()
                assert first == again
            return await c.close_sequences([7, 8])

    assert asyncio.run(decode()) == []  # the async with closed them
