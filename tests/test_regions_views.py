"""A region's checked slices (server/regions/registry.py ``resolve``): each slice a caller names is
checked once per registration and reused call after call, never past it. A device region's bytes
are a CPU tensor here, standing in for its IPC mapping; system regions are real POSIX objects."""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from logitserve.server import regions
from logitserve.server.regions import CallRegions, RegionNotFound, RegionRegistry
from logitserve.server.regions import registry as registry_module
from logitserve.server.regions.region import SLICES_KEPT, Region
from logitserve.v1 import logitserve_pb2 as pb


@pytest.fixture
def shm():
    """Makes POSIX shared-memory objects of given bytes; unlinks them at the end."""
    keys = []

    def make(data: bytes) -> str:
        key = f"lstest-{uuid.uuid4().hex}"
        fd = os.open(f"/dev/shm/{key}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, data)
        os.close(fd)
        keys.append(key)
        return key

    yield make
    for key in keys:
        os.unlink(f"/dev/shm/{key}")


def _device_region(registry: RegionRegistry, name: str, values: torch.Tensor) -> Region:
    region = Region(name, None, regions.CUDA, "", 0, values.nbytes, 0, values.nbytes, True)
    region.device_bytes = values.view(torch.uint8)
    region.memory = ("cuda", 0)
    registry._regions[(None, name)] = region
    return region


def test_a_device_regions_views_are_made_once_per_slice_and_go_with_it():
    """A CUDA region's slices resolved call after call reuse one view (a view costs microseconds
    of torch); at most SLICES_KEPT are kept (a caller naming ever new slices gets fresh ones); the
    region's end drops them."""
    registry = RegionRegistry()
    region = _device_region(registry, "r", torch.arange(1024, dtype=torch.int32))
    ref = pb.RegionRef(region="r", offset=64, byte_size=32)

    def resolved(ref=ref, shape=(2, 4)):
        with registry.resolve(ref, torch.int32, shape) as lease:
            return lease.view

    first = resolved()
    assert resolved() is first and first.tolist() == [[16, 17, 18, 19], [20, 21, 22, 23]]
    assert resolved(shape=(8,)) is not first and resolved(shape=(8,)).tolist() == list(range(16, 24))
    for offset in range(0, 4 * (SLICES_KEPT + 8), 4):
        resolved(pb.RegionRef(region="r", offset=offset, byte_size=4), (1,))
    assert len(region.slices) == SLICES_KEPT and resolved() is first
    registry.unregister("r")
    assert region.slices == {}


def test_a_name_registered_again_never_reuses_the_slices_of_the_region_it_named_before(shm):
    """The checked slices belong to the registration: the same name over other memory resolves
    afresh, by the new region's rules and over its bytes, for system and device regions alike."""
    registry = RegionRegistry()
    first, second = shm(bytes(range(64))), shm(bytes(range(100, 116)))
    registry.register_system("r", first, 0, 64)
    ref = pb.RegionRef(region="r", offset=8, byte_size=8)
    with registry.resolve(ref, torch.int64, (1,)) as lease:
        assert bytes(lease.view.read()) == bytes(range(8, 16))
    registry.unregister("r")
    with pytest.raises(RegionNotFound, match="no region 'r' registered"):
        registry.resolve(ref, torch.int64, (1,))
    registry.register_system("r", second, 0, 16)
    with registry.resolve(ref, torch.int64, (1,)) as lease:
        assert bytes(lease.view.read()) == bytes(range(108, 116))
    registry.unregister("r")
    registry.register_system("r", second, 0, 12)  # the slice is past this registration's end
    with pytest.raises(ValueError, match=r"x.region: offset 8 \+ byte_size 8 = 16, past the end of region 'r' "
                                         r"\(12 bytes\)"):
        registry.resolve(ref, torch.int64, (1,), field="x")

    device = RegionRegistry()
    _device_region(device, "d", torch.arange(16, dtype=torch.int32))
    with device.resolve(pb.RegionRef(region="d", offset=4, byte_size=4), torch.int32, (1,)) as lease:
        assert lease.view.tolist() == [1]
    device.unregister("d")
    _device_region(device, "d", torch.arange(100, 116, dtype=torch.int32))
    with device.resolve(pb.RegionRef(region="d", offset=4, byte_size=4), torch.int32, (1,)) as lease:
        assert lease.view.tolist() == [101]


def test_a_checked_slice_is_reused_and_the_rules_still_hold_for_every_other_ask(shm, monkeypatch):
    """A slice resolved again is not checked again, while the same place asked with another
    size, dtype or shape is, with the same errors."""
    registry = RegionRegistry()
    registry.register_system("r", shm(bytes(64)), 0, 64)
    checks = []
    real = RegionRegistry._checked
    monkeypatch.setattr(RegionRegistry, "_checked", staticmethod(lambda *a: checks.append(a) or real(*a)))
    ref = pb.RegionRef(region="r", offset=8, byte_size=16)
    for _ in range(3):
        registry.resolve(ref, torch.float32, (4,), field="x").release()
    assert len(checks) == 1
    with pytest.raises(ValueError, match=r"x.region.byte_size: 16, but shape \[2\] of float32 needs 8 bytes"):
        registry.resolve(ref, torch.float32, (2,), field="x")
    with pytest.raises(ValueError, match=r"x.region.offset: 2 is not a multiple of the itemsize 4 of float32"):
        registry.resolve(pb.RegionRef(region="r", offset=2, byte_size=16), torch.float32, (4,), field="x")
    with pytest.raises(ValueError, match=r"x.region.byte_size: 16, but shape \[2\] of float32 needs 8 bytes"):
        registry.resolve(pb.RegionRef(region="nope", offset=8, byte_size=16), torch.float32, (2,), field="x")
    assert registry.status("r")[0].in_use == 0


def test_a_call_reads_each_objects_size_once_and_the_next_call_again(shm, monkeypatch):
    """A call's slices of one object cost one fstat (the shrink check's), and a shrink before the
    next call refuses it, naming the field."""
    registry = RegionRegistry()
    key = shm(bytes(64))
    registry.register_system("a", key, 0, 32)
    registry.register_system("b", key, 32, 32)
    sizes = []
    real = os.fstat
    monkeypatch.setattr(registry_module.os, "fstat", lambda fd: sizes.append(fd) or real(fd))
    call = CallRegions(registry)
    for name in ("a", "b", "a"):
        call.resolve(pb.RegionRef(region=name, offset=0, byte_size=16), torch.float32, (4,), name)
    call.finish()
    assert len(sizes) == 1
    os.truncate(f"/dev/shm/{key}", 48)
    call = CallRegions(registry)
    call.resolve(pb.RegionRef(region="a", offset=0, byte_size=16), torch.float32, (4,), "a")
    with pytest.raises(ValueError, match=r"b.region: the shared-memory object .* of region 'b' shrank to 48 bytes"):
        call.resolve(pb.RegionRef(region="b", offset=0, byte_size=16), torch.float32, (4,), "b")
    call.finish()
    assert [info.in_use for info in registry.status()] == [0, 0]
