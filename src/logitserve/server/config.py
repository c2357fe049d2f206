"""The server's configuration: one frozen dataclass, filled by cli.py or by tests directly."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

DEFAULT_PORT = 50051
FLOAT_DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64")
LOG_LEVELS = ("debug", "info", "warning", "error")
SHM_KEY_SCOPES = ("auto", "token", "any")


def address(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets (``[::]:50052``): what gRPC binds and clients dial."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def default_device() -> str:
    """``cuda:0`` where torch sees a GPU, else ``cpu``."""
    import torch

    return "cuda:0" if torch.cuda.is_available() else "cpu"


def _is_cuda_device(name: str) -> bool:
    """``name`` is ``cuda:N`` as torch writes it (no leading zeros, no spaces)."""
    kind, _, index = name.partition(":")
    return kind == "cuda" and index.isdigit() and str(int(index)) == index


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``logitserve serve`` can be told; every field is also a flag (cli.py)."""

    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT
    # Torch device the kernels run on; None picks default_device().
    device: str | None = None
    # One server process per device (server/devices.py): ("all",) for every GPU torch sees, or
    # ("cuda:0", "cuda:1", ...); process i listens on port + i, metrics on metrics_port + i.
    # (): one process, on ``device``.
    devices: tuple[str, ...] = ()
    # Internal, what devices gives each of its processes: every device's process as
    # "device=host:port", in device order, answered in GetServerInfo (device_endpoints).
    device_endpoints: tuple[str, ...] = ()
    # "auto" is triton on CUDA and the torch reference on the CPU.
    backend: str = "auto"
    # Replay Sample and RouteExperts launches from CUDA graphs, one per op key and power-of-two
    # batch size (server/engine/graphs.py); False launches every batch eagerly. CUDA with triton only.
    cuda_graphs: bool = True
    # Dynamic batching: most rows in one launch, and the longest a request waits for others
    # while the device is idle. 0 launches at once when the device is free, and calls that
    # arrive during a launch share the next one: batches grow with load and a lone call pays
    # no delay (asyncio cannot time waits under ~1 ms here, so 200 us cost 1.2 ms a call).
    max_batch_rows: int = 256
    max_delay_us: int = 0
    # Requests waiting for a launch; beyond it calls get RESOURCE_EXHAUSTED at once.
    max_queue: int = 1024
    # Largest request or response message (gRPC's own limit, RESOURCE_EXHAUSTED beyond it).
    # 256 MiB holds 256 rows of a 151936-token vocabulary in float32 (155 MB).
    max_message_bytes: int = 256 * 1024 * 1024
    # Widest row (vocabulary, experts, softmax width) and most rows in one request.
    max_vocab: int = 262144
    max_rows: int = 4096
    # Dtypes whose kernels are compiled before the server reports SERVING.
    warmup_dtypes: tuple[str, ...] = ("float16", "bfloat16", "float32")
    # Row widths (vocabularies) warm-up compiles for: kernels specialise on the width, so a
    # width served but not warmed compiles during its first calls (seconds each). None: the
    # backend's own list (server/engine/device.py: Llama 2, Llama 3 and Qwen 2 vocabularies on triton).
    warmup_widths: tuple[int, ...] | None = None
    # Processes that compile warm-up's kernels side by side before the server's own warm-up
    # (server/precompile.py; Triton backend only). None: one per (dtype, width), a core left
    # over; 0 or 1: the server compiles alone.
    compile_processes: int | None = None
    # Triton's on-disk cache of compiled kernels (TRITON_CACHE_DIR; None: Triton's default,
    # ~/.triton/cache): a directory kept across restarts (a container volume) makes warm-up a load.
    compile_cache_dir: str | None = None
    # TLS: server certificate chain and key (PEM files); with a client CA, clients must present
    # a certificate it signed (mutual TLS).
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    # One bearer token per line; every RPC but health needs `authorization: Bearer <token>`.
    auth_token_file: str | None = None
    # Server processes sharing the port (SO_REUSEPORT; the kernel spreads connections over them),
    # each with its own event loop, batcher and CUDA context: one process's event loop, not the
    # GPU, limits its throughput.
    workers: int = 1
    # Let other processes bind the same port (what --workers sets for its processes).
    reuse_port: bool = False
    # Prometheus metrics over HTTP on this port (worker i of --workers: this port + i); 0 turns them off.
    metrics_port: int = 0
    # Address /metrics listens on: loopback unless asked (it needs no token).
    metrics_host: str = "127.0.0.1"
    # How long the event loop polls for the next call before it sleeps, in us (server/engine/busy_poll.py);
    # 0: it sleeps at once. Only while the server serves a lone client (no overlapping calls for
    # 50 ms), so a loaded server sleeps as before.
    busy_poll_us: int = 2000
    # Shared-memory regions (the SharedMemory service): most regions mapped at once, all owners
    # together, and their bytes (system: the length mapped; CUDA: offset + byte_size). 0 regions
    # turns registration off (RESOURCE_EXHAUSTED).
    max_regions: int = 256
    max_region_bytes: int = 16 << 30
    # Which POSIX shared-memory objects a caller may register (server/regions/names.py): "token",
    # only keys with its bearer token's prefix; "any", any object this server's user can open
    # (every client trusted alike); "auto": token when --auth-token-file is set, else any.
    shm_key_scope: str = "auto"
    # Bytes of answers held for calls not yet finished (computing, or sent to a client that does
    # not read them), all connections together and per connection (server/api/held.py); past
    # either, RESOURCE_EXHAUSTED before the work.
    max_held_answer_bytes: int = 2 << 30
    max_held_answer_bytes_per_connection: int = 512 << 20
    # HTTP/2 streams (calls) open at once on one connection (gRPC's grpc.max_concurrent_streams),
    # and connections at once (grpc.max_allowed_incoming_connections; beyond it new ones are
    # closed at once).
    max_streams_per_connection: int = 100
    max_connections: int = 512
    # Sequences (OpenSequences; server/sequences/table.py): most open at once, all callers together
    # (0 turns them off), and how long one no call names stays open. Each holds its lists on the
    # device, 8 bytes a token id (prompt, output, bias, banned, stop).
    max_sequences: int = 4096
    sequence_idle_s: float = 600.0
    # Bytes the open sequences' buffers hold, all callers together (server/sequences/bounds.py):
    # their lists, their outputs' whole room, their last answers. Past it an open, an update or
    # an output's growth is RESOURCE_EXHAUSTED.
    max_sequence_bytes: int = 2 << 30
    # Same-host channels (OpenChannel; server/api/channel/): calls through shared memory (iceoryx2)
    # instead of gRPC. Most open at once, all callers together, and how long one without a call
    # stays open. Off, or without iceoryx2 installed, OpenChannel is FAILED_PRECONDITION.
    channels: bool = True
    max_channels: int = 32
    channel_idle_s: float = 600.0
    # Stream-ordered sessions (OrderedSession; server/ordered/): most open at once, all callers
    # together (each holds a 2 MiB marks allocation and a CUDA stream; 0: none), and the most a
    # step may wait on the GPU for its caller's ready mark before its session ends (a client that
    # died or stalls then holds nothing of the server's longer).
    max_ordered_sessions: int = 16
    ordered_wait_s: float = 5.0
    # With bearer tokens on (--auth-token-file), the share of each server-wide bound a tenant can
    # fill (channels, sequences and their bytes, regions and region bytes, held answers) that one
    # token may hold (server/tenancy.py). Without tokens every caller is one identity (the
    # authorization header is only hashed, so identities can be invented): the global bounds alone.
    token_share: float = 0.5
    # On SIGTERM, in-flight calls get this long to finish.
    grace_period_s: float = 10.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port: must be in [0, 65535] (0 = off), got {self.metrics_port}")
        for name in ("max_batch_rows", "max_queue", "max_message_bytes", "max_vocab", "max_rows", "workers",
                     "max_held_answer_bytes", "max_held_answer_bytes_per_connection", "max_streams_per_connection",
                     "max_connections", "max_channels"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_delay_us < 0:
            raise ValueError(f"max_delay_us: must be >= 0, got {self.max_delay_us}")
        if self.max_message_bytes > 2**31 - 1:
            raise ValueError(f"max_message_bytes: gRPC's limit is 2147483647, got {self.max_message_bytes}")
        if self.max_regions < 0:
            raise ValueError(f"max_regions: must be >= 0 (0: no regions), got {self.max_regions}")
        if self.max_region_bytes < 0:
            raise ValueError(f"max_region_bytes: must be >= 0, got {self.max_region_bytes}")
        if self.shm_key_scope not in SHM_KEY_SCOPES:
            raise ValueError(f"shm_key_scope: must be one of {', '.join(SHM_KEY_SCOPES)}, got {self.shm_key_scope!r}")
        if self.max_sequences < 0:
            raise ValueError(f"max_sequences: must be >= 0 (0: no sequences), got {self.max_sequences}")
        if self.max_sequence_bytes < 0:
            raise ValueError(f"max_sequence_bytes: must be >= 0, got {self.max_sequence_bytes}")
        if self.max_ordered_sessions < 0:
            raise ValueError(f"max_ordered_sessions: must be >= 0 (0: none), got {self.max_ordered_sessions}")
        for name in ("sequence_idle_s", "channel_idle_s", "ordered_wait_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name}: must be a finite number > 0, got {getattr(self, name)}")
        if not (math.isfinite(self.token_share) and 0 < self.token_share <= 1):
            raise ValueError(f"token_share: must be in (0, 1], got {self.token_share}")
        if self.busy_poll_us < 0:
            raise ValueError(f"busy_poll_us: must be >= 0 (0: off), got {self.busy_poll_us}")
        if not (math.isfinite(self.grace_period_s) and self.grace_period_s >= 0):
            raise ValueError(f"grace_period_s: must be a finite number >= 0, got {self.grace_period_s}")
        if self.backend not in ("auto", "triton", "interpret", "torch"):
            raise ValueError(f"backend: must be one of auto, triton, interpret, torch, got {self.backend!r}")
        if self.device is not None and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device: must be 'cpu' or 'cuda:N', got {self.device!r}")
        self._check_devices()
        unknown = [d for d in self.warmup_dtypes if d not in FLOAT_DTYPE_NAMES]
        if unknown:
            raise ValueError(f"warmup_dtypes: {unknown} not in {', '.join(FLOAT_DTYPE_NAMES)}")
        if self.compile_processes is not None and self.compile_processes < 0:
            raise ValueError(f"compile_processes: must be >= 0 (or auto), got {self.compile_processes}")
        if self.warmup_widths is not None and not all(1 <= w <= self.max_vocab for w in self.warmup_widths):
            raise ValueError(f"warmup_widths: each must be in [1, max_vocab = {self.max_vocab}], "
                             f"got {list(self.warmup_widths)}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key: give both or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca: needs tls_cert and tls_key (mutual TLS is TLS first)")
        object.__setattr__(self, "log_level", self.log_level.lower())  # DEBUG is debug
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level: must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")

    def _check_devices(self) -> None:
        """``devices`` and ``device_endpoints``: their form, and what they cannot go with."""
        if self.devices:
            if self.devices != ("all",):
                bad = [d for d in self.devices if not _is_cuda_device(d)]
                if bad:
                    raise ValueError(f"devices: must be 'all' or cuda:N entries (cuda:0,cuda:1), got {bad}")
                if len(set(self.devices)) != len(self.devices):
                    raise ValueError(f"devices: each device once, got {list(self.devices)}")
            if self.device is not None:
                raise ValueError(f"devices: not with --device {self.device}: --devices starts one process per "
                                 f"device, each on its own --device")
            if self.workers > 1:
                raise ValueError(f"devices: not with --workers {self.workers}: each device gets one process (for "
                                 f"more processes on a GPU, run a --workers server per GPU with --device)")
            if self.device_endpoints:
                raise ValueError("devices: not with device_endpoints (set by --devices for its own processes)")
            last = len(self.devices) - 1 if self.devices != ("all",) else 0
            for name, port in (("port", self.port), ("metrics_port", self.metrics_port)):
                if port and port + last > 65535:
                    raise ValueError(f"{name}: {port} + {last} (one port per device) is past 65535")
        for entry in self.device_endpoints:
            device, sep, address = entry.partition("=")
            if not sep or not (device == "cpu" or _is_cuda_device(device)) or ":" not in address:
                raise ValueError(f"device_endpoints: each must be device=host:port (cuda:1=10.0.0.5:50052), "
                                 f"got {entry!r}")

    @property
    def endpoints(self) -> list[tuple[str, str]]:
        """``device_endpoints`` as ``(device, address)`` pairs."""
        return [tuple(entry.split("=", 1)) for entry in self.device_endpoints]

    @property
    def resolved_shm_key_scope(self) -> str:
        """``shm_key_scope`` with "auto" decided: token-scoped keys wherever tokens are on."""
        if self.shm_key_scope != "auto":
            return self.shm_key_scope
        return "token" if self.auth_token_file else "any"

    def replace(self, **changes) -> "ServerConfig":
        return dataclasses.replace(self, **changes)

    def to_argv(self) -> list[str]:
        """``logitserve serve`` arguments that parse back to this config (each field is the flag
        ``--<field-with-dashes>``)."""
        argv = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, bool):
                value = "on" if value else "off"
            elif isinstance(value, tuple):
                value = ",".join(map(str, value)) or "none"
            argv += ["--" + f.name.replace("_", "-"), str(value)]
        return argv

    @property
    def resolved_device(self) -> str:
        return self.device if self.device is not None else default_device()
