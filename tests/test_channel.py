"""The same-host channel (issue 35) answers as gRPC does: every operator it carries, through
``Client(channel="shm")`` and ``AsyncClient(channel="shm")``, against a gRPC client of the same
server, field by field; tensors inline (small, and large enough for the ports' slots to grow)
and in a registered POSIX shared-memory region with ``out=`` outputs; sequences; the calls
counted in the same RPC metrics.

Errors and limits: test_channel_errors.py; tokens: test_channel_auth.py; drain, idle channels,
dying clients: test_channel_lifecycle.py.
"""

from __future__ import annotations

import asyncio
import collections
import threading

import numpy as np
import pytest
from channel_raw import assert_same, close_channel

from logitserve.client import AsyncClient, Client, regions
from logitserve.server import ServerConfig
from logitserve.server.testing import ServerThread

RNG = np.random.default_rng(35)
X = (RNG.standard_normal((3, 40)) * 3).astype(np.float32)
GATES = RNG.standard_normal((5, 16)).astype(np.float32)


@pytest.fixture(scope="module")
def server():
    config = ServerConfig(host="127.0.0.1", port=0, device="cpu", backend="torch", warmup_dtypes=())
    with ServerThread(config) as s:
        yield s


@pytest.fixture(scope="module")
def clients(server):
    """(gRPC client, channel client) of the module's server."""
    with Client(server.target, timeout=30) as grpc_client, \
            Client(server.target, timeout=30, channel="shm", retries=0) as shm_client:
        yield grpc_client, shm_client


def _both(clients, call):
    """``call(client)`` over gRPC and over the channel, the two answers compared; the channel's."""
    grpc_client, shm_client = clients
    expected, got = call(grpc_client), call(shm_client)
    assert_same(got, expected)
    return got


def _rows(a, b):
    """Ragged ``[a_row, b_row]`` lists as (ids, offsets)."""
    return np.array(a + b, np.int64), np.array([0, len(a), len(a) + len(b)], np.int64)


SAMPLE_CASES = {
    "seeded": dict(seed=[1, 2, 3], top_k=10, top_p=0.9),
    "greedy": dict(temperature=0.0, seed=0),
    "min_p and joint filters": dict(seed=7, min_p=0.05, top_k=5, filter_order="joint"),
    "penalties": dict(seed=[4, 5, 6], repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2,
                      prompt_token_ids=np.array([1, 2, 2, 7], np.int64), prompt_offsets=[0, 3, 3, 4],
                      output_token_ids=np.array([5, 5, 9], np.int64), output_offsets=[0, 0, 2, 3]),
    "logit bias and banned": dict(seed=11, logit_bias_ids=np.array([3, 4, 8], np.int64),
                                  logit_bias_values=np.array([5.0, -2.0, 9.0], np.float32),
                                  logit_bias_offsets=[0, 1, 2, 3], banned_token_ids=np.array([0, 1], np.int64),
                                  banned_offsets=[0, 2, 2, 2]),
    "logprobs raw": dict(seed=2, logprobs=5),
    "logprobs processed with kept": dict(seed=2, top_k=8, logprobs=3, logprobs_mode="processed", return_kept=True),
    "server-drawn seeds (echoed, then replayed)": None,
}


@pytest.mark.parametrize("case", sorted(SAMPLE_CASES))
def test_sample_answers_as_grpc(clients, case):
    options = SAMPLE_CASES[case]
    if options is None:
        # Seeds the server draws differ per call; the seeds it gives back replay the same rows.
        first = clients[1].sample(X)
        assert first.seeds.shape == (3,) and first.valid.all()
        options = dict(seed=first.seeds)
        assert_same(_both(clients, lambda c: c.sample(X, **options)), first)
    else:
        got = _both(clients, lambda c: c.sample(X, **options))
        assert got.valid.all() and got.token_ids.shape == (3,)


