"""The operators as domain objects: validated calls, batched launches, results.

Each ``*Call`` is made from its request message by ``from_pb`` (all validation happens there,
raising ``ValueError`` / ``TypeError`` naming the field, or :class:`TooLarge`), knows its
batching ``key`` (calls with equal keys may share a launch; ``None`` never shares) and its
``rows``, and launches a list of compatible calls at once with ``await run_batch(calls, handle,
wait)``, which returns one result per call: Sample and RouteExperts through the device's graph
replays (:meth:`.device.DeviceHandle.launch`, waited for as ``wait`` says; a lone call's own
pieces straight into its captured graph, :meth:`.device.DeviceHandle.replay_alone`), the others
with torch on its launch thread. Results turn back into messages with ``to_pb``. Protobuf stops
here: the kernels only see torch tensors.

``SampleCall.prelaunch`` reads what a lone Sample call would launch from its request without
validating it (:class:`Prelaunch`), so that the call can replay while ``from_pb`` validates it
(server/batcher.py, ``Batcher.submit_prelaunched``).
"""

from __future__ import annotations

import math
import secrets
import struct
from dataclasses import dataclass, field
from typing import Mapping, Union

import numpy as np
import torch

from logitserve import kernels
from logitserve.kernels.topk_softmax import MAX_EXPERTS
from logitserve.v1 import logitserve_pb2 as pb

from .device import Wait
from .errors import TooLarge
from .staging import Staging, to_host
from .tensors import (FLOATS, INTS, NOT_IN_PLACE, PB_DTYPES, TORCH_DTYPES, HostTensor, decode, from_array, from_torch,
                      pack, packer, rows_values, tensor_field)

MAX_RANK = 8
ROUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FILTER_ORDERS = {
    pb.FILTER_ORDER_UNSPECIFIED: "top_k_first",
    pb.FILTER_ORDER_TOP_K_FIRST: "top_k_first",
    pb.FILTER_ORDER_JOINT: "joint",
}
# Seeds the server draws are uniform over [0, 2**63): every non-negative int64.
SEED_BITS = 63

Param = Union[int, float, list]  # a scalar, or one value per row


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

    def check_output(self, name: str, shape: tuple[int, ...], itemsize: int) -> None:
        if self.max_output_bytes is None:
            return
        size = math.prod(shape) * itemsize
        if size > self.max_output_bytes:
            raise TooLarge(f"{name}: the answer would hold {size} bytes (shape {list(shape)}), over this "
                           f"server's message limit of {self.max_output_bytes} (--max-message-bytes)")

    def check(self, name: str, rows: int, width: int) -> None:
        if rows > self.max_rows:
            raise TooLarge(f"{name}: {rows} rows, over this server's limit of {self.max_rows} (--max-rows)")
        if width > self.max_vocab:
            raise TooLarge(f"{name}: rows of {width} elements, over this server's limit of "
                           f"{self.max_vocab} (--max-vocab)")


