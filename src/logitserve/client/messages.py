"""Requests from Python arguments, shared by Client and AsyncClient (answers: :mod:`.results`).

An :class:`Encoder` builds one request: each tensor argument becomes a ``Tensor`` that names a
region (when it lies in one registered through the client, found by its address) or whose bytes
are held apart, to be framed into the serialized request once (:mod:`.wire`); ``out=`` arguments
become the request's ``output_regions``. The ``*_request`` functions build complete messages
(bytes inside) for callers that want the message itself.
"""

from __future__ import annotations

import numbers
from typing import Any, Mapping

import numpy as np

from logitserve.v1 import logitserve_pb2 as pb

from . import codec, wire
from .codec import dtype_name, is_torch
from .region_table import Located, Registrations, RegionTable

FILTER_ORDERS = {"top_k_first": pb.FILTER_ORDER_TOP_K_FIRST, "joint": pb.FILTER_ORDER_JOINT}
STEP_OPS = ("sample", "route_experts", "softmax", "causal_softmax", "silu", "swiglu")


# ------------------------------------------------------------------------------------ requests

# The outputs of each operator (its request's output_regions keys), and what each must be.
SAMPLE_OUTPUTS = ("token_ids", "seeds", "valid")
SAMPLE_LOGPROBS = ("token_logprobs", "token_ranks", "top_token_ids", "top_logprobs", "kept_bitmask")
ROUTE_OUTPUTS = ("weights", "indices")
VERIFY_OUTPUTS = ("token_ids", "num_accepted", "valid", "seeds")
TENSOR_OUTPUTS = ("out",)


