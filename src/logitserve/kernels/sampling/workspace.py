"""The workspace of ``sample``: one zero-filled byte buffer, its arrays laid out in one table.

:func:`_layout` is that table: one line per array (element type, shape, what it holds), in
order, each starting on a 16-byte boundary after the previous one. The kernels read the offsets through :func:`ws_offsets`; the host sizes
the buffer with :func:`workspace_size`, which runs the same function's code on Python ints (its
jit helpers and constexprs swapped for their Python values), so the two cannot disagree.

The merge's tickets sit at offset 0 and the kernels leave them at zero; the other arrays are
written before they are read in each call. A workspace sized for ``n_rows`` rows serves any
batch of at most that many (the plan keeps one per stream, sized for the largest batch seen).
"""

from __future__ import annotations

import types

import triton
import triton.language as tl

from .._triton_internals import InterpretedFunction, JITFunction

# Candidate slots per row. A top_k up to K_GATHER_MAX (or, without top_k, the K_GATHER_DEFAULT
# largest logits; stats.py) sets the gather bound; on random logits the list then holds about
# k + k^2 / (2 * groups) tokens (k tokens in distinct groups, plus collisions): about 145 for
# k = 128 and 512 groups, so 256 slots leave room for ties.
CAP = tl.constexpr(256)

# A row's state (the first int64 of its row ints), written by the merge.
ROW_STATE_SAMPLE = tl.constexpr(0)  # drawn by the draw launch (draw.py)
ROW_STATE_DONE = tl.constexpr(1)  # answered by the merge (greedy, or -1)
ROW_STATE_PASS1 = tl.constexpr(2)  # as SAMPLE, and the gather launch also runs the first pass


@triton.jit
def _align16(n):
    return (n + 15) // 16 * 16


@triton.jit
def _layout(rows, n_chunks, NG: tl.constexpr, CT: tl.constexpr):
    """Byte offsets of the workspace's arrays, then its total size. ``rows``: the row capacity
    (int64 in kernels); ``NG``: groups per chunk; ``CT``: bytes of the compute dtype, ct (4 or 8)."""
    # Each array's bytes, rounded up to 16      # element [shape]: what it holds
    tickets = _align16(4 * rows)                # int32 [rows]: the merge's last-program tickets
    count = _align16(4 * rows)                  # int32 [rows]: candidates gathered
    rowi = _align16(16 * rows)                  # int64 [rows, 2]: state, candidate bound key
    rowf = _align16(2 * CT * rows)              # ct [rows, 2]: max, softmax total
    flags = _align16(8 * rows * n_chunks)       # int32 [rows, chunks, 2]: NaN/finite flag, first arg-max
    stats = _align16(2 * CT * rows * n_chunks)  # ct [rows, chunks, 2]: chunk max, softmax partial
    groups = _align16(CT * rows * n_chunks * NG)  # ct [rows, chunks * NG]: group maxima
    cx = _align16(CT * rows * CAP)              # ct [rows, CAP]: candidate values
    ci = _align16(4 * rows * CAP)               # int32 [rows, CAP]: candidate indices
    p1s = _align16(CT * rows * n_chunks)        # ct [rows, chunks]: first-pass chunk winners' scores
    p1i = _align16(16 * rows * n_chunks)        # int64 [rows, chunks, 2]: their (index, key)
    parts = _align16(CT * rows * n_chunks)      # ct [rows, chunks]: parts of the walk's first check
    # In that order, the tickets at 0.
    o_count = tickets
    o_rowi = o_count + count
    o_rowf = o_rowi + rowi
    o_flags = o_rowf + rowf
    o_stats = o_flags + flags
    o_groups = o_stats + stats
    o_cx = o_groups + groups
    o_ci = o_cx + cx
    o_p1s = o_ci + ci
    o_p1i = o_p1s + p1s
    o_parts = o_p1i + p1i
    return o_count, o_rowi, o_rowf, o_flags, o_stats, o_groups, o_cx, o_ci, o_p1s, o_p1i, o_parts, o_parts + parts


@triton.jit
def ws_offsets(n_rows, n_chunks, NG: tl.constexpr, IS_F64: tl.constexpr):
    """The arrays' byte offsets (:func:`_layout`), in int64."""
    CT: tl.constexpr = 8 if IS_F64 else 4
    o_count, o_rowi, o_rowf, o_flags, o_stats, o_groups, o_cx, o_ci, o_p1s, o_p1i, o_parts, end = _layout(
        tl.cast(n_rows, tl.int64), n_chunks, NG, CT)
    return o_count, o_rowi, o_rowf, o_flags, o_stats, o_groups, o_cx, o_ci, o_p1s, o_p1i, o_parts


def _on_host(jit_fn: JITFunction | InterpretedFunction):
    """A ``@triton.jit`` function of integer arithmetic as a Python function: the same code, with
    the jit helpers and ``tl.constexpr`` values of its globals swapped for their Python ones
    (``InterpretedFunction`` where ``TRITON_INTERPRET=1`` made ``triton.jit`` return one)."""
    fn = jit_fn.fn
    host_globals = {name: value.fn if isinstance(value, (JITFunction, InterpretedFunction)) else
                    value.value if isinstance(value, tl.constexpr) else value
                    for name, value in fn.__globals__.items()}
    return types.FunctionType(fn.__code__, host_globals, fn.__name__, fn.__defaults__, fn.__closure__)


_host_layout = _on_host(_layout)


def workspace_size(n_rows: int, n_chunks: int, groups_per_chunk: int, is_f64: bool) -> int:
    """Total bytes of the workspace (:func:`_layout`'s end)."""
    return _host_layout(n_rows, n_chunks, groups_per_chunk, 8 if is_f64 else 4)[-1]


@triton.jit
def ws_ptr_of(ws_ptr, byte_offset, dtype: tl.constexpr):
    """A typed view into the byte workspace."""
    return (ws_ptr + byte_offset).to(tl.pointer_type(dtype))


@triton.jit
def ct_ptr_of(ws_ptr, byte_offset, IS_F64: tl.constexpr):
    """A view of compute-dtype values in the workspace."""
    if IS_F64:
        return (ws_ptr + byte_offset).to(tl.pointer_type(tl.float64))
    else:
        return (ws_ptr + byte_offset).to(tl.pointer_type(tl.float32))
