"""RouteExperts with the router options through an in-process server: one call per model
configuration against the kernel called directly (bit for bit: the server runs the very
kernel), batching that never mixes options or biases, and INVALID_ARGUMENT naming the field
and the rule.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch

from logitserve import kernels
from logitserve.client import AsyncClient
from logitserve.server import ServerConfig
from logitserve.server.testing import ServerThread
from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

from test_route_experts import CONFIGS, logits_and_bias

BATCH_DELAY_US = 50_000


@pytest.fixture(scope="module", params=("torch", "interpret"))
def server(request):
    config = ServerConfig(host="127.0.0.1", port=0, device="cpu", backend=request.param, warmup_dtypes=(),
                          max_delay_us=BATCH_DELAY_US, max_batch_rows=64)
    with ServerThread(config) as s:
        yield s


def _direct(server, x, k, bias, options):
    w, i = kernels.route_experts(x, k, correction_bias=bias, backend=server.config.backend, **options)
    return w.numpy(), i.numpy()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_config_matches_the_kernel(server, client, name):
    e, k, options, with_bias = CONFIGS[name]
    gen = torch.Generator().manual_seed(len(name))
    x, bias = logits_and_bias(5, e, with_bias, gen)
    x = x.to(torch.bfloat16)
    weights, indices = client.route_experts(x, k, correction_bias=None if bias is None else bias.numpy(), **options)
    want_w, want_i = _direct(server, x, k, bias, options)
    np.testing.assert_array_equal(indices, want_i)
    np.testing.assert_array_equal(weights, want_w)


def test_step_takes_the_options(server, client):
    e, k, options, _ = CONFIGS["deepseek-v3"]
    x, bias = logits_and_bias(3, e, True, torch.Generator().manual_seed(3))
    result = client.step(id="s", route_experts=dict(gate_logits=x, k=k, correction_bias=bias, **options))
    want_w, want_i = _direct(server, x, k, bias, options)
    np.testing.assert_array_equal(result.route_experts[1], want_i)
    np.testing.assert_array_equal(result.route_experts[0], want_w)


def test_calls_with_different_options_or_biases_do_not_share_a_launch(server):
    e, k, options, _ = CONFIGS["deepseek-v3"]
    gen = torch.Generator().manual_seed(7)
    x, _ = logits_and_bias(4, e, False, gen)
    biases = [logits_and_bias(1, e, True, gen)[1] for _ in range(3)]
    calls = [dict(correction_bias=b.numpy(), **options) for b in biases]
    calls += [dict(), dict(scoring="sigmoid"), dict(options, group_score="max", correction_bias=biases[0].numpy())]

    async def run():
        async with AsyncClient(server.target, timeout=120) as c:
            return await asyncio.gather(*(c.route_experts(x, k, **kw) for kw in calls))

    results = server.run(run(), timeout=300)
    for kw, (w, i) in zip(calls, results):
        bias = kw.pop("correction_bias", None)
        want_w, want_i = _direct(server, x, k, None if bias is None else torch.from_numpy(bias), kw)
        np.testing.assert_array_equal(i, want_i)
        np.testing.assert_array_equal(w, want_w)


def _tensor(a) -> pb.Tensor:
    a = np.ascontiguousarray(a)
    dtype = {np.dtype("float32"): pb.DTYPE_FLOAT32, np.dtype("float64"): pb.DTYPE_FLOAT64}[a.dtype]
    return pb.Tensor(dtype=dtype, shape=list(a.shape), data=a.tobytes())


G = _tensor(np.zeros((2, 16), np.float32))
BAD = {
    "n_group not dividing E": (dict(k=2, n_group=3), "n_group: must be >= 1 and divide E = 16, got 3"),
    "negative n_group": (dict(k=2, n_group=-2), "n_group: must be >= 1"),
    "topk_group > n_group": (dict(k=2, n_group=4, topk_group=5),
                             "topk_group: must satisfy 1 <= topk_group <= n_group"),
    "k over the kept groups": (dict(k=5, n_group=4, topk_group=1),
                               "k: must satisfy 1 <= k <= topk_group * E / n_group = 4"),
    "top2 of one expert": (dict(k=2, n_group=16, topk_group=8), "group_score: 'top2_sum' needs >= 2 experts a group"),
    "unknown scoring": (dict(k=2, scoring=7), "scoring: must be SCORING_UNSPECIFIED"),
    "unknown group score": (dict(k=2, group_score=5), "group_score: must be GROUP_SCORE_UNSPECIFIED"),
    "scale 0": (dict(k=2, routed_scaling_factor=0.0), "routed_scaling_factor: must be finite and > 0"),
    "scale nan": (dict(k=2, routed_scaling_factor=float("nan")), "routed_scaling_factor: must be finite"),
    "bias of 15": (dict(k=2, correction_bias=_tensor(np.zeros(15, np.float32))),
                   "correction_bias.shape: must be [E] = [16], got [15]"),
    "bias float64": (dict(k=2, correction_bias=_tensor(np.zeros(16, np.float64))), "correction_bias.dtype"),
    "bias of rank 2": (dict(k=2, correction_bias=_tensor(np.zeros((1, 16), np.float32))), "correction_bias"),
    "bias not finite": (dict(k=2, correction_bias=_tensor(np.full(16, np.inf, np.float32))),
                        "correction_bias: must be finite"),
}


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.LogitServeStub(channel)


@pytest.mark.parametrize("case", list(BAD))
def test_bad_options_are_invalid_argument(stub, case):
    fields, message = BAD[case]
    with pytest.raises(grpc.RpcError) as err:
        stub.RouteExperts(pb.RouteExpertsRequest(gate_logits=G, **fields), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details(), err.value.details()