def _split(t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(torch.split(t, sizes)) if len(sizes) > 1 else [t]


def _split_rows(a: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    return np.split(a, np.cumsum(sizes[:-1])) if len(sizes) > 1 else [a]


def _to_device(handle, *groups: list[HostTensor]) -> list[torch.Tensor]:
    """Each group of host tensors (one per call) stacked along dim 0; all moved in one transfer."""
    stage = Staging()
    for group in groups:
        stage.add(group)
    return stage.to(handle.device)


# ---------------------------------------------------------------------------------------------
# Sample


def _check_values(name: str, values: list, ok, rule: str, convert=lambda v: v) -> None:
    for i, v in enumerate(values):
        if not ok(convert(v)):
            raise ValueError(f"{name}[{i}]: {rule}, got {v}")


def _float_param(msg, name: str, rows: int, default: float | None, ok, rule: str, path: str) -> Param | None:
    """A float sampling parameter: the scalar field, or its per-row tensor ``<name>_rows``.

    ``ok`` maps a float to whether it keeps ``rule``; written with comparisons only, so NaN
    fails it. Values must keep the rule in float32 too, the precision
    the kernels read them in (a temperature of 1e300 is inf there, a top_p of 1e-300 is 0).
    """
    rows_field = name + "_rows"
    if msg.HasField(rows_field):
        values = rows_values(getattr(msg, rows_field), path + rows_field, rows, dtypes=(torch.float32, torch.float64))
        _check_values(path + rows_field, values, ok, rule)
        _check_values(path + rows_field, values, ok, _in_float32(rule), _as_float32)
        return values
    if not msg.HasField(name):
        return default
    value = getattr(msg, name)
    if not ok(value):
        raise ValueError(f"{path}{name}: {rule}, got {value}")
    if not ok(_as_float32(value)):
        raise ValueError(f"{path}{name}: {_in_float32(rule)}, got {value}")
    return value


def _in_float32(rule: str) -> str:
    return f"{rule} in float32, the precision the kernels use"


_FLOAT32 = struct.Struct("f")


def _as_float32(value: float) -> float:
    """``value`` rounded to float32, as the kernels read it (beyond float32's range: infinity)."""
    try:
        return _FLOAT32.unpack(_FLOAT32.pack(value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _int_param(msg, name: str, rows: int, default: int | None, rule_min: int, path: str) -> Param | None:
    """An integer sampling parameter (>= ``rule_min``): the scalar field or ``<name>_rows``."""
    rows_field = name + "_rows"
    if msg.HasField(rows_field):
        values = rows_values(getattr(msg, rows_field), path + rows_field, rows, dtypes=INTS)
        _check_values(path + rows_field, values, lambda v: v >= rule_min, f"must be >= {rule_min}")
        return values
    if not msg.HasField(name):
        return default
    value = getattr(msg, name)
    if value < rule_min:
        raise ValueError(f"{path}{name}: must be >= {rule_min}, got {value}")
    return value


def _draw_seeds(rows: int) -> list[int]:
    return [secrets.randbits(SEED_BITS) for _ in range(rows)]


# The sampling parameters as the kernels receive them from the server, one row of each kind per
# logits row: float32 (the precision they compute in; from_pb checks values in it) and int64.
FLOAT_PARAMS = ("temperature", "top_p", "min_p")
INT_PARAMS = ("top_k", "seed", "step")
# The defaults of the two parameters whose default is not protobuf's zero (DESIGN.md): no
# temperature scaling and no top-p cut.
DEFAULT_TEMPERATURE, DEFAULT_TOP_P = 1.0, 1.0


def _param_rows(columns: list[Param], rows: int, dtype: torch.dtype) -> HostTensor:
    """``columns`` (each a scalar or one value per row) as a ``[rows, len(columns)]`` tensor."""
    if list not in map(type, columns):
        return HostTensor(pack(columns, dtype) * rows, dtype, (rows, len(columns)))
    per_row = zip(*(c if type(c) is list else (c,) * rows for c in columns))
    return HostTensor(pack([v for row in per_row for v in row], dtype), dtype, (rows, len(columns)))


# The rules of the float parameters, as comparisons only, so that NaN breaks them.
def _temperature_ok(t):
    return (t >= 0) & (t < math.inf)


def _top_p_ok(p):
    return (p > 0) & (p <= 1)


def _min_p_ok(p):
    return (p >= 0) & (p <= 1)


def _random_val_ok(v):
    return (v >= 0) & (v < 1)


@dataclass(eq=False)
class SampleCall:
    """``kernels.sample`` on ``logits [B, V]`` with scalar or per-row parameters."""

    logits: HostTensor
    temperature: Param
    top_k: Param
    top_p: Param
    min_p: Param
    seed: Param  # the seeds the server drew, when the request set none
    step: Param
    filter_order: str
    random_val: Param | None
    # The parameters as the kernels read them, packed once: ``[rows, F]`` float32 (FLOAT_PARAMS,
    # then random_val if given) and ``[rows, 3]`` int64 (INT_PARAMS). Staging a batch then copies
    # one piece of each kind per call.
    params: tuple[HostTensor, HostTensor] = field(init=False, repr=False)

    op = "sample"

    @classmethod
    def from_pb(cls, msg: pb.SampleRequest, limits: Limits, path: str = "",
                in_place: Mapping[str, memoryview] = NOT_IN_PLACE) -> "SampleCall":
        logits = tensor_field(msg, "logits", path, in_place, dtypes=FLOATS, ranks=(2,))
        rows, vocab = logits.shape
        limits.check(f"{path}logits", rows, vocab)
        if msg.filter_order not in FILTER_ORDERS:
            raise ValueError(f"{path}filter_order: unknown value {msg.filter_order}")
        seed = _int_param(msg, "seed", rows, None, 0, path)
        call = cls(
            logits=logits,
            temperature=_float_param(msg, "temperature", rows, DEFAULT_TEMPERATURE, _temperature_ok,
                                     "must be finite and >= 0", path),
            top_k=_int_param(msg, "top_k", rows, 0, 0, path),
            top_p=_float_param(msg, "top_p", rows, DEFAULT_TOP_P, _top_p_ok, "must be in (0, 1]", path),
            min_p=_float_param(msg, "min_p", rows, 0.0, _min_p_ok, "must be in [0, 1]", path),
            seed=_draw_seeds(rows) if seed is None else seed,
            step=_int_param(msg, "step", rows, 0, 0, path),
            filter_order=FILTER_ORDERS[msg.filter_order],
            random_val=_float_param(msg, "random_val", rows, None, _random_val_ok, "must be in [0, 1)", path),
        )
        if call.random_val is not None and _any_nonzero(call.min_p):
            raise ValueError(f"{path}min_p: must be 0 with random_val (InfiniCore's random_sample has no min-p)")
        return call

    @property
    def rows(self) -> int:
        return self.logits.shape[0]

    @property
    def key(self):
        return self.batch_key(self.logits.dtype, self.logits.shape[1], self.filter_order, self.random_val is None)

    @classmethod
    def batch_key(cls, dtype: torch.dtype, vocab: int, filter_order: str, draws: bool) -> tuple:
        """The key of calls that may share a launch: ``draws`` when the kernel draws its own
        random values (no random_val)."""
        return (cls.op, dtype, vocab, filter_order, draws)

    def seeds(self) -> list[int]:
        return self.seed if isinstance(self.seed, list) else [self.seed] * self.rows

    def __post_init__(self):
        floats = [self.temperature, self.top_p, self.min_p]
        if self.random_val is not None:
            floats.append(self.random_val)
        self.params = (_param_rows(floats, self.rows, torch.float32),
                       _param_rows([self.top_k, self.seed, self.step], self.rows, torch.int64))

    @property
    def parts(self) -> tuple[HostTensor, HostTensor, HostTensor]:
        """What the launch reads of this call, one piece per staged part: logits, float and int parameters."""
        return (self.logits, *self.params)

    @staticmethod
    def prelaunch(msg: pb.SampleRequest, in_place: Mapping[str, memoryview]) -> "Prelaunch | None":
        """What a call of ``msg`` would launch, read from the request without validating it (see
        :class:`Prelaunch`): for a request with a seed, scalar parameters, no random_val and its
        logits read in place, whose sizes agree; None for any other.

        The defaults are from_pb's, and the parts are packed as from_pb packs them; were they
        ever not, the call made would not match and would launch again (Prelaunch.launches).
        """
        data = in_place.get("logits")
        has = msg.HasField
        if (data is None or not has("seed") or has("random_val") or has("temperature_rows") or has("top_k_rows")
                or has("top_p_rows") or has("min_p_rows") or has("seed_rows") or has("step_rows")):
            return None
        logits = msg.logits
        dtype, shape, filter_order = TORCH_DTYPES.get(logits.dtype), logits.shape, FILTER_ORDERS.get(msg.filter_order)
        if dtype not in FLOATS or len(shape) != 2 or filter_order is None:
            return None
        rows, vocab = shape
        if len(data) != rows * vocab * dtype.itemsize:
            return None
        try:
            floats = _FLOAT_ROW.pack(msg.temperature if has("temperature") else DEFAULT_TEMPERATURE,
                                     msg.top_p if has("top_p") else DEFAULT_TOP_P, msg.min_p)
        except OverflowError:  # beyond float32: from_pb says which field
            return None
        ints = _INT_ROW.pack(msg.top_k, msg.seed, msg.step)
        return Prelaunch(SampleCall.batch_key(dtype, vocab, filter_order, True),
                         (HostTensor(data, dtype, (rows, vocab)),
                          HostTensor(floats * rows, torch.float32, (rows, len(FLOAT_PARAMS))),
                          HostTensor(ints * rows, torch.int64, (rows, len(INT_PARAMS)))))

    def lone_result(self, outputs: list[np.ndarray]) -> "SampleResult":
        """The result of this call launched alone, from its graph's ``outputs``."""
        return SampleResult(outputs[0].tolist(), self.seeds())

    @staticmethod
    async def run_batch(calls: list["SampleCall"], handle, wait: Wait = Wait.THREAD) -> list["SampleResult"]:
        if len(calls) == 1:
            c = calls[0]
            outputs = await handle.replay_alone(c.key, c.parts, wait)
            if outputs is not None:
                return [c.lone_result(outputs)]
        rows = [c.rows for c in calls]
        names = FLOAT_PARAMS if calls[0].random_val is None else FLOAT_PARAMS + ("random_val",)
        names += INT_PARAMS
        filter_order = calls[0].filter_order

        def stage_for(batch_rows: int) -> Staging:
            # Every parameter goes to the kernel as a per-row tensor, whatever the calls sent: then
            # one compiled variant per (dtype, vocabulary, filter order) serves every batch, and
            # warm-up covers them all. Scalars where a batch happens to agree would pick a variant
            # per mix of scalar and per-row parameters, compiled mid-traffic (seconds per call).
            # Each parameter is a column of a row-major [rows, F] part, so its pointer's 16-byte
            # alignment (which Triton specialises on) is the same for every batch size. Padding
            # rows get zeros: a top_p of 0 makes the kernel answer -1 there at once.
            stage = Staging()
            logits, floats, ints = zip(*(c.parts for c in calls))
            stage.add(logits, rows=batch_rows)
            stage.add(floats, rows=batch_rows, zero_padding=True)
            stage.add(ints, rows=batch_rows, zero_padding=True)
            return stage

        def launch(logits, float_rows, int_rows):
            params = dict(zip(names, (*float_rows.unbind(1), *int_rows.unbind(1))))
            return (kernels.sample(logits, **params, filter_order=filter_order, backend=handle.backend),)

        tokens, = await handle.launch(calls[0].key, sum(rows), stage_for, launch, wait=wait)
        return [SampleResult(t.tolist(), c.seeds()) for t, c in zip(_split_rows(tokens, rows), calls)]


# A row of the float (FLOAT_PARAMS) and int (INT_PARAMS) parameters: the layouts _param_rows
# packs them with (tensors.pack), fetched once for SampleCall.prelaunch's hot path.
_FLOAT_ROW, _INT_ROW = packer(len(FLOAT_PARAMS), torch.float32), packer(len(INT_PARAMS), torch.int64)


@dataclass(eq=False, slots=True)
class Prelaunch:
    """A lone call's launch as read from its request before the call is made (validated): its
    batching key and the parts its captured graph reads (:attr:`SampleCall.parts`' layout).

    A call that has the server to itself can then replay while it is validated, the parts'
    values being safe to launch unchecked: the kernels check parameter values on the device and
    answer -1 for a row that breaks a rule (kernels/sample.py), and the sizes agree with the
    graph's, which the key and rows chose. Its result stands only for the call it
    :meth:`launches` (server/batcher.py, Batcher.submit_prelaunched). Never changed once made.
    """

    key: tuple
    parts: tuple[HostTensor, ...]

    @property
    def rows(self) -> int:
        return self.parts[0].shape[0]

    def launches(self, call) -> bool:
        """Whether ``call`` is what this launched: the same key, and each part the same bytes
        (the logits the very view of the request's bytes both were read from)."""
        if call.key != self.key:
            return False
        for ours, theirs in zip(self.parts, call.parts):
            if ours.shape != theirs.shape or not (ours.data is theirs.data or (type(ours.data) is bytes
                                                                               and ours.data == theirs.data)):
                return False
        return True


def _any_nonzero(value: Param) -> bool:
    return any(v != 0 for v in value) if isinstance(value, list) else value != 0


@dataclass
class SampleResult:
    token_ids: list[int]
    seeds: list[int]

    def to_pb(self) -> pb.SampleResponse:
        # Built from Python ints with struct: torch calls on the event loop cost far more. The
        # tensors' dtypes and shapes come parsed from a frame made once per row count: setting
        # them field by field cost twice as much as the whole answer does this way.
        rows = len(self.token_ids)
        frame = _SAMPLE_FRAMES.get(rows)
        if frame is None:
            frame = _SAMPLE_FRAMES[rows] = _sample_frame(rows)
        response = pb.SampleResponse.FromString(frame)
        response.token_ids.data = pack(self.token_ids, torch.int64)
        response.seeds.data = pack(self.seeds, torch.int64)
        response.valid.data = pack([i >= 0 for i in self.token_ids], torch.bool)
        return response


def _sample_frame(rows: int) -> bytes:
    """A SampleResponse of ``rows`` rows without their data: each tensor's dtype and shape."""
    response = pb.SampleResponse()
    for tensor, dtype in ((response.token_ids, torch.int64), (response.seeds, torch.int64),
                          (response.valid, torch.bool)):
        tensor.dtype = PB_DTYPES[dtype]
        tensor.shape.append(rows)
    return response.SerializeToString()


# Response frames by row count (at most --max-rows of them).
_SAMPLE_FRAMES: dict[int, bytes] = {}


# ---------------------------------------------------------------------------------------------
# RouteExperts


@dataclass(eq=False)
class RouteExpertsCall:
    """``kernels.topk_softmax`` on ``gate_logits [N, E]``."""

    gate_logits: HostTensor
    k: int
    renormalize: bool

    op = "route_experts"

    @classmethod
    def from_pb(cls, msg: pb.RouteExpertsRequest, limits: Limits, path: str = "",
                in_place: Mapping[str, memoryview] = NOT_IN_PLACE) -> "RouteExpertsCall":
        g = tensor_field(msg, "gate_logits", path, in_place, dtypes=ROUTE_DTYPES, ranks=(2,))
        limits.check(f"{path}gate_logits", g.shape[0], g.shape[1])
        experts = g.shape[1]
        if experts > MAX_EXPERTS:
            raise ValueError(f"{path}gate_logits.shape: at most {MAX_EXPERTS} experts, got E = {experts}")
        if not 1 <= msg.k <= experts:
            raise ValueError(f"{path}k: must be in [1, E] with E = {experts} experts (gate_logits.shape[1]), "
                             f"got {msg.k}")
        limits.check_output(f"{path}gate_logits", (g.shape[0], msg.k), 8)  # float32 weights + int32 indices
        return cls(g, msg.k, msg.renormalize)

    @property
    def rows(self) -> int:
        return self.gate_logits.shape[0]

    @property
    def key(self):
        return (self.op, self.gate_logits.dtype, self.gate_logits.shape[1], self.k, self.renormalize)

    @staticmethod
    async def run_batch(calls: list["RouteExpertsCall"], handle,
                        wait: Wait = Wait.THREAD) -> list["RouteExpertsResult"]:
        if len(calls) == 1:
            c = calls[0]
            outputs = await handle.replay_alone(c.key, (c.gate_logits,), wait)
            if outputs is not None:
                return [RouteExpertsResult(*outputs)]
        rows = [c.rows for c in calls]
        k, renormalize = calls[0].k, calls[0].renormalize

        def stage_for(batch_rows: int) -> Staging:
            stage = Staging()
            stage.add([c.gate_logits for c in calls], rows=batch_rows)
            return stage

        def launch(gate_logits):
            return kernels.topk_softmax(gate_logits, k, renormalize=renormalize, backend=handle.backend)

        weights, indices = await handle.launch(calls[0].key, sum(rows), stage_for, launch, wait=wait)
        return [RouteExpertsResult(w, i) for w, i in zip(_split_rows(weights, rows), _split_rows(indices, rows))]


@dataclass
class RouteExpertsResult:
    weights: np.ndarray
    indices: np.ndarray

    def to_pb(self) -> pb.RouteExpertsResponse:
        return pb.RouteExpertsResponse(weights=from_array(self.weights), indices=from_array(self.indices))


# ---------------------------------------------------------------------------------------------
# Row-wise tensor ops: Softmax, CausalSoftmax, Silu / SwiGLU. Compatible calls are stacked as
# rows of one 2-D (3-D for causal softmax) tensor and split again after the launch.


class _LaunchedOnThread:
    """An op whose batches launch eagerly with torch, on the device's launch thread
    (``launch_on_thread(calls, handle)``, one result per call)."""

    @classmethod
    async def run_batch(cls, calls: list, handle, wait: Wait = Wait.THREAD) -> list["TensorResult"]:
        return await handle.run(cls.launch_on_thread, calls, handle)


@dataclass
class TensorResult:
    out: torch.Tensor
    response: type

    def to_pb(self):
        return self.response(out=from_torch(self.out))


def _rows_and_width(shape: tuple[int, ...], axis: int) -> tuple[int, int]:
    width = shape[axis]
    return math.prod(shape) // width, width


@dataclass(eq=False)
class SoftmaxCall(_LaunchedOnThread):
    """``kernels.softmax`` along ``dim`` of a tensor of any rank."""

    x: HostTensor
    dim: int

    op = "softmax"

    @classmethod
    def from_pb(cls, msg: pb.SoftmaxRequest, limits: Limits, path: str = "",
                in_place: Mapping[str, memoryview] = NOT_IN_PLACE) -> "SoftmaxCall":
        x = tensor_field(msg, "x", path, in_place, dtypes=FLOATS, ranks=tuple(range(1, MAX_RANK + 1)))
        dim = msg.dim if msg.HasField("dim") else -1
        if not -x.ndim <= dim < x.ndim:
            raise ValueError(f"{path}dim: must be in [{-x.ndim}, {x.ndim}) for a rank-{x.ndim} x, got {dim}")
        dim %= x.ndim
        limits.check(f"{path}x", *_rows_and_width(tuple(x.shape), dim))
        return cls(x, dim)

    @property
    def rows(self) -> int:
        return _rows_and_width(tuple(self.x.shape), self.dim)[0]

    @property
    def key(self):
        # Only last-axis softmaxes stack as rows; another axis launches alone.
        return (self.op, self.x.dtype, self.x.shape[-1]) if self.dim == self.x.ndim - 1 else None

    @staticmethod
    def launch_on_thread(calls: list["SoftmaxCall"], handle) -> list[TensorResult]:
        if len(calls) == 1:
            c = calls[0]
            x, = _to_device(handle, [c.x])
            return [TensorResult(to_host(kernels.softmax(x, dim=c.dim, backend=handle.backend)), pb.SoftmaxResponse)]
        width = calls[0].x.shape[-1]
        x, = _to_device(handle, [c.x.reshape(-1, width) for c in calls])
        out = to_host(kernels.softmax(x, dim=-1, backend=handle.backend))
        return [TensorResult(o.reshape(c.x.shape), pb.SoftmaxResponse)
                for o, c in zip(_split(out, [c.rows for c in calls]), calls)]


@dataclass(eq=False)
class CausalSoftmaxCall(_LaunchedOnThread):
    """``kernels.causal_softmax`` on scores ``[S, T]`` or ``[B, S, T]``, ``T >= S``."""

    x: HostTensor

    op = "causal_softmax"

    @classmethod
    def from_pb(cls, msg: pb.CausalSoftmaxRequest, limits: Limits, path: str = "",
                in_place: Mapping[str, memoryview] = NOT_IN_PLACE) -> "CausalSoftmaxCall":
        x = tensor_field(msg, "x", path, in_place, dtypes=FLOATS, ranks=(2, 3))
        s, t = x.shape[-2:]
        if t < s:
            raise ValueError(f"{path}x.shape: needs T >= S (every row sees a column), got S = {s}, T = {t}")
        limits.check(f"{path}x", x.numel() // t, t)
        return cls(x)

    @property
    def rows(self) -> int:
        return self.x.numel() // self.x.shape[-1]

    @property
    def key(self):
        return (self.op, self.x.dtype, *self.x.shape[-2:])

    @staticmethod
    def launch_on_thread(calls: list["CausalSoftmaxCall"], handle) -> list[TensorResult]:
        s, t = calls[0].x.shape[-2:]
        stacked, = _to_device(handle, [c.x.reshape(-1, s, t) for c in calls])
        out = to_host(kernels.causal_softmax(stacked, backend=handle.backend))
        sizes = [c.x.numel() // (s * t) for c in calls]
        return [TensorResult(o.reshape(c.x.shape), pb.CausalSoftmaxResponse)
                for o, c in zip(_split(out, sizes), calls)]


@dataclass(eq=False)
class SiluCall(_LaunchedOnThread):
    """``kernels.silu(x)``, or ``kernels.swiglu(x, up)`` when ``up`` is given (broadcasting)."""

    x: HostTensor
    up: HostTensor | None

    op = "silu"

    @classmethod
    def from_pb(cls, msg: pb.SiluRequest, limits: Limits, path: str = "",
                in_place: Mapping[str, memoryview] = NOT_IN_PLACE) -> "SiluCall":
        ranks = tuple(range(1, MAX_RANK + 1))
        x = tensor_field(msg, "x", path, in_place, dtypes=FLOATS, ranks=ranks)
        up = None
        shape = tuple(x.shape)
        if msg.HasField("up"):
            up = decode(msg.up, f"{path}up", dtypes=FLOATS, ranks=ranks, data=in_place.get("up"))
            if up.dtype != x.dtype:
                raise TypeError(f"{path}up.dtype: must match x.dtype ({x.dtype}), got {up.dtype}".replace("torch.", ""))
            try:
                shape = tuple(torch.broadcast_shapes(x.shape, up.shape))
            except RuntimeError:
                raise ValueError(f"{path}up.shape: {list(up.shape)} does not broadcast with x.shape "
                                 f"{list(x.shape)}") from None
        limits.check(f"{path}x", *_rows_and_width(shape, -1))
        limits.check_output(f"{path}x", shape, x.element_size())
        return cls(x, up)

    @property
    def rows(self) -> int:
        return self.x.numel() // self.x.shape[-1]

    @property
    def key(self):
        if self.up is None:
            return ("silu", self.x.dtype, self.x.shape[-1])
        # SwiGLU stacks only when nothing broadcasts; broadcasting calls launch alone.
        return ("swiglu", self.x.dtype, self.x.shape[-1]) if self.up.shape == self.x.shape else None

    @staticmethod
    def launch_on_thread(calls: list["SiluCall"], handle) -> list[TensorResult]:
        backend = handle.backend
        if len(calls) == 1:
            c = calls[0]
            x, *up = _to_device(handle, [c.x]) if c.up is None else _to_device(handle, [c.x], [c.up])
            out = kernels.silu(x, backend=backend) if c.up is None else kernels.swiglu(x, up[0], backend=backend)
            return [TensorResult(to_host(out), pb.SiluResponse)]
        width = calls[0].x.shape[-1]
        if calls[0].up is None:
            x, = _to_device(handle, [c.x.reshape(-1, width) for c in calls])
            out = kernels.silu(x, backend=backend)
        else:
            x, up = _to_device(handle, [c.x.reshape(-1, width) for c in calls],
                               [c.up.reshape(-1, width) for c in calls])
            out = kernels.swiglu(x, up, backend=backend)
        out = to_host(out)
        return [TensorResult(o.reshape(c.x.shape), pb.SiluResponse)
                for o, c in zip(_split(out, [c.rows for c in calls]), calls)]


# ---------------------------------------------------------------------------------------------
# Step: several of the above in one round trip.

STEP_OPS = {
    "sample": SampleCall,
    "route_experts": RouteExpertsCall,
    "softmax": SoftmaxCall,
    "causal_softmax": CausalSoftmaxCall,
    "silu": SiluCall,
}


def _within(in_place: Mapping[str, memoryview], name: str) -> Mapping[str, memoryview]:
    """The entries of ``in_place`` inside the sub-message ``name``, by their names there."""
    prefix = name + "."
    return {k[len(prefix):]: v for k, v in in_place.items() if k.startswith(prefix)}


@dataclass
class StepCall:
    """The operators one StepRequest names, each a call of its own (they batch independently)."""

    id: str
    calls: dict[str, object]

    @classmethod
    def from_pb(cls, msg: pb.StepRequest, limits: Limits,
                in_place: Mapping[str, memoryview] = NOT_IN_PLACE) -> "StepCall":
        """``in_place``: tensor bytes read in place, by dotted name (``sample.logits``)."""
        calls = {name: op.from_pb(getattr(msg, name), limits, path=f"{name}.", in_place=_within(in_place, name))
                 for name, op in STEP_OPS.items() if msg.HasField(name)}
        if not calls:
            raise ValueError(f"step: sets none of {', '.join(STEP_OPS)}")
        return cls(msg.id, calls)

    @property
    def rows(self) -> int:
        return sum(c.rows for c in self.calls.values())


@dataclass
class StepResult:
    id: str
    results: dict[str, object]

    def to_pb(self) -> pb.StepResponse:
        return pb.StepResponse(id=self.id, **{name: r.to_pb() for name, r in self.results.items()})


# ---------------------------------------------------------------------------------------------
# Warm-up: one small call per operator and dtype, through the same launch path as requests.


# Batch sizes warm-up runs at: one of each class Triton specialises an integer on (== 1,
# divisible by 16, neither).
WARMUP_BATCH_ROWS = (1, 2, 16)


def warmup_calls(dtype: torch.dtype, widths: tuple[int, ...]) -> list[tuple[str, object]]:
    """``(label, call)`` pairs that compile every operator for ``dtype`` at row ``widths``.

    Sampling compiles one variant per filter order and one for random_val (the server passes
    every parameter per row, see SampleCall.run_batch). Every op runs at batch sizes 1, 2 and
    16: Triton specialises integer arguments on being 1 and on divisibility by 16, so these
    three cover every batch the batcher can form. Without them a new kernel variant compiled
    mid-traffic (a 5 s p99 on the H100 service benchmark).
    """
    gen = torch.Generator().manual_seed(0)
    cases: list[tuple[str, object]] = []
    for w in widths:
        for b in WARMUP_BATCH_ROWS:
            logits = HostTensor.of(torch.randn(b, w, generator=gen).to(dtype))
            seeds = list(range(1, b + 1))
            cases += [
                (f"sample {b}x{w}", SampleCall(logits, 0.8, 50, 0.9, 0.0, seeds, 0, "top_k_first", None)),
                (f"sample joint {b}x{w}", SampleCall(logits, 0.8, 50, 0.9, 0.0, seeds, 0, "joint", None)),
                (f"sample random_val {b}x{w}", SampleCall(logits, 0.8, 50, 0.9, 0.0, seeds, 0, "top_k_first", 0.5)),
                (f"softmax {b}x{w}", SoftmaxCall(logits, 1)),
            ]
    x = HostTensor.of(torch.randn(2, 4, 8, generator=gen).to(dtype))
    cases += [
        ("causal_softmax", CausalSoftmaxCall(x)),
        ("silu", SiluCall(x, None)),
        ("swiglu", SiluCall(x, x)),
    ]
    if dtype in ROUTE_DTYPES:
        for experts, k in ((8, 2), (64, 6), (128, 8), (256, 8)):
            for b in WARMUP_BATCH_ROWS:
                g = HostTensor.of(torch.randn(b, experts, generator=gen).to(dtype))
                cases.append((f"route_experts {b}x{experts} k={k}", RouteExpertsCall(g, k, True)))
    return cases


# ---------------------------------------------------------------------------------------------
# GetServerInfo


@dataclass
class ServerInfo:
    """What GetServerInfo answers: the server's version, device, backend, dtypes, limits, counters."""

    version: str
    device: str
    device_name: str
    backend: str
    warmed_dtypes: list[torch.dtype]
    limits: dict[str, int]
    stats: dict[str, int]

    def to_pb(self) -> pb.GetServerInfoResponse:
        return pb.GetServerInfoResponse(
            version=self.version, device=self.device, device_name=self.device_name, backend=self.backend,
            dtypes=[PB_DTYPES[d] for d in FLOATS], warmed_dtypes=[PB_DTYPES[d] for d in self.warmed_dtypes],
            limits=pb.Limits(**self.limits), stats=pb.ServerStats(**self.stats))
