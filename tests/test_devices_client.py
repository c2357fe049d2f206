"""The client on a server of a process per device: each call reaches the process of its
tensors' device (client/devices.py), checked by which real server process served it.

Two CPU server processes are told (``--device-endpoints``, what ``--devices`` tells its own)
that they are cuda:0's and cuda:1's; the client's target is the first. This machine has no GPU,
so the one thing faked is the client's reading of a tensor's device (``tensor_device``): the
tensors named ``on[1]`` are taken to be on cuda:1, and travel as bytes, as CUDA tensors outside a
region do."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from logitserve.client import AsyncClient, Client, device_routes, regions
from logitserve.client.device_routes import dialled, target_host
from logitserve.server.process import ServerProcess, free_ports


@pytest.fixture(scope="module")
def servers():
    first, second = free_ports(1), free_ports(1)
    while second == first:
        second = free_ports(1)
    endpoints = f"cuda:0=127.0.0.1:{first},cuda:1=127.0.0.1:{second}"
    flags = ("--device-endpoints", endpoints, "--warmup-dtypes", "none", "--busy-poll-us", "0")
    with ServerProcess(*flags, port=first) as zero, ServerProcess(*flags, port=second) as one:
        yield zero, one


@pytest.fixture
def on(monkeypatch):
    """``on[i]``: tensors the client reads as lying on cuda:i (by identity)."""
    devices: dict[int, list] = {0: [], 1: []}
    monkeypatch.setattr(device_routes, "tensor_device",
                        lambda x: next((d for d, xs in devices.items() if any(x is t for t in xs)), None))
    return devices


def served(server) -> int:
    """Calls the process has served (its counter, read through a client of its own)."""
    with Client(server.target, timeout=30) as c:
        return c.server_info().stats["batched_requests"]


def rows(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((2, 16)).astype(np.float32)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def test_each_call_goes_to_its_devices_process(servers, on):
    zero, one = servers
    x0, x1, host = rows(0), rows(1), rows(2)
    on[0].append(x0)
    on[1].append(x1)
    with Client(zero.target, timeout=60) as client:
        info = client.server_info()
        assert info.device_endpoints == {"cuda:0": zero.target, "cuda:1": one.target}
        before = served(zero), served(one)
        np.testing.assert_allclose(client.softmax(x1), softmax(x1), rtol=1e-5)
        assert (served(zero), served(one)) == (before[0], before[1] + 1)
        np.testing.assert_allclose(client.softmax(x0), softmax(x0), rtol=1e-5)
        np.testing.assert_allclose(client.softmax(host), softmax(host), rtol=1e-5)  # no CUDA tensor: the target
        assert (served(zero), served(one)) == (before[0] + 2, before[1] + 1)
        with pytest.raises(ValueError, match=r"Silu: a call runs in one process .* memory on cuda:0 at the target "
                                             rf"127\.0\.0\.1:{zero.port}; memory on cuda:1 at cuda:1's process"):
            client.swiglu(x0, x1)
        assert (served(zero), served(one)) == (before[0] + 2, before[1] + 1)  # refused before anything was sent


def test_an_async_client_learns_the_processes_at_its_first_cuda_call(servers, on):
    zero, one = servers
    x1 = rows(3)
    on[1].append(x1)

    async def calls():
        async with AsyncClient(zero.target, timeout=60) as client:
            first = await client.softmax(x1)  # learns the list (GetServerInfo), then calls cuda:1's process
            device_client = await client.on_device(1)
            return first, await client.softmax(x1), device_client.target, (await client.on_device(0)) is client

    before = served(zero), served(one)
    first, second, device_target, zero_is_target = asyncio.run(calls())
    np.testing.assert_allclose(first, softmax(x1), rtol=1e-5)
    np.testing.assert_allclose(second, softmax(x1), rtol=1e-5)
    assert device_target == one.target and zero_is_target
    assert (served(zero), served(one)) == (before[0], before[1] + 2)


def test_a_region_registered_at_a_device_process_takes_its_calls_there(servers, on):
    zero, one = servers
    x0 = rows(4)
    on[0].append(x0)
    buf = regions.shared_copy(rows(5))
    out = regions.shared_array((2, 16), np.float32)
    try:
        with Client(zero.target, timeout=60) as client, Client(one.target, timeout=60) as other:
            device_client = client.on_device(1)
            device_client.register_system("logits", buf)
            device_client.register_system("probs", out)
            assert client.registered == ["logits", "probs"]
            assert [s.name for s in client.shared_memory_status()] == ["logits", "probs"]
            before = served(zero), served(one)
            client.softmax(buf.array, out=out.array)  # names only cuda:1's process's regions: goes there
            np.testing.assert_allclose(out.array, softmax(buf.array), rtol=1e-5)
            assert (served(zero), served(one)) == (before[0], before[1] + 1)
            with pytest.raises(ValueError, match=r"names memory on cuda:0 at the target .*; region 'logits' at "
                                                 r"cuda:1's process"):
                client.swiglu(buf.array, x0)
            with pytest.raises(ValueError, match=r"register_system: 'logits' is registered at 127\.0\.0\.1:"):
                client.register_system("logits", buf)
            held = {s.name for s in other.shared_memory_status(all_of_caller=True)}
            assert {client.server_name("logits"), client.server_name("probs")} <= held
            assert client.unregister("logits") == ["logits"]  # at the process that holds it
            assert client.registered == ["probs"]
        # Closing the client closed its device client, which unregistered what it held.
        with Client(one.target, timeout=60) as other:
            assert not [s for s in other.shared_memory_status(all_of_caller=True) if s.name.endswith(".probs")]
    finally:
        for b in (buf, out):
            b.array = b.tensor = None
            b.shm.close()
            b.unlink()


def test_sequence_ids_belong_to_the_targets_process(servers, on):
    zero, _ = servers
    x1 = rows(6)
    on[1].append(x1)
    with Client(zero.target, timeout=60) as client:
        with client.open_sequences([{"id": 1, "seed": 7}, {"id": 2, "seed": 8}]) as seqs:
            with pytest.raises(ValueError, match=r"memory on cuda:1 at cuda:1's process .*; sequence ids \(opened "
                                                 r"at the target\) at the target"):
                seqs.sample(x1)
            assert seqs.sample(rows(7)).token_ids.shape == (2,)  # host logits: the target, where they are


@pytest.mark.parametrize("address, target, expected", [
    ("0.0.0.0:50052", "gpu-host:50051", "gpu-host:50052"),
    ("[::]:50052", "[::1]:50051", "[::1]:50052"),
    ("0.0.0.0:50052", "dns:///gpu-host.internal:50051", "gpu-host.internal:50052"),
    ("0.0.0.0:50052", "dns://10.0.0.2:53/gpu-host:50051", "gpu-host:50052"),
    ("0.0.0.0:50052", "ipv4:10.0.0.7:50051,10.0.0.8:50051", "10.0.0.7:50052"),
    ("10.0.0.9:50052", "gpu-host:50051", "10.0.0.9:50052"),  # a host of its own is kept
])
def test_an_any_address_is_read_as_the_host_the_client_dialled(address, target, expected):
    assert dialled(address, target) == expected
    assert target_host("gpu-host") == "gpu-host"
