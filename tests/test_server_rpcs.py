"""Every RPC through an in-process server against the kernels called directly, on the torch and
interpret backends: same tokens for the same seeds, same values bit for bit (the server runs the
very kernels); Step, StreamSteps, and dynamic batching (fewer launches than calls, same tokens).
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from helpers import seeded_logits
from logitserve import kernels
from logitserve.client import AsyncClient, Client
from logitserve.server import ServerConfig
from logitserve.server.testing import ServerThread

BACKENDS = ("torch", "interpret")
# Long enough that calls started together on this (2-core, shared) machine meet in one group.
BATCH_DELAY_US = 50_000


@pytest.fixture(scope="module", params=BACKENDS)
def server(request):
    config = ServerConfig(host="127.0.0.1", port=0, device="cpu", backend=request.param, warmup_dtypes=(),
                          max_delay_us=BATCH_DELAY_US, max_batch_rows=64)
    with ServerThread(config) as s:
        yield s


def _backend(server) -> str:
    return server.config.backend


def _np(t: torch.Tensor) -> np.ndarray:
    """What the client returns for a server tensor: numpy, bfloat16 widened to float32."""
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


# ------------------------------------------------------------------------------------- Sample


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_sample_matches_kernel(server, client, dtype):
    logits = seeded_logits(4, 67, dtype)
    params = dict(temperature=[0.7, 1.0, 0.0, 1.3], top_k=[0, 5, 0, 20], top_p=[0.9, 1.0, 1.0, 0.5],
                  min_p=[0.0, 0.05, 0.0, 0.0], seed=[11, 12, 13, 14], step=[0, 3, 1, 7])
    result = client.sample(logits, **params)
    expect = kernels.sample(logits, temperature=torch.tensor(params["temperature"]), top_k=torch.tensor(params["top_k"]),
                            top_p=torch.tensor(params["top_p"]), min_p=torch.tensor(params["min_p"]),
                            seed=torch.tensor(params["seed"]), step=torch.tensor(params["step"]),
                            backend=_backend(server))
    assert result.token_ids.dtype == np.int64 and result.token_ids.shape == (4,)
    np.testing.assert_array_equal(result.token_ids, expect.numpy())
    np.testing.assert_array_equal(result.seeds, params["seed"])
    assert result.valid.all()
    assert result.token_ids[2] == int(logits[2].float().argmax())  # temperature 0: greedy


def test_sample_scalar_parameters_and_joint_order(server, client):
    logits = seeded_logits(3, 50, seed=1)
    for order in ("top_k_first", "joint"):
        result = client.sample(logits.numpy(), temperature=0.8, top_k=10, top_p=0.8, seed=5, step=2,
                               filter_order=order)
        expect = kernels.sample(logits, temperature=0.8, top_k=10, top_p=0.8, seed=5, step=2, filter_order=order,
                                backend=_backend(server))
        np.testing.assert_array_equal(result.token_ids, expect.numpy())
        np.testing.assert_array_equal(result.seeds, [5, 5, 5])


def test_sample_drawn_seeds_replay(server, client):
    logits = seeded_logits(3, 40, seed=2)
    first = client.sample(logits, temperature=1.5)
    assert first.seeds.dtype == np.int64 and (first.seeds >= 0).all()
    assert len(set(first.seeds.tolist())) == 3  # one fresh seed per row
    replay = client.sample(logits, temperature=1.5, seed=first.seeds)
    np.testing.assert_array_equal(replay.token_ids, first.token_ids)
    direct = kernels.sample(logits, temperature=1.5, seed=torch.from_numpy(first.seeds), backend=_backend(server))
    np.testing.assert_array_equal(first.token_ids, direct.numpy())


def test_sample_invalid_rows(server, client):
    logits = seeded_logits(3, 16, seed=3)
    logits[0, 4] = float("nan")
    logits[2] = float("-inf")
    result = client.sample(logits, seed=1)
    np.testing.assert_array_equal(result.valid, [False, True, False])
    assert result.token_ids[0] == -1 and result.token_ids[2] == -1 and 0 <= result.token_ids[1] < 16


def test_sample_random_val_matches_kernel(server, client):
    logits = seeded_logits(3, 30, seed=4)
    rv = [0.0, 0.5, 0.999]
    result = client.sample(logits, temperature=0.9, top_k=7, top_p=0.8, random_val=rv)
    expect = kernels.sample(logits, temperature=0.9, top_k=7, top_p=0.8, random_val=torch.tensor(rv),
                            backend=_backend(server))
    np.testing.assert_array_equal(result.token_ids, expect.numpy())


# Real vocabularies (Llama 2, Llama 3, Qwen 2): messages of up to 1.2 MB, and the kernels'
# multi-block paths (about 1.5 s a call on the interpreter here).
REAL_WIDTHS = (32000, 128256, 151936)


def test_sample_real_vocab_widths(server, client):
    backend = _backend(server)
    for vocab in REAL_WIDTHS:
        logits = seeded_logits(2, vocab, seed=5)
        result = client.sample(logits, temperature=0.7, top_p=0.95, seed=[1, 2])
        expect = kernels.sample(logits, temperature=0.7, top_p=0.95, seed=torch.tensor([1, 2]), backend=backend)
        np.testing.assert_array_equal(result.token_ids, expect.numpy(), err_msg=f"V={vocab}")


# ------------------------------------------------------------------------------ other operators


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("renormalize", [False, True])
def test_route_experts_matches_kernel(server, client, dtype, renormalize):
    gate = seeded_logits(5, 12, dtype, seed=6)
    weights, indices = client.route_experts(gate, 3, renormalize=renormalize)
    w, i = kernels.topk_softmax(gate, 3, renormalize=renormalize, backend=_backend(server))
    assert weights.dtype == np.float32 and indices.dtype == np.int32
    np.testing.assert_array_equal(weights, w.numpy())
    np.testing.assert_array_equal(indices, i.numpy())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_softmax_matches_kernel(server, client, dtype):
    x = seeded_logits(3, 33, dtype, seed=7)
    np.testing.assert_array_equal(client.softmax(x), _np(kernels.softmax(x, backend=_backend(server))))
    x3 = x.reshape(3, 3, 11)
    np.testing.assert_array_equal(client.softmax(x3, dim=0), _np(kernels.softmax(x3, dim=0, backend=_backend(server))))


@pytest.mark.parametrize("shape", [(4, 4), (3, 7), (2, 3, 5)])
def test_causal_softmax_matches_kernel(server, client, shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(8))
    out = client.causal_softmax(x)
    np.testing.assert_array_equal(out, kernels.causal_softmax(x, backend=_backend(server)).numpy())
    s, t = shape[-2:]
    assert (out[..., 0, t - s + 1:] == 0).all()  # the first row sees T - S + 1 columns


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_silu_and_swiglu_match_kernels(server, client, dtype):
    g = torch.Generator().manual_seed(9)
    gate, up = torch.randn(3, 10, generator=g).to(dtype), torch.randn(3, 10, generator=g).to(dtype)
    np.testing.assert_array_equal(client.silu(gate), _np(kernels.silu(gate, backend=_backend(server))))
    np.testing.assert_array_equal(client.swiglu(gate, up), _np(kernels.swiglu(gate, up, backend=_backend(server))))
    row = up[:1]  # broadcasting up [1, 10] over gate [3, 10]
    np.testing.assert_array_equal(client.swiglu(gate, row), _np(kernels.swiglu(gate, row, backend=_backend(server))))


# ---------------------------------------------------------------------------- Step, StreamSteps


def _step_args(i: int) -> dict:
    g = torch.Generator().manual_seed(100 + i)
    return dict(
        id=f"step-{i}",
        sample={"logits": torch.randn(2, 20, generator=g), "temperature": 0.9, "seed": [i, i + 1], "step": i},
        route_experts={"gate_logits": torch.randn(3, 8, generator=g), "k": 2, "renormalize": True},
        softmax={"x": torch.randn(2, 9, generator=g)},
        causal_softmax={"x": torch.randn(3, 4, generator=g)},
        swiglu={"gate": torch.randn(2, 6, generator=g), "up": torch.randn(2, 6, generator=g)},
    )


def _check_step(server, result, args) -> None:
    b = _backend(server)
    s = args["sample"]
    assert result.id == args["id"]
    tokens = kernels.sample(s["logits"], temperature=0.9, seed=torch.tensor(s["seed"]), step=s["step"], backend=b)
    np.testing.assert_array_equal(result.sample.token_ids, tokens.numpy())
    w, i = kernels.topk_softmax(args["route_experts"]["gate_logits"], 2, renormalize=True, backend=b)
    np.testing.assert_array_equal(result.route_experts[0], w.numpy())
    np.testing.assert_array_equal(result.route_experts[1], i.numpy())
    np.testing.assert_array_equal(result.softmax, kernels.softmax(args["softmax"]["x"], backend=b).numpy())
    np.testing.assert_array_equal(result.causal_softmax,
                                  kernels.causal_softmax(args["causal_softmax"]["x"], backend=b).numpy())
    sw = args["swiglu"]
    # Read under the name asked, though SwiGLU's answer shares the silu slot on the wire.
    assert result.silu is None
    np.testing.assert_array_equal(result.swiglu, kernels.swiglu(sw["gate"], sw["up"], backend=b).numpy())


def test_step_runs_every_operator(server, client):
    args = _step_args(0)
    _check_step(server, client.step(**args), args)


def test_step_with_a_subset(server, client):
    result = client.step(softmax={"x": np.ones((1, 4), np.float32)})
    assert result.sample is None and result.route_experts is None and result.silu is None and result.swiglu is None
    np.testing.assert_allclose(result.softmax, 0.25)
    x = np.zeros((1, 4), np.float32)
    result = client.step(silu={"x": x})
    assert result.swiglu is None
    np.testing.assert_array_equal(result.silu, x)


def test_stream_steps_in_order(server, client):
    steps = [_step_args(i) for i in range(3)]
    results = list(client.stream_steps(steps))
    assert [r.id for r in results] == ["step-0", "step-1", "step-2"]
    for result, args in zip(results, steps):
        _check_step(server, result, args)


def test_stream_steps_feeds_back_tokens(server, client):
    # A decode loop: each step's logits depend on the previous step's token.
    import queue

    pending: queue.Queue = queue.Queue()
    pending.put({"id": "0", "sample": {"logits": seeded_logits(1, 10, seed=0), "temperature": 0.0}})
    tokens = []
    for result in client.stream_steps(iter(pending.get, None)):
        tokens.append(int(result.sample.token_ids[0]))
        if len(tokens) == 4:
            pending.put(None)
        else:
            logits = seeded_logits(1, 10, seed=len(tokens))
            logits[0, (tokens[-1] + 1) % 10] = 100.0  # greedy picks the successor of the last token
            pending.put({"id": str(len(tokens)), "sample": {"logits": logits, "temperature": 0.0}})
    assert tokens[1:] == [(t + 1) % 10 for t in tokens[:-1]]


def test_async_client_stream_and_calls(server):
    async def main():
        async with AsyncClient(server.target, timeout=120) as c:
            x = np.linspace(-3, 3, 12, dtype=np.float32).reshape(2, 6)
            np.testing.assert_array_equal(await c.silu(x), kernels.silu(torch.from_numpy(x),
                                                                        backend=_backend(server)).numpy())
            results = [r async for r in c.stream_steps(_step_args(i) for i in range(2))]
            info = await c.server_info()
        return results, info

    results, info = asyncio.run(main())
    for result, i in zip(results, range(2)):
        _check_step(server, result, _step_args(i))
    assert info.backend == _backend(server) and info.device == "cpu"


# ------------------------------------------------------------------------------------ batching


def test_concurrent_samples_share_launches(server, client):
    n = 8
    rows = [seeded_logits(1, 64, seed=200 + i) for i in range(n)]
    kwargs = [dict(temperature=0.5 + 0.1 * i, top_k=[0, 8][i % 2], top_p=[1.0, 0.9][i % 2], seed=1000 + i, step=i)
              for i in range(n)]
    batcher = server.service.batcher
    before = batcher.launches
    results: list = [None] * n
    barrier = threading.Barrier(n)

    def call(i):
        with Client(server.target, timeout=120) as c:
            barrier.wait()
            results[i] = c.sample(rows[i], **kwargs[i])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    launches = batcher.launches - before
    assert launches < n, f"{n} concurrent single-row calls took {launches} launches"
    one_by_one = [client.sample(rows[i], **kwargs[i]) for i in range(n)]
    for i in range(n):
        np.testing.assert_array_equal(results[i].token_ids, one_by_one[i].token_ids)


def test_concurrent_route_experts_share_launches(server):
    gates = [seeded_logits(2, 16, seed=300 + i) for i in range(6)]

    async def main():
        async with AsyncClient(server.target, timeout=120) as c:
            return await asyncio.gather(*(c.route_experts(g, 4) for g in gates))

    before = server.service.batcher.launches
    results = asyncio.run(main())
    assert server.service.batcher.launches - before < len(gates)
    for (w, i), g in zip(results, gates):
        ew, ei = kernels.topk_softmax(g, 4, backend=_backend(server))
        np.testing.assert_array_equal(w, ew.numpy())
        np.testing.assert_array_equal(i, ei.numpy())


def test_server_info(server, client):
    info = client.server_info()
    assert info.backend == _backend(server) and info.device == "cpu"
    assert info.dtypes == ("float16", "bfloat16", "float32", "float64")
    assert info.limits["max_batch_rows"] == 64 and info.limits["max_delay_us"] == BATCH_DELAY_US
    assert info.stats["launches"] == server.service.batcher.launches
