"""The element-wise checks of Sample's processor fields: in bulk, off the event loop (issue 33).

A processors call's lists can be long (a prompt's and an output's tokens, 10^7 banned ids). On
the event loop, sample_processors.py reads only each field's dtype, shape and presence; the
values are checked here, on a worker thread, before the call queues (the batcher awaits
``SampleCall.checked``, which runs :meth:`BulkChecks.run_off_loop`). The loop keeps answering
other calls meanwhile, and since a call queues only once it is valid, its checks hold up no
launch either.

Every check is torch reductions on the tensor where it lies, never a loop over elements: the
request's bytes viewed as a CPU tensor (no copy), a system region's bytes read through its
descriptor (one copy, which the launch reads too, :class:`Reads`: the server never maps them
where they could shrink under it), a CUDA region on its device (never copied to the host;
offsets ``[B + 1]`` sent as bytes beside ids in a CUDA region go to the ids' device). The checks of fields in CUDA regions run in the call's
launch instead (:meth:`BulkChecks.split`): their reductions queue on the launch's stream ahead
of the kernels, and their flag comes back with the tokens, so that they cost no synchronisation
and no thread of their own (on the H200 they held a call 1.2 ms); a call launched through a list
table (processors_in_place.py) has its lists checked by the table's own kernel, in its graph, by
these rules, and only the per-row parameters by these reductions (:meth:`BulkChecks.of_rows`),
the messages made here either way. The kernels read such lists
safely whatever they hold (on CUDA they clamp spans and skip ids outside the vocabulary); a call
whose flag is set answers INVALID_ARGUMENT, and its outputs in regions hold what the launch wrote. The rules are the kernels' (``kernels/sampling/
processors.py``: :func:`ragged_broken` and :func:`ragged_error`, which the kernels' own CPU
check runs too) and the parameter table's (``kernels/sampling/params.py``). Each check first
gives a flag, on its tensor's device, saying whether anything is broken; the flags are read
back together, once per device (on CUDA, one synchronisation for the whole call). Only when one
is set are the messages made, in field order: the first names the field, the element or row,
and the rule (``ValueError``, INVALID_ARGUMENT), the first offending element found by argmax
over a mask and its row by a binary search of the offsets.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from logitserve.kernels.sampling.params import SamplingParam
from logitserve.kernels.sampling.processors import first_true, ragged_broken, ragged_error, row_of

from ..regions.access import SystemSlice
from ..tensors import DeviceTensor, HostTensor

Checked = HostTensor | DeviceTensor


class Reads:
    """Each field's tensor as the checks read it, once: a CUDA region in place, on its device;
    the request's bytes viewed (``HostTensor.torch``, no copy); a system region's bytes copied out
    through its descriptor, once per call. The launch takes the same tensors
    (sample_processors.py): what it reads is what was checked, and a list in a system region is
    read once, not a second time after its checks (a client writing the region in between would
    launch unchecked values)."""

    __slots__ = ("_copies",)

    def __init__(self):
        self._copies: dict[Checked, torch.Tensor] = {}  # system regions' fields, by identity

    def __call__(self, t: Checked) -> torch.Tensor:
        if type(t) is not HostTensor or type(t.data) is not SystemSlice:
            return t.torch()
        copy = self._copies.get(t)
        if copy is None:
            copy = self._copies[t] = t.torch()
        return copy


def in_float32(param: SamplingParam) -> str:
    """The rule a float parameter breaks once rounded to float32, as the messages state it."""
    return f"must be {param.rule} in float32, the precision the kernels use"


@dataclass(frozen=True)
class _Rows:
    """A per-row parameter ``<name>_rows [B]``: every value within the table's rule, and for a
    float, within it in float32 too (a repetition penalty of 1e300 is infinite there)."""

    name: str  # the field, with its path
    param: SamplingParam
    values: Checked

    @property
    def data(self) -> Checked:
        return self.values

    def _floats(self) -> bool:
        return self.param.kind is float

    def broken(self, read: Reads) -> torch.Tensor:
        v = read(self.values)
        ok = self.param.ok(v)
        if self._floats():
            ok &= self.param.ok(v.to(torch.float32))
        return ~ok.all()

    def error(self, read: Reads) -> str | None:
        v = read(self.values)
        rules = [(v, f"must be {self.param.rule}")]
        if self._floats():
            rules.append((v.to(torch.float32), in_float32(self.param)))
        for seen, rule in rules:
            bad = ~self.param.ok(seen)
            if bad.any().item():
                i = first_true(bad)
                return f"{self.name}[{i}]: {rule}, got {v[i].item()}"
        return None


@dataclass(frozen=True)
class _Ragged:
    """A ragged list: offsets from 0, not decreasing, ending at the ids' length; ids in [0, V)."""

    path: str
    ids_name: str
    offsets_name: str
    ids: Checked | None  # None: offsets alone, every row empty
    offsets: Checked
    vocab: int

    @property
    def data(self) -> Checked:
        """Where the list lies: the ids' place (its offsets go to them), or the offsets' alone."""
        return self.offsets if self.ids is None else self.ids

    def _tensors(self, read: Reads) -> tuple[torch.Tensor | None, torch.Tensor]:
        offsets = read(self.offsets)
        if self.ids is None:
            return None, offsets
        ids = read(self.ids)
        return ids, offsets.to(ids.device)

    def broken(self, read: Reads) -> torch.Tensor:
        return ragged_broken(*self._tensors(read), self.vocab)

    def error(self, read: Reads) -> str | None:
        found = ragged_error(*self._tensors(read), self.vocab)
        if found is None:
            return None
        which, message = found
        return f"{self.path}{self.ids_name if which == 'ids' else self.offsets_name}: {message}"


