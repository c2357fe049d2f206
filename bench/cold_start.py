"""Seconds from start to health SERVING of ``logitserve serve`` with default flags (plus any given),
its Triton cache in a fresh directory, or in ``$CACHE`` when set (a kept cache: a restart).

    python -m bench.cold_start [--compile-processes 0 ...]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

from .servers import ServerSpec, running, serve_argv


def main(argv: list[str] | None = None) -> int:
    flags = sys.argv[1:] if argv is None else argv
    cache = os.environ.get("CACHE") or tempfile.mkdtemp(prefix="triton-cold-")
    env = {**os.environ, "TRITON_CACHE_DIR": cache}
    start = time.monotonic()
    with running(ServerSpec("cold", serve_argv(*flags), env=env), 900):
        print(f"SERVING after {time.monotonic() - start:.1f} s with flags {flags}, Triton cache {cache}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