def test_a_large_request_grows_the_ports_slots(clients):
    """2 x 96000 float32 logits (768 KB) and their softmax (768 KB back): over the 64 KiB the
    ports start with, in both directions."""
    big = (RNG.standard_normal((2, 96000)) * 3).astype(np.float32)
    _both(clients, lambda c: c.sample(big, seed=[8, 9], logprobs=2))
    got = _both(clients, lambda c: c.softmax(big))
    np.testing.assert_allclose(got.sum(axis=1), 1.0, rtol=1e-4)


ROUTE_CASES = {
    "softmax top-k": dict(k=2),
    "renormalized": dict(k=3, renormalize=True),
    "grouped sigmoid with a bias": dict(k=4, scoring="sigmoid", n_group=4, topk_group=2, renormalize=True,
                                        correction_bias=np.linspace(-0.5, 0.5, 16).astype(np.float32),
                                        routed_scaling_factor=2.5),
    "grouped by max": dict(k=2, n_group=4, topk_group=1, group_score="max"),
}


@pytest.mark.parametrize("case", sorted(ROUTE_CASES))
def test_route_experts_answers_as_grpc(clients, case):
    weights, indices = _both(clients, lambda c: c.route_experts(GATES, **ROUTE_CASES[case]))
    assert weights.shape == indices.shape == (5, ROUTE_CASES[case]["k"])


def test_tensor_operators_answer_as_grpc(clients):
    scores = RNG.standard_normal((2, 3, 5)).astype(np.float32)
    up = RNG.standard_normal((3, 40)).astype(np.float16)
    _both(clients, lambda c: c.softmax(X))
    _both(clients, lambda c: c.softmax(X.reshape(3, 4, 10), dim=1))
    _both(clients, lambda c: c.softmax(X.astype(np.float16)))
    _both(clients, lambda c: c.causal_softmax(scores))
    _both(clients, lambda c: c.silu(X))
    _both(clients, lambda c: c.swiglu(X.astype(np.float16), up))
    _both(clients, lambda c: c.swiglu(X, X[:1]))  # broadcast


def test_verify_draft_answers_as_grpc(clients):
    target = RNG.standard_normal((2, 4, 12)).astype(np.float32)
    draft = RNG.standard_normal((2, 3, 12)).astype(np.float32)
    draft_ids = np.array([[1, 4, 2], [7, 7, 0]])
    got = _both(clients, lambda c: c.verify_draft(draft_ids, target, draft_logits=draft, draft_temperature=0.8,
                                                   seed=[3, 4], top_p=0.9))
    assert got.token_ids.shape == (2, 4)
    probs = np.exp(draft) / np.exp(draft).sum(-1, keepdims=True)
    _both(clients, lambda c: c.verify_draft(draft_ids, target, draft_probs=probs.astype(np.float32), seed=5))


def test_step_answers_as_grpc(clients):
    got = _both(clients, lambda c: c.step(id="s1", sample={"logits": X, "seed": 4, "logprobs": 2},
                                          route_experts={"gate_logits": GATES, "k": 2},
                                          softmax={"x": X}, causal_softmax={"x": X[:, :3]},
                                          swiglu={"gate": X, "up": X}))
    assert got.id == "s1" and got.silu is None and got.swiglu.shape == X.shape


def test_server_info_answers_as_grpc(clients, server):
    grpc_client, shm_client = clients
    expected, got = grpc_client.server_info(), shm_client.server_info()
    for name in ("version", "device", "device_name", "backend", "dtypes", "warmed_dtypes", "limits"):
        assert_same(getattr(got, name), getattr(expected, name), name)
    assert got.stats.keys() == expected.stats.keys()
    assert got.stats["launches"] == server.service.batcher.launches  # GetServerInfo launches nothing


