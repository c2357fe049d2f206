"""Where a server spends a processors call's host time: cProfile on its event loop and on its
launch thread while a client process repeats one ``bench.processors_service`` case.

    python -m bench.processors_profile [--case regions|sequences|plain|verify] [--thread loop|launch] [--calls 200]

The server runs in this process (``ServerThread``, cuda:0, warm-up of float32 at 128256 only), the
client in a spawned one, so that CUDA IPC regions work as in the service bench. The profile is
enabled on the thread profiled after the client's warm-up calls and printed sorted by own time
and by cumulative time. cProfile's overhead grows with the number of Python calls: read
the shares and call counts, not the absolute times. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import multiprocessing
import pstats
import sys

import numpy as np

CASES = ("plain", "regions", "sequences", "verify")


def _client(target: str, case: str, calls: int, ready, go, done) -> None:
    """The spawned client: the case's arena and warm-up, then ``calls`` timed calls once told."""
    import torch

    from logitserve.client import Client

    from .processors_service import (OUTPUT_LEN, PARAMS, PENALTIES, PROMPT_LEN, SEQUENCE_ID_BASE, Arena, _inputs,
                                     _outputs, verify_inputs)

    rows, vocab, device = 256, 128256, "cuda:0"
    d = _inputs(rows, vocab)
    with Client(target, timeout=600) as client:
        arena = Arena(client, "p", device, dict(logits=d["logits"], **d["lists"], bitmask=d["bitmask"],
                                                **_outputs(rows)))
        v = arena.views
        out = {k: v[k] for k in ("token_ids", "seeds", "valid")}
        if case == "plain":
            def call():
                client.sample(v["logits"], **PARAMS, seed=d["seeds"], out=out)
        elif case == "regions":
            def call():
                client.sample(v["logits"], **PARAMS, **PENALTIES, seed=d["seeds"], **{k: v[k] for k in d["lists"]},
                              grammar_bitmask=v["bitmask"], out=out)
        elif case == "sequences":
            prompts, outputs = d["lists"]["prompt_token_ids"].numpy(), d["lists"]["output_token_ids"].numpy()
            seqs = client.open_sequences([dict(id=SEQUENCE_ID_BASE + i, seed=i + 1, **PARAMS, **PENALTIES,
                                               prompt_token_ids=prompts[i * PROMPT_LEN:(i + 1) * PROMPT_LEN],
                                               output_token_ids=outputs[i * OUTPUT_LEN:(i + 1) * OUTPUT_LEN])
                                          for i in range(rows)])

            def call():
                seqs.sample(v["logits"], grammar_bitmask=v["bitmask"], out=out)
        else:
            views, _ = verify_inputs(client, device, 32, vocab, [])
            outs = {k: views[k] for k in ("token_ids", "num_accepted", "valid", "seeds")}

            def call():
                client.verify_draft(views["draft"], views["target"], draft_probs=views["probs"], temperature=1.0,
                                    seed=np.arange(32, dtype=np.int64) + 1, out=outs)
        for _ in range(10):
            call()
        torch.cuda.synchronize()
        ready.set()
        go.wait()
        for _ in range(calls):
            call()
        done.set()


async def _on_loop(fn) -> None:
    fn()


def _report(profile: cProfile.Profile, title: str, calls: int, top: int) -> str:
    out = io.StringIO()
    out.write(f"## {title} ({calls} calls)\n")
    for key in ("tottime", "cumulative"):
        stats = pstats.Stats(profile, stream=out)
        stats.sort_stats(key).print_stats(top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=CASES, default="regions")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--thread", choices=("loop", "launch"), default="loop",
                        help="the thread profiled: the event loop or the device's launch thread")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench.processors_profile needs a CUDA device", file=sys.stderr)
        return 2
    from logitserve.server import ServerConfig
    from logitserve.server.testing import ServerThread

    config = ServerConfig(host="127.0.0.1", port=0, device="cuda:0", warmup_dtypes=("float32",),
                          warmup_widths=(128256,), compile_processes=0)
    ctx = multiprocessing.get_context("spawn")
    ready, go, done = ctx.Event(), ctx.Event(), ctx.Event()
    with ServerThread(config, start_timeout=900) as server:
        client = ctx.Process(target=_client, args=(server.target, args.case, args.calls, ready, go, done))
        client.start()
        try:
            ready.wait(600)
            profile = cProfile.Profile()
            # On the thread profiled (one profiler at a time in a process since Python 3.12).
            on_thread = _on_loop if args.thread == "loop" else server.service.handle.submit
            server.run(on_thread(profile.enable))
            go.set()
            done.wait(600)
            server.run(on_thread(profile.disable))
        finally:
            go.set()
            client.join(60)
            if client.is_alive():
                client.terminate()
    print(f"# bench.processors_profile --case {args.case} --thread {args.thread}: {torch.cuda.get_device_name()}")
    print(_report(profile, f"{args.thread} thread", args.calls, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
