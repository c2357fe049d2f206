"""Calls whose tensors live in shared-memory regions: inputs read in place, outputs written into
regions, and how a batch of such calls launches.

An input is read in place (:func:`reads_in_place`) when it is a :class:`~..tensors.DeviceTensor`
(the client's CUDA memory, on the server's device). An input in a page-locked system region on a
CUDA server (server/regions/pinning.py) is copied in (:func:`copies_in`): one kernel copy from
the region to the device, no staging. Every other input is staged as on the byte path
(server/engine/staging.py): on CUDA, one host-to-device copy of the batch's host pieces. A piece in a
pageable system region (every system region on the CPU) is read from its object straight into the
staging buffer, through the object's descriptor: its client may shrink it at any moment, and a
mapping would then fault (server/regions/access.py). On the CPU that read is the one copy such an
input costs.

A batch takes the in-place path (:func:`launches_in_place`) when one of its calls reads an input
in place or copies one in, or writes an output into device memory. A lone call whose in-place
inputs and outputs are all in device memory or page-locked regions replays a CUDA graph
(:func:`graph_key`; the graph holds the copies in and out): a graph's inputs and outputs are fixed
addresses, and a client's registered buffer keeps its address from call to call, so the graph is
keyed by those addresses (and captured on a key's second use, where the client shows it reuses
the buffer: ``LaunchGraphs.seen_again``). A region mapped at the same address
later, with the same shapes, replays the same graph correctly: it reads whatever the call's
leases hold mapped there. Any other in-place batch launches eagerly on the launch thread. A
lone call launches on its inputs where they are, and writes its outputs straight into their
regions where the op takes ``out=`` (softmax, causal softmax, SiLU, SwiGLU) and the region is
CUDA memory on the device; otherwise with one copy (device to region; into a pageable system
region a write through its descriptor, server/regions/access.py). A batch of several such calls is
gathered (:func:`device_inputs`): the rows of every call go into one input on the device (region
pieces by device-to-device copies, host pieces staged in one transfer), one launch serves the
batch, and each call's outputs are copied into its regions (or brought to the host). Launching
each call alone on its inputs in place instead, which saves the gather copy, served 18-22 %
fewer rows a second to eight clients on the H100 (64 and 4 rows of 128256 float32; 2026-11-25,
docs/PERFORMANCE.md), so it went.

:class:`Outputs` is a call's ``output_regions``, resolved and leased at validation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from logitserve.kernels.copy import copy_by_kernel
from logitserve.v1 import logitserve_pb2 as pb

from ..regions import CUDA, RegionLease, check_outputs
from ..engine.staging import Staging
from ..tensors import PB_DTYPES, DeviceTensor, HostTensor

def reads_in_place(t) -> bool:
    """Whether the kernels read input ``t`` where it is: the client's device memory."""
    return type(t) is DeviceTensor


def copies_in(t, device: torch.device) -> bool:
    """Whether input ``t`` reaches ``device`` by one copy from its page-locked region (a kernel
    reading the host pages, see :func:`on_device`)."""
    return type(t) is HostTensor and t.pinned and device.type == "cuda"


def unstaged(t, device: torch.device) -> bool:
    """Whether input ``t`` skips staging on ``device``: read in place, or copied in."""
    return reads_in_place(t) or copies_in(t, device)


def on_device(t, device: torch.device) -> torch.Tensor:
    """Input ``t``, read in place or copied in, as a tensor the kernels read (launch thread, or
    inside a graph's capture, which records the copy)."""
    if not copies_in(t, device):
        return t.torch()
    # A kernel reads the page-locked pages through their device address, never the CPU: where a
    # client shrank the object under the region, a CPU touch of the mapping faults (SIGBUS), and
    # the driver's own copy of a page-locked buffer touched it (bench/pinned_shrink.py).
    copied = torch.empty(t.shape, dtype=t.dtype, device=device)
    copy_by_kernel(_pinned(t), copied)
    return copied