def test_sequences_through_the_channel_answer_as_over_grpc(clients):
    """The same sequences opened, sampled by id, updated and closed over each transport: the
    same seeds, tokens, steps and closed ids (ids apart: without tokens both share one owner)."""
    grpc_client, shm_client = clients
    spec = dict(seed=21, top_k=6, repetition_penalty=1.2, prompt_token_ids=[1, 2, 3], logit_bias={4: 3.0})
    answers = []
    for client, first in ((grpc_client, 100), (shm_client, 200)):
        ids = [first, first + 1]
        opened = client.open_sequences([{"id": ids[0], **spec}, {"id": ids[1], **spec, "seed": 22}])
        tokens = [opened.sample(X[:2]).token_ids for _ in range(3)]
        steps = client.update_sequences([{"id": ids[0], "top_k": 2, "banned_token_ids": [int(tokens[-1][0])]}])
        after = opened.sample(X[:2], logprobs=2)
        closed = client.close_sequences(ids + [first + 50])
        answers.append((opened.seeds, tokens, steps, after, closed))
    (g_seeds, g_tokens, g_steps, g_after, g_closed), (s_seeds, s_tokens, s_steps, s_after, s_closed) = answers
    assert g_seeds == s_seeds == [21, 22]
    assert_same(s_tokens, g_tokens)
    assert g_steps == s_steps == [3]
    assert_same(s_after, g_after)
    assert [i - 100 for i in g_closed] == [i - 200 for i in s_closed] == [0, 1]


def test_a_channel_samples_sequences_opened_over_grpc(clients):
    """A caller's sequences are its own whichever transport opened them."""
    grpc_client, shm_client = clients
    grpc_client.open_sequences([{"id": 300, "seed": 5}])
    by_channel = shm_client.sample(X[:1], sequence_ids=[300])
    grpc_client.update_sequences([{"id": 300, "seed": 5}])  # the seed again, the step now 1
    assert shm_client.close_sequences([300]) == [300]
    with Client(shm_client.target) as again:
        again.open_sequences([{"id": 301, "seed": 5}])
        assert_same(again.sample(X[:1], sequence_ids=[301]), by_channel)
        again.close_sequences([301])


@pytest.fixture
def shared(server):
    """Input logits in a POSIX shared-memory object and an output array per client, registered
    by both clients (each under its own region scope)."""
    made = [regions.shared_array((3, 40), "float32"), regions.shared_array((2, 2), "int64"),
            regions.shared_array((2, 2), "int64"), regions.shared_array((2, 2, 2), "float32"),
            regions.shared_array((2, 2, 2), "int32")]
    made[0].array[:] = X
    yield made
    for buf in made:
        buf.array = None
        try:
            buf.shm.close()
        except BufferError:  # a view a failed assertion's traceback still holds
            pass
        buf.unlink()


def test_tensors_in_a_registered_region_answer_as_grpc(server, clients, shared):
    logits, tokens, seeds, weights, indices = shared
    for client in clients:
        client.register("logits", logits)
        client.register("outs", tokens)
        client.register("seeds", seeds)
        client.register("w", weights)
        client.register("i", indices)
    grpc_client, shm_client = clients
    try:
        answers = []
        for n, client in enumerate(clients):
            got = client.sample(logits.array[1:3], seed=[5, 6], logprobs=2,
                                out={"token_ids": tokens.array[n], "seeds": seeds.array[n]})
            assert got.token_ids is tokens.array[n] or np.shares_memory(got.token_ids, tokens.array)
            answers.append((got.token_ids.copy(), got.seeds.copy(), got.top_logprobs))
            routed = client.route_experts(logits.array[:2], 2, out=(weights.array[n], indices.array[n]))
            answers.append(tuple(np.array(part) for part in routed))
            answers.append(client.softmax(logits.array[:2, :8]))
        grpc_answers, shm_answers = answers[:3], answers[3:]
        assert_same(shm_answers, grpc_answers)
        np.testing.assert_array_equal(tokens.array[0], tokens.array[1])  # written in place by the server
        np.testing.assert_array_equal(weights.array[0], weights.array[1])
        leases = [info.in_use for info in server.service.regions.status("", None)]
        assert leases and not any(leases), leases  # every call's lease given back
    finally:
        for client in clients:
            client.unregister()