class Encoder:
    """One request in the making: the tensors' bytes held apart (``data``, by path), the
    outputs given with ``out=`` (``outputs``, by path: returned in place of decoded arrays) and
    the CUDA devices whose memory the request names (``cuda_devices``: their streams are
    synchronized before it is sent), and the registrations it names (``referenced``, ``{server
    name: serial}``: a NOT_FOUND for one drops it from the table). ``table``: the client's
    regions (None: every tensor goes as bytes, and ``out=`` is refused)."""

    def __init__(self, table: RegionTable | None = None):
        self.table = table
        self.data: dict[wire.Path, memoryview] = {}
        self.outputs: dict[wire.Path, Any] = {}
        self.cuda_devices: set[int] = set()
        self.referenced: Registrations = {}

    def given(self, msg):
        """A message the caller built (a Tensor, an operator's request), the regions it names by
        a name registered through the client renamed to the server's name (other names go as
        written)."""
        if self.table is None:
            return msg
        msg, named = self.table.references(msg)
        self.referenced.update(named)
        return msg

    def _located(self, where: Located) -> pb.RegionRef:
        if where.device is not None:
            self.cuda_devices.add(where.device)
        self.referenced[where.region] = where.serial
        return where.ref()

    def tensor(self, x, path: wire.Path, label: str) -> pb.Tensor:
        """The Tensor for argument ``x`` at ``path``: a region reference when ``x`` lies in a
        registered region, else its header, its bytes kept in ``data``. A ``pb.Tensor`` (e.g.
        ``regions.region_tensor``) is taken as it is, its region's name translated (:meth:`given`)."""
        if isinstance(x, pb.Tensor):
            return self.given(x)
        where = self.table.locate(x) if self.table is not None else None
        if where is not None:
            return pb.Tensor(dtype=codec.wire_dtype(x), shape=tuple(x.shape), region=self._located(where))
        dtype, shape, data = codec.tensor_parts(x, label)
        self.data[path] = data
        return pb.Tensor(dtype=dtype, shape=shape)

    def outputs_into(self, msg, path: wire.Path, out, expect: Mapping[str, tuple[int, tuple[int, ...]]]) -> None:
        """Fill ``msg.output_regions`` from ``out``: one array or tensor (an operator with the
        single output ``out``), a dict by output name, or an object with those attributes
        (e.g. a :class:`SampleResult` of registered arrays). Each must have the dtype and shape
        ``expect[name]`` says and lie, contiguous, in a region registered through the client."""
        if out is None:
            return
        names = tuple(expect)
        if isinstance(out, Mapping):
            unknown = set(out) - set(names)
            if unknown:
                raise ValueError(f"out: {sorted(unknown)} are not outputs of this call; use {', '.join(names)}")
            given = {k: v for k, v in out.items() if v is not None}
        elif names == TENSOR_OUTPUTS and (is_torch(out) or isinstance(out, np.ndarray)):
            given = {"out": out}
        elif isinstance(out, tuple) and len(out) == len(names):
            given = {k: v for k, v in zip(names, out) if v is not None}
        else:
            given = {k: getattr(out, k) for k in names if getattr(out, k, None) is not None}
            if not given:
                raise TypeError(f"out: give a dict or an object with some of {', '.join(names)}")
        for name, obj in given.items():
            label = "out" if names == TENSOR_OUTPUTS else f"out[{name!r}]"
            dtype, shape = expect[name]
            if not (is_torch(obj) or isinstance(obj, np.ndarray)):
                raise TypeError(f"{label}: a numpy array or torch tensor in a registered region, got {type(obj).__name__}")
            have = codec.wire_dtype(obj)
            if have != dtype or tuple(obj.shape) != tuple(shape):
                have_name = dtype_name(have) if have is not None else str(obj.dtype)
                raise ValueError(f"{label}: must be {dtype_name(dtype)} of shape {list(shape)}, "
                                 f"got {have_name} of shape {list(obj.shape)}")
            where = self.table.locate(obj) if self.table is not None else None
            if where is None:
                raise ValueError(f"{label}: not inside a region registered through this client (register it with "
                                 f"register_system / register_cuda; it must be contiguous and little-endian)")
            msg.output_regions[name].CopyFrom(self._located(where))
            self.outputs[(*path, name)] = obj

    def serialize(self, msg, recycler: wire.Recycler | None = None) -> bytes:
        """The request's bytes, each tensor's bytes copied once (:func:`.wire.serialize`)."""
        return wire.serialize(msg, self.data, recycler)

    def full(self, msg):
        """``msg`` with every held tensor's bytes put into its ``data`` (a complete message)."""
        for path, data in self.data.items():
            tensor = msg
            for name in path:
                tensor = getattr(tensor, name)
            tensor.data = bytes(data)
        return msg


def _is_scalar(value) -> bool:
    if isinstance(value, (numbers.Number, np.generic)):
        return True
    if is_torch(value) or isinstance(value, np.ndarray):
        return value.ndim == 0
    return False


def _set_param(enc: Encoder, path: wire.Path, msg, name: str, value, *, floating: bool) -> None:
    """A sampling parameter: scalar field ``name``, or per-row Tensor ``name + "_rows"``."""
    if value is None:
        return
    if _is_scalar(value):
        setattr(msg, name, float(value) if floating else int(value))
        return
    if is_torch(value):
        if floating and not value.is_floating_point():
            value = value.double()
    elif not isinstance(value, pb.Tensor):
        value = np.asarray(value)
        if floating and value.dtype.kind in "biu":
            value = value.astype(np.float64)
    field = f"{name}_rows"
    getattr(msg, field).CopyFrom(enc.tensor(value, (*path, field), name))


def _rows(tensor: pb.Tensor) -> int:
    return int(tensor.shape[0]) if len(tensor.shape) else 0


# Sample's ragged lists and processor tensors, as Client.sample's keywords (the wire's field names).
PROCESSOR_TENSORS = ("prompt_token_ids", "prompt_offsets", "output_token_ids", "output_offsets", "logit_bias_ids",
                     "logit_bias_values", "logit_bias_offsets", "allowed_token_ids", "allowed_offsets",
                     "banned_token_ids", "banned_offsets", "stop_token_ids", "stop_offsets", "grammar_bitmask")


