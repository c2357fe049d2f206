"""The synthetic LLM of ``bench.decode_loop``, its calibration, and the decode loop of every mode.

The engine is a CUDA graph of bf16 matmuls on a stream of its own: ``emb[tokens]`` (the token
ids a sampler wrote on the device at the previous step), ``layers`` times ``h = tanh(h @ W)``
(one ``W`` for every layer: the time is what matters, and one 8192x8192 matrix is 128 MiB), then
the logits ``h @ emb.T`` (tied embeddings) as float32 ``[B, vocab]``. Each step's logits depend
on the previous step's tokens, so a sampler that draws one wrong token (or reads stale logits)
changes every later step: equal tokens over a run mean every step saw the right logits.

The constants keep the values finite and the sampling not trivial: ``GAIN`` > 1 puts the tanh
recurrence in its chaotic regime (its activations settle near ``ACTIVATION_RMS`` whatever the
depth, and different tokens lead to different states), and the embedding's scale gives logits
of standard deviation near ``LOGIT_STD``: at temperature 0.8 the 50 most likely tokens hold
about half to three quarters of the mass, so top-k and top-p both cut.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

import numpy as np
import torch

from logitserve import kernels

GAIN = 1.5
ACTIVATION_RMS = 0.6  # where the tanh recurrence's activations settle (measured at hidden 2048)
LOGIT_STD = 3.0
FIRST_SEED = 1234  # row r samples with seed FIRST_SEED + r at step n (the step index)
PROBE_LAYERS = (2, 34)  # the two depths whose forward times give a batch size's linear model
TIMED_REPLAYS = 20  # graph replays back to back per calibration measurement


# ------------------------------------------------------------------------------ calibration


@dataclasses.dataclass(frozen=True)
class ForwardModel:
    """A forward's time as ``fixed_ms + per_layer_ms * layers`` (the embedding and the output
    projection are the fixed part)."""

    fixed_ms: float
    per_layer_ms: float


def fit(layers_a: int, ms_a: float, layers_b: int, ms_b: float) -> ForwardModel:
    """The line through two measured depths (a per-layer time of at least a nanosecond, so a
    noisy pair cannot make it zero or negative)."""
    per_layer = max((ms_b - ms_a) / (layers_b - layers_a), 1e-6)
    return ForwardModel(ms_a - per_layer * layers_a, per_layer)


def layers_for(target_ms: float, model: ForwardModel) -> int:
    """The depth whose forward takes ``target_ms`` by ``model``; at least 1 (a target under the
    fixed part cannot be met: the run then reports the time it got)."""
    return max(1, round((target_ms - model.fixed_ms) / model.per_layer_ms))


def calibrate(measure: Callable[[int], float], target_ms: float, model: ForwardModel, tolerance: float,
              attempts: int = 4) -> tuple[int, float]:
    """``(layers, ms)``: the depth whose measured forward (``measure(layers)`` in ms) is within
    ``tolerance`` (a fraction) of ``target_ms``, or the closest of ``attempts`` tries. Each miss
    rescales the per-layer time by what the last depth measured (the fixed part kept), as a
    forward's time per layer drifts with depth (caches, clocks)."""
    tried: dict[int, float] = {}
    layers = layers_for(target_ms, model)
    for _ in range(attempts):
        ms = tried[layers] = measure(layers)
        if abs(ms - target_ms) <= tolerance * target_ms:
            break
        if ms > model.fixed_ms:
            model = ForwardModel(model.fixed_ms, (ms - model.fixed_ms) / layers)
        following = layers_for(target_ms, model)
        if following in tried:
            break
        layers = following
    best = min(tried, key=lambda depth: abs(tried[depth] - target_ms))
    return best, tried[best]


# ----------------------------------------------------------------------------------- engine


class Weights:
    """The parameters every batch size shares: the embedding table, also the output projection
    (tied), and the one hidden x hidden matrix each layer applies."""

    def __init__(self, hidden: int, vocab: int, device: torch.device):
        generator = torch.Generator(device=device).manual_seed(0)
        self.embedding_std = LOGIT_STD / (ACTIVATION_RMS * math.sqrt(hidden))
        self.embedding = torch.randn(vocab, hidden, generator=generator, device=device, dtype=torch.bfloat16)
        self.embedding.mul_(self.embedding_std)
        self.layer = torch.randn(hidden, hidden, generator=generator, device=device, dtype=torch.bfloat16)
        self.layer.mul_(GAIN / math.sqrt(hidden))
        self.hidden, self.vocab, self.device = hidden, vocab, device


