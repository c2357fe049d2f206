"""``logitserve serve --devices all|cuda:0,cuda:1,...``: one server process per GPU.

A host whose GPUs each run an engine (data parallel) needs a sampler on every GPU, reached
through CUDA IPC on that GPU: a region's memory opens only on its own device. This supervisor
starts one ordinary ``logitserve serve --device cuda:i`` process per device, each with its own
CUDA context, batcher, graphs and regions: the i-th listed listens on ``--port`` + i and serves
metrics on ``--metrics-port`` + i (``--port 0``: free ports, picked and held here, bound and
not listening, until the processes bind them). Each process is told every process's address
(``--device-endpoints``) and answers it in GetServerInfo (``device_endpoints``), so that a
client sends each call to the process of its tensors' device (client/devices.py).

An address is ``--host`` and the port. Bound to every address of the host (``--host 0.0.0.0``
or ``::``), it is written so (``0.0.0.0:50052``, ``[::]:50052``), and a client reads it as the
host it dialled with that port.

Supervision is :func:`~.workers.supervise`'s: signals passed on, one process that exits stops
the others, the supervisor exits with its code.
"""

from __future__ import annotations

import logging

from .config import ServerConfig, address
from .logs import get_logger, log_event
from .workers import reserve_port, start_server, supervise

log = get_logger("devices")


def resolve_devices(devices: tuple[str, ...]) -> list[str]:
    """``--devices`` as the list of torch devices: ``all`` is every GPU torch sees here; a listed
    GPU must be one of them. ``ValueError`` naming ``--devices`` otherwise."""
    import torch

    count = torch.cuda.device_count()
    seen = f"cuda:0 to cuda:{count - 1}" if count else "none: no GPU, or CUDA_VISIBLE_DEVICES hides them"
    if devices == ("all",):
        if count == 0:
            raise ValueError(f"--devices all: torch sees no CUDA device on this host ({seen})")
        return [f"cuda:{i}" for i in range(count)]
    missing = [d for d in devices if int(d.split(":")[1]) >= count]
    if missing:
        raise ValueError(f"--devices: {', '.join(missing)} not among the CUDA devices torch sees here ({seen})")
    return list(devices)


def run_devices(config: ServerConfig, devices: list[str] | None = None) -> int:
    """Start a process per device of ``config.devices`` (or of ``devices``, already resolved:
    a test's CPU processes) and supervise them; the supervisor's exit code."""
    try:
        devices = resolve_devices(config.devices) if devices is None else devices
        last = len(devices) - 1
        for flag, port in (("--port", config.port), ("--metrics-port", config.metrics_port)):
            if port and port + last > 65535:
                raise ValueError(f"{flag}: {port} + {last} (one port per device) is past 65535")
    except ValueError as exc:
        log_event(log, "failed to start", level=logging.ERROR, error=str(exc))
        return 2
    reserved = []
    try:
        for i in range(len(devices)):
            port = config.port + i if config.port else 0
            try:
                reserved.append(reserve_port(config.host, port))
            except OSError as exc:
                log_event(log, "failed to start", level=logging.ERROR,
                          error=f"--port {config.port}: port {port} of {devices[i]}: {exc}")
                return 2
        ports = [sock.getsockname()[1] for sock in reserved]
        endpoints = tuple(f"{d}={address(config.host, p)}" for d, p in zip(devices, ports))
        processes = [start_server(config.replace(devices=(), device=device, port=port, reuse_port=True,
                                                 metrics_port=config.metrics_port + i if config.metrics_port else 0,
                                                 device_endpoints=endpoints), i)
                     for i, (device, port) in enumerate(zip(devices, ports))]
        log_event(log, "devices started", endpoints=list(endpoints), pids=[p.pid for p in processes])
        return supervise(processes, log, "device")
    finally:
        for sock in reserved:
            sock.close()
