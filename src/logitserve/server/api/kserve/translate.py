"""KServe v2 requests into ``logitserve.v1`` requests, and ``logitserve.v1`` answers back.

:func:`to_v1` turns a ``ModelInferRequest`` into the request message of its model's operator
(with its tensors' bytes passed in place, as wire.py does for logitserve.v1), which the
operator's ``from_pb`` then validates like any other: one validator for both fronts. What this
module checks itself is only the KServe request's own shape: the model, input and output names,
datatypes the protocol has, parameters' kinds, where each tensor's elements are (raw bytes, typed
``contents`` or a shared-memory region). :func:`renamed` puts an error of ``from_pb`` into the
KServe request's terms (``logits.data`` is ``LOGITS``, ``float32`` is ``FP32``).

:func:`to_kserve` builds the ``ModelInferResponse`` from the operator's answer: outputs in
``raw_output_contents`` first, then those written into regions.

:func:`split_raw` parses a request with its ``raw_input_contents`` left where gRPC received them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from logitserve.kserve import grpc_service_pb2 as kpb
from logitserve.v1 import logitserve_pb2 as pb

from ...errors import NotFound, TooLarge
from ...regions import RegionNotFound
from ...wire import LEN, NotPlain, read_varint
from .models import DATATYPE_NAMES, DATATYPES, ITEMSIZES, MODELS, VERSION, Model
from .sequence_params import SEQUENCE_PARAMS, SequenceParams, sequence_params

# Request parameters Triton's clients may send that mean nothing here: ignored. (Triton's
# sequence parameters are read by sequence_params.py.)
IGNORED_PARAMS = frozenset({"priority", "timeout", "triton_enable_empty_final_response", "binary_data_output"})
SHM_REGION, SHM_OFFSET, SHM_BYTES = "shared_memory_region", "shared_memory_offset", "shared_memory_byte_size"
# Each datatype's typed contents field and numpy dtype.
_CONTENTS = {"BOOL": ("bool_contents", np.bool_), "INT32": ("int_contents", np.int32),
             "INT64": ("int64_contents", np.int64), "FP32": ("fp32_contents", np.float32),
             "FP64": ("fp64_contents", np.float64)}
_CONTENTS_FIELDS = tuple(f.name for f in kpb.InferTensorContents.DESCRIPTOR.fields)
RAW_INPUT_CONTENTS = kpb.ModelInferRequest.DESCRIPTOR.fields_by_name["raw_input_contents"].number


class ModelNotFound(NotFound):
    """No model (or version) of that name: NOT_FOUND (guard.py)."""


def model_of(name: str, version: str = "") -> Model:
    model = MODELS.get(name)
    if model is None:
        raise ModelNotFound(f"unknown model {name!r}; models: {', '.join(MODELS)}")
    if version not in ("", VERSION):
        raise ModelNotFound(f"model {name!r} has no version {version!r}; versions: {VERSION}")
    return model


@dataclass
class Translated:
    """A ModelInferRequest as its operator's request: ``message`` (tensor bytes in ``in_place``
    by field name), the outputs asked for (KServe names, in order; empty: all)."""

    model: Model
    message: object
    in_place: dict
    outputs: list[str]
    names: dict[str, str]  # v1 field -> KServe name, for messages
    # Output slices as given (KServe name -> RegionRef) whose byte_size, a capacity, was cut to
    # the output's bytes in ``message``: :func:`check_capacities` holds them to their regions.
    capacities: dict
    # Triton's sequence parameters of the request (sequence_params.py; sequences.py acts on
    # them), None without them.
    sequence: SequenceParams | None = None


def _param_value(param, value: kpb.InferParameter, what: str):
    choice = value.WhichOneof("parameter_choice")
    got = None if choice is None else getattr(value, choice)
    ok = {float: ("double_param", "int64_param", "uint64_param"), int: ("int64_param", "uint64_param"),
          bool: ("bool_param",), str: ("string_param",)}[param.kind]
    if choice not in ok:
        raise TypeError(f"{what}: must be {param.kind.__name__}, got {choice or 'nothing'}"
                        f"{'' if got is None else f' {got!r}'}")
    if param.kind is str:
        if got not in param.values:
            raise ValueError(f"{what}: must be one of {', '.join(param.values)}, got {got!r}")
        return param.values[got]
    return param.kind(got)


def _shm(parameters, what: str):
    """A tensor's shared-memory reference from its parameters (None: none)."""
    if SHM_REGION not in parameters:
        return None
    region = parameters[SHM_REGION]
    if region.WhichOneof("parameter_choice") != "string_param" or not region.string_param:
        raise ValueError(f"{what}: parameter {SHM_REGION} must be a region's name")
    numbers = {}
    for key in (SHM_OFFSET, SHM_BYTES):
        value = parameters[key] if key in parameters else None
        choice = None if value is None else value.WhichOneof("parameter_choice")
        if value is None and key == SHM_OFFSET:
            numbers[key] = 0
        elif choice in ("int64_param", "uint64_param") and getattr(value, choice) >= 0:
            numbers[key] = getattr(value, choice)
        else:
            raise ValueError(f"{what}: parameter {key} must be an integer >= 0"
                             f"{' (required with ' + SHM_REGION + ')' if value is None else ''}")
    return pb.RegionRef(region=region.string_param, offset=numbers[SHM_OFFSET], byte_size=numbers[SHM_BYTES])


