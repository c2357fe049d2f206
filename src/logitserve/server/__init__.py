"""logitserve's gRPC server: ``logitserve serve`` (cli.py), or in-process via :func:`create_server`.

Its layers, top first (docs/DESIGN.md states the rules; tests/test_layers.py checks them): the
entry points here (app: the wiring, health, reflection, TLS, drain; cli: flags and environment;
workers and devices: several processes; process and testing: a server in a child process or on
a background loop; precompile: warm-up compiled side by side); the front doors in ``api/`` (the
LogitServe servicer, KServe, same-host channels, reflection, and the guard every handler goes
through); server-held sequences in ``sequences/``; the operators' calls in ``ops/``; the
machinery in ``engine/`` (device handle, batcher, CUDA graphs, staging, the busy-polling loop);
tensors (Tensor messages to tensors, a region's slice included); shared-memory regions in
``regions/``; and the shared modules (config, errors, identity, logs, metrics, tenancy, version,
wire).
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
