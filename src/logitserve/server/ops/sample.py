"""Sample: ``kernels.sample`` on ``logits [B, V]`` with scalar or per-row parameters.

The parameters' names, defaults, valid ranges and rules come from one table,
``logitserve.kernels.sampling.params``: the checks and error messages here are derived from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import torch

from logitserve import kernels
from logitserve.kernels.sampling.params import FILTER_ORDERS, FLOAT_PARAMS, INT_PARAMS, RANDOM_VAL, SAMPLING_PARAMS, SEED
from logitserve.v1 import logitserve_pb2 as pb

from ..engine.staging import Staging, to_host
from ..tensors import FLOATS, NOT_IN_PLACE, PB_DTYPES, HostTensor, from_torch, tensor_field
from .batching import split, split_rows
from .limits import Limits, answer_bytes
from .processor_checks import BulkChecks, off_loop
from .resident import Outputs, column_stage, device_inputs, graph_key, launches_in_place, on_device
from .sample_params import DeviceRows, Param, draw_seeds, param_rows, read_device_rows, take_device_rows, wire_param
from .processors_in_place import run_with_table, takes_table
from .sample_processors import LOGPROBS_FIELDS, launch_processed
from .sample_processors import parse as parse_processors

# The wire's filter orders by enum value, unset meaning the first (the kernels' default).
WIRE_FILTER_ORDERS = {pb.FILTER_ORDER_UNSPECIFIED: FILTER_ORDERS[0],
                      **{pb.FilterOrder.Value(f"FILTER_ORDER_{name.upper()}"): name for name in FILTER_ORDERS}}

# The order from_pb checks the parameters in, which names the first broken one: seed, then the
# table's order.
_CHECKED = (SEED, *(p for p in SAMPLING_PARAMS.values() if p is not SEED))


def _any_nonzero(value: Param) -> bool:
    return any(v != 0 for v in value) if isinstance(value, list) else value != 0


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
    # The outputs to write into regions (output_regions), and the call's leases (server/regions/calls.py).
    outputs: Outputs | None = None
    regions: object = None
    answer_size: int = 0  # the answer's message size (limits.answer_bytes)
    # Logits processors as kernel keywords (the fields as they arrived, or scalars;
    # sample_processors.py), and logprobs n (None: none) with its mode. Either makes the call a
    # launch of its own. ``checks``: their values' checks, run off the loop before the call
    # queues (:meth:`checked`).
    processors: dict | None = None
    checks: BulkChecks | None = None
    device_checks: BulkChecks | None = None  # those of fields in CUDA regions: run in the launch
    # Per-row parameters in CUDA regions, read and checked by :meth:`checked` (0 until then).
    device_rows: dict[str, DeviceRows] | None = None
    logprobs: int | None = None
    logprobs_mode: str = "raw"
    return_kept: bool = False
    # The rows' sequences (server/sequences/sample.py SequenceRows) when the call names them:
    # their state becomes the parameters and processors at the launch, a group of its own.
    sequences: object = None

    op = "sample"

    @classmethod
    def from_pb(cls, msg: pb.SampleRequest, limits: Limits, path: str = "",
                in_place: Mapping[str, memoryview] = NOT_IN_PLACE, regions=None, sequences=None) -> "SampleCall":
        """``sequences``: the caller's open sequences (server/sequences/sample.py SequenceLookup),
        which the Sample RPC alone passes."""
        logits = tensor_field(msg, "logits", path, in_place, dtypes=FLOATS, ranks=(2,), regions=regions)
        rows, vocab = logits.shape
        limits.check(f"{path}logits", rows, vocab)
        named = None
        if len(msg.sequence_steps) and not msg.sequence_ids:
            raise ValueError(f"{path}sequence_steps: only with sequence_ids (the steps of the rows' sequences)")
        if msg.HasField("ordered") and sequences is None:
            raise ValueError(f"{path}ordered: only the Sample RPC takes an ordered mark (not Step or StreamSteps)")
        if msg.sequence_ids:
            if sequences is None:
                raise ValueError(f"{path}sequence_ids: only the Sample RPC takes sequence ids (not Step or "
                                 f"StreamSteps)")
            named = sequences.rows(msg, rows, vocab, path)
        if msg.filter_order not in WIRE_FILTER_ORDERS:
            raise ValueError(f"{path}filter_order: unknown value {msg.filter_order}")
        values = {p.name: wire_param(msg, p, rows, path, regions, device_rows=True) for p in _CHECKED}
        device_rows = take_device_rows(values) or None
        if values["seed"] is None:  # drawn, unless the rows' sequences hold them (set at the launch)
            values["seed"] = 0 if named is not None else draw_seeds(rows)
        shapes = {"token_ids": (torch.int64, (rows,)), "seeds": (torch.int64, (rows,)), "valid": (torch.bool, (rows,))}
        outputs = Outputs.of(msg, "Sample", regions, path, shapes)
        processors, checks, n_logprobs, logprobs_mode = parse_processors(msg, rows, vocab, path, regions, wire_param,
                                                                         in_place)
        checks, device_checks = checks.split() if checks is not None else (None, None)
        size = answer_bytes(pb.SampleResponse, {**shapes, **_logprobs_shapes(rows, vocab, n_logprobs, msg.return_kept)},
                            outputs)
        limits.check_answer(f"{path}logits", size)
        call = cls(logits=logits, filter_order=WIRE_FILTER_ORDERS[msg.filter_order], outputs=outputs,
                   regions=regions, answer_size=size, processors=processors, checks=checks,
                   device_checks=device_checks, device_rows=device_rows, logprobs=n_logprobs,
                   logprobs_mode=logprobs_mode, return_kept=msg.return_kept, sequences=named, **values)
        call._check_min_p(path)
        return call

    def _check_min_p(self, path: str) -> None:
        if self.random_val is not None and _any_nonzero(self.min_p):
            raise ValueError(f"{path}min_p: must be 0 with random_val (InfiniCore's random_sample has no min-p)")

    async def checked(self) -> None:
        """The per-row parameters in CUDA regions read, then the processor fields' element-wise
        checks, on worker threads (``ValueError`` naming the first broken one): the batcher
        awaits this before it queues the call."""
        if self.device_rows is not None:
            for name, values in (await off_loop(read_device_rows, self.device_rows)).items():
                setattr(self, name, values)
            self.__post_init__()  # the parameters packed again, with the values read
            self._check_min_p(next(iter(self.device_rows.values())).path)
        if self.checks is not None:
            await self.checks.run_off_loop()

    @property
    def inputs(self) -> tuple:
        return (self.logits,)

    @property
    def rows(self) -> int:
        return self.logits.shape[0]

    @property
    def key(self):
        """The key of calls that may share a launch; the last item: whether the kernel draws its
        own random values (no random_val). None (a group of its own) with processors or logprobs."""
        if self.processors is not None or self.logprobs is not None or self.return_kept or self.sequences is not None:
            return None
        return (self.op, self.logits.dtype, self.logits.shape[1], self.filter_order, self.random_val is None)

    def seeds(self) -> list[int]:
        return self.seed if isinstance(self.seed, list) else [self.seed] * self.rows

    def put_outputs(self, tokens: torch.Tensor, seeds: torch.Tensor | None = None) -> None:
        """On the launch thread (or while a graph is captured): ``token_ids``, ``valid`` and
        ``seeds`` into the regions ``output_regions`` names. ``seeds``: a tensor of this call's
        seeds where the launch has one (a graph must read the replay's own), else made here."""
        if self.outputs is None:
            return
        if seeds is None:
            seeds = torch.tensor(self.seeds(), dtype=torch.int64)
            if tokens.is_cuda:  # page-locked, so the copy into a CUDA region waits for nothing
                seeds = seeds.pin_memory()
        for name, value in (("token_ids", tokens), ("valid", tokens >= 0), ("seeds", seeds)):
            if name in self.outputs:
                self.outputs.put(name, value)

    def use_rows(self, floats, ints) -> None:
        """At a sequence call's launch: its rows' parameters, from their state, in place of the
        call's: numpy float32 ``[rows, len(FLOAT_PARAMS)]`` and int64 ``[rows, len(INT_PARAMS)]``
        columns, as :attr:`params` packs them."""
        self.seed = ints[:, INT_PARAMS.index(SEED.name)].tolist()
        self.params = (HostTensor(floats.tobytes(), torch.float32, floats.shape),
                       HostTensor(ints.tobytes(), torch.int64, ints.shape))

    def __post_init__(self):
        floats = [getattr(self, name) for name in FLOAT_PARAMS]
        if self.random_val is not None:
            floats.append(self.random_val)
        self.params = (param_rows(floats, self.rows, torch.float32),
                       param_rows([getattr(self, name) for name in INT_PARAMS], self.rows, torch.int64))

    @property
    def parts(self) -> tuple[HostTensor, HostTensor, HostTensor]:
        """What the launch reads of this call, one piece per staged part: logits, float and int parameters."""
        return (self.logits, *self.params)

    @staticmethod
    async def run_batch(calls: list["SampleCall"], handle) -> list["SampleResult"]:
        if calls[0].key is None:  # processors, logprobs or the kept set: a group of one
            results = []
            for c in calls:
                names = param_names([c])
                if takes_table(c, handle):  # lists in CUDA regions: a list table, a graph
                    tokens, lp = await run_with_table(c, handle, names)
                elif c.sequences is None:  # lists ragged, eagerly
                    tokens, lp, broken = await handle.run(launch_processed, c, handle, names)
                    if broken is not None and broken.item():  # a field in a CUDA region breaks a rule
                        raise ValueError(await handle.run(c.device_checks.error))
                    tokens = tokens.numpy()
                else:
                    tokens, lp = await c.sequences.run(c, handle, names, launch_processed)
                results.append(SampleResult(tokens, c.seeds(), c.outputs, written=True, logprobs=lp))
            return results
        if launches_in_place(calls, handle.device):
            key = graph_key(calls[0], handle) if len(calls) == 1 else None
            if key is not None and handle.graphs.seen_again(key):
                return [await _replay_in_place(calls[0], key, handle)]
            done = await handle.run(_launch_in_place, calls, handle)
            return [SampleResult(tokens.numpy(), c.seeds(), c.outputs, written=True) for tokens, c in done]
        rows = [c.rows for c in calls]
        names = param_names(calls)
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

        tokens, = await handle.launch(calls[0].key, sum(rows), stage_for, launch)
        return [SampleResult(t, c.seeds(), c.outputs) for t, c in zip(split_rows(tokens, rows), calls)]


def param_names(calls: list[SampleCall]) -> tuple[str, ...]:
    """The kernel's per-row parameters, in the order of the packed float and int columns."""
    names = FLOAT_PARAMS if calls[0].random_val is None else FLOAT_PARAMS + (RANDOM_VAL.name,)
    return names + INT_PARAMS


async def _replay_in_place(call: SampleCall, key, handle) -> "SampleResult":
    """A lone call on logits in the client's device memory (or copied in from a page-locked
    region), from the CUDA graph of ``key`` (server/ops/resident.py): the parameters staged as on
    the byte path, the outputs written into their regions by the graph."""
    names, rows = param_names([call]), call.rows

    def launch(float_rows, int_rows):
        # The graph's padding rows of parameters are not read: the logits have the call's rows.
        params = dict(zip(names, (*float_rows[:rows].unbind(1), *int_rows[:rows].unbind(1))))
        logits = on_device(call.logits, handle.device)  # captured with the copy in, if any
        tokens = kernels.sample(logits, **params, filter_order=call.filter_order, backend=handle.backend)
        call.put_outputs(tokens, params[SEED.name])
        return (tokens,)

    tokens, = await handle.launch(key, rows, column_stage(*call.params), launch)
    return SampleResult(tokens, call.seeds(), call.outputs, written=True)


def _launch_in_place(calls: list[SampleCall], handle) -> list[tuple[torch.Tensor, SampleCall]]:
    """On the launch thread: ``calls`` launched together on their logits where they are
    (server/ops/resident.py); each call's outputs put into its regions. Each call's token ids on
    the host (read once the stream is done), with the call."""
    logits, floats, ints = device_inputs(handle, [c.logits for c in calls], [c.params[0] for c in calls],
                                         [c.params[1] for c in calls])
    params = dict(zip(param_names(calls), (*floats.unbind(1), *ints.unbind(1))))
    tokens = kernels.sample(logits, **params, filter_order=calls[0].filter_order, backend=handle.backend)
    done = []
    for t, c in zip(split(tokens, [c.rows for c in calls]), calls):
        c.put_outputs(t)
        done.append((to_host(t), c))
    return done


def _logprobs_shapes(rows: int, vocab: int, n: int | None, kept: bool) -> dict:
    """The answer's logprobs fields (dtype, shape) as SampleResult.to_pb writes them: the chosen
    token's logprob and rank when logprobs are asked for, the top ``n`` when n > 0, the kept set."""
    shapes = {}
    if n is not None:
        shapes.update(token_logprobs=(torch.float32, (rows,)), token_ranks=(torch.int64, (rows,)))
        if n > 0:
            shapes.update(top_token_ids=(torch.int64, (rows, n)), top_logprobs=(torch.float32, (rows, n)))
    if kept:
        shapes["kept_bitmask"] = (torch.int32, (rows, (vocab + 31) // 32))
    return shapes


@dataclass
class SampleResult:
    token_ids: np.ndarray | list[int]  # int64 [rows]: the launch's array (a list from a sequence call)
    seeds: list[int]
    outputs: Outputs | None = None  # the outputs that go into regions
    written: bool = False  # they are there already (else to_pb writes them: system regions)
    # (token_logprobs, token_ranks, top_token_ids, top_logprobs, kept_bitmask) as CPU tensors (or
    # None), when asked for.
    logprobs: tuple | None = None

    def to_pb(self) -> pb.SampleResponse:
        response = self._tokens_pb()
        if self.logprobs is not None:
            for name, value in zip(LOGPROBS_FIELDS, self.logprobs):
                if value is not None and value.numel():  # top-0: no top fields (no empty tensors)
                    getattr(response, name).CopyFrom(from_torch(value))
        return response

    def _columns(self) -> dict[str, bytes]:
        """Each output's bytes, converted in bulk by numpy (no Python object per row, no torch
        call: torch calls on the event loop cost microseconds each)."""
        tokens = np.asarray(self.token_ids, dtype="<i8")
        return {"token_ids": tokens.tobytes(), "seeds": np.asarray(self.seeds, dtype="<i8").tobytes(),
                "valid": (tokens >= 0).tobytes()}

    def _tokens_pb(self) -> pb.SampleResponse:
        if self.outputs is not None:
            return self._to_regions()
        # The tensors' dtypes and shapes come parsed from a frame made once per row count:
        # setting them field by field cost twice as much as the whole answer does this way.
        rows = len(self.token_ids)
        frame = _SAMPLE_FRAMES.get(rows)
        if frame is None:
            frame = _SAMPLE_FRAMES[rows] = _sample_frame(rows)
        response = pb.SampleResponse.FromString(frame)
        columns = self._columns()
        response.token_ids.data = columns["token_ids"]
        response.seeds.data = columns["seeds"]
        response.valid.data = columns["valid"]
        return response

    def _to_regions(self) -> pb.SampleResponse:
        """The answer with the outputs named in output_regions written there (unless written on
        the device already) and referenced, the others as bytes."""
        rows = len(self.token_ids)
        response = pb.SampleResponse()
        columns = self._columns()
        for name, dtype in (("token_ids", torch.int64), ("seeds", torch.int64), ("valid", torch.bool)):
            if name in self.outputs:
                if not self.written:
                    self.outputs.write(name, columns[name])
                getattr(response, name).CopyFrom(self.outputs.message(name))
            else:
                getattr(response, name).CopyFrom(pb.Tensor(dtype=PB_DTYPES[dtype], shape=[rows], data=columns[name]))
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