class Engine:
    """One batch size's buffers, its stream, and the CUDA graph of its forward at the depth last
    built. ``tokens`` (int64 [B]) is what the forward reads and a sampler writes; ``logits``
    (float32 [B, vocab]) is what it writes. Both stay at one address for the engine's life (the
    graph and the server's registered regions name them), whatever the depth."""

    def __init__(self, weights: Weights, batch: int):
        device, vocab = weights.device, weights.vocab
        self.weights, self.batch, self.layers = weights, batch, 0
        self.stream = torch.cuda.Stream(device)
        self.first_tokens = (torch.arange(batch, device=device) * 7919 + 17) % vocab
        self.tokens = self.first_tokens.clone()
        self.seed_rows = torch.arange(batch, dtype=torch.int64, device=device) + FIRST_SEED
        self.seed_rows_host = self.seed_rows.cpu().numpy()
        # A -1 from a sampler (a row it could not draw) must not become an out-of-bounds gather:
        # that would be a device-side assert, the end of the CUDA context for every mode after.
        self._safe_tokens = torch.empty_like(self.tokens)
        self._state = torch.empty(batch, weights.hidden, dtype=torch.bfloat16, device=device)
        self._mixed = torch.empty_like(self._state)
        self._logits_bf16 = torch.empty(batch, vocab, dtype=torch.bfloat16, device=device)
        self.logits = torch.empty(batch, vocab, dtype=torch.float32, device=device)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._model: ForwardModel | None = None  # fitted at the first calibration

    def register(self, client) -> None:
        """``logits`` and ``tokens`` as CUDA regions of ``client``, which then sends them by reference."""
        client.register_cuda(f"logits-{self.batch}", self.logits)
        client.register_cuda(f"tokens-{self.batch}", self.tokens)

    def _forward(self) -> None:
        """The forward, every op writing a buffer made beforehand: the graph allocates nothing."""
        w = self.weights
        torch.clamp(self.tokens, 0, w.vocab - 1, out=self._safe_tokens)
        torch.index_select(w.embedding, 0, self._safe_tokens, out=self._state)
        self._state.mul_(1.0 / w.embedding_std)
        for _ in range(self.layers):
            torch.mm(self._state, w.layer, out=self._mixed)
            torch.tanh(self._mixed, out=self._state)
        torch.mm(self._state, w.embedding.t(), out=self._logits_bf16)
        self.logits.copy_(self._logits_bf16)

    def build(self, layers: int) -> None:
        """Capture the forward at ``layers`` deep, as torch asks: warmed up eagerly on a side
        stream first (cuBLAS picks its kernels and workspace outside the capture), captured on
        torch's private capture stream."""
        self.stream.synchronize()  # no replay of the old graph is in flight when it goes
        self._graph = None  # and its memory pool goes before the new one is made
        self.layers = layers
        device = self.weights.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(3):
                self._forward()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._forward()
        self._graph = graph
        # Everything above ran on other streams; the engine's stream starts after all of it.
        torch.cuda.synchronize(device)

    def forward(self) -> None:
        """Replay the graph on the current stream: callers are inside ``torch.cuda.stream(self.stream)``."""
        self._graph.replay()

    def reset(self) -> None:
        """The first step's tokens, written on the current stream (the engine's)."""
        self.tokens.copy_(self.first_tokens)

    def time_forward(self, layers: int) -> float:
        """ms of one forward ``layers`` deep: TIMED_REPLAYS replays back to back, CUDA events around them."""
        self.build(layers)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            self.reset()
            for _ in range(3):
                self.forward()
            start.record(self.stream)
            for _ in range(TIMED_REPLAYS):
                self.forward()
            end.record(self.stream)
        end.synchronize()
        return start.elapsed_time(end) / TIMED_REPLAYS

    def calibrate_to(self, step_ms: float, tolerance: float) -> tuple[int, float]:
        """Build the depth whose forward takes ``step_ms`` (within ``tolerance``, or the closest
        found): ``(layers, measured ms)``. The batch size's linear model comes from two probe
        depths at the first call; every later target starts from it."""
        if self._model is None:
            self._model = fit(*(value for depth in PROBE_LAYERS for value in (depth, self.time_forward(depth))))
        layers, ms = calibrate(self.time_forward, step_ms, self._model, tolerance)
        if layers != self.layers:  # the closest depth was not the last one tried
            self.build(layers)
        return layers, ms

    def logit_spread(self) -> tuple[float, float]:
        """(standard deviation of the first tokens' logits, largest change of a logit when every
        row's token moves by one): raises unless the logits are finite and depend on the tokens."""
        with torch.cuda.stream(self.stream):
            self.reset()
            self.forward()
            first = self.logits.clone()
            self.tokens.add_(1)
            self.forward()
            change = (self.logits - first).abs().max()
            std = first.std()
        self.stream.synchronize()
        if not (torch.isfinite(first).all() and torch.isfinite(self.logits).all()):
            raise RuntimeError("the engine's logits are not finite")
        if change.item() == 0:
            raise RuntimeError("the engine's logits do not depend on its tokens")
        return std.item(), change.item()


