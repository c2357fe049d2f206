"""Staging (server/engine/staging.py) and graph buckets (server/engine/graphs.py) on the CPU: parts land 16-byte
aligned in one buffer, padded parts leave their padding rows alone, and a buffer written for one
batch takes another of the same layout."""

from __future__ import annotations

import torch

from logitserve.server.engine.graphs import bucket_rows
from logitserve.server.engine.staging import ALIGN, Staging
from logitserve.server.tensors import HostTensor


def _stage(pieces: list[torch.Tensor], values: list[float], rows: int | None = None) -> Staging:
    stage = Staging()
    stage.add([HostTensor.of(p) for p in pieces], rows=rows)
    stage.add([HostTensor.of(torch.tensor(values).reshape(2, -1))])
    return stage


def test_parts_are_stacked_aligned_and_returned_in_order():
    a, b = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), torch.arange(3, dtype=torch.bfloat16).reshape(1, 3)
    stage = _stage([a, b], [0.5, 1.0, 2.0, 3.0])
    stacked, values = stage.to(torch.device("cpu"))
    assert torch.equal(stacked, torch.cat([a, b]))
    assert torch.equal(values, torch.tensor([[0.5, 1.0], [2.0, 3.0]]))
    assert [offset for _, _, offset in stage.layout] == [0, 2 * ALIGN]  # 18 bytes of bfloat16, then aligned
    assert stage.nbytes == 2 * ALIGN + 16


def test_padded_part_leaves_its_padding_rows_as_the_buffer_holds_them():
    host = torch.full((4096,), 0xAB, dtype=torch.uint8)
    first = _stage([torch.ones(5, 4)], [1.0] * 8, rows=8)
    first.write(memoryview(host.numpy()))
    second = _stage([torch.zeros(2, 4)], [7.0] * 8, rows=8)
    assert second.layout == first.layout  # the same bucket: one buffer serves both
    second.write(memoryview(host.numpy()))
    stacked, values = second.views(host)
    assert stacked.shape == (8, 4)
    assert bool((stacked[:2] == 0).all()) and bool((stacked[2:5] == 1).all())  # rows 2..4 from the first batch
    assert bool((stacked[5:].view(torch.uint8) == 0xAB).all())  # never written
    assert bool((values == 7.0).all())


def test_zero_padded_part_writes_zeros_past_its_pieces():
    host = torch.full((256,), 0xAB, dtype=torch.uint8)
    stage = Staging()
    stage.add([HostTensor.of(torch.full((2, 3), 5.0)), HostTensor.of(torch.full((1, 3), 6.0))], rows=8,
              zero_padding=True)
    stage.write(memoryview(host.numpy()))
    part, = stage.views(host)
    assert part.shape == (8, 3)
    assert bool((part[:2] == 5).all()) and bool((part[2] == 6).all()) and bool((part[3:] == 0).all())
    assert bool((host[8 * 3 * 4:].view(torch.uint8) == 0xAB).all())  # nothing past the part


def test_bucket_rows_is_the_next_power_of_two():
    assert [bucket_rows(n) for n in (1, 2, 3, 4, 5, 16, 17, 64, 65)] == [1, 2, 4, 4, 8, 16, 32, 64, 128]


def test_host_tensor_reshapes_and_decodes_without_copying_its_bytes():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    h = HostTensor.of(t)
    assert h.shape == (3, 4) and h.numel() == 12 and h.element_size() == 4 and h.ndim == 2
    r = h.reshape(-1, 6)
    assert r.shape == (2, 6) and r.data is h.data
    assert torch.equal(r.torch(), t.reshape(2, 6))
    assert h.tolist() == t.reshape(-1).tolist()
