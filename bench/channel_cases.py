"""The client side of ``bench.channel_service``: each case over gRPC and over the same-host
channel (``Client(channel="shm")``), interleaved round by round in one client process
(:func:`measure_cases`), and the concurrent clients of the throughput phases
(:func:`throughput_client`).

Each transport has its own ``Client`` and its own copy of every tensor, in an :class:`Arena` it
registered: CUDA memory (CUDA IPC) on a CUDA device, a POSIX shared-memory object otherwise. Both
copies hold the same values, so both transports must give the same answers; each case compares
them before and after its timing, with the outputs cleared before each compared call (an answer
that came back before its outputs were written shows as a difference).

Imports torch only inside :func:`measure_cases`: the throughput clients send 1x8 float32 logits
as bytes and need only numpy and the client.
"""

from __future__ import annotations

import math
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .driver import loop_for

TRANSPORTS = ("grpc", "shm")
SAMPLE_PARAMS = dict(temperature=0.8, top_k=50, top_p=0.9)
DEEPSEEK_V3 = dict(scoring="sigmoid", n_group=8, topk_group=4, renormalize=True, routed_scaling_factor=2.5)
DEEPSEEK_V3_K = 8
DEEPSEEK_V3_EXPERTS = 256
ALIGN = 256  # each tensor of an arena starts at a multiple of this
WARMUP_CALLS = 20  # per transport and case before the first comparison: compiles, graph captures, channel opening
BIG_MIN_CALLS = 10  # per round of a case that is not tiny (its rounds are bounded by case_seconds)
KERNEL_MIN_CALLS = 100
ROUND_LIMIT = 4.0  # a round stops after ROUND_LIMIT x case_seconds even short of its minimum of calls


def latency_stats(ns: list[int]) -> dict:
    us = np.asarray(ns, dtype=np.float64) / 1e3
    p50, p90, p99 = np.percentile(us, [50, 90, 99])
    return dict(calls=len(us), p50_us=float(p50), p90_us=float(p90), p99_us=float(p99), mean_us=float(us.mean()),
                min_us=float(us.min()), max_us=float(us.max()))


def time_calls(call: Callable[[], object], min_calls: int, seconds: float) -> dict:
    """``call`` one after another for ``seconds`` and at least ``min_calls`` times (up to
    ROUND_LIMIT x ``seconds``), each timed by perf_counter_ns."""
    ns: list[int] = []
    start = time.perf_counter()
    while True:
        elapsed = time.perf_counter() - start
        if (elapsed >= seconds and len(ns) >= min_calls) or elapsed >= ROUND_LIMIT * seconds:
            break
        t0 = time.perf_counter_ns()
        call()
        ns.append(time.perf_counter_ns() - t0)
    return latency_stats(ns)


def time_kernel(fn: Callable[[], object], device: str, seconds: float) -> dict:
    """``fn`` (a kernel launch) timed on the device: CUDA events around each launch on CUDA,
    perf_counter_ns on CPU; after three untimed launches."""
    import torch

    cuda = device.startswith("cuda")
    for _ in range(3):
        fn()
    if not cuda:
        return time_calls(fn, KERNEL_MIN_CALLS, seconds)
    torch.cuda.synchronize(device)
    start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ns: list[int] = []
    start = time.perf_counter()
    while len(ns) < KERNEL_MIN_CALLS or time.perf_counter() - start < seconds:
        start_event.record()
        fn()
        end_event.record()
        end_event.synchronize()
        ns.append(int(start_event.elapsed_time(end_event) * 1e6))
    return latency_stats(ns)


