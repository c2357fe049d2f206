"""Keeping a lone client's call path warm (--keep-warm-us): what a rehearsal runs and when, that a
polling event loop calls it, and that a server doing it answers exactly as one that does not."""

import asyncio
import socket
import time

import numpy as np
import pytest
import torch

from logitserve import kernels
from logitserve.client import AsyncClient
from logitserve.client.messages import sample_request
from logitserve.server import ops
from logitserve.server.app import create_server
from logitserve.server.busy_poll import BusyPollEventLoop, BusyPollSelector
from logitserve.server.config import ServerConfig
from logitserve.server.keep_warm import MAX_REHEARSED_BYTES, KeepWarm
from logitserve.server.servicer import request_parsers

SAMPLE = "/logitserve.v1.LogitServe/Sample"


class _Counted:
    """``ops.SampleCall`` and a result whose validation and answer count their calls."""

    def __init__(self, result=None):
        self.validated = self.answered = 0
        self.result = result or ops.SampleResult([3], [11])

    def from_pb(self, message, limits, in_place):
        self.validated += 1
        return ops.SampleCall.from_pb(message, limits, in_place=in_place)

    def to_pb(self):
        self.answered += 1
        return self.result.to_pb()


def _keep_warm(idle=lambda: True) -> KeepWarm:
    return KeepWarm({"Sample": request_parsers()[SAMPLE]}, ops.Limits(max_rows=64, max_vocab=1024), idle)


def _sample_bytes(vocab: int) -> bytes:
    return sample_request(np.zeros((1, vocab), np.float32), temperature=0.7, top_k=5, seed=1).SerializeToString()


def test_a_rehearsal_parses_validates_and_answers_the_latest_call_again():
    keep_warm, counted = _keep_warm(), _Counted()
    keep_warm.rehearse()  # nothing kept yet: nothing to do
    keep_warm.remember("Sample", counted, _sample_bytes(100), counted)
    for _ in range(3):
        keep_warm.rehearse()
    assert (counted.validated, counted.answered) == (3, 3)


def test_no_rehearsal_while_the_server_holds_a_call():
    busy = [True]
    keep_warm, counted = _keep_warm(idle=lambda: not busy[0]), _Counted()
    keep_warm.remember("Sample", counted, _sample_bytes(100), counted)
    keep_warm.rehearse()
    assert counted.validated == 0
    busy[0] = False
    keep_warm.rehearse()
    assert counted.validated == 1


def test_big_requests_are_not_kept():
    keep_warm, small, big = _keep_warm(), _Counted(), _Counted()
    keep_warm.remember("Sample", small, _sample_bytes(100), small)
    raw = _sample_bytes(MAX_REHEARSED_BYTES // 4 + 1)
    assert len(raw) > MAX_REHEARSED_BYTES
    keep_warm.remember("Sample", big, raw, big)
    keep_warm.rehearse()
    assert (small.validated, big.validated) == (1, 0)  # the last small one is still the one kept


def test_a_failing_rehearsal_is_dropped_and_never_raises():
    keep_warm = _keep_warm()

    class Broken:
        calls = 0

        @classmethod
        def from_pb(cls, message, limits, in_place):
            cls.calls += 1
            raise RuntimeError("broken")

    keep_warm.remember("Sample", Broken, _sample_bytes(10), ops.SampleResult([0], [0]))
    keep_warm.rehearse()
    keep_warm.rehearse()
    assert Broken.calls == 1


def test_the_polling_selector_calls_its_function_every_interval_and_not_while_held_off():
    reader, writer = socket.socketpair()
    with reader, writer, BusyPollSelector(window_s=1.0) as selector:
        selector.register(reader, 1)
        calls = []
        selector.while_polling, selector.every_s = (lambda: calls.append(time.monotonic())), 0.005
        assert selector.select(0.1) == []
        assert 5 <= len(calls) <= 21  # one each 5 ms of the 100 ms polled, none in its first 5 ms
        assert all(b - a >= 0.005 for a, b in zip(calls, calls[1:]))
        calls.clear()
        selector.hold_off = lambda: True
        selector.select(0.05)
        assert calls == []


def test_a_server_that_keeps_warm_rehearses_between_a_lone_clients_calls_and_answers_as_the_kernels_do(
        monkeypatch):
    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(5))
    validations = []
    from_pb = ops.SampleCall.from_pb.__func__
    monkeypatch.setattr(ops.SampleCall, "from_pb",
                        classmethod(lambda cls, *a, **kw: (validations.append(1), from_pb(cls, *a, **kw))[1]))

    async def main():
        config = ServerConfig(device="cpu", host="127.0.0.1", port=0, warmup_dtypes=(), keep_warm_us=200)
        service, port = create_server(config)
        await service.start()
        try:
            async with AsyncClient(f"127.0.0.1:{port}") as client:
                answers = []
                for _ in range(3):
                    answers.append(await client.sample(logits, temperature=0.8, top_k=20, top_p=0.9, seed=[3, 4]))
                    await asyncio.sleep(0.02)  # the client's round trip: the server polls, and rehearses
                return answers
        finally:
            await service.stop(0)

    with asyncio.Runner(loop_factory=lambda: BusyPollEventLoop(50_000)) as runner:
        answers = runner.run(main())
    assert len(validations) > 3  # the three calls, and rehearsals of them
    expected = kernels.sample(logits, temperature=0.8, top_k=20, top_p=0.9, seed=torch.tensor([3, 4]), backend="torch")
    for answer in answers:
        assert answer.token_ids.tolist() == expected.tolist()


@pytest.mark.parametrize("value", [-1])
def test_keep_warm_us_must_not_be_negative(value):
    with pytest.raises(ValueError, match="keep_warm_us: must be >= 0"):
        ServerConfig(keep_warm_us=value)