def build_sample(enc: Encoder, path: wire.Path, logits, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                 seed=None, step=0, filter_order="top_k_first", random_val=None, out=None, repetition_penalty=None,
                 frequency_penalty=None, presence_penalty=None, min_tokens=None, logprobs=None, logprobs_mode=None,
                 return_kept=False, sequence_ids=None, sequence_steps=None, **tensors) -> pb.SampleRequest:
    if sequence_ids is not None:  # the rows' sequences hold their parameters: the defaults stay unset
        temperature, top_k, top_p, min_p, step = (None if _is_scalar(v) and v == d else v for v, d in (
            (temperature, 1.0), (top_k, 0), (top_p, 1.0), (min_p, 0.0), (step, 0)))
    if filter_order not in FILTER_ORDERS:
        raise ValueError(f"filter_order: must be one of {', '.join(FILTER_ORDERS)}, got {filter_order!r}")
    msg = pb.SampleRequest(logits=enc.tensor(logits, (*path, "logits"), "logits"),
                           filter_order=FILTER_ORDERS[filter_order])
    for name, value in (("temperature", temperature), ("top_p", top_p), ("min_p", min_p),
                        ("random_val", random_val)):
        _set_param(enc, path, msg, name, value, floating=True)
    for name, value in (("top_k", top_k), ("seed", seed), ("step", step)):
        _set_param(enc, path, msg, name, value, floating=False)
    for name, value in (("repetition_penalty", repetition_penalty), ("frequency_penalty", frequency_penalty),
                        ("presence_penalty", presence_penalty)):
        _set_param(enc, path, msg, name, value, floating=True)
    _set_param(enc, path, msg, "min_tokens", min_tokens, floating=False)
    for name, value in tensors.items():
        if name not in PROCESSOR_TENSORS:
            raise TypeError(f"sample() got an unexpected keyword argument {name!r}")
        if value is None or (not isinstance(value, pb.Tensor) and np.size(value) == 0):
            continue  # an empty list: its offsets alone (the wire has no empty tensors)
        getattr(msg, name).CopyFrom(enc.tensor(value, (*path, name), name))
    if logprobs is not None:
        msg.logprobs = int(logprobs)
    if logprobs_mode is not None:
        msg.logprobs_mode = logprobs_mode
    msg.return_kept = bool(return_kept)
    if sequence_ids is not None:
        msg.sequence_ids.extend(int(i) for i in np.asarray(sequence_ids, dtype=np.int64).reshape(-1))
    if sequence_steps is not None:
        msg.sequence_steps.extend(int(i) for i in np.asarray(sequence_steps, dtype=np.int64).reshape(-1))
    rows = (_rows(msg.logits),)
    enc.outputs_into(msg, path, out, {"token_ids": (pb.DTYPE_INT64, rows), "seeds": (pb.DTYPE_INT64, rows),
                                      "valid": (pb.DTYPE_BOOL, rows)})
    return msg


_SCORINGS = {"softmax": pb.RouteExpertsRequest.SCORING_UNSPECIFIED, "sigmoid": pb.RouteExpertsRequest.SCORING_SIGMOID}
_GROUP_SCORES = {"top2_sum": pb.RouteExpertsRequest.GROUP_SCORE_UNSPECIFIED,
                 "max": pb.RouteExpertsRequest.GROUP_SCORE_MAX}


