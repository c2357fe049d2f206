"""A device region's resolved views (server/regions/registry.py ``resolve``), on the CPU: the
region's bytes a CPU tensor standing in for its IPC mapping."""

from __future__ import annotations

import torch

from logitserve.server import regions
from logitserve.server.regions import RegionRegistry
from logitserve.v1 import logitserve_pb2 as pb


def test_a_device_regions_views_are_made_once_per_slice_and_go_with_it():
    """A CUDA region's slices resolved call after call reuse one view (a view costs microseconds
    of torch); at most VIEWS_KEPT are kept (a caller naming ever new slices gets fresh ones); the
    region's end drops them. Its bytes here are a CPU tensor standing in for the IPC mapping."""
    from logitserve.server.regions.region import VIEWS_KEPT, Region

    registry = RegionRegistry()
    region = Region("r", None, regions.CUDA, "", 0, 4096, 0, 4096, True)
    region.device_bytes = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    region.memory = ("cuda", 0)
    registry._regions[(None, "r")] = region
    ref = pb.RegionRef(region="r", offset=64, byte_size=32)

    def resolved(ref=ref, shape=(2, 4)):
        with registry.resolve(ref, torch.int32, shape) as lease:
            return lease.view

    first = resolved()
    assert resolved() is first and first.tolist() == [[16, 17, 18, 19], [20, 21, 22, 23]]
    assert resolved(shape=(8,)) is not first and resolved(shape=(8,)).tolist() == list(range(16, 24))
    for offset in range(0, 4 * (VIEWS_KEPT + 8), 4):
        resolved(pb.RegionRef(region="r", offset=offset, byte_size=4), (1,))
    assert len(region.views) == VIEWS_KEPT and resolved() is first
    registry.unregister("r")
    assert region.views == {}
