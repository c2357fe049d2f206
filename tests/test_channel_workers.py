"""--workers with same-host channels: each worker process serves its own channels (its iceoryx2
service), and a client's channel, regions and calls stay with the worker its gRPC connection
reached (the kernel spreads connections over the workers), as its regions do over gRPC alone."""

from __future__ import annotations

import multiprocessing

import numpy as np
import torch

from logitserve.client import Client
from logitserve.client.regions import shared_tensor
from logitserve.server.process import ServerProcess

CLIENTS = 4


def _client(target: str, seed: int, answers) -> None:
    rng = np.random.default_rng(seed)
    gate = rng.standard_normal((3, 16)).astype(np.float32)
    with Client(target, channel="shm", timeout=60) as client:
        with shared_tensor((3, 16), torch.float32, key=client.shm_key()) as shared:
            shared.tensor[:] = torch.from_numpy(gate)
            client.register("gate", shared)
            weights, indices = client.route_experts(shared.tensor, 2)  # by reference, through the channel
            through_channel = client._same_host.is_open
            client.unregister("gate")
    expected = np.argsort(-gate, axis=1, kind="stable")[:, :2]
    answers.put((seed, through_channel, np.array_equal(indices, expected)))


def test_every_client_process_calls_its_worker_through_its_channel():
    with ServerProcess("--workers", "2", "--warmup-dtypes", "none") as server:
        context = multiprocessing.get_context("spawn")
        answers = context.Queue()
        processes = [context.Process(target=_client, args=(server.target, seed, answers)) for seed in range(CLIENTS)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(120)
            assert process.exitcode == 0
        got = sorted(answers.get(timeout=10) for _ in range(CLIENTS))
    assert got == [(seed, True, True) for seed in range(CLIENTS)]
