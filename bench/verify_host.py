"""The host's parse of a VerifyDraft whose every tensor is in a registered region (issue 45 item 3:
"VerifyDraft resolving its regions once per registration rather than per call").

    python -m bench.verify_host [--trees DIR [DIR ...]] [--batch 32] [--n 4] [--rounds 15] [--calls 200]
                                [--object-per-tensor]

``VerifyDraftCall.from_pb`` of a request naming POSIX shared-memory regions for the draft tokens,
the target logits, the draft probabilities, four per-row parameters (temperature, top_k, top_p,
seed) and the four outputs (eleven regions, slices of one object; ``--object-per-tensor``: each of
its own), then the call's leases released (``CallRegions.finish``): what the
server's event loop spends on it before the call queues, with no network and no launch. System
regions, so it runs on this CPU; the region-resolving part is the CUDA path's too. Each round
runs ``--calls`` parses in a subprocess per tree, the trees in turn (``--trees``: directories
holding ``src/logitserve`` of other commits, ``git archive REV src | tar -x -C DIR``; default this
tree), and reports each tree's median over the rounds of its per-call median, in microseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import uuid

from .trees import ROOT, interleaved, table

VOCAB = 128256
SHM_DIR = "/dev/shm"


def _object(size: int) -> str:
    """A new POSIX shared-memory object of ``size`` zero bytes (sparse: never written but for the
    small regions); its key."""
    key = f"lsbench-{uuid.uuid4().hex}"
    fd = os.open(os.path.join(SHM_DIR, key), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, size)
    os.close(fd)
    return key


def _measure(batch: int, n: int, calls: int, object_per_tensor: bool) -> float:
    """Median us of ``calls`` parses of a ``batch`` x ``n`` VerifyDraft with every tensor in a region."""
    import time

    import numpy as np

    from logitserve.server.ops.limits import Limits
    from logitserve.server.ops.verify_draft import VerifyDraftCall
    from logitserve.server.regions import CallRegions, RegionRegistry
    from logitserve.v1 import logitserve_pb2 as pb

    # Each tensor: (wire dtype, shape, bytes) in its own region of one object.
    rows_values = {
        "draft_token_ids": (pb.DTYPE_INT64, [batch, n], np.arange(batch * n, dtype=np.int64) % 1000),
        "target_logits": (pb.DTYPE_FLOAT32, [batch, n + 1, VOCAB], None),
        "draft_probs": (pb.DTYPE_FLOAT32, [batch, n, VOCAB], None),
        "temperature_rows": (pb.DTYPE_FLOAT32, [batch], np.full(batch, 0.8, dtype=np.float32)),
        "top_k_rows": (pb.DTYPE_INT64, [batch], np.full(batch, 50, dtype=np.int64)),
        "top_p_rows": (pb.DTYPE_FLOAT32, [batch], np.full(batch, 0.9, dtype=np.float32)),
        "seed_rows": (pb.DTYPE_INT64, [batch], np.arange(batch, dtype=np.int64)),
    }
    outputs = {"token_ids": 8 * batch * (n + 1), "num_accepted": 8 * batch, "valid": batch, "seeds": 8 * batch}
    sizes = {name: 4 * int(np.prod(shape)) if code == pb.DTYPE_FLOAT32 else 8 * int(np.prod(shape))
             for name, (code, shape, _) in rows_values.items()}
    sizes.update(outputs)
    keys = [_object(size) for size in sizes.values()] if object_per_tensor else [_object(sum(sizes.values()))]
    registry, msg = RegionRegistry(max_mapped_bytes=1 << 40), pb.VerifyDraftRequest()
    try:
        at, key = 0, keys[0]
        for i, (name, size) in enumerate(sizes.items()):
            if object_per_tensor:
                at, key = 0, keys[i]
            registry.register_system(name, key, at, size)
            ref = pb.RegionRef(region=name, offset=0, byte_size=size)
            if name in outputs:
                msg.output_regions[name].CopyFrom(ref)
            else:
                code, shape, values = rows_values[name]
                getattr(msg, name).CopyFrom(pb.Tensor(dtype=code, shape=shape, region=ref))
                if values is not None:
                    fd = os.open(os.path.join(SHM_DIR, key), os.O_RDWR)
                    os.pwrite(fd, values.tobytes(), at)
                    os.close(fd)
            at += size
        limits, times = Limits(max_rows=4096, max_vocab=VOCAB), []
        for _ in range(calls + 3):
            started = time.perf_counter()
            regions = CallRegions(registry)
            VerifyDraftCall.from_pb(msg, limits, regions=regions)
            regions.finish()
            times.append((time.perf_counter() - started) * 1e6)
        return statistics.median(times[3:])
    finally:
        registry.close()
        for key in keys:
            os.unlink(os.path.join(SHM_DIR, key))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs="+", type=pathlib.Path, default=[ROOT])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--object-per-tensor", action="store_true",
                        help="each tensor's region a slice of its own object (default: of one object)")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # one tree's subprocess
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps({"us": _measure(args.batch, args.n, args.calls, args.object_per_tensor)}))
        return 0
    figures = interleaved("bench.verify_host", args.trees, args.rounds,
                          ["--batch", str(args.batch), "--n", str(args.n), "--calls", str(args.calls)]
                          + ["--object-per-tensor"] * args.object_per_tensor)
    objects = "an object each" if args.object_per_tensor else "one object"
    print(f"host parse of a VerifyDraft B {args.batch} n {args.n}, every tensor in a system region ({objects}), "
          f"us per call "
          f"(median of {args.rounds} rounds of {args.calls} calls' medians)")
    print("\n".join(table(args.trees, figures, digits=1)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
