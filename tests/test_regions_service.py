"""The SharedMemory service through a grpc.aio server (guarded, with token auth) and the client's
region helpers; on a GPU, a CUDA region registered from another process. The registry itself:
test_regions.py; regions on the request path: test_zero_copy*.py."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading

import grpc
import numpy as np
import pytest
import torch

from logitserve.client import AsyncClient, Client, LogitServeError
from logitserve.client import regions as client_regions
from logitserve.server.regions import servicer as regions_servicer
from logitserve.server.api.auth import TokenStore
from logitserve.server.api.guard import Guard, GuardedRegistrar
from logitserve.server.regions import RegionRegistry, owner_of
from logitserve.v1 import logitserve_pb2 as pb


def ref(region: str, offset: int, byte_size: int) -> pb.RegionRef:
    return pb.RegionRef(region=region, offset=offset, byte_size=byte_size)


# ------------------------------------------------------------------------ the SharedMemory service


class ShmServer:
    """A grpc.aio server with only the SharedMemory service (guarded, with token auth) on its
    own event loop thread."""

    def __init__(self, registry: RegionRegistry, tokens: TokenStore):
        self.registry = registry
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.port = self.run(self._start(tokens))

    async def _start(self, tokens):
        self.server = grpc.aio.server()
        regions_servicer.add_to_server(self.registry, GuardedRegistrar(self.server, Guard(tokens=tokens)))
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return port

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def close(self):
        self.run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="module")
def shm_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("auth") / "tokens"
    path.write_text("alice\nbob\n")
    server = ShmServer(RegionRegistry(max_regions=8, max_mapped_bytes=1 << 20, devices={0}), TokenStore(str(path)))
    yield server
    server.close()


def test_service_end_to_end_with_the_client(shm_server):
    registry = shm_server.registry
    # region_scope=None: the server's names are the names written (the test reads the registry).
    with client_regions.shared_array((4, 8), "float32") as buf, \
            Client(shm_server.target, token="alice", timeout=30, region_scope=None) as alice, \
            Client(shm_server.target, token="bob", timeout=30, region_scope=None) as bob:
        assert alice.register_system("logits", buf) is None  # key and byte_size from the buffer
        alice.register_system("tail", buf.key, 32, offset=96)
        status = alice.shared_memory_status()
        assert [(s.name, s.kind, s.key, s.offset, s.byte_size, s.in_use) for s in status] == [
            ("logits", "system", buf.key, 0, 128, 0), ("tail", "system", buf.key, 96, 32, 0)]
        assert alice.shared_memory_status("tail", kind="system")[0].offset == 96
        assert alice.shared_memory_status(kind="cuda") == []

        buf.array[:] = np.arange(32, dtype=np.float32).reshape(4, 8)
        with registry.resolve(buf.ref("logits"), torch.float32, (4, 8), owner_of("Bearer alice"), "logits") as lease:
            assert np.array_equal(lease.copy_out().numpy(), buf.array)
            assert registry.status("logits", owner_of("Bearer alice"))[0].in_use == 1
            assert alice.shared_memory_status("logits")[0].in_use == 1

        def code(call):
            with pytest.raises(LogitServeError) as info:
                call()
            return info.value.code, info.value.details

        assert code(lambda: alice.register_system("logits", buf)) == (
            grpc.StatusCode.ALREADY_EXISTS, "name: a region 'logits' is already registered; unregister it first")
        assert code(lambda: alice.shared_memory_status("nope"))[0] == grpc.StatusCode.NOT_FOUND
        c, details = code(lambda: alice.register_system("x", "../etc/passwd", 8))
        assert c == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("key: '../etc/passwd' is not a plain")
        c, details = code(lambda: alice.register_system("x", buf.key, 1 << 20))
        assert c == grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith("byte_size: registering 'x'")
        c, details = code(lambda: alice.register_cuda("x", b"\0" * 64, device_id=1, byte_size=8))
        assert c == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("device_id: 1 is not a device of this")
        c, details = code(lambda: alice.register_cuda("x", b"\0" * 10, device_id=0, byte_size=8))
        assert c == grpc.StatusCode.INVALID_ARGUMENT and "raw_handle: 10 bytes" in details
        with Client(shm_server.target, timeout=30) as nobody:
            assert code(lambda: nobody.shared_memory_status())[0] == grpc.StatusCode.UNAUTHENTICATED

        assert bob.shared_memory_status() == []  # alice's regions are alice's
        assert code(lambda: bob.shared_memory_status("logits"))[0] == grpc.StatusCode.NOT_FOUND
        assert bob.unregister("logits") == []
        bob.register_system("logits", buf)
        assert bob.unregister() == ["logits"]

        assert alice.unregister("nope") == []
        assert alice.unregister(kind="cuda") == []
        assert alice.unregister() == ["logits", "tail"]
        assert alice.shared_memory_status() == [] and registry.mapped_count == 0


def test_service_through_the_async_client(shm_server):
    async def main():
        with client_regions.shared_tensor((3, 5), torch.bfloat16) as buf:
            async with AsyncClient(shm_server.target, token="bob", timeout=30, region_scope=None) as bob:
                await bob.register_system("x", buf)
                buf.tensor.copy_(torch.linspace(-1, 1, 15).view(3, 5))
                with shm_server.registry.resolve(buf.ref("x"), torch.bfloat16, (3, 5), owner_of("Bearer bob")) as lease:
                    assert torch.equal(lease.copy_out(), buf.tensor)
                assert [s.name for s in await bob.shared_memory_status()] == ["x"]
                assert await bob.unregister("x") == ["x"]
    asyncio.run(main())


def test_client_helpers_copy_once_and_describe_regions():
    x = np.arange(6, dtype=">f4").reshape(2, 3)  # big-endian: stored little-endian
    with client_regions.shared_copy(x) as buf:
        assert buf.array.dtype == np.dtype("<f4") and np.array_equal(buf.array, x) and buf.byte_size == 24
        assert buf.ref("r", 8) == pb.RegionRef(region="r", offset=8, byte_size=16)
    assert not os.path.exists(f"/dev/shm/{buf.key}")
    t = torch.arange(4, dtype=torch.int64)
    with client_regions.shared_copy(t) as buf:
        assert torch.equal(buf.tensor, t)
    msg = client_regions.region_tensor("r", "bfloat16", [2, 3], offset=4)
    assert (msg.dtype, list(msg.shape), msg.data, msg.region) == (
        pb.DTYPE_BFLOAT16, [2, 3], b"", pb.RegionRef(region="r", offset=4, byte_size=12))
    assert client_regions.region_tensor("r", torch.float32, [2]).region.byte_size == 8
    assert client_regions.region_tensor("r", np.int32, [3]).dtype == pb.DTYPE_INT32
    with pytest.raises(TypeError, match="device_id and byte_size are required"):
        client_regions.cuda_request("r", b"\0" * 64, None, 8, 0)


# ------------------------------------------------------------------------------------------ CUDA

# The client process: a float32 tensor at an offset inside a larger allocation, registered
# through the client helper; it keeps the memory until told to go.
CUDA_CLIENT_SCRIPT = textwrap.dedent("""
    import sys, torch
    from logitserve.client import Client
    from logitserve.client.regions import cuda_ipc_handle
    big = torch.zeros(1 << 20, dtype=torch.float32, device="cuda:0")
    part = big[1000:1000 + 6 * 7].view(6, 7)
    part.copy_(torch.arange(42, dtype=torch.float32).view(6, 7) * 0.5 - 3)
    torch.cuda.synchronize()
    handle = cuda_ipc_handle(part)
    # The region must outlive this client (the test reads it through the server afterwards).
    with Client(sys.argv[1], token="alice", timeout=60, unregister_on_close=False, region_scope=None) as client:
        client.register_cuda("dev", part)
    print(handle.offset, handle.byte_size, flush=True)
    sys.stdin.readline()