def build_route_experts(enc: Encoder, path: wire.Path, gate_logits, k: int, renormalize: bool = False, *,
                        scoring: str = "softmax", correction_bias=None, n_group: int = 1, topk_group: int = 1,
                        group_score: str = "top2_sum", routed_scaling_factor: float = 1.0,
                        out=None) -> pb.RouteExpertsRequest:
    if scoring not in _SCORINGS:
        raise ValueError(f"scoring: must be one of {tuple(_SCORINGS)}, got {scoring!r}")
    if group_score not in _GROUP_SCORES:
        raise ValueError(f"group_score: must be one of {tuple(_GROUP_SCORES)}, got {group_score!r}")
    msg = pb.RouteExpertsRequest(gate_logits=enc.tensor(gate_logits, (*path, "gate_logits"), "gate_logits"),
                                 k=int(k), renormalize=renormalize, scoring=_SCORINGS[scoring],
                                 group_score=_GROUP_SCORES[group_score])
    # 1 is the unset default: today's requests stay byte for byte the same.
    msg.n_group = 0 if n_group == 1 else int(n_group)
    msg.topk_group = 0 if topk_group == 1 else int(topk_group)
    if routed_scaling_factor != 1.0:
        msg.routed_scaling_factor = float(routed_scaling_factor)
    if correction_bias is not None:
        # Small ([E]): always sent as bytes in the message, never as a region reference.
        dtype, shape, data = codec.tensor_parts(correction_bias, "correction_bias")
        msg.correction_bias.CopyFrom(pb.Tensor(dtype=dtype, shape=shape, data=bytes(data)))
    shape = (_rows(msg.gate_logits), int(k))
    enc.outputs_into(msg, path, out, {"weights": (pb.DTYPE_FLOAT32, shape), "indices": (pb.DTYPE_INT32, shape)})
    return msg


def build_verify_draft(enc: Encoder, path: wire.Path, draft_token_ids, target_logits, *, draft_probs=None,
                       draft_logits=None, draft_temperature=None, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                       seed=None, step=0, filter_order="top_k_first", out=None) -> pb.VerifyDraftRequest:
    if filter_order not in FILTER_ORDERS:
        raise ValueError(f"filter_order: must be one of {', '.join(FILTER_ORDERS)}, got {filter_order!r}")
    msg = pb.VerifyDraftRequest(filter_order=FILTER_ORDERS[filter_order])
    for name, value in (("draft_token_ids", draft_token_ids), ("target_logits", target_logits),
                        ("draft_probs", draft_probs), ("draft_logits", draft_logits)):
        if value is not None:
            getattr(msg, name).CopyFrom(enc.tensor(value, (*path, name), name))
    for name, value in (("draft_temperature", draft_temperature), ("temperature", temperature), ("top_p", top_p),
                        ("min_p", min_p)):
        _set_param(enc, path, msg, name, value, floating=True)
    for name, value in (("top_k", top_k), ("seed", seed), ("step", step)):
        _set_param(enc, path, msg, name, value, floating=False)
    rows, positions = (tuple(msg.draft_token_ids.shape) + (0, 0))[:2]
    enc.outputs_into(msg, path, out, {"token_ids": (pb.DTYPE_INT64, (rows, positions + 1)),
                                      "num_accepted": (pb.DTYPE_INT64, (rows,)), "valid": (pb.DTYPE_BOOL, (rows,)),
                                      "seeds": (pb.DTYPE_INT64, (rows,))})
    return msg


def _like(tensor: pb.Tensor, shape=None) -> dict:
    return {"out": (tensor.dtype, tuple(tensor.shape) if shape is None else tuple(shape))}


def build_softmax(enc: Encoder, path: wire.Path, x, dim: int = -1, *, out=None) -> pb.SoftmaxRequest:
    msg = pb.SoftmaxRequest(x=enc.tensor(x, (*path, "x"), "x"), dim=int(dim))
    enc.outputs_into(msg, path, out, _like(msg.x))
    return msg


def build_causal_softmax(enc: Encoder, path: wire.Path, x, *, out=None) -> pb.CausalSoftmaxRequest:
    msg = pb.CausalSoftmaxRequest(x=enc.tensor(x, (*path, "x"), "x"))
    enc.outputs_into(msg, path, out, _like(msg.x))
    return msg


def build_silu(enc: Encoder, path: wire.Path, x, *, out=None) -> pb.SiluRequest:
    msg = pb.SiluRequest(x=enc.tensor(x, (*path, "x"), "x"))
    enc.outputs_into(msg, path, out, _like(msg.x))
    return msg


