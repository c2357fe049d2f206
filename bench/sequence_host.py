"""The host's work in a Sample by sequence ids, without the launch (issue 45 item 3: "sequence calls
with no Python per row").

    python -m bench.sequence_host [--trees DIR [DIR ...]] [--batch 256] [--rounds 15] [--calls 50]

``SequenceRows.run`` on the Triton path (the sequence table's lock, the rows' state read, their
outputs' room, the list table's rows, the answers kept, the tokens counted) with a stand-in device
handle whose launch answers at once: what a call costs the server's event loop per row, apart from
the GPU. Each round runs ``--calls`` calls of ``--batch`` rows (256-token prompts, 1,024-token
outputs, a penalty) in a subprocess per tree, the trees in turn (``--trees``: directories holding
``src/logitserve`` of other commits, ``git archive REV src | tar -x -C DIR``; default this tree),
and reports each tree's median over the rounds of its per-call median, in microseconds.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics

from .trees import ROOT, interleaved, table

VOCAB = 128256


async def _measure(batch: int, calls: int) -> float:
    """Median us of ``calls`` host passes of a ``batch``-row call by sequence ids."""
    import time

    import torch

    from logitserve.server.ops.limits import Limits
    from logitserve.server.ops.sample import SampleCall, param_names
    from logitserve.server.sequences.bounds import SequenceBounds
    from logitserve.server.sequences.open import open_specs
    from logitserve.server.sequences.sample import SequenceRows
    from logitserve.server.sequences.table import SequenceTable
    from logitserve.v1 import logitserve_pb2 as pb

    class Handle:  # the launch thread, its launch answering at once
        backend, graphs, device = "triton", None, torch.device("cpu")

        async def run(self, fn, *args):
            if getattr(fn, "__name__", "") == "eagerly":
                return torch.arange(batch, dtype=torch.int64), None
            return fn(*args)

    table = SequenceTable(SequenceBounds(4 * batch, 1 << 36), idle_s=3600, device=torch.device("cpu"))
    specs = [pb.SequenceSpec(id=i, prompt_token_ids=range(256), output_token_ids=range(1024), seed=i,
                             temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1) for i in range(batch)]
    sequences = await open_specs(table, specs, None, VOCAB)
    logits = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[batch, 8], data=bytes(batch * 32))
    limits, handle, times = Limits(max_rows=4 * batch, max_vocab=VOCAB), Handle(), []
    for _ in range(calls + 3):
        call = SampleCall.from_pb(pb.SampleRequest(logits=logits), limits)
        rows = SequenceRows(table, sequences, VOCAB, "")
        started = time.perf_counter()
        await rows.run(call, handle, param_names([call]), None)
        times.append((time.perf_counter() - started) * 1e6)
    return statistics.median(times[3:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs="+", type=pathlib.Path, default=[ROOT])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # one tree's subprocess
    args = parser.parse_args(argv)
    if args.measure:
        import asyncio

        print(json.dumps({"us": asyncio.run(_measure(args.batch, args.calls))}))
        return 0
    figures = interleaved("bench.sequence_host", args.trees, args.rounds,
                          ["--batch", str(args.batch), "--calls", str(args.calls)])
    print(f"host work of a {args.batch}-row Sample by sequence ids, us per call (median of {args.rounds} rounds of "
          f"{args.calls} calls' medians)")
    print("\n".join(table(args.trees, figures)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