def _pinned(t: HostTensor) -> torch.Tensor:
    """A page-locked input's host tensor: for the device's copy alone, never read by the CPU."""
    return t.data.pinned_tensor(t.dtype, t.shape)


def launches_in_place(calls: list, device: torch.device) -> bool:
    """Whether a batch of ``calls`` takes the in-place path: an input read in place or copied
    in, or an output in device memory."""
    for c in calls:
        if c.outputs is not None and c.outputs.on_device:
            return True
        if any(unstaged(t, device) for t in c.inputs):
            return True
    return False


def graph_key(call, handle):
    """The key of a lone in-place ``call``'s CUDA graph (its op key, then :func:`places`), or None
    where it launches eagerly: no graphs on this device, or no places."""
    if handle.graphs is None or call.key is None:
        return None
    where = places(call.inputs, call.outputs, handle)
    return None if where is None else (call.key, "in place", *where)


def places(inputs, outputs: "Outputs | None", handle) -> list | None:
    """What a CUDA graph over ``inputs`` and ``outputs`` holds fixed: the address, shape and dtype
    of every input read in place or copied in, contiguous, and the address of every output
    region; or None where a graph cannot serve them: an input or output in a pageable system
    region (a graph cannot copy to or from pageable memory) or on another device, or inputs
    copied in of more than the graphs' ``max_bytes`` (each graph would hold a device copy of
    them; at that size the copy, not the host's launch work, takes the time). Inputs staged
    (bytes) hold nothing fixed."""
    where, copied_in = [], 0
    for t in inputs:
        if type(t) is DeviceTensor:
            if t.tensor.device != handle.device:
                return None
            where.append((t.tensor.data_ptr(), t.shape, t.dtype))
        elif copies_in(t, handle.device):
            copied_in += t.numel() * t.element_size()
            if copied_in > handle.graphs.max_bytes:
                return None
            where.append(("host", _pinned(t).data_ptr(), t.shape, t.dtype))
        elif t.in_region:
            return None
    for name in sorted(outputs.slots) if outputs is not None else ():
        target = outputs.direct(name, handle.device)
        if target is None:
            target = outputs.pinned(name)
        if target is None:
            return None
        where.append((name, target.data_ptr()))
    return where


def column_stage(*columns: HostTensor):
    """The ``stage_for`` of a lone in-place call whose only staged inputs are its per-row
    parameter columns: each a part, padded to the graph's rows with zeros."""
    def stage_for(batch_rows: int) -> Staging:
        stage = Staging()
        for column in columns:
            stage.add([column], rows=batch_rows, zero_padding=True)
        return stage

    return stage_for


def device_inputs(handle, *groups: list) -> list[torch.Tensor]:
    """Each group of pieces (HostTensor or DeviceTensor, one per call, same trailing shape)
    stacked along dim 0 on the device, on the launch thread. A group of one piece read in place
    (or copied in) is that piece itself; the other host pieces of every group go in one staged
    transfer; a group mixing them is gathered with one device copy (``torch.cat``)."""
    device = handle.device
    stage = Staging()
    hosts = []
    for group in groups:
        host = [p for p in group if not unstaged(p, device)]
        hosts.append(host)
        if host:
            stage.add(host)
    staged = iter(stage.to(device) if stage.layout else ())
    out = []
    for group, host in zip(groups, hosts):
        part = next(staged) if host else None
        if len(host) == len(group):
            out.append(part)
        elif len(group) == 1:
            out.append(on_device(group[0], device))
        else:
            pieces, row = [], 0
            for p in group:
                if unstaged(p, device):
                    pieces.append(on_device(p, device))
                else:
                    pieces.append(part[row:row + p.shape[0]])
                    row += p.shape[0]
            out.append(torch.cat(pieces))
    return out


@dataclass(eq=False, slots=True)
class _Slot:
    ref: pb.RegionRef
    lease: RegionLease
    dtype: torch.dtype
    shape: tuple[int, ...]


