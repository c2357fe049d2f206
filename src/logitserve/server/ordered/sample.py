"""A Sample call ordered on the GPU (SampleRequest.ordered): checked, enqueued on its session's
stream behind the caller's ready mark, answered at once.

The call is the ordinary ``SampleCall`` (validated by its ``from_pb``, the same rules and
messages), with what ordering needs on top (:func:`check_orderable`): its logits and outputs in
CUDA regions on this device, its token ids among the outputs, and nothing the server would have to
read on the host after the mark (per-row sampling parameters in CUDA regions, which the server
reads on the host: before the mark they would be the caller's previous values) or answer from
the device (logprobs, the kept set). A draw by sequence ids is taken (:func:`_enqueue_sequence_step`):
its rows are held from its enqueue until it is done, when its tokens are counted on the host, and
a session's next step follows only a done one (its rows' outputs and steps are the host's count):
a call for it while the step before is on the GPU is promised and answered at once, the step
enqueued by the session's top-ups once the one before is done. Logits processors are taken with every tensor field in a CUDA
region (a copy of host bytes to the device would wait for the session's stream, and with it for
the caller's mark, holding the launch thread every caller shares): their checks run after the
step's ``done`` on copies of the fields, their flag is read once the step is done, and a broken
rule is reported as the step's ``failed`` event (INVALID_ARGUMENT; the session goes on). Its launch (:func:`_enqueue`, on the launch thread) is the in-place call's: the
parameters staged in one copy, ``kernels.sample`` reading the logits in place, the outputs
written into their regions; before it a wait for ``ready >= mark``, after it ``done = mark``, all
on the session's stream, and nothing waits for the device.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools

import numpy as np
import torch

from logitserve import kernels
from logitserve.v1 import logitserve_pb2 as pb

from ..engine.staging import to_host
from ..ops.resident import column_stage
from ..ops.sample import SampleCall, param_names
from ..ops.processor_checks import BulkChecks, Reads
from ..ops.sample_processors import kernel_keywords
from ..tensors import PB_DTYPES, DeviceTensor, HostTensor
from .session import OrderedSession, PendingStep


def check_orderable(call: SampleCall, device: torch.device, path: str = "") -> None:
    """``ValueError`` naming the field and the rule unless ``call`` can be ordered on the GPU."""
    field = f"{path}ordered"
    refused = [name for name, on in (("sequence_steps", call.sequences is not None and call.sequences.steps is not None),
                                     ("logprobs", call.logprobs is not None), ("return_kept", call.return_kept),
                                     ("per-row parameters in CUDA regions", call.device_rows is not None)) if on]
    if refused:
        raise ValueError(f"{field}: not with {', '.join(refused)} (an ordered call runs only what needs nothing "
                         f"read or answered by the host after its ready mark; a retry is its mark's: one enqueued "
                         f"already is refused as such)")
    logits = call.logits
    if type(logits) is not DeviceTensor or logits.tensor.device != device:
        raise ValueError(f"{path}logits: an ordered call's logits must be in a CUDA region on the server's device "
                         f"({device}): the kernels read them once the caller's ready mark says they are written")
    if call.outputs is None or "token_ids" not in call.outputs:
        raise ValueError(f"{path}output_regions: an ordered call must name token_ids (a CUDA region): its answer "
                         f"returns before the tokens are drawn")
    for name in call.outputs.slots:
        if call.outputs.direct(name, device) is None:
            raise ValueError(f"{path}output_regions[{name}]: an ordered call's outputs must be CUDA regions on the "
                             f"server's device ({device})")
    host_fields = [name for name, value in (call.processors or {}).items() if isinstance(value, HostTensor)]
    if host_fields:
        raise ValueError(f"{path}{host_fields[0]}: an ordered call's logits processor fields must be CUDA regions "
                         f"(or scalars): the launch thread cannot copy host bytes to the device without waiting for "
                         f"the session's stream, which waits for the caller's mark")


async def enqueue_sample(table, session: OrderedSession, call: SampleCall, mark: int, repeat: int = 1,
                         path: str = "") -> None:
    """Enqueue ``call`` as step ``mark`` of ``session`` (of ``table``), serving ``repeat`` marks
    from there (OrderedMark.repeat); returns once the launch thread has enqueued its first mark
    (the device is not waited for), the next ones following as the session has room (:func:`fill`);
    a call for a later mark than the next to enqueue returns at once, its marks all the top-ups',
    as does a draw by sequence ids while the session's step before it is on the GPU.
    ``SessionEnded`` / ``MarkEnqueued`` / ``ValueError`` as the session's checks say; waits (the
    caller's deadline applies) while the session holds its ``max_steps_ahead`` unfinished steps.

    Once the launch thread has a step, it is the session's whatever the caller does: a caller
    cancelled meanwhile leaves, and the step still joins the session's pending ones (its leases
    released once the device is done with it), as its mark is on the GPU by then. A call that
    fails before its first mark is enqueued changes nothing of the session; a promised mark that
    cannot be enqueued when its turn comes (a sequence closed meanwhile, say) ends the session,
    with the reason (:func:`fill`)."""
    await call.checked()  # processor fields as bytes or in system regions, off the loop (as the batcher does)
    if call.sequences is not None:  # its answer's seeds, before any step of it is enqueued
        call.seed = [seq.params.seed for seq in call.sequences.sequences]
    field = f"{path}ordered.mark"
    async with session.busy:
        session.check_mark(mark, field)
        if mark > session.next_enqueue:
            # Ahead of the GPU (rows to change a few steps on): promised at once, enqueued by the
            # top-ups as steps finish. Waiting here for room would hold the caller, whose ready
            # marks for the steps before are what makes room.
            session.promise(call, mark, repeat, enqueued=False)
        elif call.sequences is not None and session.pending:
            # A draw by sequence ids follows only a done step (room_for): promised now and enqueued
            # by the top-ups once the step before is done. Waiting for that here would hold the
            # answer a forward, and the caller's next call (sent after it) would arrive after the
            # step it follows was done: its whole round trip between two forwards.
            session.promise(call, mark, repeat, enqueued=False)
        else:
            await session.wait_for_room(room_for(session, call))
            session.check_mark(mark, field)
            await asyncio.shield(asyncio.ensure_future(_enqueue_step(table, session, call, mark)))
            session.promise(call, mark, repeat)
    fill(table, session)


def room_for(session: OrderedSession, call: SampleCall) -> int:
    """How many unfinished steps ``call``'s next step may follow: a draw by sequence ids none (its
    rows' outputs and steps are counted on the host once the step before is done), else the
    session's ``max_steps_ahead``."""
    return 1 if call.sequences is not None else session.max_steps_ahead


