"""Per-request size limits (--max-rows, --max-vocab, --max-message-bytes)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ..errors import TooLarge

# Highest tensor rank the row-wise ops accept.
MAX_RANK = 8


@dataclass(frozen=True)
class Limits:
    """Per-request size limits (--max-rows, --max-vocab): beyond them, RESOURCE_EXHAUSTED.

    ``max_output_bytes`` (the server's --max-message-bytes) bounds what a request makes the
    server allocate for its answer: a broadcasting SwiGLU of a ``[4096, 1]`` and a ``[1, 262144]``
    tensor, a few MB on the wire, would otherwise compute gigabytes it could never send.
    """

    max_rows: int
    max_vocab: int
    max_output_bytes: int | None = None

    def check_answer(self, name: str, size: int) -> None:
        """``size``: the answer's message size as gRPC counts it (:func:`answer_bytes`), known
        before any work; over --max-message-bytes it is RESOURCE_EXHAUSTED now, not a failed send
        after the work."""
        if self.max_output_bytes is not None and size > self.max_output_bytes:
            raise TooLarge(f"{name}: the answer would be a {size}-byte message, over this server's message "
                           f"limit of {self.max_output_bytes} (--max-message-bytes)")

    def check(self, name: str, rows: int, width: int) -> None:
        if rows > self.max_rows:
            raise TooLarge(f"{name}: {rows} rows, over this server's limit of {self.max_rows} (--max-rows)")
        if width > self.max_vocab:
            raise TooLarge(f"{name}: rows of {width} elements, over this server's limit of "
                           f"{self.max_vocab} (--max-vocab)")


def varint_size(n: int) -> int:
    """Bytes of ``n`` (>= 0) as a protobuf varint."""
    return max(1, (n.bit_length() + 6) // 7)


def field_bytes(number: int, length: int) -> int:
    """Bytes of a length-delimited field (a message, bytes, a string) of ``length`` bytes: tag,
    length, payload."""
    return varint_size(number << 3) + varint_size(length) + length


def answer_bytes(response_type, shapes: dict, outputs=None) -> int:
    """The exact serialized size of a ``response_type`` answer whose every field of ``shapes``
    (name -> (dtype, shape)) is a Tensor with its bytes (or, for an output ``outputs`` puts in a
    region, the region reference): what gRPC compares with --max-message-bytes."""
    total = 0
    for name, (dtype, shape) in shapes.items():
        if outputs is not None and name in outputs:
            number = response_type.DESCRIPTOR.fields_by_name[name].number
            total += field_bytes(number, outputs.message(name).ByteSize())
        else:
            total += _tensor_field_bytes(response_type, name, dtype, tuple(shape))
    return total


@functools.lru_cache(maxsize=4096)
def _tensor_field_bytes(response_type, name: str, dtype, shape: tuple) -> int:
    """Bytes of field ``name`` of ``response_type``, a Tensor of ``dtype`` and ``shape`` with its
    data. Cached: a server sees few distinct shapes, and building the message costs more than
    the rest of a small call's validation."""
    from logitserve.v1 import logitserve_pb2 as pb  # noqa: PLC0415 - keeps this module's import light

    from ..tensors import PB_DTYPES
    data = math.prod(shape) * dtype.itemsize
    inner = pb.Tensor(dtype=PB_DTYPES[dtype], shape=list(shape)).ByteSize()
    inner += field_bytes(3, data) if data else 0
    return field_bytes(response_type.DESCRIPTOR.fields_by_name[name].number, inner)