# ------------------------------------------------------------------------------ decode loop


@dataclasses.dataclass
class Run:
    """One mode's decode run: the timed steps' times and every step's tokens (warm-up included)."""

    ms_per_step: float  # wall time of the timed steps over their count
    forward_ms: list[float]  # each timed step's forward, on the device
    gap_us: list[float]  # the device idle between a timed forward's end and the next one's start
    tokens: np.ndarray  # int64 [warmup + steps, B]
    kernel_us: list[float] | None = None  # in_process: each timed step's sampling kernel
    notes: list[str] = dataclasses.field(default_factory=list)

    def record(self) -> dict:
        """The run for the JSON: every timed step's times and their medians (not the tokens)."""
        kernel = None if self.kernel_us is None else float(np.median(self.kernel_us))
        return dict(ms_per_step=self.ms_per_step, forward_ms_median=float(np.median(self.forward_ms)),
                    gap_us_median=float(np.median(self.gap_us)), kernel_us_median=kernel, forward_ms=self.forward_ms,
                    gap_us=self.gap_us, kernel_us=self.kernel_us, notes=self.notes)


def compare_tokens(reference: np.ndarray, tokens: np.ndarray) -> dict:
    """``{"steps": how many steps drew other tokens in any row, "first": the first such step or
    None}``; arrays of another shape differ at every step."""
    if reference.shape != tokens.shape:
        return {"steps": max(len(reference), len(tokens)), "first": 0}
    differing = np.flatnonzero((reference != tokens).reshape(len(reference), -1).any(axis=1))
    return {"steps": int(differing.size), "first": int(differing[0]) if differing.size else None}


def decode(engine: Engine, steps: int, warmup: int, sample_step: Callable[[int], None]) -> Run:
    """``warmup + steps`` decode steps: forward ``n`` (graph replay), then ``sample_step(n)``, which
    must leave step ``n``'s tokens in ``engine.tokens`` for forward ``n + 1``, ordered on the
    engine's stream (complete, or a device-side wait on that stream). The host synchronizes once
    before the timed steps and once after them, beyond what ``sample_step`` does itself.

    Events on the engine's stream around each forward give the device's gap between forwards.
    Step ``n``'s tokens go into a device history right after forward ``n + 1`` (which read them;
    step ``n + 1``'s sampling is not yet ordered in), inside the forward's events: the gap holds
    the sampling alone."""
    total, stream = warmup + steps, engine.stream
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(total)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(total)]
    with torch.cuda.stream(stream):
        history = torch.empty(total, engine.batch, dtype=torch.int64, device=engine.tokens.device)
        engine.reset()
        for n in range(total):
            if n == warmup:
                stream.synchronize()
                began = time.perf_counter()
            starts[n].record(stream)
            engine.forward()
            if n:
                history[n - 1].copy_(engine.tokens)
            ends[n].record(stream)
            sample_step(n)
        history[total - 1].copy_(engine.tokens)
        stream.synchronize()
        wall = time.perf_counter() - began
        tokens = history.cpu().numpy()
    timed = range(warmup, total)
    return Run(ms_per_step=wall * 1e3 / steps,
               forward_ms=[starts[n].elapsed_time(ends[n]) for n in timed],
               gap_us=[ends[n].elapsed_time(starts[n + 1]) * 1e3 for n in timed if n + 1 < total], tokens=tokens)