async def _enqueue_next(table, session: OrderedSession, field: str) -> bool:
    """Wait for room and enqueue the session's next promised mark; False when none is promised."""
    found = session.next_step()
    if found is None:
        return False
    await session.wait_for_room(room_for(session, found[0]))
    session.check_mark(session.next_enqueue, field)
    found = session.next_step()
    if found is None:
        return False
    call, mark, k = found
    await asyncio.shield(asyncio.ensure_future(_enqueue_step(table, session, repetition(call, k), mark)))
    return True


def fill(table, session: OrderedSession) -> None:
    """Top up the session's promised marks while it has room, in a task of its own (one at a
    time); the watcher calls it again as steps finish."""
    if session.filling or session.ended is not None or not session.sources or len(session.pending) >= \
            room_for(session, session.sources[0].call):
        return
    session.filling = True

    async def top_up() -> None:
        try:
            async with session.busy:
                while (session.ended is None and session.sources
                       and len(session.pending) < room_for(session, session.sources[0].call)):
                    if not await _enqueue_next(table, session, "ordered.mark"):
                        break
        except Exception as exc:  # noqa: BLE001 - the session cannot keep its promised marks: it ends
            table.end(session, f"enqueueing mark {session.next_enqueue} failed: {exc!r}")
        finally:
            session.filling = False

    asyncio.ensure_future(top_up())


