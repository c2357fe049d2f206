"""logitserve's gRPC server: ``logitserve serve`` (cli.py), or in-process via :func:`create_server`.

Modules, one concern each: config (the settings), cli (flags and environment), device (a device
handle and its launch thread), graphs (launches replayed from CUDA graphs), staging (inputs to
the device in one copy), tensors (Tensor messages <-> torch), ops (validated calls and their
batched launches), batcher (dynamic batching), servicer (the RPC handlers), guard (each
handler's status codes, logs, metrics, auth), auth (tokens), metrics (Prometheus), logs (JSON
lines), app (wiring, health, reflection, TLS, drain).
"""

from __future__ import annotations

import importlib.metadata

try:
    __version__ = importlib.metadata.version("logitserve")
except importlib.metadata.PackageNotFoundError:  # a checkout on PYTHONPATH (scripts/device_env.sh)
    __version__ = "0.0.0+checkout"

from .app import Service, create_server  # noqa: E402
from .config import ServerConfig  # noqa: E402

__all__ = ["ServerConfig", "Service", "__version__", "create_server"]
