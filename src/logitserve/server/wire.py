"""Reading a request's tensor bytes where they arrived, instead of through protobuf's copies.

Parsing a request copies each bytes field into protobuf's arena, and reading the field copies
it again into a new bytes object: a Sample request's 256 KB of logits (1x128256 bfloat16) were
copied twice before staging copied them a third time, into page-locked memory. :class:`InPlaceReader`
finds a tensor field's ``data`` in the received bytes, at the top of the request or inside
sub-messages (a Step's ``sample.logits``), and keeps it as a memoryview of them; the rest of the
request, that field's ``dtype`` and ``shape`` included, is parsed by protobuf from a copy a few
dozen bytes long, the lengths of the fields around the data written anew.

The result is what protobuf would parse, tensor bytes aside, for any valid encoding: fields in
any order, unknown fields, a field written twice (protobuf merges the occurrences; the first
one's ``data`` is taken out, and when a later occurrence brings ``data`` of its own, that
one wins, as in protobuf, and is read the ordinary way). Bytes that are not a valid encoding are
left to protobuf, which raises for them as it would have anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

# Wire types (protobuf encoding): varint, 64-bit, length-delimited, 32-bit.
VARINT, I64, LEN, I32 = 0, 1, 2, 5
TENSOR_DATA = 3  # logitserve.v1.Tensor.data's field number


class NotPlain(Exception):
    """The bytes are not a plain encoding :class:`InPlaceReader` can split: leave them to protobuf."""


def read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    """The varint at ``buf[pos]`` and the position after it."""
    try:
        byte = buf[pos]
    except IndexError:
        raise NotPlain from None
    if byte < 0x80:  # tags, dtypes and short lengths: one byte
        return byte, pos + 1
    value, shift = byte & 0x7F, 7
    while True:
        pos += 1
        try:
            byte = buf[pos]
        except IndexError:
            raise NotPlain from None
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos + 1
        shift += 7
        if shift > 63:
            raise NotPlain


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _first_fields(buf: bytes, start: int, end: int, numbers) -> dict[int, tuple[int, int, int, int]]:
    """The first length-delimited field of each of ``numbers`` in the message ``buf[start:end]``:
    where its tag, its length and its value start, and where it ends. One pass, which stops once
    all are found."""
    found = {}
    pos = start
    while pos < end and len(found) < len(numbers):
        tag_at = pos
        tag, pos = read_varint(buf, pos)
        wire = tag & 7
        if wire == LEN:
            length_at = pos
            length, pos = read_varint(buf, pos)
            if pos + length > end:
                raise NotPlain
            number = tag >> 3
            if number in numbers and number not in found:
                found[number] = (tag_at, length_at, pos, pos + length)
            pos += length
        elif wire == VARINT:
            _, pos = read_varint(buf, pos)
        elif wire == I64:
            pos += 8
        elif wire == I32:
            pos += 4
        else:  # groups, or not an encoding at all
            raise NotPlain
    if pos > end:
        raise NotPlain
    return found


@dataclass(slots=True)
class Received:
    """A request as read by :class:`InPlaceReader`: the message, and for each tensor field whose
    ``data`` stayed in the received bytes, those bytes (the message's own ``data`` is empty),
    by the field's dotted name (``logits``; in a Step, ``sample.logits``)."""

    message: object
    tensor_bytes: Mapping[str, memoryview] = field(default_factory=dict)


class InPlaceReader:
    """A request deserializer: ``reader(raw)`` is ``raw`` parsed by ``parse`` (a message type's
    ``FromString``) with the ``data`` of the tensor fields ``tensors`` left in ``raw``, as a
    :class:`Received`; it raises what ``parse`` raises for bytes that are not a valid encoding.

    ``tensors`` maps each tensor field's dotted name to the field numbers that lead to it from
    the top of the message: ``{"logits": (1,)}``, or for a Step ``{"sample.logits": (2, 1)}``.
    """

    def __init__(self, parse: Callable[[bytes], object], tensors: Mapping[str, tuple[int, ...]]):
        self._parse = parse
        # The fields to look for, level by level: field number -> the level inside it, or at the
        # bottom (a tensor's data field) the tensor's name and its attribute path.
        self._tree: dict = {}
        for name, path in tensors.items():
            level = self._tree
            for number in path:
                level = level.setdefault(number, {})
            level[TENSOR_DATA] = (name, name.split("."))

    def __call__(self, raw: bytes) -> Received:
        cuts: dict[str, _Cut] = {}
        try:
            self._locate(raw, 0, len(raw), [], self._tree, cuts)
        except NotPlain:
            return Received(self._parse(raw))
        if not cuts:
            return Received(self._parse(raw))
        message = self._parse(_without(raw, cuts.values()))
        views = {}
        for name, (attributes, _, (_, data_at, data_end)) in cuts.items():
            tensor = message
            for attribute in attributes:
                tensor = getattr(tensor, attribute)
            if not tensor.data:  # else a later occurrence brought data of its own: it wins, as in protobuf
                views[name] = memoryview(raw)[data_at:data_end]
        return Received(message, views)

    def _locate(self, raw: bytes, start: int, end: int, enclosing: list, level: dict, cuts: dict) -> None:
        """Add to ``cuts`` where the first occurrence of each tensor's data below ``level`` sits,
        reading the message ``raw[start:end]`` once for all of them."""
        for number, (tag_at, length_at, value_at, field_end) in _first_fields(raw, start, end, level).items():
            below = level[number]
            if type(below) is tuple:  # a tensor's data field
                name, attributes = below
                cuts[name] = (attributes, enclosing, (tag_at, value_at, field_end))
            else:
                self._locate(raw, value_at, field_end, [*enclosing, (length_at, value_at, field_end)], below, cuts)


# Where a tensor's data sits: the tensor's attribute path, the fields enclosing the data,
# outermost first, each as (where its length prefix starts, where its value starts, where it
# ends), and the data field as (where its tag starts, where its bytes start, where they end).
_Cut = tuple[list[str], list[tuple[int, int, int]], tuple[int, int, int]]


def _without(raw: bytes, cuts) -> bytes:
    """``raw`` with the data fields of ``cuts`` taken out and the lengths of the fields that
    enclose them written anew (a varint may get shorter, which shortens its parents in turn)."""
    parent: dict[int, int | None] = {}  # enclosing field (by length_at) -> the one around it
    spans: dict[int, tuple[int, int]] = {}  # enclosing field -> (value_at, end)
    removed: dict[int, int] = {}  # enclosing field -> bytes taken out of its value
    edits = []  # (start, end, what replaces raw[start:end])
    for _, enclosing, (tag_at, _, data_end) in cuts:
        for depth, (length_at, value_at, end) in enumerate(enclosing):
            parent[length_at] = enclosing[depth - 1][0] if depth else None
            spans[length_at] = (value_at, end)
            removed.setdefault(length_at, 0)
        removed[enclosing[-1][0]] += data_end - tag_at
        edits.append((tag_at, data_end, b""))
    # Innermost first (an inner field starts after its parent's length prefix).
    for length_at in sorted(spans, reverse=True):
        value_at, end = spans[length_at]
        length = _encode_varint(end - value_at - removed[length_at])
        edits.append((length_at, value_at, length))
        if parent[length_at] is not None:
            removed[parent[length_at]] += removed[length_at] + (value_at - length_at) - len(length)
    pieces, done = [], 0
    for start, end, replacement in sorted(edits):
        pieces += (raw[done:start], replacement)
        done = end
    pieces.append(raw[done:])
    return b"".join(pieces)
