"""Region soak (issue 37): client processes sharing one caller register, use and unregister
regions at once, and none may lose another's.

    python -m bench.region_soak --device cuda:0 --clients 4 --seconds 40   # CUDA IPC regions
    python -m bench.region_soak --device cpu --clients 2 --seconds 10      # system regions

Starts the service as a subprocess (no tokens: every client is the same caller) and spawns
``--clients`` processes. Each loops: new input and output tensors (torch CUDA tensors on a GPU
server, shared-memory objects on a CPU one), registered under the same names in every process
("logits", "gate", "out"); Sample (greedy, tokens written into the output region), RouteExperts
and Softmax (into the output region) through them, each answer checked against torch;
``unregister()``; the tensors dropped. Reported per client: loops, errors by status, wrong
answers, the most regions in its table, and its memory (device memory allocated by torch on a
GPU, RSS on the CPU) after a warm-up and at the end. tests/test_region_soak.py is CI's
system-region version of the same check.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import time

import numpy as np

B, V, E, K = 8, 4096, 64, 4


def _memory_mib(device: str) -> float:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.memory_allocated() / 2**20
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _tensors(device: str, rng):
    """logits [B, V], gate [B, E], and an output arena, each in memory the client can register."""
    import torch

    from logitserve.client import regions

    logits = torch.from_numpy(rng.standard_normal((B, V), dtype=np.float32) * 3)
    gate = torch.from_numpy(rng.standard_normal((B, E), dtype=np.float32))
    if device.startswith("cuda"):
        out = torch.full((B * V + 2 * B,), float("nan"), device=device)  # poisoned: every output must be written
        return logits.to(device), gate.to(device), out, (logits, gate)
    bufs = [regions.shared_copy(logits.numpy()), regions.shared_copy(gate.numpy()),
            regions.shared_array((B * V + 2 * B,), "float32")]
    bufs[2].array[:] = np.nan
    return bufs[0], bufs[1], bufs[2], (logits, gate)


def _as_torch(x):
    import torch

    return x if isinstance(x, torch.Tensor) else torch.from_numpy(x.array)


def _one_loop(client, device: str, rng) -> tuple[int, int]:
    """Register, call, check and unregister once: wrong answers, table size while registered."""
    import torch

    logits, gate, out, (ref_logits, ref_gate) = _tensors(device, rng)
    for name, x in (("logits", logits), ("gate", gate), ("out", out)):
        client.register(name, x)
    peak = len(client.registered)
    o = _as_torch(out)
    probs, tokens = o[:B * V].view(B, V), o[B * V:].view(torch.int64)
    x_logits, x_gate = _as_torch(logits), _as_torch(gate)
    wrong = 0
    client.sample(x_logits, temperature=0, out={"token_ids": tokens})
    wrong += not torch.equal(tokens.cpu(), torch.argmax(ref_logits, dim=-1))
    weights, experts = client.route_experts(x_gate, k=K, renormalize=True)
    expected = torch.topk(ref_gate, K, dim=-1).indices
    wrong += not torch.equal(torch.as_tensor(np.asarray(experts)).long().sort(-1).values, expected.sort(-1).values)
    client.softmax(x_logits, out=probs)
    wrong += not torch.allclose(probs.cpu(), torch.softmax(ref_logits, dim=-1), atol=1e-6, rtol=1e-5)
    client.unregister()
    for buf in (logits, gate, out):
        if hasattr(buf, "unlink"):
            buf.unlink()
    return wrong, peak


def client_process(target: str, device: str, seconds: float, seed: int, start, results) -> None:
    import torch  # noqa: F401  (imported before the clock starts)

    from logitserve.client import Client, LogitServeError

    rng = np.random.default_rng(seed)
    errors: collections.Counter = collections.Counter()
    wrong = loops = table_max = 0
    memory_warm = None
    with Client(target, timeout=60) as client:
        start.wait()
        began = time.monotonic()
        while time.monotonic() < began + seconds:
            if memory_warm is None and time.monotonic() > began + seconds / 4:
                memory_warm = _memory_mib(device)
            try:
                bad, peak = _one_loop(client, device, rng)
                wrong, table_max = wrong + bad, max(table_max, peak)
            except LogitServeError as exc:
                errors[exc.code.name] += 1
                client.unregister()
            loops += 1
        table_after = len(client.registered)
        memory_end = _memory_mib(device)
    results.put({"seed": seed, "loops": loops, "errors": dict(errors), "wrong": wrong, "table_max": table_max,
                 "table_after": table_after, "memory_warm": memory_warm or memory_end, "memory_end": memory_end})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=40.0)
    args = parser.parse_args()

    from logitserve.server.process import ServerProcess

    backend = "triton" if args.device.startswith("cuda") else "torch"
    with ServerProcess("--warmup-dtypes", "float32", "--warmup-widths", str(V), device=args.device,
                       backend=backend) as server:
        spawn = multiprocessing.get_context("spawn")
        start, results = spawn.Barrier(args.clients), spawn.Queue()
        procs = [spawn.Process(target=client_process, args=(server.target, args.device, args.seconds, seed, start,
                                                           results), daemon=True) for seed in range(args.clients)]
        for proc in procs:
            proc.start()
        reports = sorted((results.get(timeout=args.seconds + 300) for _ in procs), key=lambda r: r["seed"])
        for proc in procs:
            proc.join(timeout=30)
    unit = "device MiB" if args.device.startswith("cuda") else "RSS MiB"
    print(f"region soak: {args.clients} clients, {args.seconds:.0f} s, {args.device}, no tokens (one caller)")
    print(f"| client | loops | errors | wrong | table max | table at end | {unit} warm | {unit} end |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for r in reports:
        print(f"| {r['seed']} | {r['loops']} | {r['errors'] or 'none'} | {r['wrong']} | {r['table_max']} | "
              f"{r['table_after']} | {r['memory_warm']:.1f} | {r['memory_end']:.1f} |")
    failed = sum(bool(r["errors"]) or r["wrong"] > 0 or r["table_after"] > 0 for r in reports)
    print(f"total: {sum(r['loops'] for r in reports)} loops, "
          f"{sum(sum(r['errors'].values()) for r in reports)} errors, {sum(r['wrong'] for r in reports)} wrong")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