def test_async_client_answers_as_grpc(server):
    open_before = server.service.channels.open_channels

    async def main():
        async with AsyncClient(server.target, timeout=30) as over_grpc, \
                AsyncClient(server.target, timeout=30, channel="shm", retries=0) as over_shm:
            for options in (dict(seed=[1, 2, 3], logprobs=3), dict(temperature=0.0, seed=0), dict(seed=9, top_p=0.5)):
                assert_same(await over_shm.sample(X, **options), await over_grpc.sample(X, **options))
            for options in (dict(k=2), dict(k=4, scoring="sigmoid", n_group=4, topk_group=2)):
                assert_same(await over_shm.route_experts(GATES, **options),
                            await over_grpc.route_experts(GATES, **options))
            # Tasks side by side queue for the one channel: each gets its own answer.
            many = await asyncio.gather(*(over_shm.sample(X, seed=s) for s in range(6)))
            for s, got in enumerate(many):
                assert_same(got, await over_grpc.sample(X, seed=s))
            assert over_shm._same_host.is_open
            assert server.service.channels.open_channels == open_before + 1
        assert server.service.channels.open_channels == open_before  # closed with its client

    asyncio.run(main())


def test_threads_sharing_a_client_whose_channel_was_closed(server):
    """Threads calling through one client (their calls queue for its one channel) after the
    server closed that channel (as idle expiry does): every call is answered (the client opens a
    new channel and sends the call again), and the client holds one channel, none once closed."""
    open_before = server.service.channels.open_channels
    client = Client(server.target, timeout=20, channel="shm", retries=0)
    expected = [client.sample(X, seed=seed) for seed in range(4)]
    outcomes: collections.Counter = collections.Counter()
    held = []
    try:
        for _ in range(3):
            key = client._same_host.key  # None where a failed call left the client without a channel
            if key is not None:
                assert close_channel(server.target, key)
            start = threading.Barrier(4)

            def call(seed):
                start.wait()
                try:
                    assert_same(client.sample(X, seed=seed), expected[seed])
                    outcomes["OK"] += 1
                except Exception as exc:  # noqa: BLE001 - every failure counted by what it was
                    outcomes[f"{type(exc).__name__}: {exc}"[:120]] += 1

            callers = [threading.Thread(target=call, args=(seed,)) for seed in range(4)]
            for caller in callers:
                caller.start()
            for caller in callers:
                caller.join(30)
            held.append(server.service.channels.open_channels - open_before)
    finally:
        client.close()
    left = server.service.channels.open_channels - open_before
    assert (dict(outcomes), held, left) == ({"OK": 12}, [1, 1, 1], 0)


def _count(server, name, **labels):
    return server.service.metrics.registry.get_sample_value(name, labels) or 0.0


def test_channel_calls_count_in_the_rpc_metrics(server, clients):
    _, shm_client = clients
    shm_client.server_info()  # the channel opened before the counts are read
    before = {rpc: _count(server, "logitserve_requests_total", rpc=rpc) for rpc in ("Sample", "Softmax", "Silu")}
    failed = _count(server, "logitserve_failures_total", rpc="Sample", code="INVALID_ARGUMENT")
    latency = _count(server, "logitserve_request_latency_seconds_count", rpc="Softmax")
    for _ in range(3):
        shm_client.sample(X, seed=1)
    shm_client.softmax(X)
    shm_client.swiglu(X, X)
    with pytest.raises(Exception):
        shm_client.sample(X, top_p=2.0)
    server.run(asyncio.sleep(0.05))  # the guard reports on the loop's next turn
    assert _count(server, "logitserve_requests_total", rpc="Sample") == before["Sample"] + 4
    assert _count(server, "logitserve_requests_total", rpc="Softmax") == before["Softmax"] + 1
    assert _count(server, "logitserve_requests_total", rpc="Silu") == before["Silu"] + 1
    assert _count(server, "logitserve_failures_total", rpc="Sample", code="INVALID_ARGUMENT") == failed + 1
    assert _count(server, "logitserve_request_latency_seconds_count", rpc="Softmax") == latency + 1
    assert server.service.held.total == 0