class Arena:
    """The tensors of one case for one transport, carved at aligned offsets from one byte buffer:
    CUDA memory on a CUDA device, a POSIX shared-memory object otherwise; registered as one region."""

    def __init__(self, device: str, parts: dict):
        import torch

        from logitserve.client import regions

        offsets, size = {}, 0
        for name, (shape, dtype) in parts.items():
            offsets[name] = size
            size += -(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN
        self.shared = None if device.startswith("cuda") else regions.shared_tensor((size,), torch.uint8)
        self.bytes = torch.zeros(size, dtype=torch.uint8, device=device) if self.shared is None else self.shared.tensor
        self.views = {name: self.bytes[offsets[name]:offsets[name] + math.prod(shape) * dtype.itemsize]
                      .view(dtype).view(shape) for name, (shape, dtype) in parts.items()}

    def register(self, client, name: str) -> None:
        client.register(name, self.bytes if self.shared is None else self.shared)

    def release(self) -> None:
        """Drop the views and the memory (after the client unregistered it)."""
        self.views = self.bytes = None
        if self.shared is not None:
            try:
                self.shared.close()
            except BufferError:  # a view still alive somewhere: the mapping goes with the process
                pass
            self.shared.unlink()


@dataclass
class Case:
    key: str  # names its target in the report
    label: str
    tiny: bool  # rounds of at least tiny_calls calls; else bounded by case_seconds
    call: dict  # transport -> the timed call
    answer: dict  # transport -> outputs cleared, one call, its answer as {field: numpy array}
    kernel: Callable[[], object] | None  # the same work by logitserve.kernels in this process
    rows: int = 0
    # Whether an answer is not the call's: values answer[t] cleared before the call, or seeds other than sent.
    unwritten: Callable[[dict], bool] | None = None


def opens_of(client) -> int:
    """The client's channel openings so far (``SameHostChannel.opens``). One is the first call's;
    more mean calls failed over to a new channel (each an OpenChannel and new ports, and the old
    channel left open on the server until its idle timeout)."""
    return client._same_host.opens


def _host(x) -> np.ndarray:
    return x.cpu().numpy().copy() if hasattr(x, "cpu") else np.array(x)


def _build(clients: dict, device: str, shapes: dict, arenas: list) -> list[Case]:
    import torch

    from logitserve import kernels

    cuda = device.startswith("cuda")
    memory = "CUDA IPC" if cuda else "system shm"
    cases = []

    def info_answer(t):
        info = clients[t].server_info()
        return {"server": np.array([info.version, info.device, info.backend])}

    cases.append(Case("info", "GetServerInfo", True, {t: clients[t].server_info for t in TRANSPORTS},
                      {t: (lambda t=t: info_answer(t)) for t in TRANSPORTS}, None))

    gate = np.random.default_rng(1).standard_normal((1, 8), dtype=np.float32)
    gate_device = torch.from_numpy(gate).to(device)
    cases.append(Case("route_1x8", "RouteExperts 1x8 f32 k=2 (bytes)", True,
                      {t: (lambda t=t: clients[t].route_experts(gate, 2)) for t in TRANSPORTS},
                      {t: (lambda t=t: dict(zip(("weights", "indices"), clients[t].route_experts(gate, 2))))
                       for t in TRANSPORTS},
                      lambda: kernels.route_experts(gate_device, 2)))

    def placed(name: str, parts: dict, values: dict) -> dict:
        """Per transport: an arena of ``parts`` holding ``values``, registered through its client."""
        views = {}
        for t in TRANSPORTS:
            arena = Arena(device, parts)
            arenas.append(arena)
            for field, value in values.items():
                arena.views[field].copy_(value)
            arena.register(clients[t], name)
            views[t] = arena.views
        return views

    tokens = shapes["route_tokens"]
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(tokens, DEEPSEEK_V3_EXPERTS, generator=generator).to(torch.bfloat16)
    bias = torch.randn(DEEPSEEK_V3_EXPERTS, generator=generator) * 0.1
    v = placed("router", {"gate": ((tokens, DEEPSEEK_V3_EXPERTS), torch.bfloat16),
                          "bias": ((DEEPSEEK_V3_EXPERTS,), torch.float32),
                          "weights": ((tokens, DEEPSEEK_V3_K), torch.float32),
                          "indices": ((tokens, DEEPSEEK_V3_K), torch.int32)}, {"gate": logits, "bias": bias})

    def route(t):
        return clients[t].route_experts(v[t]["gate"], DEEPSEEK_V3_K, correction_bias=v[t]["bias"], **DEEPSEEK_V3,
                                        out={"weights": v[t]["weights"], "indices": v[t]["indices"]})

    def route_answer(t):
        v[t]["weights"].fill_(float("nan"))
        v[t]["indices"].fill_(-1)
        weights, indices = route(t)
        return {"weights": _host(weights), "indices": _host(indices)}

    cases.append(Case("route_dsv3", f"RouteExperts DeepSeek-V3 {tokens}x{DEEPSEEK_V3_EXPERTS} bf16 ({memory})", False,
                      {t: (lambda t=t: route(t)) for t in TRANSPORTS},
                      {t: (lambda t=t: route_answer(t)) for t in TRANSPORTS},
                      lambda: kernels.route_experts(v["grpc"]["gate"], DEEPSEEK_V3_K, correction_bias=v["grpc"]["bias"],
                                                    **DEEPSEEK_V3),
                      unwritten=lambda a: bool((a["indices"] < 0).any() or np.isnan(a["weights"]).any())))

    vocab = shapes["vocab"]
    for rows in shapes["sample_rows"]:
        cases.append(_sample_case(clients, device, rows, vocab, memory, placed))
    return cases


def _sample_case(clients: dict, device: str, rows: int, vocab: int, memory: str, placed) -> Case:
    import torch

    from logitserve import kernels

    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)) * 3
    seeds = np.arange(rows, dtype=np.int64) + 1
    seeds_device = torch.from_numpy(seeds).to(device)
    v = placed(f"sample-{rows}", {"logits": ((rows, vocab), torch.float32), "token_ids": ((rows,), torch.int64),
                                  "seeds": ((rows,), torch.int64), "valid": ((rows,), torch.bool)}, {"logits": logits})

    def sample(t):
        outs = {name: v[t][name] for name in ("token_ids", "seeds", "valid")}
        return clients[t].sample(v[t]["logits"], **SAMPLE_PARAMS, seed=seeds, out=outs)

    def answer(t):
        v[t]["token_ids"].fill_(-1)
        v[t]["seeds"].fill_(0)
        v[t]["valid"].fill_(False)
        result = sample(t)
        return {"token_ids": _host(result.token_ids), "seeds": _host(result.seeds), "valid": _host(result.valid)}

    return Case(f"sample_{rows}", f"Sample {rows}x{vocab} f32 ({memory})", False,
                {t: (lambda t=t: sample(t)) for t in TRANSPORTS}, {t: (lambda t=t: answer(t)) for t in TRANSPORTS},
                lambda: kernels.sample(v["grpc"]["logits"], **SAMPLE_PARAMS, seed=seeds_device), rows,
                lambda a: not (np.array_equal(a["seeds"], seeds) and a["valid"].all()))