# ------------------------------------------------------------------------------------ modes


def in_process(engine: Engine, params: dict, steps: int, warmup: int) -> Run:
    """The floor: ``logitserve.kernels.sample`` in the engine's process, on its stream, its ids
    copied into the buffer the next forward reads. CUDA events around each sampling call."""
    total = warmup + steps
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(total)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(total)]

    def sample_step(n: int) -> None:
        starts[n].record(engine.stream)
        ids = kernels.sample(engine.logits, **params, seed=engine.seed_rows, step=n)
        ends[n].record(engine.stream)
        engine.tokens.copy_(ids)

    run = decode(engine, steps, warmup, sample_step)
    run.kernel_us = [starts[n].elapsed_time(ends[n]) * 1e3 for n in range(warmup, total)]
    return run


def sync_call(engine: Engine, params: dict, steps: int, warmup: int, client) -> Run:
    """Today's call: ``Client.sample`` on the engine's registered logits, the tokens written into
    its registered buffer. The client synchronizes the engine's stream before sending; the
    server's writes are complete when it returns, so the host waits out every step."""

    def sample_step(n: int) -> None:
        client.sample(engine.logits, **params, seed=engine.seed_rows_host, step=n,
                      out={"token_ids": engine.tokens}, stream=engine.stream)

    return decode(engine, steps, warmup, sample_step)


def ordered_call(engine: Engine, params: dict, steps: int, warmup: int, client) -> Run:
    """Stream-ordered calls: ``session.sample`` returns once the server has enqueued the work,
    and the engine's stream waits on the device for its writes, so the host never waits on a
    step. The last handle's result is checked against the history the device kept."""
    last = []

    def sample_step(n: int) -> None:
        last[:] = [session.sample(engine.logits, out={"token_ids": engine.tokens}, stream=engine.stream, **params,
                                  seed=engine.seed_rows_host, step=n)]

    with client.ordered_session() as session:
        run = decode(engine, steps, warmup, sample_step)
        answered = last[0].result().token_ids
    answered = answered.cpu().numpy() if hasattr(answered, "cpu") else np.asarray(answered)
    if not np.array_equal(answered, run.tokens[-1]):
        run.notes.append(f"the last handle's result {answered[:4].tolist()} is not the last step's tokens "
                         f"{run.tokens[-1][:4].tolist()}")
    return run


def ordered_standing(engine: Engine, params: dict, steps: int, warmup: int, client) -> Run:
    """Steps enqueued ahead with no call per step: one ``session.sample(repeat=)`` at step 0
    (step + k for its k-th step), then ``session.step`` each step: a ready mark and a wait on the
    engine's stream, no message to the server."""
    last = []

    def sample_step(n: int) -> None:
        if n == 0:
            last[:] = [session.sample(engine.logits, out={"token_ids": engine.tokens}, stream=engine.stream, **params,
                                      seed=engine.seed_rows_host, step=0, repeat=warmup + steps)]
        else:
            last[:] = [session.step(engine.stream)]

    with client.ordered_session() as session:
        run = decode(engine, steps, warmup, sample_step)
        answered = last[0].result().token_ids
    if not np.array_equal(np.asarray(answered), run.tokens[-1]):
        run.notes.append(f"the last step's result {np.asarray(answered)[:4].tolist()} is not its tokens "
                         f"{run.tokens[-1][:4].tolist()}")
    return run


def run_mode(mode: str, engine: Engine, params: dict, steps: int, warmup: int, client) -> Run:
    """A run of ``mode``: in_process without a client; else ``sync_*`` or ``ordered_*`` calls
    through ``client`` (its transport, gRPC or the same-host channel, is the client's)."""
    if params.get("sequences"):
        from . import decode_sequences  # it builds on this module

        if client is None:
            return decode_sequences.in_process(engine, params, steps, warmup)
        return decode_sequences.through(mode, engine, params, steps, warmup, client)
    if client is None:
        return in_process(engine, params, steps, warmup)
    call = sync_call if mode.startswith("sync_") else ordered_standing if mode == "ordered_standing" else ordered_call
    return call(engine, params, steps, warmup, client)
