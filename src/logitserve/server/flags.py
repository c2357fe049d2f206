"""The flags of ``logitserve serve``: each one's type, default (ServerConfig's) and help, in one
table that the parser (cli.py), its environment variables (``LOGITSERVE_*``) and README.md's flag
table (flag_table.py) are all made from."""

from __future__ import annotations

import argparse

from .config import LOG_LEVELS, ServerConfig

ENV_PREFIX = "LOGITSERVE_"


def _width_list(text: str) -> tuple[int, ...] | None:
    if text.strip().lower() == "auto":
        return None
    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: must be 'auto' or comma-separated integers") from None


def _auto_int(text: str) -> int | None:
    if text.strip().lower() == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: must be 'auto' or an integer") from None


def _name_list(text: str) -> tuple[str, ...]:
    """Comma-separated entries (``--devices``, ``--warmup-dtypes``); "none" or "" for none. Which
    entries are valid is ServerConfig's rule, named by its error."""
    if text.strip().lower() in ("", "none"):
        return ()
    return tuple(s.strip() for s in text.split(",") if s.strip())


def _switch(text: str) -> bool:
    value = text.strip().lower()
    if value in ("on", "true", "1", "yes"):
        return True
    if value in ("off", "false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r}: must be on or off")


# (flag, type, ServerConfig field default, help). Defaults come from ServerConfig, so the
# dataclass stays the one place they are written.
_D = ServerConfig()
FLAGS = (
    ("--host", str, _D.host, "address to listen on"),
    ("--port", int, _D.port, "port to listen on (0 picks a free one; the listening log line says which)"),
    ("--device", str, None, "the torch device the kernels run on: cuda:N or cpu (unset: cuda:0 where torch sees a "
     "GPU, else cpu)"),
    ("--devices", _name_list, "none", "one server process per GPU: all (every GPU torch sees) or cuda:0,cuda:1,...; "
     "the i-th listens on --port + i (--port 0: free ports) and serves metrics on --metrics-port + i; GetServerInfo "
     "lists every process, and the Python client sends each call to the process of its tensors' GPU. Not with "
     "--device or --workers > 1 (none: one process, on --device)"),
    ("--device-endpoints", _name_list, "none", "internal, set by --devices for its processes: every device's "
     "process as device=host:port,... (GetServerInfo's device_endpoints)"),
    ("--backend", str, _D.backend, "kernel backend: auto (triton on CUDA, torch on CPU), triton, interpret, torch"),
    ("--cuda-graphs", _switch, "on" if _D.cuda_graphs else "off", "replay Sample and RouteExperts launches from CUDA "
     "graphs, one per power-of-two batch size (CUDA with triton; off: launch eagerly)"),
    ("--max-batch-rows", int, _D.max_batch_rows, "most rows the batcher puts into one launch"),
    ("--max-delay-us", int, _D.max_delay_us, "longest a call waits for others to join its launch while the device "
     "is idle (us; 0: launch at once)"),
    ("--max-queue", int, _D.max_queue, "calls waiting for a launch; past it, new ones get RESOURCE_EXHAUSTED at "
     "once"),
    ("--max-message-bytes", int, _D.max_message_bytes, "largest request or response message (gRPC's own limit: "
     "RESOURCE_EXHAUSTED past it; at most 2147483647)"),
    ("--max-vocab", int, _D.max_vocab, "widest row (vocabulary, experts, softmax width) in a request"),
    ("--max-rows", int, _D.max_rows, "most rows in a request"),
    ("--warmup-dtypes", _name_list, ",".join(_D.warmup_dtypes), "comma-separated dtypes whose kernels are compiled "
     "before SERVING (none for none)"),
    ("--warmup-widths", _width_list, "auto", "comma-separated row widths (vocabularies) compiled before SERVING "
     "(auto: 32000,128256,151936 with triton, 64 otherwise); a width not warmed compiles during its first calls"),
    ("--compile-processes", _auto_int, "auto", "processes compiling warm-up's kernels side by side before SERVING "
     "(auto: one per dtype and width, a core left over; 0: the server alone)"),
    ("--compile-cache-dir", str, None, "Triton's compiled-kernel cache (TRITON_CACHE_DIR; default ~/.triton/cache): "
     "keep it across restarts, e.g. on a volume, and warm-up loads instead of compiling"),
    ("--tls-cert", str, None, "PEM certificate chain: serve TLS (with --tls-key)"),
    ("--tls-key", str, None, "PEM private key of --tls-cert"),
    ("--tls-client-ca", str, None, "PEM CA bundle: require client certificates it signed (mutual TLS)"),
    ("--auth-token-file", str, None, "file of bearer tokens, one per line (# comments; re-read on SIGHUP): every RPC "
     "but health needs the header authorization: Bearer TOKEN"),
    ("--workers", int, _D.workers, "server processes sharing the port (SO_REUSEPORT), each with its own event loop, "
     "batcher and CUDA context; one Python process's event loop is the service's limit (docs/PERFORMANCE.md)"),
    ("--reuse-port", _switch, "on" if _D.reuse_port else "off",
     "let other processes bind the same port (set by --workers for its processes)"),
    ("--metrics-port", int, _D.metrics_port, "Prometheus /metrics port, worker i of --workers on this port + i (0: "
     "off): requests, failures by code, latency and queue-time histograms, rows and calls per launch, launches, "
     "queue depth, cached plans, the device (logitserve_device_info{device})"),
    ("--metrics-host", str, _D.metrics_host, "address /metrics listens on (no token needed there: loopback "
     "unless a scraper elsewhere needs it)"),
    ("--busy-poll-us", int, _D.busy_poll_us, "how long the event loop polls for the next call before it sleeps, "
     "while one client calls one call after another (us; a core busy while its calls keep coming; 0: it sleeps at "
     "once); 100-200 us off a lone call's p50 on the H100 host (docs/PERFORMANCE.md)"),
    ("--max-regions", int, _D.max_regions, "shared-memory regions (SharedMemory service) mapped at once, all clients "
     "together; past it, registering answers RESOURCE_EXHAUSTED (0: none)"),
    ("--max-region-bytes", int, _D.max_region_bytes, "bytes of shared-memory regions mapped at once, all clients "
     "together (system: the length mapped; CUDA: offset + size); on a CUDA server system regions are page-locked "
     "where mapped, so this also bounds the host memory clients can lock"),
    ("--shm-key-scope", str, _D.shm_key_scope, "which POSIX shared-memory objects a client may register: token, only "
     "keys that start with its bearer token's prefix (logitserve.client.keys.key_prefix(token)), so no token maps "
     "another's memory; any, any object the server's user can open (every client trusted alike); auto: token with "
     "--auth-token-file, else any (docs/SERVICE.md, 'Who can reach which memory')"),
    ("--max-held-answer-bytes", int, _D.max_held_answer_bytes, "bytes of answers held for calls not finished "
     "(computing, or sent to a client that does not read them), all connections together; past it RESOURCE_EXHAUSTED "
     "before the work. Memory held is about twice this (the answer's bytes and gRPC's copy)"),
    ("--max-held-answer-bytes-per-connection", int, _D.max_held_answer_bytes_per_connection, "the same as "
     "--max-held-answer-bytes, for one connection's calls"),
    ("--max-streams-per-connection", int, _D.max_streams_per_connection, "calls (HTTP/2 streams) open at once on "
     "one connection (gRPC's grpc.max_concurrent_streams)"),
    ("--max-connections", int, _D.max_connections, "client connections open at once; newer ones are closed at once "
     "(gRPC's grpc.max_allowed_incoming_connections)"),
    ("--max-sequences", int, _D.max_sequences, "sequences (OpenSequences: sampling state the server keeps, Sample by "
     "sequence_ids) open at once, all clients together; past it, opening answers RESOURCE_EXHAUSTED (0: none)"),
    ("--sequence-idle-s", float, _D.sequence_idle_s, "a sequence no call names for this long is closed (seconds); "
     "a later call naming it answers NOT_FOUND"),
    ("--max-sequence-bytes", int, _D.max_sequence_bytes, "bytes the open sequences' buffers hold (lists, outputs' "
     "room, last answers), all clients together; past it an open, update or output's growth is RESOURCE_EXHAUSTED"),
    ("--channels", _switch, "on" if _D.channels else "off", "same-host channels (OpenChannel, Client(..., "
     "channel=\"shm\")): calls through shared memory (iceoryx2) instead of gRPC (on, off; off: OpenChannel answers "
     "FAILED_PRECONDITION)"),
    ("--max-channels", int, _D.max_channels, "same-host channels open at once, all clients together (each about 1.6 "
     "MB of /dev/shm at 32; with tokens, one token holds at most its --token-share); past it OpenChannel is "
     "RESOURCE_EXHAUSTED and the client calls over gRPC"),
    ("--channel-idle-s", float, _D.channel_idle_s, "a channel without a call for this long is closed (seconds; its "
     "client opens a new one at its next call)"),
    ("--max-ordered-sessions", int, _D.max_ordered_sessions, "stream-ordered sessions (OrderedSession) open at "
     "once, all clients together (each a 2 MiB marks allocation and a CUDA stream; with tokens, one token holds at "
     "most its --token-share; 0: none); past it OrderedSession is RESOURCE_EXHAUSTED"),
    ("--ordered-wait-s", float, _D.ordered_wait_s, "the most a stream-ordered step waits on the GPU for its client's "
     "ready mark (seconds); past it the session ends and its waits are released"),
    ("--token-share", float, _D.token_share, "with --auth-token-file, the share of each server-wide bound "
     "(channels, sequences and their bytes, regions and their bytes, held answers, ordered sessions) one token may "
     "hold"),
    ("--grace-period-s", float, _D.grace_period_s, "on SIGTERM, how long in-flight calls get to finish (seconds; "
     "health NOT_SERVING meanwhile); calls still running then end UNAVAILABLE and the process exits within 3 s more"),
    ("--log-level", str.lower, _D.log_level, f"one of {', '.join(LOG_LEVELS)}, any case (debug adds a line per RPC "
     "and per warm-up case)"),
)


def env_name(flag: str) -> str:
    return ENV_PREFIX + field_name(flag).upper()


def field_name(flag: str) -> str:
    """The ServerConfig field a flag sets (``--max-rows``: ``max_rows``)."""
    return flag.lstrip("-").replace("-", "_")


def shown_default(default) -> str:
    """A flag's default as ``--help`` and README.md's table show it (600.0 as 600, None as unset)."""
    if default is None:
        return "unset"
    return format(default, "g") if isinstance(default, float) else str(default)