def repetition(call: SampleCall, k: int) -> SampleCall:
    """``call``'s k-th repetition: its ``step`` (scalar or per row) + k, everything else shared
    (its regions, outputs, seeds)."""
    if k == 0:
        return call
    step = [v + k for v in call.step] if isinstance(call.step, list) else call.step + k
    return dataclasses.replace(call, step=step)


async def _enqueue_step(table, session: OrderedSession, call: SampleCall, mark: int) -> None:
    if call.sequences is not None:
        return await _enqueue_sequence_step(table, session, call, mark)
    call.regions.hold()  # released by the session once the step's event has passed
    try:
        done, broken = await table.handle.enqueue(_enqueue, call, session.gpu, mark, table.handle)
    except BaseException:
        call.regions.release()
        raise
    broken_rule = None if broken is None else functools.partial(_broken_rule, table.handle, *broken)
    session.add(PendingStep(mark, done, call.regions, broken_rule))
    table.watch()


async def _enqueue_sequence_step(table, session: OrderedSession, call: SampleCall, mark: int) -> None:
    """A draw by sequence ids as step ``mark``: the rows' state read and held under the sequence
    table's launch lock (no other call draws them until this step is done), the step enqueued;
    once it is done the tokens are counted on the host (:meth:`SequenceRows.count_ordered`). The
    session holds no step before it (:func:`room_for`): its state is the one the last step left."""
    rows = call.sequences
    async with rows.table.launch_lock:
        states, state_rows = rows.read_ordered(call, f"ordered session {session.id}, mark {mark}")
        call.regions.hold()  # released by the session once the step's event has passed
        try:
            done, tokens = await table.handle.enqueue(_enqueue_sequences, call, session.gpu, mark, table.handle,
                                                      state_rows)
        except BaseException:
            call.regions.release()
            rows.count_ordered(call, None)
            raise

    def retired(ran: bool) -> None:
        del states[:]  # held until the step is done (read_ordered says why)
        rows.count_ordered(call, tokens.tolist() if ran else None)

    session.add(PendingStep(mark, done, call.regions, retired=retired))
    table.watch()


