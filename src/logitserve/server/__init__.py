"""logitserve's gRPC server: ``logitserve serve`` (cli.py), or in-process via :func:`create_server`.

Modules, one concern each, bottom-up: config (the settings), tensors and wire (Tensor messages
and requests read in place), errors, logs, staging (inputs to the device in one copy), graphs
(launches replayed from CUDA graphs), device (a device handle, its launch thread, the one way a
batch is launched), ops (validated calls and their batched launches), batcher (dynamic
batching, and how a launch waits), occupancy (calls in the server), busy_poll (the lone-client
event loop), guard (each handler's status codes, logs, metrics, auth), auth (tokens), metrics
(Prometheus), servicer (the RPC handlers), app (wiring, health, reflection, TLS, drain), cli
(flags and environment) and workers (``--workers``). The contract they keep is in
docs/DESIGN.md.
"""

from __future__ import annotations

from .config import ServerConfig
from .version import __version__

__all__ = ["ServerConfig", "Service", "__version__", "create_server"]


def __getattr__(name: str):
    """``Service`` and ``create_server`` import the app (and torch) when first used: ``logitserve
    --help`` and ``logitserve version`` need neither."""
    if name in ("Service", "create_server"):
        from . import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
