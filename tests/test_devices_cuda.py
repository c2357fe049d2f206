"""``logitserve serve --devices cuda:0,cuda:1`` on a host of two GPUs (skipped with fewer): two
client processes, one per GPU, each with its logits and outputs in CUDA memory of its GPU
registered through CUDA IPC, both dialling cuda:0's process; each call reaches its GPU's
process, and the tokens equal one GPU's. A GPU-0 region registered at GPU 1's process is
refused, naming both devices and where it goes."""

from __future__ import annotations

import multiprocessing

import grpc
import numpy as np
import pytest
import torch

from logitserve.client import Client, LogitServeError

from test_devices import Supervisor

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

ROWS, VOCAB = 16, 4096
PARAMS = dict(temperature=0.8, top_k=50, top_p=0.9, seed=np.arange(ROWS, dtype=np.int64) + 11)


def logits_on(device: str) -> torch.Tensor:
    """The same logits on every device (made on the CPU from one seed)."""
    return (torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(5)) * 3).to(device)


@pytest.fixture(scope="module")
def server():
    pytest.importorskip("cuda.bindings")
    supervisor = Supervisor("-m", "logitserve.server.cli", "serve", "--devices", "cuda:0,cuda:1", "--host",
                            "127.0.0.1", "--port", "0", "--warmup-dtypes", "float32", "--warmup-widths", str(VOCAB))
    try:
        endpoints = dict(e.split("=", 1) for e in supervisor.wait_for("devices started", 120)["endpoints"])
        for _ in endpoints:
            supervisor.wait_for("serving", 900)
        yield endpoints
    finally:
        supervisor.close()


def sample_on(index: int, target: str, results) -> None:
    """A client process of GPU ``index``: logits and token ids in its CUDA memory, registered
    through a client of ``target``; the tokens, and the device of the process that served."""
    device = f"cuda:{index}"
    logits = logits_on(device)
    token_ids = torch.full((ROWS,), -1, dtype=torch.int64, device=device)
    with Client(target, timeout=600) as client:
        client.register("logits", logits)
        client.register("token_ids", token_ids)
        first = client.sample(logits, **PARAMS, out={"token_ids": token_ids}).token_ids.cpu().numpy()
        again = client.sample(logits, **PARAMS, out={"token_ids": token_ids}).token_ids.cpu().numpy()
        served_by = client.on_device(index).server_info().device
    results.put((index, first.tolist(), again.tolist(), served_by))


def served(target: str) -> int:
    with Client(target, timeout=60) as client:
        return client.server_info().stats["batched_requests"]


def test_a_client_process_per_gpu_through_cuda_ipc_reaches_its_gpus_process(server):
    zero, one = server["cuda:0"], server["cuda:1"]
    with Client(zero, timeout=600) as client:  # one GPU's answer: the same logits, as bytes, at cuda:0
        expected = client.sample(logits_on("cpu"), **PARAMS).token_ids.tolist()
    before = served(zero), served(one)
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    procs = [spawn.Process(target=sample_on, args=(i, zero, results)) for i in range(2)]
    for p in procs:
        p.start()
    answers = sorted(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for index, first, again, served_by in answers:
        assert served_by == f"cuda:{index}"
        assert first == again == expected, index
    assert (served(zero) - before[0], served(one) - before[1]) == (2, 2)  # each GPU's two calls, at its process


def test_a_gpu0_region_at_gpu1s_process_is_refused_with_the_reason(server):
    gpu0 = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda:0")
    with Client(server["cuda:0"], timeout=120) as client:
        with pytest.raises(LogitServeError) as info:
            client.on_device(1).register_cuda("wrong-device", gpu0)  # a client of GPU 1's process: sent there
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details.startswith("device_id: 0 is not a device of this server (cuda:1): the region's "
                                             "memory is on cuda:0, and this process runs on cuda:1"), info.value.details
    # Through a client whose target is GPU 1's process, the same tensor goes to GPU 0's, which takes it.
    with Client(server["cuda:1"], timeout=120) as client:
        client.register_cuda("right-device", gpu0)
        assert [s.name for s in client.shared_memory_status()] == ["right-device"]
        assert client.on_device(0).target == server["cuda:0"]
        assert client.on_device(0).shared_memory_status()[0].name == "right-device"