def _contents(tensor, datatype: str, what: str) -> bytes:
    """An input's typed contents as bytes (its datatype's field, and only it)."""
    used = [name for name in _CONTENTS_FIELDS if len(getattr(tensor.contents, name))]
    if datatype not in _CONTENTS:
        raise ValueError(f"{what}: datatype {datatype} has no typed contents; send it in raw_input_contents")
    name, dtype = _CONTENTS[datatype]
    if used and used != [name]:
        raise ValueError(f"{what}: datatype {datatype} takes contents.{name}, got contents.{', '.join(used)}")
    return np.asarray(getattr(tensor.contents, name), dtype=dtype).tobytes()


def to_v1(model: Model, request: kpb.ModelInferRequest, raw: list) -> Translated:
    """``request`` for ``model`` (:func:`model_of` its name; ``raw``: its raw_input_contents) as
    the model's logitserve.v1 request."""
    message = model.request()
    in_place: dict = {}
    names: dict[str, str] = {}
    sizes: dict = {}
    next_raw = 0
    for tensor in request.inputs:
        port = model.input(tensor.name)
        what = f"input {tensor.name}"
        if port is None:
            raise ValueError(f"model {model.name!r} has no input {tensor.name!r}; inputs: "
                             f"{', '.join(p.name for p in model.inputs)}")
        if port.field in names:
            raise ValueError(f"{what}: given twice")
        names[port.field] = port.name
        code = DATATYPES.get(tensor.datatype)
        if code is None:
            raise TypeError(f"{what}: datatype {tensor.datatype!r} is not served; {port.name} takes "
                            f"{', '.join(port.accepts)}")
        target = getattr(message, port.field)
        target.dtype = code
        target.shape.extend(tensor.shape)
        sizes[port.field] = (ITEMSIZES[tensor.datatype], tuple(tensor.shape))
        ref = _shm(tensor.parameters, what)
        has_contents = tensor.HasField("contents")
        if ref is not None:
            if has_contents:
                raise ValueError(f"{what}: both contents and {SHM_REGION}; send one")
            target.region.CopyFrom(ref)
            continue
        if has_contents:
            if raw:
                raise ValueError(f"{what}: contents must not be given when raw_input_contents is used")
            data = _contents(tensor, tensor.datatype, what)
        elif next_raw < len(raw):
            data = raw[next_raw]
            next_raw += 1
        else:
            raise ValueError(f"{what}: no elements (neither contents, nor raw_input_contents[{next_raw}], nor "
                             f"a {SHM_REGION})")
        if port.field.endswith("_rows"):
            target.data = bytes(data)  # a few numbers per row, read by protobuf
        else:
            in_place[port.field] = memoryview(data).cast("B")
    if next_raw != len(raw):
        raise ValueError(f"raw_input_contents: {len(raw)} given, but {next_raw} inputs take raw contents")
    for port in model.inputs:
        if not port.optional and port.field not in names:
            raise ValueError(f"input {port.name}: required (model {model.name!r} takes "
                             f"{', '.join(p.name for p in model.inputs)})")
    scalars = {}
    sequence = sequence_params(model, request.parameters)
    for key, value in request.parameters.items():
        param = model.param(key)
        if param is None:
            if key in SEQUENCE_PARAMS:
                continue
            if key in IGNORED_PARAMS:
                continue
            raise ValueError(f"parameter {key!r}: not a parameter of model {model.name!r} "
                             f"({', '.join(p.name for p in model.params) or 'it takes none'})")
        scalars[key] = _param_value(param, value, f"parameters[{key}]")
        try:
            setattr(message, key, scalars[key])
        except (ValueError, TypeError) as exc:
            raise ValueError(f"parameters[{key}]: {exc}") from None
        names.setdefault(key, f"parameters[{key}]")
    capacities: dict = {}
    outputs = _outputs(model, request, message, sizes, scalars, capacities)
    for port in model.outputs:
        names.setdefault(port.field, port.name)
    return Translated(model, message, in_place, outputs, names, capacities, sequence)


