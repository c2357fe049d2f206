"""The KServe v2 / Triton front against ``logitserve.v1``: ``Sample`` through each, same server, same call.

    python -m bench.kserve_vs_v1 --device cuda:0 --out kserve_vs_v1.json     # the H100 table, about 2 minutes
    python -m bench.kserve_vs_v1 --device cpu --vocab 1024 --iters 20        # CPU smoke, about 30 s

Issue 24's target: through the KServe front, ``sample`` at 1 and 64 rows of 128256 costs no more
than 1.2x the same call through ``logitserve.v1``, on the byte path and from CUDA shared memory.

Starts one ``logitserve serve`` process on 127.0.0.1 (``logitserve.server.process``), then measures
from a client process of its own (spawned), over one gRPC channel, at concurrency 1, ``Sample``
with temperature 0.8, top_k 50, top_p 0.9 and per-row seeds on float32 logits ``[rows, vocab]``
(``--rows``, default 1 and 64; ``--vocab``, default 128256), through four paths:

- ``v1 bytes``: ``LogitServe.Sample``, the logits in ``Tensor.data``;
- ``KServe bytes``: ``GRPCInferenceService.ModelInfer`` of model ``sample``, the logits and seeds
  in ``raw_input_contents`` (tritonclient's default), the parameters as request parameters;
- ``v1 CUDA``: the logits in a CUDA region registered through ``SharedMemory.RegisterCudaSharedMemory``;
- ``KServe CUDA``: the logits in a CUDA region registered through ``CudaSharedMemoryRegister``.

Each CUDA region is device memory of its own (``cudaMalloc`` through cuda-python, filled once with
the same logits) shared by its ``cudaIpcMemHandle``. The seeds travel as bytes and the outputs
(token ids, seeds, valid) come back in the answer on every path. Only the server's front differs
between the two calls of a pair: the requests are protobuf messages built before timing, sent
through the generated stubs of the two protos over the same channel (each call serializes its
request and parses its answer: the same bytes either way, give or take a few header fields).

The fronts are interleaved: ``--rounds`` rounds, each timing ``--iters`` calls of every
(rows, path) through one front and then the other, the order flipping from round to round, after
``--warmup`` calls of each (a CUDA graph is captured on a buffer's second use). Reported per
rows and path: the median over rounds of each round's p50 and p90 (ms), the KServe / v1 ratio of
those medians, and the range of the per-round p50 ratios. Before timing, every path's tokens
are checked equal to ``v1 bytes``'s. A Markdown table goes to stdout, everything to ``--out``
(JSON). ``--device cpu``: the two byte paths only (no CUDA regions on a CPU server).

Needs what ``logitserve serve`` needs, and cuda-python (``cuda.bindings``) for the CUDA paths.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import statistics
import sys
import time

import numpy as np

from .driver import ClientFailed, in_client_process, percentile
from .service import machine_line

PARAMS = dict(temperature=0.8, top_k=50, top_p=0.9)
FRONTS = ("v1", "kserve")
V1_REGION, KSERVE_REGION = "bench-v1-logits", "bench-kserve-logits"
CALL_TIMEOUT_S = 600.0  # a first call may compile a kernel variant


def _check(result):
    """The values of a cuda.bindings call (``(err, *values)``), raising on an error."""
    from cuda.bindings import runtime

    err, *values = result
    if err != runtime.cudaError_t.cudaSuccess:
        raise RuntimeError(f"CUDA runtime call failed: {err}")
    return values[0] if len(values) == 1 else None


class DeviceLogits:
    """A copy of host logits in an allocation of its own (``cudaMalloc``): its IPC handle names
    exactly this memory, from its base, so a region of it starts at offset 0."""

    def __init__(self, host: np.ndarray, device_id: int):
        from cuda.bindings import runtime

        from logitserve.client import regions

        _check(runtime.cudaSetDevice(device_id))
        self.device_id, self.byte_size = device_id, host.nbytes
        self.ptr = _check(runtime.cudaMalloc(host.nbytes))
        _check(runtime.cudaMemcpy(self.ptr, host.ctypes.data, host.nbytes,
                                  runtime.cudaMemcpyKind.cudaMemcpyHostToDevice))
        _check(runtime.cudaDeviceSynchronize())  # complete before the server reads it
        self.raw_handle = regions.handle_bytes(_check(runtime.cudaIpcGetMemHandle(self.ptr)))

    def free(self) -> None:
        from cuda.bindings import runtime

        _check(runtime.cudaFree(self.ptr))


def _kserve_request(logits: np.ndarray, seeds: np.ndarray, region: str | None):
    """ModelInferRequest of model ``sample``: LOGITS in ``raw_input_contents``, or in ``region``
    (with the shared-memory parameters tritonclient's ``set_shared_memory`` sets); SEED as bytes."""
    from logitserve.kserve import grpc_service_pb2 as kpb

    request = kpb.ModelInferRequest(model_name="sample")
    request.parameters["temperature"].double_param = PARAMS["temperature"]
    request.parameters["top_k"].int64_param = PARAMS["top_k"]
    request.parameters["top_p"].double_param = PARAMS["top_p"]
    tensor = request.inputs.add(name="LOGITS", datatype="FP32", shape=logits.shape)
    if region is None:
        request.raw_input_contents.append(logits.tobytes())
    else:
        tensor.parameters["shared_memory_region"].string_param = region
        tensor.parameters["shared_memory_byte_size"].int64_param = logits.nbytes
    request.inputs.add(name="SEED", datatype="INT64", shape=seeds.shape)
    request.raw_input_contents.append(seeds.tobytes())
    return request


def _kserve_tokens(response) -> np.ndarray:
    index = [o.name for o in response.outputs].index("TOKEN_IDS")
    return np.frombuffer(response.raw_output_contents[index], dtype="<i8")


def _timed_calls(call, request, iters: int) -> list[float]:
    """``iters`` calls one after another; their latencies in seconds."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        call(request, timeout=CALL_TIMEOUT_S)
        times.append(time.perf_counter() - t0)
    return times


def measure(target: str, device: str, rows_list: list[int], vocab: int, rounds: int, iters: int,
            warmup: int) -> list[dict]:
    """Every (rows, path)'s rounds, measured in this (client) process."""
    import grpc

    from logitserve.client import codec, messages, regions
    from logitserve.kserve import grpc_service_pb2 as kpb
    from logitserve.kserve import grpc_service_pb2_grpc as kpb_grpc
    from logitserve.v1 import logitserve_pb2 as pb
    from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

    cuda = device.startswith("cuda")
    device_id = int(device.partition(":")[2] or 0) if cuda else None
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    channel = grpc.insecure_channel(target, options=options)
    v1, kserve = pb_grpc.LogitServeStub(channel), kpb_grpc.GRPCInferenceServiceStub(channel)
    shared = pb_grpc.SharedMemoryStub(channel)
    stubs = {"v1": v1.Sample, "kserve": kserve.ModelInfer}
    tokens_of = {"v1": lambda r: codec.decode(r.token_ids), "kserve": _kserve_tokens}
    cases, registered = [], []  # registered: (front, region name, DeviceLogits)
    try:
        for rows in rows_list:
            logits = np.random.default_rng(rows).standard_normal((rows, vocab), dtype=np.float32) * 3
            seeds = np.arange(rows, dtype=np.int64) + 1
            requests = {"bytes": {"v1": messages.sample_request(logits, **PARAMS, seed=seeds),
                                  "kserve": _kserve_request(logits, seeds, None)}}
            if cuda:
                v1_name, kserve_name = f"{V1_REGION}-{rows}", f"{KSERVE_REGION}-{rows}"
                mem = DeviceLogits(logits, device_id)
                registered.append(("v1", v1_name, mem))
                shared.RegisterCudaSharedMemory(pb.RegisterCudaSharedMemoryRequest(
                    name=v1_name, raw_handle=mem.raw_handle, device_id=device_id, byte_size=mem.byte_size))
                mem = DeviceLogits(logits, device_id)
                registered.append(("kserve", kserve_name, mem))
                kserve.CudaSharedMemoryRegister(kpb.CudaSharedMemoryRegisterRequest(
                    name=kserve_name, raw_handle=mem.raw_handle, device_id=device_id, byte_size=mem.byte_size))
                v1_logits = regions.region_tensor(v1_name, "float32", logits.shape)
                requests["CUDA"] = {"v1": messages.sample_request(v1_logits, **PARAMS, seed=seeds),
                                    "kserve": _kserve_request(logits, seeds, kserve_name)}
            expect = tokens_of["v1"](v1.Sample(requests["bytes"]["v1"], timeout=CALL_TIMEOUT_S))
            for path, pair in requests.items():
                same = all(np.array_equal(tokens_of[front](stubs[front](pair[front], timeout=CALL_TIMEOUT_S)), expect)
                           for front in FRONTS)
                cases.append(dict(rows=rows, vocab=vocab, path=path, requests=pair, tokens_equal=same,
                                  times={front: [] for front in FRONTS}))
        for case in cases:
            for front in FRONTS:
                _timed_calls(stubs[front], case["requests"][front], warmup)
        for r in range(rounds):
            order = FRONTS if r % 2 == 0 else FRONTS[::-1]
            for case in cases:
                for front in order:
                    case["times"][front].append(_timed_calls(stubs[front], case["requests"][front], iters))
            print(f"# round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    finally:
        # Each region through the front that registered it (a name never registered is no error),
        # then its memory: the server has closed its handle by then.
        for front, name, mem in registered:
            if front == "kserve":
                kserve.CudaSharedMemoryUnregister(kpb.CudaSharedMemoryUnregisterRequest(name=name))
            else:
                shared.UnregisterSharedMemory(pb.UnregisterSharedMemoryRequest(name=name))
            mem.free()
        channel.close()
    return [summary(case) for case in cases]


def summary(case: dict) -> dict:
    """A case's per-round p50 and p90 (ms) for each front, their medians, and the ratios."""
    out = {k: case[k] for k in ("rows", "vocab", "path", "tokens_equal")}
    for front in FRONTS:
        rounds = [sorted(times) for times in case["times"][front]]
        p50s = [percentile(t, 50) * 1e3 for t in rounds]
        p90s = [percentile(t, 90) * 1e3 for t in rounds]
        out[front] = dict(calls_per_round=len(rounds[0]), p50_ms_by_round=p50s, p90_ms_by_round=p90s,
                          p50_ms=statistics.median(p50s), p90_ms=statistics.median(p90s))
    out["ratio_p50"] = out["kserve"]["p50_ms"] / out["v1"]["p50_ms"]
    out["ratio_p90"] = out["kserve"]["p90_ms"] / out["v1"]["p90_ms"]
    by_round = [k / v for k, v in zip(out["kserve"]["p50_ms_by_round"], out["v1"]["p50_ms_by_round"])]
    out["ratio_p50_by_round"] = by_round
    return out


def table(results: list[dict]) -> list[str]:
    lines = ["| logits f32 | path | v1 p50 ms | KServe p50 ms | KServe / v1 p50 | per-round p50 ratios | v1 p90 ms "
             "| KServe p90 ms | KServe / v1 p90 | tokens equal |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|---|"]
    for r in results:
        spread = f"{min(r['ratio_p50_by_round']):.2f}-{max(r['ratio_p50_by_round']):.2f}"
        v1, kserve = r["v1"], r["kserve"]
        lines.append(f"| {r['rows']}x{r['vocab']} | {r['path']} | {v1['p50_ms']:.3f} | {kserve['p50_ms']:.3f} "
                     f"| {r['ratio_p50']:.2f}x | {spread} | {v1['p90_ms']:.3f} | {kserve['p90_ms']:.3f} "
                     f"| {r['ratio_p90']:.2f}x | {'yes' if r['tokens_equal'] else 'NO'} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="the server's device: cuda:0 (every path) or cpu "
                                                           "(the byte paths)")
    parser.add_argument("--backend", default="auto", help="the server's --backend")
    parser.add_argument("--rows", default="1,64", help="comma-separated rows per call (default 1,64)")
    parser.add_argument("--vocab", type=int, default=128256, help="row width (default 128256)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, the fronts' order flipping each (default 5)")
    parser.add_argument("--iters", type=int, help="calls per front, path and size in a round (default 50; "
                                                  "cpu: 20)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed calls of each before the first round")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for SERVING")
    parser.add_argument("--out", help="write the results as JSON to this path")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    rows_list = [int(r) for r in args.rows.split(",")]
    iters = args.iters if args.iters is not None else (50 if cuda else 20)

    from logitserve.server.process import ServerProcess

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    command = f"python -m bench.kserve_vs_v1 {shlex.join(argv if argv is not None else sys.argv[1:])}"
    machine = machine_line(args)
    t0 = time.monotonic()
    # Warm-up compiles what the benchmark calls: float32 at its width.
    with ServerProcess("--warmup-dtypes", "float32", "--warmup-widths", str(args.vocab), device=args.device,
                       backend=args.backend, start_timeout=args.startup_timeout) as server:
        try:
            results = in_client_process(measure, server.target, args.device, rows_list, args.vocab, args.rounds,
                                        iters, args.warmup)
        except ClientFailed as exc:
            print(exc, file=sys.stderr)
            return 1
    text = "\n".join([f"KServe front vs logitserve.v1: {machine}.",
                      f"Command: `{command}`. Sample, temperature 0.8, top_k 50, top_p 0.9, per-row seeds; "
                      f"concurrency 1; {args.rounds} interleaved rounds of {iters} calls per front; medians over "
                      f"rounds of each round's percentile.", "", *table(results), "",
                      f"Whole run {time.monotonic() - t0:.0f} s."])
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(machine=machine, command=command, rounds=args.rounds, iters=iters, warmup=args.warmup,
                           results=results), f, indent=1)
    return 0 if all(r["tokens_equal"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
