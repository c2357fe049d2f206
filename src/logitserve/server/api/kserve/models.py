"""The models of the KServe v2 front: each operator of ``logitserve.v1`` as a model with named
inputs and outputs, and what its metadata and configuration say.

A :class:`Model` maps its inputs and outputs onto the fields of the operator's ``logitserve.v1``
request and answer (``LOGITS`` is ``SampleRequest.logits``, ``TEMPERATURE`` is
``temperature_rows``, ``TOKEN_IDS`` is ``SampleResponse.token_ids``) and its request
``parameters`` onto the request's scalar fields (``temperature``, ``k``, ``dim``...). Nothing
here validates: the translated request goes through the operator's ``from_pb`` like any other
(translate.py). The datatypes listed are the canonical ones the metadata shows; an input takes
every datatype its field takes (docs/SERVICE.md tables them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from logitserve.kernels.sampling.params import RANDOM_VAL, SAMPLING_PARAMS
from logitserve.kernels.verify import DRAFT_TEMPERATURE
from logitserve.kserve import grpc_service_pb2 as kpb
from logitserve.v1 import logitserve_pb2 as pb

from ... import ops

VERSION = "1"  # every model has one version
PLATFORM = "logitserve"

# Datatypes as the protocol spells them <-> logitserve.v1's.
DATATYPES = {"BOOL": pb.DTYPE_BOOL, "INT32": pb.DTYPE_INT32, "INT64": pb.DTYPE_INT64, "FP16": pb.DTYPE_FLOAT16,
             "BF16": pb.DTYPE_BFLOAT16, "FP32": pb.DTYPE_FLOAT32, "FP64": pb.DTYPE_FLOAT64}
DATATYPE_NAMES = {v: k for k, v in DATATYPES.items()}
ITEMSIZES = {"BOOL": 1, "INT32": 4, "INT64": 8, "FP16": 2, "BF16": 2, "FP32": 4, "FP64": 8}
FLOAT_TYPES = ("FP16", "BF16", "FP32", "FP64")


@dataclass(frozen=True)
class Port:
    """An input or output: its name, the ``logitserve.v1`` field it is, its canonical datatype,
    the datatypes it takes (inputs), its dims (-1: varies) and whether it may be left out."""

    name: str
    field: str
    datatype: str
    dims: tuple[int, ...]
    accepts: tuple[str, ...] = ()
    optional: bool = False


@dataclass(frozen=True)
class Param:
    """A request parameter: the scalar field of the request it sets, and its kind."""

    name: str
    kind: type  # float, int, bool or str
    about: str
    # str parameters: value -> the field's value.
    values: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Model:
    name: str
    rpc: str  # the logitserve.v1 RPC it is (output_regions take its answer's field names)
    request: type  # the logitserve.v1 request message
    call: type  # the ops call class whose from_pb validates it
    inputs: tuple[Port, ...]
    outputs: tuple[Port, ...]
    params: tuple[Param, ...] = ()
    about: str = ""
    # (input sizes {field: (itemsize, shape)}, scalar fields set) -> each output field's bytes;
    # used to take an output region's byte_size as a capacity (raises on shapes that disagree).
    output_bytes: Callable | None = None
    # Whether it takes Triton's sequence parameters (sequence_id, sequence_start, sequence_end:
    # kserve/sequences.py): the operator samples by a sequence the server holds.
    sequences: bool = False

    def input(self, name: str) -> Port | None:
        return next((p for p in self.inputs if p.name == name), None)

    def output(self, name: str) -> Port | None:
        return next((p for p in self.outputs if p.name == name), None)

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)

    def metadata(self) -> kpb.ModelMetadataResponse:
        tensor = kpb.ModelMetadataResponse.TensorMetadata
        return kpb.ModelMetadataResponse(
            name=self.name, versions=[VERSION], platform=PLATFORM,
            inputs=[tensor(name=p.name, datatype=p.datatype, shape=p.dims) for p in self.inputs],
            outputs=[tensor(name=p.name, datatype=p.datatype, shape=p.dims) for p in self.outputs])

    def config(self) -> kpb.ModelConfig:
        return kpb.ModelConfig(
            name=self.name, platform=PLATFORM, backend=PLATFORM, max_batch_size=0,
            input=[kpb.ModelInput(name=p.name, data_type=kpb.DataType.Value(f"TYPE_{p.datatype}"), dims=p.dims,
                                  optional=p.optional) for p in self.inputs],
            output=[kpb.ModelOutput(name=p.name, data_type=kpb.DataType.Value(f"TYPE_{p.datatype}"), dims=p.dims)
                    for p in self.outputs],
            parameters={p.name: kpb.ModelParameter(string_value=p.about) for p in self.params})


def _rows(sizes) -> int:
    return sizes["logits"][1][0]


def _sample_bytes(sizes, scalars) -> dict[str, int]:
    rows = _rows(sizes)
    return {"token_ids": 8 * rows, "seeds": 8 * rows, "valid": rows}


def _route_bytes(sizes, scalars) -> dict[str, int]:
    rows = sizes["gate_logits"][1][0]
    return {"weights": 4 * rows * scalars["k"], "indices": 4 * rows * scalars["k"]}


def _same_bytes(sizes, scalars) -> dict[str, int]:
    itemsize, shape = sizes["x"]
    if "up" in sizes:
        shape = np.broadcast_shapes(tuple(shape), tuple(sizes["up"][1]))
    return {"out": itemsize * math.prod(shape)}



def _verify_bytes(sizes, scalars) -> dict[str, int]:
    rows, n = sizes["draft_token_ids"][1]
    return {"token_ids": 8 * rows * (n + 1), "num_accepted": 8 * rows, "valid": rows, "seeds": 8 * rows}


def _param_port(p) -> Port:
    return Port(p.name.upper(), p.rows_field, "FP32" if p.kind is float else "INT64", (-1,),
                ("FP32", "FP64") if p.kind is float else ("INT32", "INT64"), optional=True)


def _param(p) -> Param:
    return Param(p.name, p.kind, f"{p.name} of every row (default {'unset' if p.default is None else p.default}): "
                                 f"{p.rule}")


_FILTER_ORDER = Param("filter_order", str, "top_k_first (default) or joint",
                      values={name: value for value, name in ops.WIRE_FILTER_ORDERS.items() if value})
# The target's sampling parameters of verify_draft: Sample's, but random_val.
_VERIFY_PARAMS = tuple(p for p in SAMPLING_PARAMS.values() if p is not RANDOM_VAL) + (DRAFT_TEMPERATURE,)
_DRAFT = (-1, -1, -1)
_VERIFY_INPUTS = (Port("DRAFT_TOKEN_IDS", "draft_token_ids", "INT64", (-1, -1), ("INT32", "INT64")),
                  Port("DRAFT_PROBS", "draft_probs", "FP32", _DRAFT, FLOAT_TYPES, optional=True),
                  Port("DRAFT_LOGITS", "draft_logits", "FP32", _DRAFT, FLOAT_TYPES, optional=True),
                  Port("TARGET_LOGITS", "target_logits", "FP32", _DRAFT, FLOAT_TYPES),
                  *(_param_port(p) for p in _VERIFY_PARAMS))
_VERIFY_OUTPUTS = (Port("OUTPUT_TOKEN_IDS", "token_ids", "INT64", (-1, -1)),
                   Port("NUM_ACCEPTED", "num_accepted", "INT64", (-1,)), Port("VALID", "valid", "BOOL", (-1,)),
                   Port("SEEDS", "seeds", "INT64", (-1,)))
_SAMPLE_INPUTS = tuple(_param_port(p) for p in SAMPLING_PARAMS.values())
_SAMPLE_PARAMS = tuple(_param(p) for p in SAMPLING_PARAMS.values()) + (_FILTER_ORDER,)
_X = Port("X", "x", "FP32", (-1, -1), FLOAT_TYPES)
_OUT = Port("OUT", "out", "FP32", (-1, -1))

MODELS: dict[str, Model] = {m.name: m for m in (
    Model("sample", "Sample", pb.SampleRequest, ops.SampleCall,
          (Port("LOGITS", "logits", "FP32", (-1, -1), FLOAT_TYPES), *_SAMPLE_INPUTS),
          (Port("TOKEN_IDS", "token_ids", "INT64", (-1,)), Port("SEEDS", "seeds", "INT64", (-1,)),
           Port("VALID", "valid", "BOOL", (-1,))),
          _SAMPLE_PARAMS, "the next token of every row of LOGITS [B, V]", _sample_bytes, sequences=True),
    Model("route_experts", "RouteExperts", pb.RouteExpertsRequest, ops.RouteExpertsCall,
          (Port("GATE_LOGITS", "gate_logits", "FP32", (-1, -1), ("FP16", "BF16", "FP32")),),
          (Port("WEIGHTS", "weights", "FP32", (-1, -1)), Port("INDICES", "indices", "INT32", (-1, -1))),
          (Param("k", int, "experts per token (required)"),
           Param("renormalize", bool, "divide the k weights by their sum (default false)")),
          "the k experts of every token of GATE_LOGITS [N, E]", _route_bytes),
    Model("softmax", "Softmax", pb.SoftmaxRequest, ops.SoftmaxCall, (_X,), (_OUT,),
          (Param("dim", int, "the dimension to normalise (default -1)"),), "softmax of X (any rank)", _same_bytes),
    Model("causal_softmax", "CausalSoftmax", pb.CausalSoftmaxRequest, ops.CausalSoftmaxCall, (_X,), (_OUT,), (),
          "causal softmax of X [S, T] or [B, S, T]", _same_bytes),
    Model("silu", "Silu", pb.SiluRequest, ops.SiluCall, (_X,), (_OUT,), (), "silu(X) (any shape)", _same_bytes),
    Model("swiglu", "Silu", pb.SiluRequest, ops.SiluCall,
          (Port("GATE", "x", "FP32", (-1, -1), FLOAT_TYPES), Port("UP", "up", "FP32", (-1, -1), FLOAT_TYPES)),
          (_OUT,), (), "silu(GATE) * UP", _same_bytes),
    Model("verify_draft", "VerifyDraft", pb.VerifyDraftRequest, ops.VerifyDraftCall, _VERIFY_INPUTS,
          _VERIFY_OUTPUTS, tuple(_param(p) for p in _VERIFY_PARAMS) + (_FILTER_ORDER,),
          "chain speculative sampling of DRAFT_TOKEN_IDS [B, n] against TARGET_LOGITS [B, n + 1, V], with "
          "DRAFT_PROBS or DRAFT_LOGITS [B, n, V]", _verify_bytes),
)}