def compare(case: Case) -> list[str]:
    """Where the transports' answers to ``case`` differ (empty: the same)."""
    answers = {t: case.answer[t]() for t in TRANSPORTS}
    differences = [f"{case.label}: {t}: the outputs are not this call's answer (values cleared before the call, "
                   "or seeds other than those sent)"
                   for t in TRANSPORTS if case.unwritten is not None and case.unwritten(answers[t])]
    for field, expected in answers["grpc"].items():
        got = answers["shm"][field]
        if expected.shape != got.shape or not np.array_equal(expected, got):
            where = np.argwhere(expected != got)[:3].tolist() if expected.shape == got.shape else "shape"
            differences.append(f"{case.label}: {field}: grpc {expected.ravel()[:8].tolist()} vs shm "
                               f"{got.ravel()[:8].tolist()} (first differing at {where})")
    return differences


def measure_cases(target: str, device: str, shapes: dict, rounds: int, case_seconds: float,
                  tiny_calls: int, poll_us: int | None = None) -> dict:
    """Every case, in this (client) process: warm-up, comparison, kernel time, then ``rounds``
    rounds of grpc then shm, then the comparison again. ``poll_us``: how long the shm client
    polls for an answer before it sleeps (None: the client's default)."""
    import torch

    from logitserve.client import Client
    from logitserve.client.same_host import SameHost

    arenas: list[Arena] = []
    shm = "shm" if poll_us is None else SameHost(poll_us=poll_us)
    clients = {t: Client(target, timeout=600, channel=shm if t == "shm" else t) for t in TRANSPORTS}
    results = []
    try:
        for case in _build(clients, device, shapes, arenas):
            for t in TRANSPORTS:
                for _ in range(WARMUP_CALLS if case.tiny else WARMUP_CALLS // 4):
                    case.call[t]()
            differences = compare(case)
            opened_before = opens_of(clients["shm"])
            kernel = None if case.kernel is None else time_kernel(case.kernel, device, min(case_seconds, 1.0))
            by_round: dict[str, list] = {t: [] for t in TRANSPORTS}
            for _ in range(rounds):
                for t in TRANSPORTS:
                    start = time.time()
                    timed = time_calls(case.call[t], tiny_calls if case.tiny else BIG_MIN_CALLS, case_seconds)
                    # The round's wall-clock window: `python -m bench.stack_profile FILE --from --to` gives
                    # what a sampled server or client (BENCH_SERVER_ / BENCH_CLIENT_STACK_SAMPLES) did in it.
                    by_round[t].append(dict(timed, window=[start, time.time()]))
            differences += compare(case)
            results.append(dict(key=case.key, label=case.label, rows=case.rows, kernel=kernel, rounds=by_round,
                                differences=differences, reopened=opens_of(clients["shm"]) - opened_before))
            print(f"# {case.label}: " + ", ".join(f"{t} {[round(r['p50_us'], 1) for r in by_round[t]]} us"
                                                  for t in TRANSPORTS)
                  + ("" if kernel is None else f", kernel {kernel['p50_us']:.1f} us")
                  + (f", channel reopened {results[-1]['reopened']} times" if results[-1]["reopened"] else "")
                  + (f", DIFFERENT: {differences}" if differences else ""), flush=True)
        if not clients["shm"]._same_host.is_open:
            raise RuntimeError("the shm client's channel is not open after its calls: they did not cross it")
    finally:
        for client in clients.values():
            client.close()
        for arena in arenas:
            arena.release()
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    return dict(device_name=name, cases=results)


def throughput_client(index: int, target: str, phases: list, seconds: float, barrier, queue) -> None:
    """One of the concurrent clients: both transports' clients opened and warmed, then, phase by
    phase (``(transport, clients)``; all processes meet at the barrier before and after each),
    RouteExperts 1x8 in a loop for ``seconds`` when ``index`` is among the phase's clients."""
    try:
        from logitserve.client import Client

        gate = np.random.default_rng(100 + index).standard_normal((1, 8), dtype=np.float32)
        clients = {t: Client(target, timeout=60, channel=t) for t in TRANSPORTS}
        for client in clients.values():
            for _ in range(WARMUP_CALLS):
                client.route_experts(gate, 2)
        results = []
        for transport, active in phases:
            barrier.wait(timeout=300)
            if index < active:
                client, opened_before = clients[transport], opens_of(clients["shm"])
                times, wall = loop_for(lambda: client.route_experts(gate, 2), seconds)
                results.append(dict(wall_s=wall, latencies_ns=[round(t * 1e9) for t in times],
                                    reopened=opens_of(clients["shm"]) - opened_before))
            else:
                results.append(None)
            barrier.wait(timeout=300 + seconds)
        for client in clients.values():
            client.close()
        queue.put((index, "ok", results))
    except BaseException:  # noqa: BLE001 - reported by the parent, the others released
        queue.put((index, "error", traceback.format_exc()))
        barrier.abort()