@dataclass(frozen=True)
class _Bias:
    """Logit bias values: finite once in float32, as the kernels add them (checked after the
    logit bias list, so its offsets hold when a value's row is looked up)."""

    name: str
    values: Checked
    offsets: Checked

    @property
    def data(self) -> Checked:
        return self.values

    def _float32(self, read: Reads) -> torch.Tensor:
        return read(self.values).to(torch.float32)

    def broken(self, read: Reads) -> torch.Tensor:
        return ~torch.isfinite(self._float32(read)).all()

    def error(self, read: Reads) -> str | None:
        v = self._float32(read)
        bad = ~torch.isfinite(v)
        if not bad.any().item():
            return None
        i = first_true(bad)
        return (f"{self.name}[{i}]: must be finite in float32 (row {row_of(read(self.offsets), i)}), got "
                f"{v[i].item()}")


@dataclass(eq=False)
class BulkChecks:
    """The element-wise checks of one call's processor fields, in field order, and the tensors
    they read (``read``: the launch reads the same)."""

    checks: list = field(default_factory=list)
    read: Reads = field(default_factory=Reads)

    def rows(self, name: str, param: SamplingParam, values: Checked) -> None:
        self.checks.append(_Rows(name, param, values))

    def ragged(self, path: str, ids_name: str, offsets_name: str, ids: Checked | None, offsets: Checked,
               vocab: int) -> None:
        self.checks.append(_Ragged(path, ids_name, offsets_name, ids, offsets, vocab))

    def bias(self, name: str, values: Checked, offsets: Checked) -> None:
        self.checks.append(_Bias(name, values, offsets))

    def __bool__(self) -> bool:
        return bool(self.checks)

    def split(self) -> tuple["BulkChecks | None", "BulkChecks | None"]:
        """``(checks of host fields, checks of fields in CUDA regions)``, each None when empty:
        the first run before the call queues (:meth:`run_off_loop`), the second in the launch
        (:meth:`in_launch`, then :meth:`error`)."""
        host = BulkChecks([c for c in self.checks if type(c.data) is not DeviceTensor], self.read)
        device = BulkChecks([c for c in self.checks if type(c.data) is DeviceTensor], self.read)
        return host or None, device or None

    def of_rows(self) -> "BulkChecks | None":
        """The per-row parameters' checks alone (None: none): their tensors are ``[B]``, so a
        CUDA graph holds their reductions; a list's length changes from call to call, and a list
        table's own launch checks those instead (server/ops/processors_in_place.py)."""
        return BulkChecks([c for c in self.checks if type(c) is _Rows], self.read) or None

    def in_launch(self) -> torch.Tensor:
        """On the launch thread, ahead of the kernels: whether any check is broken, as a 0-d bool
        tensor on the device (queued, not read; :meth:`error` makes the message)."""
        return torch.stack([check.broken(self.read) for check in self.checks]).any()

    def error(self) -> str | None:
        """The first broken rule's message, in field order (None: none)."""
        for check in self.checks:
            message = check.error(self.read)
            if message is not None:
                return message
        return None

    def run(self) -> None:
        """Every check (on a worker thread); ``ValueError`` naming the first broken field."""
        flags: dict[torch.device, list[torch.Tensor]] = {}
        for check in self.checks:
            flag = check.broken(self.read)
            flags.setdefault(flag.device, []).append(flag)
        if not any(torch.stack(on_device).any().item() for on_device in flags.values()):
            return
        message = self.error()
        if message is not None:
            raise ValueError(message)

    async def run_off_loop(self) -> None:
        """:meth:`run` on a worker thread (:func:`off_loop`)."""
        await off_loop(self.run)


async def off_loop(fn, *args):
    """``fn(*args)`` on a worker thread of the running loop, which reads a call's tensors.
    Cancelled, it still returns only once the thread is done: some tensors are perhaps in regions
    whose leases the handler gives back as it ends."""
    done = asyncio.get_running_loop().run_in_executor(None, fn, *args)
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        while not done.done():
            try:
                await asyncio.wait([done])
            except asyncio.CancelledError:
                pass  # cancelled again: the thread is still reading
        done.exception()  # retrieved: what the thread found goes nowhere, the caller has left
        raise
