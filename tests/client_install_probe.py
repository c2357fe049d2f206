"""Run by tests/test_client_install.py with the python of a client-only virtual environment (no
torch): imports ``logitserve.client`` with warnings as errors, calls a server, and writes what it
got for the test to check against this checkout's own client.

    python -I -W error client_install_probe.py TARGET IN.npz OUT.npz

IN.npz holds ``logits`` (float32 [B, V]), ``seeds`` (int64 [B]) and ``gate`` (float32 [N, E]).
OUT.npz gets the answers (``sampled``, ``greedy``, ``greedy_async`` from AsyncClient, ``weights``,
``indices``, ``shm_tokens``) and ``report``, a JSON string: where the client was imported from,
what logitserve and grpcio require, the regions the server listed, whether torch can be imported.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import json
import sys

import numpy as np

from logitserve.client import AsyncClient, Client, regions

SAMPLE = {"temperature": 0.8, "top_k": 20, "top_p": 0.9}  # as the test's


def requires(name: str) -> list[str]:
    """The requirements of the installed distribution ``name``, its extras' left out."""
    return [r for r in importlib.metadata.requires(name) or () if "extra ==" not in r]


async def greedy_async(target: str, logits: np.ndarray) -> np.ndarray:
    async with AsyncClient(target, timeout=60) as client:
        return (await client.sample(logits, temperature=0)).token_ids


def main(target: str, in_path: str, out_path: str) -> None:
    given = np.load(in_path)
    logits, seeds, gate = given["logits"], given["seeds"], given["gate"]
    got = {}
    with Client(target, timeout=60) as client:
        got["sampled"] = client.sample(logits, seed=seeds, **SAMPLE).token_ids
        got["greedy"] = client.sample(logits, temperature=0).token_ids
        got["weights"], got["indices"] = client.route_experts(gate, 2, True)
        # Logits and the sampled tokens both in POSIX shared memory, registered by this client.
        with regions.shared_array(logits.shape, "float32") as inputs, regions.shared_array((64,), "uint8") as outputs:
            inputs.array[:] = logits
            client.register("logits", inputs)
            client.register("tokens", outputs)
            listed = sorted(r.name for r in client.shared_memory_status())
            slot = outputs.array[:8 * len(logits)].view(np.int64)
            result = client.sample(inputs.array, seed=seeds, **SAMPLE, out={"token_ids": slot})
            assert result.token_ids is slot, "out=: the result is not the registered slot"
            got["shm_tokens"] = np.array(slot)
            client.unregister()
            del slot, result
    got["greedy_async"] = asyncio.run(greedy_async(target, logits))
    report = {
        "client_file": sys.modules["logitserve.client"].__file__,
        "requires": {name: requires(name) for name in ("logitserve", "grpcio")},
        "regions": listed,
        "torch_importable": importlib.util.find_spec("torch") is not None,
        "torch_imported": "torch" in sys.modules,
    }
    np.savez(out_path, report=json.dumps(report), **got)


if __name__ == "__main__":
    main(*sys.argv[1:])