""")


@pytest.mark.cuda
def test_cuda_region_from_another_process(shm_server):
    pytest.importorskip("cuda.bindings")
    proc = subprocess.Popen([sys.executable, "-c", CUDA_CLIENT_SCRIPT, shm_server.target], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        offset, byte_size = map(int, proc.stdout.readline().split())
        assert offset >= 4000 and byte_size == 42 * 4  # inside the allocation, not at its base
        alice = owner_of("Bearer alice")
        [info] = shm_server.registry.status("dev", alice)
        assert (info.kind, info.offset, info.byte_size, info.device_id) == ("cuda", offset, byte_size, 0)
        expect = torch.arange(42, dtype=torch.float32).view(6, 7) * 0.5 - 3
        with shm_server.registry.resolve(ref("dev", 0, byte_size), torch.float32, (6, 7), alice, "logits") as lease:
            assert lease.view.is_cuda and lease.view.device.index == 0
            assert torch.equal(lease.view.cpu(), expect)
        with shm_server.registry.resolve(ref("dev", 28, 8 * 4), torch.float32, (8,), alice) as lease:
            assert torch.equal(lease.tensor().cpu(), expect.flatten()[7:15])
        with pytest.raises(ValueError, match="past the end of region 'dev'"):
            shm_server.registry.resolve(ref("dev", 8, byte_size), torch.float32, (42,), alice)
        assert shm_server.registry.unregister("dev", alice) == ["dev"]
    finally:
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=60)