def _outputs(model: Model, request, message, sizes, scalars, capacities: dict) -> list[str]:
    wanted = []
    for out in request.outputs:
        port = model.output(out.name)
        if port is None:
            raise ValueError(f"model {model.name!r} has no output {out.name!r}; outputs: "
                             f"{', '.join(p.name for p in model.outputs)}")
        if out.name in wanted:
            raise ValueError(f"output {out.name}: asked for twice")
        wanted.append(out.name)
        ref = _shm(out.parameters, f"output {out.name}")
        if ref is not None:
            # The slice's byte_size is a capacity (as in Triton): the output takes its first bytes.
            try:
                need = model.output_bytes(sizes, scalars)[port.field]
            except (KeyError, IndexError, TypeError, ValueError):
                need = None  # the inputs disagree: from_pb says how
            if need is not None and 0 < need <= ref.byte_size:
                capacities[out.name] = pb.RegionRef(region=ref.region, offset=ref.offset, byte_size=ref.byte_size)
                ref.byte_size = need
            message.output_regions[port.field].CopyFrom(ref)
    return wanted


def check_capacities(job: Translated, region_bytes) -> None:
    """Each output slice of ``job`` whose byte_size is a capacity lies within its region, as
    Triton requires (the operator's validation sees only the output's first bytes of it);
    ``region_bytes(name)``: the caller's region's size, None without one (the operator's
    validation then says so). Raises ValueError naming the output."""
    for name, ref in job.capacities.items():
        size = region_bytes(ref.region)
        end = ref.offset + ref.byte_size
        if size is not None and end > size:
            raise ValueError(f"{name} {SHM_REGION}: {SHM_OFFSET} {ref.offset} + {SHM_BYTES} {ref.byte_size} = "
                             f"{end}, past the end of region {ref.region!r} ({size} bytes)")


_DTYPE_WORDS = {"float16": "FP16", "bfloat16": "BF16", "float32": "FP32", "float64": "FP64", "int32": "INT32",
                "int64": "INT64", "bool": "BOOL"}
_DTYPE_RE = re.compile(r"\b(" + "|".join(_DTYPE_WORDS) + r")\b")
_OUTPUT_RE = re.compile(r"output_regions\[(\w+)\]")
_REGION_FIELDS = ((".region.byte_size", f" {SHM_BYTES}"), (".region.offset", f" {SHM_OFFSET}"),
                  (".region", f" {SHM_REGION}"))


