"""The server on a GPU (compiled Triton kernels, pinned staging, per-row parameters): every RPC equals
the kernels called directly on the same device, alone and when concurrent calls share launches.
Runs where CUDA is present (``-k cuda``).
"""

from __future__ import annotations

import concurrent.futures
import time

import numpy as np
import pytest
import torch

from helpers import seeded_logits
from logitserve import kernels
from logitserve.server import ServerConfig
from logitserve.server.testing import ServerThread

pytestmark = pytest.mark.cuda
DEVICE = "cuda:0"


@pytest.fixture(scope="module")
def server():
    config = ServerConfig(host="127.0.0.1", port=0, device=DEVICE, backend="triton", warmup_dtypes=("bfloat16",),
                          max_batch_rows=256)
    with ServerThread(config) as s:
        yield s


def _direct_sample(logits: torch.Tensor, **params) -> np.ndarray:
    on_device = {k: torch.tensor(v, device=DEVICE) if isinstance(v, list) else v for k, v in params.items()}
    return kernels.sample(logits.to(DEVICE), backend="triton", **on_device).cpu().numpy()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sample_per_row_and_scalar_parameters(client, dtype):
    logits = seeded_logits(4, 128256, dtype, seed=1)
    rows = dict(temperature=[0.7, 1.0, 0.0, 1.3], top_k=[0, 50, 0, 20], top_p=[0.9, 1.0, 1.0, 0.5],
                min_p=[0.0, 0.05, 0.0, 0.0], seed=[11, 12, 13, 14], step=[0, 3, 1, 7])
    np.testing.assert_array_equal(client.sample(logits, **rows).token_ids, _direct_sample(logits, **rows))
    scalars = dict(temperature=0.8, top_k=50, top_p=0.9, seed=5, step=2)
    np.testing.assert_array_equal(client.sample(logits, **scalars).token_ids, _direct_sample(logits, **scalars))


def test_concurrent_samples_share_launches_and_match_alone(server, client):
    logits = seeded_logits(48, 32000, torch.bfloat16, seed=2)
    params = [dict(temperature=0.5 + 0.02 * i, top_k=(0, 20, 50)[i % 3], top_p=0.8 + 0.004 * i, seed=100 + i, step=i)
              for i in range(48)]
    alone = [client.sample(logits[i:i + 1], **p).token_ids[0] for i, p in enumerate(params)]
    batcher = server.service.batcher
    launches = batcher.launches
    # Each launch takes 20 ms more, as a busy device would: calls arriving meanwhile share the
    # next one. (Without it, the GPU finishes each call before the in-process clients send the next.)
    server.service.handle.before_launch = lambda calls: time.sleep(0.02)
    try:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            together = list(pool.map(lambda i: client.sample(logits[i:i + 1], **params[i]).token_ids[0], range(48)))
    finally:
        server.service.handle.before_launch = None
    assert together == alone
    assert batcher.launches - launches < 48


def test_route_experts_softmax_and_activations(client):
    gate = seeded_logits(64, 256, torch.bfloat16, seed=3)
    weights, indices = client.route_experts(gate, 8)
    w, i = kernels.topk_softmax(gate.to(DEVICE), 8, backend="triton")
    np.testing.assert_array_equal(weights, w.cpu().numpy())
    np.testing.assert_array_equal(indices, i.cpu().numpy())

    x = seeded_logits(3, 4099, torch.float32, seed=4)
    np.testing.assert_array_equal(client.softmax(x), kernels.softmax(x.to(DEVICE)).cpu().numpy())
    scores = seeded_logits(2 * 5, 9, torch.float32, seed=5).reshape(2, 5, 9)
    np.testing.assert_array_equal(client.causal_softmax(scores), kernels.causal_softmax(scores.to(DEVICE)).cpu().numpy())
    up = seeded_logits(3, 4099, torch.float32, seed=6)
    np.testing.assert_array_equal(client.silu(x), kernels.silu(x.to(DEVICE)).cpu().numpy())
    np.testing.assert_array_equal(client.swiglu(x, up), kernels.swiglu(x.to(DEVICE), up.to(DEVICE)).cpu().numpy())


@pytest.mark.parametrize("from_logits", [False, True], ids=["draft probs", "draft logits"])
def test_verify_draft_equals_the_kernel(client, from_logits):
    target = seeded_logits(4 * 5, 128256, torch.bfloat16, seed=7).reshape(4, 5, 128256)
    draft_logits = seeded_logits(4 * 4, 128256, torch.float32, seed=8).reshape(4, 4, 128256) + \
        target[:, :4].float()
    q = torch.softmax(draft_logits, -1)
    ids = torch.multinomial(q.reshape(-1, 128256), 1, generator=torch.Generator().manual_seed(9)).reshape(4, 4)
    rows = dict(temperature=[0.7, 1.0, 0.0, 1.3], top_k=[0, 50, 0, 20], top_p=[0.9, 1.0, 1.0, 0.5],
                min_p=[0.0, 0.05, 0.0, 0.0], seed=[11, 12, 13, 14], step=[0, 3, 1, 7])
    draft = dict(draft_logits=draft_logits, draft_temperature=0.9) if from_logits else dict(draft_probs=q)
    got = client.verify_draft(ids, target, **draft, **rows)
    on_device = {k: torch.tensor(v, device=DEVICE) for k, v in rows.items()}
    want = kernels.verify(ids.to(DEVICE), target.to(DEVICE), **{k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v
                                                                  for k, v in draft.items()},
                          backend="triton", **on_device)
    np.testing.assert_array_equal(got.token_ids, want.token_ids.cpu().numpy())
    np.testing.assert_array_equal(got.num_accepted, want.num_accepted.cpu().numpy())
    assert got.valid.all()