def _enqueue_sequences(call: SampleCall, gpu, mark: int, handle, state_rows) -> tuple[torch.cuda.Event, torch.Tensor]:
    """On the launch thread: a draw by sequence ids on the session's stream, as the graph of a
    synchronous one launches it (sequences/lists.py: the list table, the draw, the outputs, each
    token appended to its sequence's output), behind the ready wait; the tokens copied to the
    host before ``done``. Its completion event, and the tokens' host copy (read once it passed)."""
    launch = call.sequences.launch_ordered(call, handle, param_names([call]), state_rows)
    gpu.stream.wait_stream(torch.cuda.current_stream(handle.device))  # an output grown there
    with torch.cuda.stream(gpu.stream):
        staged = launch.stage_for(call.rows).to(handle.device)
        gpu.wait_ready(mark)
        tokens, = launch.launch(*staged)
        host = torch.empty(call.rows, dtype=torch.int64, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        gpu.write_done(mark)
        done = torch.cuda.Event()
        done.record(gpu.stream)
    return done, host


async def _broken_rule(handle, flag: torch.Tensor, checks: BulkChecks) -> str | None:
    """Once the step is done: the message of a processor field in a CUDA region that broke its
    rule, read from the copies the step's kernels and checks read, or None."""
    if not flag.item():
        return None
    return await handle.run(checks.error)


def _enqueue(call: SampleCall, gpu, mark: int, handle) -> tuple[torch.cuda.Event, tuple | None]:
    """On the launch thread: the step's work on the session's stream; its completion event, and
    with processor fields in CUDA regions the host flag of their checks (valid once it passed)
    with the checks over the copies they read.

    Only the kernels go between the ready wait and ``done``: the parameters' copy goes before the
    wait (it overlaps the caller's forward), and the processor fields' checks after ``done`` (the
    kernels clamp any list, so the checks only report), on copies taken right after the wait: once
    ``done`` is written the caller may change its lists for the next step."""
    broken = None
    with torch.cuda.stream(gpu.stream):
        floats, ints = column_stage(*call.params)(call.rows).to(handle.device)
        params = kernel_params(call, floats, ints)
        gpu.wait_ready(mark)
        processors = {}
        if call.processors is not None:
            snapshot = _Snapshot()
            snapshot.take([value for value in call.processors.values() if type(value) is DeviceTensor])
            processors = kernel_keywords(call.processors, handle.device, snapshot)
        tokens = kernels.sample(call.logits.torch(), **params, filter_order=call.filter_order, backend=handle.backend,
                                **processors)
        call.put_outputs(tokens, params["seed"])
        gpu.write_done(mark)
        if call.device_checks is not None:
            checks = BulkChecks(call.device_checks.checks, snapshot)
            broken = to_host(checks.in_launch()), checks
        done = torch.cuda.Event()
        done.record(gpu.stream)
    return done, broken


def kernel_params(call: SampleCall, floats: torch.Tensor, ints: torch.Tensor) -> dict:
    """The kernels' sampling parameters: one every row shares as a Python scalar, as an engine's
    own call passes it (the launches are picked from scalars: a per-row top_k, say, costs the
    gather a second launch, which sat between the ready wait and ``done``), else the row's
    staged column (``floats``, ``ints``: the call's ``params`` on the device). The scalar is read
    from the packed host column, float32-rounded as the column is, so both draw alike."""
    host_floats, host_ints = (np.frombuffer(t.data, dtype=_NUMPY[t.dtype]).reshape(t.shape)
                              for t in call.params)
    params = {}
    for name, host, column, kind in zip(param_names([call]), (*host_floats.T, *host_ints.T),
                                        (*floats.unbind(1), *ints.unbind(1)),
                                        (float,) * host_floats.shape[1] + (int,) * host_ints.shape[1]):
        params[name] = kind(host[0]) if (host == host[0]).all() else column
    return params


_NUMPY = {torch.float32: np.float32, torch.int64: np.int64}


class _Snapshot(Reads):
    """The processor fields as the step's kernels read them: each one in a CUDA region copied once
    (its first read, right after the ready wait), the kernels and the checks reading the copy."""

    __slots__ = ()

    def take(self, fields: list[DeviceTensor]) -> None:
        """The copies of ``fields``, taken together: one multi-tensor copy a dtype rather than a
        copy kernel a field, on the step's critical path (between its ready wait and ``done``)."""
        originals = [t.torch() for t in fields]
        copies = [torch.empty_like(o) for o in originals]
        if copies:
            torch._foreach_copy_(copies, originals)
        self._copies.update(zip(fields, copies))

    def __call__(self, t):
        if type(t) is not DeviceTensor:
            return super().__call__(t)
        copy = self._copies.get(t)
        if copy is None:
            copy = self._copies[t] = t.torch().clone()
        return copy


def ordered_answer(call: SampleCall) -> pb.SampleResponse:
    """The answer of an enqueued call: each output named by its region, seeds as bytes when not
    named (the server knows them now), valid left out when not named (it is not known yet)."""
    response = pb.SampleResponse()
    for name in ("token_ids", "seeds", "valid"):
        if name in call.outputs:
            getattr(response, name).CopyFrom(call.outputs.message(name))
    if "seeds" not in call.outputs:
        seeds = call.seeds()
        response.seeds.CopyFrom(pb.Tensor(dtype=PB_DTYPES[torch.int64], shape=[len(seeds)],
                                          data=np.asarray(seeds, dtype="<i8").tobytes()))
    return response