def renamed(exc: BaseException, names: dict[str, str]) -> BaseException:
    """``exc`` (from the operator's ``from_pb``) in the KServe request's names, same type."""
    text = _OUTPUT_RE.sub(lambda m: names.get(m.group(1), m.group(0)), str(exc))
    if names:
        fields = re.compile(r"\b(" + "|".join(map(re.escape, sorted(names, key=len, reverse=True))) + r")(?=[.:\[ ])")
        text = fields.sub(lambda m: names[m.group(1)], text)
    for old, new in _REGION_FIELDS:
        text = text.replace(old, new)
    text = re.sub(r"\b([A-Z][A-Z_]*)\.data\b", r"\1", text)
    text = re.sub(r"\b([A-Z][A-Z_]*)\.dtype\b", r"\1 datatype", text)
    text = re.sub(r"\b([A-Z][A-Z_]*)\.shape\b", r"\1 shape", text)
    text = _DTYPE_RE.sub(lambda m: _DTYPE_WORDS[m.group(1)], text)
    try:
        return type(exc)(text)
    except TypeError:
        return exc


RENAMED = (ValueError, TypeError, TooLarge, RegionNotFound)


def to_kserve(model: Model, request_id: str, answer, outputs: list[str],
              response: kpb.ModelInferResponse | None = None) -> kpb.ModelInferResponse:
    """The ModelInferResponse of ``answer`` (the operator's logitserve.v1 answer), written into
    ``response`` when given (an empty one, such as a stream answer's ``infer_response``: the
    answer is not copied into it); ``outputs``: the names asked for (empty: every output)."""
    if response is None:
        response = kpb.ModelInferResponse()
    response.model_name, response.model_version, response.id = model.name, VERSION, request_id
    ports = [model.output(name) for name in outputs] if outputs else list(model.outputs)
    in_regions = []
    for port in ports:
        tensor = getattr(answer, port.field)
        if tensor.HasField("region"):
            in_regions.append((port, tensor))
            continue
        response.outputs.add(name=port.name, datatype=DATATYPE_NAMES[tensor.dtype], shape=tensor.shape)
        response.raw_output_contents.append(tensor.data)
    for port, tensor in in_regions:  # after every raw one: tritonclient indexes raw_output_contents by position
        out = response.outputs.add(name=port.name, datatype=DATATYPE_NAMES[tensor.dtype], shape=tensor.shape)
        out.parameters[SHM_REGION].string_param = tensor.region.region
        out.parameters[SHM_OFFSET].uint64_param = tensor.region.offset
        out.parameters[SHM_BYTES].uint64_param = tensor.region.byte_size
    return response


def split_raw(data: bytes) -> tuple[kpb.ModelInferRequest, list]:
    """``data`` parsed as a ModelInferRequest, its raw_input_contents as views of ``data`` (not
    copied by protobuf); any encoding this cannot split is parsed by protobuf as a whole."""
    view = memoryview(data)
    raw, rest, start, pos = [], [], 0, 0
    try:
        while pos < len(data):
            tag, after = read_varint(data, pos)
            if tag >> 3 == RAW_INPUT_CONTENTS and tag & 7 == LEN:
                length, begin = read_varint(data, after)
                end = begin + length
                if end > len(data):
                    raise NotPlain
                rest.append(view[start:pos])
                raw.append(view[begin:end])
                start = pos = end
                continue
            pos = _skip(data, tag, after)
        rest.append(view[start:])
    except NotPlain:
        message = kpb.ModelInferRequest.FromString(data)
        return message, list(message.raw_input_contents)
    message = kpb.ModelInferRequest.FromString(b"".join(rest))
    if len(message.raw_input_contents):  # cannot happen for a plain encoding; keep protobuf's view
        message = kpb.ModelInferRequest.FromString(data)
        return message, list(message.raw_input_contents)
    return message, raw


def _skip(data: bytes, tag: int, pos: int) -> int:
    """The position after the value of a field of ``tag`` starting at ``pos``."""
    kind = tag & 7
    if kind == 0:
        return read_varint(data, pos)[1]
    if kind == 1:
        end = pos + 8
    elif kind == LEN:
        length, pos = read_varint(data, pos)
        end = pos + length
    elif kind == 5:
        end = pos + 4
    else:
        raise NotPlain
    if end > len(data) or tag >> 3 == 0:
        raise NotPlain
    return end
