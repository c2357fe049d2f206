"""Requests whose tensor bytes are copied once, and answers read where they arrived.

Building a request the ordinary way copies a tensor's bytes three times on the client: into a
``bytes`` object (``tobytes``), into the message (``Tensor.data``) and into the serialized
request (``SerializeToString``). :func:`serialize` copies them once: the message is built with
every tensor's ``data`` empty (a few dozen bytes), serialized by protobuf, and the data fields
are framed here (tag, varint length, the raw buffer) and joined with it in one
``bytes.join``, the lengths of the messages around each tensor written anew. The result is
byte for byte what protobuf writes for the message with its data filled in
(``SerializeToString(deterministic=True)``; tests/test_client_bytes.py checks every RPC and
dtype), so the server cannot tell the difference. The client then hands gRPC these bytes
(its methods take and return raw bytes: no serializer of their own).

:func:`split` is the answer's side: a response's tensor ``data`` fields are cut out of the
received bytes and kept as memoryviews of them, and only the rest (dtypes, shapes, regions) is
parsed by protobuf, so an answer's elements are copied once, into the array the caller gets
(:func:`logitserve.client.codec.decode`'s ``data``), instead of into protobuf's arena, then a
``bytes``, then the array.

Paths name a tensor field from the top of a message by field names: ``("logits",)``, or in a
Step ``("sample", "logits")``.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading
from typing import Mapping

import numpy as np

from logitserve.v1 import logitserve_pb2 as pb

# Wire types (protobuf encoding): varint, 64-bit, length-delimited, 32-bit.
VARINT, I64, LEN, I32 = 0, 1, 2, 5
TENSOR_DATA = 3  # logitserve.v1.Tensor.data's field number
_DATA_TAG = bytes([TENSOR_DATA << 3 | LEN])
_TENSOR = pb.Tensor.DESCRIPTOR

Path = tuple[str, ...]


def encode_varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _varint(buf, pos: int) -> tuple[int, int]:
    """The varint at ``buf[pos]`` and the position after it."""
    value, shift = 0, 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def _skip(buf, pos: int, wire: int) -> int:
    if wire == VARINT:
        return _varint(buf, pos)[1]
    if wire == I64:
        return pos + 8
    if wire == I32:
        return pos + 4
    raise ValueError(f"wire type {wire} is not used by logitserve.v1")


# ------------------------------------------------------------------------------------ requests


def _number_tree(descriptor, paths) -> dict:
    """``{field number: subtree}`` down to each path's Tensor, whose entry is its path."""
    tree: dict = {}
    for path in paths:
        level, desc = tree, descriptor
        for depth, name in enumerate(path):
            field = desc.fields_by_name.get(name)
            if field is None or field.message_type is None:
                raise KeyError(f"{descriptor.full_name}: no message field {'.'.join(path[:depth + 1])}")
            if depth == len(path) - 1:
                if field.message_type is not _TENSOR:
                    raise KeyError(f"{descriptor.full_name}.{'.'.join(path)} is not a Tensor")
                level[field.number] = path
            else:
                level = level.setdefault(field.number, {})
                desc = field.message_type
    return tree


# Where a bytes object's elements start, from its address (CPython's PyBytesObject.ob_sval).
_BYTES_DATA = bytes.__basicsize__ - 1
# Requests at least this large are written into a recycled buffer (Recycler).
RECYCLE_MIN_BYTES = 4 << 20


class Recycler:
    """One spare request buffer per client, written anew for the next request of the same size.

    A large request's bytes are a fresh allocation each call, and the allocator maps fresh pages
    for it (glibc: above 32 MiB, always): the kernel faults in and zeroes every page while the
    one copy writes them, which costs more than the copy (about 95 ms for 131 MB on a 2-core VM,
    the copy itself about 15 ms). A bytes object that nothing else references any more (its
    reference count says so: gRPC holds a reference while it uses one) is written again instead
    of allocating a new one. CPython only; elsewhere every request is a new object.
    """

    enabled = sys.implementation.name == "cpython"

    def __init__(self):
        self._lock = threading.Lock()
        self._spare: bytes | None = None

    def take(self, size: int) -> bytes | None:
        """The spare buffer when it is ``size`` bytes and referenced by nothing else, else None."""
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None and len(spare) == size and sys.getrefcount(spare) == 2:  # ``spare`` and the argument
            return spare
        return None

    def give_back(self, buf: bytes) -> None:
        """Keep ``buf`` for a later request (safe at any time: :meth:`take` checks that nothing
        else references it then)."""
        if self.enabled and len(buf) >= RECYCLE_MIN_BYTES:
            with self._lock:
                self._spare = buf


def _write(pieces: list, size: int, into: bytes | None) -> bytes:
    """``b"".join(pieces)`` (``size`` bytes), written into ``into`` when given."""
    if into is None:
        return b"".join(pieces)
    address = id(into) + _BYTES_DATA
    pos = 0
    for piece in pieces:
        if isinstance(piece, bytes):  # the message's own bytes around the tensors: ctypes takes them as they are
            ctypes.memmove(address + pos, piece, len(piece))
            pos += len(piece)
            continue
        n = memoryview(piece).nbytes
        if n:
            ctypes.memmove(address + pos, np.frombuffer(piece, dtype=np.uint8).__array_interface__["data"][0], n)
            pos += n
    if pos != size:
        raise AssertionError(f"wrote {pos} bytes into a buffer of {size}")
    return into


