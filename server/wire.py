"""Reading a request's tensor bytes where they arrived, instead of through protobuf's copies.

Parsing a request copies each bytes field into protobuf's arena, and reading the field copies
it again into a new bytes object: a Sample request's 256 KB of logits (1x128256 bfloat16) were
copied twice before staging copied them a third time, into page-locked memory. :func:`read_in_place`
finds a tensor field's ``data`` in the received bytes and keeps it as a memoryview of them; the
rest of the request, that field's ``dtype`` and ``shape`` included, is parsed by protobuf from a
copy a few dozen bytes long.

The result is what protobuf would parse, tensor bytes aside, for any valid encoding: fields in
any order, unknown fields, a tensor field written twice (protobuf merges the occurrences; the
first one's ``data`` is taken out, and when a later occurrence brings ``data`` of its own, that
one wins, as in protobuf, and is read the ordinary way). Bytes that are not a valid encoding are
left to protobuf, which raises for them as it would have anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

# Wire types (protobuf encoding): varint, 64-bit, length-delimited, 32-bit.
VARINT, I64, LEN, I32 = 0, 1, 2, 5
TENSOR_DATA = 3  # logitserve.v1.Tensor.data's field number


class _NotHere(Exception):
    """The bytes are not a plain encoding :func:`read_in_place` can split: leave them to protobuf."""


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    """The varint at ``buf[pos]`` and the position after it."""
    value = shift = 0
    while True:
        try:
            byte = buf[pos]
        except IndexError:
            raise _NotHere from None
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise _NotHere


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _find(buf: bytes, start: int, end: int, number: int) -> tuple[int, int, int, int] | None:
    """The first length-delimited field ``number`` in ``buf[start:end]``: where its tag, its length
    and its value start, and where it ends; None when there is none."""
    pos = start
    while pos < end:
        tag_at = pos
        tag, pos = _varint(buf, pos)
        wire = tag & 7
        if wire == LEN:
            length_at = pos
            length, pos = _varint(buf, pos)
            if pos + length > end:
                raise _NotHere
            if tag >> 3 == number:
                return tag_at, length_at, pos, pos + length
            pos += length
        elif wire == VARINT:
            _, pos = _varint(buf, pos)
        elif wire == I64:
            pos += 8
        elif wire == I32:
            pos += 4
        else:  # groups, or not an encoding at all
            raise _NotHere
    if pos != end:
        raise _NotHere
    return None


@dataclass(frozen=True, slots=True)
class Received:
    """A request as read by :func:`read_in_place`: the message, and for each tensor field whose
    ``data`` stayed in the received bytes, those bytes (the message's own ``data`` is empty)."""

    message: object
    tensor_bytes: Mapping[str, memoryview] = field(default_factory=dict)


def read_in_place(raw: bytes, parse: Callable[[bytes], object], tensors: Mapping[str, int]) -> Received:
    """``raw`` parsed by ``parse`` (a message type's ``FromString``) with the ``data`` of the
    tensor fields ``tensors`` (name: field number) left in ``raw``; raises what ``parse`` raises
    for bytes that are not a valid encoding."""
    views: dict[str, memoryview] = {}
    pieces: list[bytes] = []
    done = 0  # raw[:done] is in pieces
    try:
        # In the order they appear: pieces are taken front to back.
        spans = sorted((s, name) for name, number in tensors.items() if (s := _find(raw, 0, len(raw), number)))
        for (_, length_at, value_at, end), name in spans:
            data = _find(raw, value_at, end, TENSOR_DATA)
            if data is None:
                continue
            data_tag_at, _, data_at, data_end = data
            # The field again, its value without data: the tag, a new length, dtype and shape.
            header = raw[value_at:data_tag_at] + raw[data_end:end]
            pieces += (raw[done:length_at], _encode_varint(len(header)), header)
            done = end
            views[name] = memoryview(raw)[data_at:data_end]
    except _NotHere:
        return Received(parse(raw))
    if not views:
        return Received(parse(raw))
    pieces.append(raw[done:])
    message = parse(b"".join(pieces))
    for name in list(views):
        if getattr(message, name).data:  # a later occurrence brought data of its own: it wins
            del views[name]
    return Received(message, views)

