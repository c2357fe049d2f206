"""Whether the region slices of a request's independent parts share memory.

A Step's parts are calls of their own: they queue and launch independently, in any order, so a
part whose output shares bytes with another part's input or output would read or write them at
an unknown time (issue 32: softmax's output overwrote silu's input before silu read it). Such a
request is refused, before anything launches. Within one part the op's own rule stands (an
output may be its own input: in place).

Memory, not names, decides: each lease's ``span`` is ``(memory, start, stop)``, ``memory`` the
object (``("system", st_dev, st_ino)``: two names registered over one object share it) or the
device (``("cuda", device)``, the range in device addresses, unique in the process), and
``[start, stop)`` the bytes of the slice in it.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from .region import RegionLease

RULE = ("a Step part's output may not share memory with another part's input or output (the parts run "
        "independently, in any order); give them disjoint memory")


def _overlap(a: tuple, b: tuple) -> bool:
    """Whether spans ``a`` and ``b`` share a byte (an empty slice shares none)."""
    return a[0] == b[0] and max(a[1], b[1]) < min(a[2], b[2])


def check_parts_apart(parts: Mapping[str, Sequence[RegionLease]]) -> None:
    """``ValueError`` naming both fields when an output of one part (``writable`` lease) shares
    memory with any lease of another part."""
    named = [(part, lease) for part, leases in parts.items() for lease in leases]
    for i, (part, lease) in enumerate(named):
        for other_part, other in named[i + 1:]:
            if other_part == part or not (lease.writable or other.writable):
                continue
            if _overlap(lease.span, other.span):
                raise ValueError(f"{lease.field} and {other.field}: their regions share memory; {RULE}")