def build_swiglu(enc: Encoder, path: wire.Path, gate, up, *, out=None) -> pb.SiluRequest:
    msg = pb.SiluRequest(x=enc.tensor(gate, (*path, "x"), "gate"), up=enc.tensor(up, (*path, "up"), "up"))
    if out is not None:
        try:
            shape = np.broadcast_shapes(tuple(msg.x.shape), tuple(msg.up.shape))
        except ValueError:
            raise ValueError(f"gate {list(msg.x.shape)} and up {list(msg.up.shape)} do not broadcast") from None
        enc.outputs_into(msg, path, out, _like(msg.x, shape))
    return msg


_BUILDERS = {
    "sample": build_sample,
    "route_experts": build_route_experts,
    "softmax": build_softmax,
    "causal_softmax": build_causal_softmax,
    "silu": build_silu,
    "swiglu": build_swiglu,
}


def build_step(enc: Encoder, id: str = "", **ops: Mapping[str, Any] | None) -> pb.StepRequest:
    """A StepRequest from keyword arguments per operator (see :func:`step_request`)."""
    unknown = set(ops) - set(STEP_OPS)
    if unknown:
        raise TypeError(f"step: unknown operator(s) {sorted(unknown)}; use {', '.join(STEP_OPS)}")
    if ops.get("silu") is not None and ops.get("swiglu") is not None:
        raise ValueError("step: give silu or swiglu, not both (they share the step's silu slot)")
    msg = pb.StepRequest(id=id)
    for name, kwargs in ops.items():
        if kwargs is None:
            continue
        slot = "silu" if name == "swiglu" else name
        built = enc.given(kwargs) if not isinstance(kwargs, Mapping) else _BUILDERS[name](enc, (slot,), **kwargs)
        getattr(msg, slot).CopyFrom(built)
    return msg


def _complete(builder, *args, **kwargs):
    enc = Encoder()
    return enc.full(builder(enc, (), *args, **kwargs))


def sample_request(logits, **kwargs) -> pb.SampleRequest:
    """A complete SampleRequest (arguments as ``Client.sample``'s, without ``out``)."""
    return _complete(build_sample, logits, **kwargs)


def route_experts_request(gate_logits, k: int, renormalize: bool = False, **router) -> pb.RouteExpertsRequest:
    """A complete RouteExpertsRequest; ``router``: the router keywords of ``Client.route_experts``."""
    return _complete(build_route_experts, gate_logits, k, renormalize, **router)


def verify_draft_request(draft_token_ids, target_logits, **kwargs) -> pb.VerifyDraftRequest:
    """A complete VerifyDraftRequest (arguments as ``Client.verify_draft``'s, without ``out``)."""
    return _complete(build_verify_draft, draft_token_ids, target_logits, **kwargs)


def softmax_request(x, dim: int = -1) -> pb.SoftmaxRequest:
    return _complete(build_softmax, x, dim)


def causal_softmax_request(x) -> pb.CausalSoftmaxRequest:
    return _complete(build_causal_softmax, x)


def silu_request(x) -> pb.SiluRequest:
    return _complete(build_silu, x)


def swiglu_request(gate, up) -> pb.SiluRequest:
    return _complete(build_swiglu, gate, up)


def step_request(id: str = "", **ops: Mapping[str, Any] | None) -> pb.StepRequest:
    """A StepRequest from keyword arguments per operator, e.g.
    ``step_request(sample={"logits": x, "temperature": 0.7}, route_experts={"gate_logits": g, "k": 2})``.

    ``swiglu={"gate": g, "up": u}`` fills the step's ``silu`` slot (a step holds one of the two).
    """
    enc = Encoder()
    return enc.full(build_step(enc, id, **ops))


def as_step_request(step) -> pb.StepRequest:
    """A StepRequest from a StepRequest or a dict of :func:`step_request`'s arguments."""
    return step if isinstance(step, pb.StepRequest) else step_request(**step)