def serialize(message, data: Mapping[Path, object], recycler: Recycler | None = None) -> bytes:
    """``message`` serialized with the bytes ``data[path]`` as the ``data`` of the Tensor at each
    path (whose own ``data`` is empty and whose ``region`` is unset): what protobuf would write
    for the message with those fields filled in, the buffers copied once, into the result.
    ``data`` values are bytes-like (memoryviews of arrays). ``recycler``: where a large result
    may be written into a buffer of an earlier request that nothing references any more."""
    data = {path: buf for path, buf in data.items() if memoryview(buf).nbytes}  # proto3 writes no empty bytes
    head = message.SerializeToString(deterministic=True)
    if not data:
        return head
    pieces: list = []
    found: list = []
    size = _emit(head, 0, len(head), _number_tree(message.DESCRIPTOR, data), data, pieces, found)
    if len(found) != len(data):
        missing = sorted(".".join(p) for p in set(data) - set(found))
        raise KeyError(f"{message.DESCRIPTOR.full_name}: tensor(s) {missing} not set in the message")
    into = recycler.take(size) if recycler is not None and size >= RECYCLE_MIN_BYTES and recycler.enabled else None
    return _write(pieces, size, into)


def _emit(buf: bytes, start: int, end: int, tree: dict, data, pieces: list, found: list) -> int:
    """Append the pieces of ``buf[start:end]`` with the data framed in; return their length."""
    pos = copied = start
    total = 0
    while pos < end:
        tag, pos = _varint(buf, pos)
        if tag & 7 != LEN:
            pos = _skip(buf, pos, tag & 7)
            continue
        length, value_at = _varint(buf, pos)
        field_end = value_at + length
        sub = tree.get(tag >> 3)
        if sub is not None:
            pieces.append(buf[copied:pos])  # what came before, and this field's tag
            total += pos - copied
            if isinstance(sub, dict):
                inner: list = []
                size = _emit(buf, value_at, field_end, sub, data, inner, found)
            else:  # the Tensor: dtype and shape, then data (field 3; region, field 4, is unset)
                payload = data[sub]
                nbytes = memoryview(payload).nbytes
                prefix = _DATA_TAG + encode_varint(nbytes)
                inner = [buf[value_at:field_end], prefix, payload]
                size = length + len(prefix) + nbytes
                found.append(sub)
            size_bytes = encode_varint(size)
            pieces.append(size_bytes)
            pieces += inner
            total += len(size_bytes) + size
            copied = field_end
        pos = field_end
    if pos != end:
        raise ValueError("malformed message")
    pieces.append(buf[copied:end])
    return total + end - copied


# ------------------------------------------------------------------------------------- answers


@functools.cache
def _tensor_fields(descriptor) -> dict:
    """``{field number: (name, subtree)}`` of the fields of ``descriptor`` that are or contain a
    Tensor (subtree None for a Tensor)."""
    tree = {}
    for field in descriptor.fields:
        sub = field.message_type
        if sub is None or sub.GetOptions().map_entry:
            continue
        if sub is _TENSOR:
            tree[field.number] = (field.name, None)
        elif sub is not descriptor:
            inner = _tensor_fields(sub)
            if inner:
                tree[field.number] = (field.name, inner)
    return tree


def split(raw: bytes, message_type) -> tuple[object, dict[Path, memoryview]]:
    """``raw`` parsed as ``message_type`` with the ``data`` of every Tensor in it left in
    ``raw``: ``(message, {path: memoryview})``, the message's own ``data`` fields empty."""
    tree = _tensor_fields(message_type.DESCRIPTOR)
    views: dict[Path, memoryview] = {}
    pieces: list = []
    view = memoryview(raw)
    try:
        _strip(raw, view, 0, len(raw), tree, (), pieces, views)
    except (ValueError, IndexError):
        return message_type.FromString(raw), {}  # not a plain encoding: protobuf says what is wrong
    return message_type.FromString(b"".join(pieces)), views


def _strip(buf: bytes, view: memoryview, start: int, end: int, tree, path: Path, pieces: list, views: dict) -> int:
    """Append the pieces of ``buf[start:end]`` without tensor data; return their length.
    ``tree`` None: this is a Tensor, whose data goes to ``views[path]``."""
    pos = copied = start
    total = 0
    while pos < end:
        tag_at = pos
        tag, pos = _varint(buf, pos)
        if tag & 7 != LEN:
            pos = _skip(buf, pos, tag & 7)
            continue
        length, value_at = _varint(buf, pos)
        field_end = value_at + length
        if field_end > end:
            raise ValueError("truncated")
        number = tag >> 3
        if tree is None:
            if number == TENSOR_DATA:  # cut out; a later occurrence wins, as in protobuf
                views[path] = view[value_at:field_end]
                pieces.append(buf[copied:tag_at])
                total += tag_at - copied
                copied = field_end
        elif number in tree:
            name, sub = tree[number]
            pieces.append(buf[copied:pos])
            total += pos - copied
            inner: list = []
            size = _strip(buf, view, value_at, field_end, sub, (*path, name), inner, views)
            size_bytes = encode_varint(size)
            pieces.append(size_bytes)
            pieces += inner
            total += len(size_bytes) + size
            copied = field_end
        pos = field_end
    if pos != end:
        raise ValueError("malformed message")
    pieces.append(buf[copied:end])
    return total + end - copied
