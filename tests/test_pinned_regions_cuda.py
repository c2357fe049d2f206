"""System shared memory on a CUDA server is page-locked at registration (server/regions/pinning.py):
the device copies a call's logits straight from the client's region (one DMA copy, no staging)
and writes its outputs back there, and a lone call on a reused region replays a CUDA graph that
holds both copies. Each answer follows its own call's region contents."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import HAS_CUDA
from logitserve import kernels
from logitserve.client import Client
from logitserve.client import regions as client_regions
from logitserve.server.config import ServerConfig
from logitserve.server.regions import RegionRegistry
from logitserve.server.testing import ServerThread
from logitserve.v1 import logitserve_pb2 as pb

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]

DEVICE = "cuda:0"


def test_a_registered_system_region_is_page_locked_until_unregistered():
    buf = client_regions.shared_array((3, 1000), "float32")
    registry = RegionRegistry(pin_system=True)
    ref = pb.RegionRef(region="r", offset=4000, byte_size=4000)
    try:
        # Registered again after each unregister: the kernel maps the object at the address it
        # just freed, where pages left locked would make CUDA refuse to lock them again.
        addresses = set()
        for _ in range(3):
            registry.register_system("r", buf.key, 0, buf.byte_size)
            with registry.resolve(ref, torch.float32, (1000,)) as lease:
                assert lease.pinned and lease.tensor().is_pinned()
                addresses.add(lease.tensor().data_ptr())
            registry.unregister("r")
        assert len(addresses) < 3  # an address was mapped twice, so the test shows what it claims
        # Unpinned registries (a CPU server) leave regions unmapped: read through the descriptor.
        plain = RegionRegistry()
        plain.register_system("r", buf.key, 0, buf.byte_size)
        with plain.resolve(ref, torch.float32, (1000,)) as lease:
            assert not lease.pinned and not lease.copy_out().is_pinned()
            with pytest.raises(RuntimeError, match="not mapped"):
                lease.tensor()
        plain.close()
    finally:
        registry.close()
        buf.close()
        buf.unlink()


@pytest.fixture(scope="module")
def server():
    config = ServerConfig(port=0, host="127.0.0.1", device=DEVICE, backend="triton")
    with ServerThread(config, warm_up=False, start_timeout=600) as s:
        yield s


@pytest.mark.parametrize("dtype, rows", [(torch.float32, 4), (torch.bfloat16, 4), (torch.float32, 1)])
def test_a_reused_system_region_replays_a_graph_that_follows_each_call(server, dtype, rows):
    vocab = 50021
    logits_buf = client_regions.shared_tensor((rows, vocab), dtype)
    out_buf = client_regions.shared_array((rows,), "int64")
    seeds_buf = client_regions.shared_array((rows,), "int64")
    valid_buf = client_regions.shared_array((rows,), "bool")
    graphs = server.service.handle.graphs
    with Client(server.target, timeout=600) as client:
        client.register("in", logits_buf)
        client.register("out", out_buf)
        client.register("seeds", seeds_buf)
        client.register("valid", valid_buf)
        captures, replays = graphs.captures, graphs.replays
        try:
            for i in range(5):
                g = torch.Generator().manual_seed(100 + i)
                logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
                logits_buf.tensor.copy_(logits)
                seeds = np.arange(rows, dtype=np.int64) + 10 * i
                for buf in (out_buf, seeds_buf):
                    buf.array[:] = -1  # poisoned: every output must be written by this call
                valid_buf.array[:] = False
                result = client.sample(logits_buf.tensor, temperature=0.7 + 0.1 * i, top_k=40, seed=seeds, step=i,
                                       out={"token_ids": out_buf.array, "seeds": seeds_buf.array,
                                            "valid": valid_buf.array})
                expect = kernels.sample(logits.to(DEVICE), temperature=0.7 + 0.1 * i, top_k=40,
                                        seed=torch.from_numpy(seeds).to(DEVICE), step=i, backend="triton")
                np.testing.assert_array_equal(out_buf.array, expect.cpu().numpy(), err_msg=f"call {i}")
                np.testing.assert_array_equal(np.asarray(result.token_ids), expect.cpu().numpy())
                np.testing.assert_array_equal(seeds_buf.array, seeds)
                assert valid_buf.array.all()
        finally:
            client.unregister()
    # The first call launched eagerly, the second captured, the last three replayed.
    assert graphs.captures - captures == 1 and graphs.replays - replays >= 3
    for buf in (logits_buf, out_buf, seeds_buf, valid_buf):
        buf.close()
        buf.unlink()
