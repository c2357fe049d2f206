"""The client's byte path against the pre-serialized request: what ``Client.sample`` adds.

    python -m bench.client_bytes --rows 16,64,256 --calls 15 --out client_bytes.md

A stand-in server in a process of its own answers ``Sample`` with a valid answer of the right
number of rows and does nothing else (it reads the request's header in place, never its
logits), so what differs between the columns is the client's own work on the same transport:

- ``raw``: the request serialized before timing, sent as bytes, the answer not parsed;
- ``Client``: ``logitserve.client.Client.sample`` from a float32 numpy array or a bfloat16 torch
  tensor (``--dtypes``; numpy has no bfloat16), the request's tensor bytes copied once, the answer
  read in place (client/wire.py);
- ``Client before``: the client as it was before (``git show BASE:client``, ``--base``): the
  message built with ``tobytes`` and serialized by protobuf, the answer parsed by protobuf.

p50 of ``--calls`` calls per column, the columns interleaved call by call.
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent import futures

import grpc
import numpy as np

from logitserve.v1 import logitserve_pb2 as pb

VOCAB = 128256
METHOD = "/logitserve.v1.LogitServe/Sample"


# ------------------------------------------------------------------------- the stand-in server


def _serve(ready) -> None:
    from logitserve.client import codec, wire

    answers: dict[int, bytes] = {}

    def sample(raw: bytes, context) -> bytes:
        request, _ = wire.split(raw, pb.SampleRequest)  # the header only: the logits stay where they are
        rows = int(request.logits.shape[0])
        if rows not in answers:
            ids = np.zeros(rows, np.int64)
            answers[rows] = pb.SampleResponse(token_ids=codec.encode(ids), seeds=codec.encode(ids),
                                              valid=codec.encode(ids == 0)).SerializeToString()
        return answers[rows]

    class Handler(grpc.GenericRpcHandler):
        def service(self, details):
            return grpc.unary_unary_rpc_method_handler(sample) if details.method == METHOD else None

    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    server = grpc.server(futures.ThreadPoolExecutor(2), options=options)
    server.add_generic_rpc_handlers((Handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    ready.put(port)
    server.wait_for_termination()


# ------------------------------------------------------------------------------- the old client


def old_client_module(base: str):
    """The client package as of git revision ``base``, importable as ``oldclient``."""
    root = tempfile.mkdtemp(prefix="client-before-")
    os.makedirs(os.path.join(root, "oldclient"))
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                         check=True).stdout.strip()
    # The client's folder moved into src/ with the src layout; an older revision has it at the root.
    names = []
    for folder in ("src/logitserve/client/", "client/"):
        names = subprocess.run(["git", "ls-tree", "--name-only", base, folder], capture_output=True, text=True,
                               check=True, cwd=top).stdout.split()
        if names:
            break
    for name in names:
        if name.endswith(".py"):
            text = subprocess.run(["git", "show", f"{base}:{name}"], capture_output=True, text=True, check=True,
                                  cwd=top).stdout
            with open(os.path.join(root, "oldclient", os.path.basename(name)), "w") as f:
                f.write(text)
    sys.path.insert(0, root)
    return importlib.import_module("oldclient")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="16,64,256", help="comma-separated rows of 128256 logits")
    parser.add_argument("--dtypes", default="f32", help="comma-separated: f32 (numpy), bf16 (torch)")
    parser.add_argument("--calls", type=int, default=15, help="timed calls per column and size")
    parser.add_argument("--base", default="9e86efb", help="git revision of the client before (default 9e86efb)")
    parser.add_argument("--out", help="also write the table here")
    args = parser.parse_args(argv)

    from logitserve.client import Client

    old = old_client_module(args.base) if args.base else None
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Queue()
    proc = ctx.Process(target=_serve, args=(ready,), daemon=True)
    proc.start()
    lines = []
    try:
        target = f"127.0.0.1:{ready.get(timeout=60)}"
        channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", -1),
                                                         ("grpc.max_receive_message_length", -1)])
        raw_call = channel.unary_unary(METHOD)
        client = Client(target, timeout=120)
        before = old.Client(target, timeout=120) if old else None
        lines += ["| logits | MB | raw ms | Client ms | Client / raw | Client before ms | before / raw |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for dtype, rows in ((d, int(r)) for d in args.dtypes.split(",") for r in args.rows.split(",")):
            logits = np.random.default_rng(rows).standard_normal((rows, VOCAB), dtype=np.float32)
            if dtype == "bf16":
                import torch

                logits = torch.from_numpy(logits).to(torch.bfloat16)
            kw = dict(temperature=0.8, top_k=50, top_p=0.9, seed=np.arange(rows))
            request = client._encoder()
            msg = __import__("logitserve.client.messages", fromlist=["x"]).build_sample(request, (), logits, **kw)
            raw = request.serialize(msg)
            columns = {"raw": lambda: raw_call(raw, timeout=120), "client": lambda: client.sample(logits, **kw)}
            if before:
                columns["before"] = lambda: before.sample(logits, **kw)
            times = {k: [] for k in columns}
            for name, call in columns.items():  # warm-up
                call()
            for _ in range(args.calls):
                for name, call in columns.items():
                    t0 = time.perf_counter()
                    call()
                    times[name].append((time.perf_counter() - t0) * 1e3)
            p50 = {k: statistics.median(v) for k, v in times.items()}
            b = p50.get("before", float("nan"))
            nbytes = logits.numel() * logits.element_size() if dtype == "bf16" else logits.nbytes
            lines.append(f"| {rows}x{VOCAB} {dtype} | {nbytes / 1e6:.1f} | {p50['raw']:.1f} | {p50['client']:.1f} "
                         f"| {p50['client'] / p50['raw']:.2f}x | {b:.1f} | {b / p50['raw']:.2f}x |")
            print(lines[-1], file=sys.stderr, flush=True)
        client.close()
        if before:
            before.close()
        channel.close()
    finally:
        proc.terminate()
        proc.join(10)
    header = [f"Client byte path (stand-in server, separate process; {os.cpu_count()} CPUs, grpcio {grpc.__version__}); "
              f"p50 of {args.calls} calls:", ""]
    text = "\n".join(header + lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
