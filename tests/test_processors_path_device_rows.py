"""Sample's per-row parameters in CUDA regions (issue 45, item 5): copied to the host and
checked on a worker thread before the call queues (``SampleCall.checked``), not on the event
loop where the call is parsed. No GPU here: a stand-in for the call's regions resolves every
reference to a "CUDA" lease viewing a CPU tensor, which reaches the call as a DeviceTensor as a
client's CUDA memory would."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from logitserve.client import messages
from logitserve.server.ops.limits import Limits
from logitserve.server.ops.sample import SampleCall
from logitserve.server.regions import CUDA
from logitserve.server.tensors import DeviceTensor
from logitserve.v1 import logitserve_pb2 as pb

ROWS, VOCAB = 3, 16


class _Lease:
    kind, pinned = CUDA, False

    def __init__(self, view: torch.Tensor):
        self.view = view


class _DeviceRegions:
    """Each reference names one of ``tensors`` by region name."""

    def __init__(self, **tensors: torch.Tensor):
        self.tensors = tensors

    def resolve(self, ref, dtype, shape, name, writable=False):
        return _Lease(self.tensors[ref.region])


@pytest.fixture
def reads(monkeypatch):
    """The threads DeviceTensor.tolist runs on (the copy to the host)."""
    threads = []
    tolist = DeviceTensor.tolist

    def recorded(self):
        threads.append(threading.current_thread())
        return tolist(self)

    monkeypatch.setattr(DeviceTensor, "tolist", recorded)
    return threads


def _request(**rows_fields: torch.Tensor) -> pb.SampleRequest:
    msg = messages.sample_request(np.zeros((ROWS, VOCAB), np.float32))
    for field, t in rows_fields.items():
        getattr(msg, field).CopyFrom(pb.Tensor(dtype=pb.DTYPE_FLOAT32 if t.is_floating_point() else pb.DTYPE_INT64,
                                               shape=[ROWS], region=pb.RegionRef(region=field)))
        msg.ClearField(field.removesuffix("_rows"))
    return msg


def _parsed_then_checked(msg, regions, op=SampleCall) -> tuple[SampleCall, threading.Thread]:
    """``op.from_pb`` and ``checked`` as the server runs them: both on the loop's thread, the
    checks' reads where ``checked`` puts them."""
    async def run():
        call = op.from_pb(msg, Limits(64, 1024), regions=regions)
        parsed.append(call)
        await call.checked()
        return threading.current_thread()

    parsed = []
    loop_thread = asyncio.run(run())
    return parsed[0], loop_thread


def test_device_rows_are_read_off_the_loop(reads):
    temperature = torch.tensor([0.5, 0.0, 2.0])
    seeds = torch.tensor([11, 2**62, 3])
    regions = _DeviceRegions(temperature_rows=temperature, seed_rows=seeds)
    call, loop_thread = _parsed_then_checked(_request(temperature_rows=temperature, seed_rows=seeds), regions)
    assert len(reads) == 2 and loop_thread not in reads
    assert call.temperature == [0.5, 0.0, 2.0] and call.seeds() == [11, 2**62, 3]
    floats, ints = call.params
    assert torch.equal(floats.torch()[:, 0], temperature)
    assert ints.torch()[:, 1].tolist() == [11, 2**62, 3]


def test_a_bad_device_row_is_named_by_its_checks():
    temperature = torch.tensor([0.5, -1.0, 2.0])
    regions = _DeviceRegions(temperature_rows=temperature)
    with pytest.raises(ValueError, match=r"^temperature_rows\[1\]: must be .*got -1.0$"):
        _parsed_then_checked(_request(temperature_rows=temperature), regions)


def test_device_min_p_with_random_val_is_refused_once_read():
    min_p = torch.tensor([0.0, 0.1, 0.0])
    msg = _request(min_p_rows=min_p)
    msg.random_val = 0.5
    with pytest.raises(ValueError, match=r"^min_p: must be 0 with random_val"):
        _parsed_then_checked(msg, _DeviceRegions(min_p_rows=min_p))