class Outputs:
    """A call's ``output_regions``: each output it names, resolved for the caller at validation
    into a writable lease of exactly the output's size (held by the call's
    :class:`~..regions.CallRegions`)."""

    __slots__ = ("slots",)

    def __init__(self, slots: dict[str, _Slot]):
        self.slots = slots

    @classmethod
    def of(cls, msg, rpc: str, regions, path: str, shapes: dict) -> "Outputs | None":
        """The outputs ``msg.output_regions`` names (None when none): ``shapes`` gives each
        output's ``(dtype, shape)``. ``ValueError`` / ``RegionNotFound`` naming the field."""
        if not len(msg.output_regions):
            return None
        field = f"{path}output_regions"
        check_outputs(msg.output_regions, rpc, field)
        if regions is None:
            raise ValueError(f"{field}: this call takes no shared-memory regions")
        slots = {}
        for name in sorted(msg.output_regions):
            ref = msg.output_regions[name]
            dtype, shape = shapes[name]
            lease = regions.resolve(ref, dtype, shape, f"{field}[{name}]", writable=True)
            kept = pb.RegionRef(region=ref.region, offset=ref.offset, byte_size=ref.byte_size)
            slots[name] = _Slot(kept, lease, dtype, tuple(shape))
        return cls(slots)

    def __contains__(self, name: str) -> bool:
        return name in self.slots

    @property
    def on_device(self) -> bool:
        """Whether an output is in CUDA memory (written on the launch thread)."""
        return any(s.lease.kind == CUDA for s in self.slots.values())

    def direct(self, name: str, device: torch.device) -> torch.Tensor | None:
        """Output ``name``'s region as a tensor a kernel can write (``out=``): when it is named and
        CUDA memory on ``device``; else None (a system region is written through its descriptor,
        never through a mapping: :meth:`put`)."""
        slot = self.slots.get(name)
        if slot is None or slot.lease.kind != CUDA:
            return None
        target = slot.lease.tensor()
        return target if target.device == device else None

    def pinned(self, name: str) -> torch.Tensor | None:
        """Output ``name``'s region as a host tensor, where it is page-locked system memory (which
        the device writes itself: :meth:`put`); else None."""
        slot = self.slots.get(name)
        return slot.lease.tensor() if slot is not None and slot.lease.pinned else None

    def put(self, name: str, value: torch.Tensor) -> None:
        """Write ``value`` (output ``name``, any device) into its region, unless a kernel wrote it
        there already (``out=``). On the launch thread: on CUDA the copy is ordered on its stream.
        From the device into a page-locked region the copy is a kernel writing host memory, which
        a CUDA graph captures (a copy into pageable memory waits for the stream: it cannot be).
        A host value goes into a system region through its descriptor (``ValueError`` naming the
        region when its object has shrunk)."""
        lease = self.slots[name].lease
        if lease.kind == CUDA:
            target = lease.tensor()
            if target.device != value.device or target.data_ptr() != value.data_ptr():
                # Not waiting for the stream (a page-locked or device value): an ordered call's
                # stream may be waiting for its caller's mark (server/ordered/).
                target.copy_(value.reshape(target.shape), non_blocking=True)
        elif lease.pinned and value.device.type == "cuda":
            copy_by_kernel(value.reshape(lease.shape).contiguous(), lease.tensor())
        else:
            lease.write_from(value)

    def write(self, name: str, data) -> None:
        """Write host ``data`` (bytes, or an array of the output's dtype and size) into output
        ``name``'s region, a system one, through its descriptor (no torch call: for the event
        loop); ``ValueError`` naming the region when its object has shrunk."""
        self.slots[name].lease.write_from(data)

    def message(self, name: str) -> pb.Tensor:
        """The answer's Tensor for output ``name``: dtype, shape and region, no data."""
        slot = self.slots[name]
        return pb.Tensor(dtype=PB_DTYPES[slot.dtype], shape=list(slot.shape), region=slot.ref)

