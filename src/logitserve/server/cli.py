"""``logitserve serve``: flags, each also read from a ``LOGITSERVE_*`` environment variable.

A flag on the command line wins over its variable (``--max-delay-us`` over
``LOGITSERVE_MAX_DELAY_US``), which wins over the default. SIGTERM or SIGINT drains (health
NOT_SERVING, new calls UNAVAILABLE, in-flight calls get ``--grace-period-s``) and exits 0;
SIGHUP re-reads ``--auth-token-file``.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import logging
import os
import re
import signal
import sys
from typing import NoReturn

from .engine.busy_poll import event_loop_factory
from .config import LOG_LEVELS, ServerConfig, default_device
from .logs import WORKER_ENV, configure, get_logger, log_event
from .version import __version__

log = get_logger("cli")
ENV_PREFIX = "LOGITSERVE_"
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def _warn_if_open(config: ServerConfig) -> None:
    """A warning when anyone who can reach the address may call: not loopback, no TLS, no tokens."""
    if config.host not in _LOOPBACK and not config.host.startswith("127.") and config.tls_cert is None \
            and config.auth_token_file is None:
        log_event(log, "serving without TLS or tokens on a non-loopback address", level=logging.WARNING,
                  host=config.host, port=config.port,
                  fix="--auth-token-file and --tls-cert/--tls-key, or --host 127.0.0.1 behind a proxy")


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
     "MB of /dev/shm at 32); past it RESOURCE_EXHAUSTED"),
    ("--channel-idle-s", float, _D.channel_idle_s, "a channel without a call for this long is closed (seconds; its "
     "client opens a new one at its next call)"),
    ("--token-share", float, _D.token_share, "with --auth-token-file, the share of each server-wide bound "
     "(channels, sequences and their bytes, regions and their bytes, held answers) one token may hold"),
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


class _BadVariable(ValueError):
    """An environment variable whose value its flag's type refuses (argparse would name the flag)."""


def _from_environment(env: str, flag: str, kind, value: str):
    """``value`` of variable ``env`` as flag ``flag`` parses it, or :class:`_BadVariable` naming the
    variable (and, for a Kubernetes service link, why it is there)."""
    try:
        return kind(value)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        hint = ""
        if value.startswith(("tcp://", "udp://")):
            hint = (" (a Kubernetes Service named logitserve sets it in every pod of its namespace: set "
                    "enableServiceLinks: false in the pod spec, or name the Service otherwise)")
        raise _BadVariable(f"{env} ({flag}): {value!r} is not a valid value: {exc}{hint}") from None


def build_parsers(environ=os.environ, given: frozenset = frozenset()) -> tuple[argparse.ArgumentParser,
                                                                                argparse.ArgumentParser]:
    """The command line and its ``serve`` sub-command (whose ``error`` prints serve's usage).
    ``_BadVariable`` for an environment variable its flag refuses, unless the flag is among those
    ``given`` on the command line (which win over the variable)."""
    parser = argparse.ArgumentParser(prog="logitserve", description="logitserve: sampling, MoE routing and "
                                     "softmax kernels over gRPC")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the gRPC server",
                                description="Run the gRPC server. Every flag can also be set by the environment "
                                            "variable named after it (shown in brackets).")
    for flag, kind, default, text in FLAGS:
        env = env_name(flag)
        # A variable is parsed here, by its flag's type (argparse would run it on a string default
        # too, but its error would name the flag, not the variable).
        value = default if env not in environ or flag in given else _from_environment(env, flag, kind,
                                                                                       environ[env])
        serve.add_argument(flag, type=kind, default=value, help=f"{text} [{env}; default: {shown_default(default)}]")
    commands.add_parser("version", help="print the version")
    return parser, serve


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The parsed flags as a ServerConfig, which checks their rules (ValueError)."""
    return ServerConfig(**{field_name(flag): getattr(args, field_name(flag)) for flag, *_ in FLAGS})


async def serve(config: ServerConfig) -> int:
    """Run until SIGTERM / SIGINT, then drain; 0 on a clean stop, 1 if warm-up failed."""
    from .app import create_server

    service, _port = create_server(config)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, service.reload_tokens)
    await service.start()
    warm = asyncio.create_task(service.warm_up())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({warm, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if warm.done() and warm.exception() is not None:
        log_event(log, "warm-up failed", exc_info=warm.exception())
        stopping.cancel()
        await service.stop(0)
        return 1
    await stopping
    log_event(log, "signal received, draining")
    await service.stop(config.grace_period_s)
    if not warm.done():
        warm.cancel()
    if service.launch_abandoned:
        # The launch thread would hold the interpreter's exit until it ends (a CPU launch can take
        # minutes): leave now, as promised (grace + a stated bound).
        for handler in logging.getLogger("logitserve").handlers:
            handler.flush()
        os._exit(0)
    return 0


def _given(argv: list[str]) -> frozenset[str]:
    """The flags on the command line (``--port 1`` and ``--port=1`` alike)."""
    return frozenset(a.split("=", 1)[0] for a in argv if a.startswith("--"))


def _source(flag: str, argv: list[str], environ) -> str:
    """``flag`` as the user set it: the flag, or ``LOGITSERVE_X (--x)`` where the value came from
    the environment variable and not the command line."""
    env = env_name(flag)
    return f"{env} ({flag})" if flag not in _given(argv) and env in environ else flag


def _in_flag_names(message: str, argv: list[str], environ) -> str:
    """A ServerConfig error with its field names as the flags (``max_rows`` -> ``--max-rows``), or
    as the environment variable where the value came from there and not from the command line."""
    def name(match: re.Match) -> str:
        return _source("--" + match.group(0).replace("_", "-"), argv, environ)
    fields = sorted((field_name(flag) for flag, *_ in FLAGS), key=len, reverse=True)
    head, sep, rest = message.partition(":")
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, fields)) + r")\b")
    # the field names before the colon (the subject); in the text only those with an underscore
    underscored = re.compile(r"\b(" + "|".join(re.escape(f) for f in fields if "_" in f) + r")\b")
    return pattern.sub(name, head) + sep + underscored.sub(name, rest)


def _unrecognized(serve: argparse.ArgumentParser, unknown: list[str]) -> str:
    """argparse's "unrecognized arguments" with the nearest flag to each unknown one (what Python
    3.14's suggest_on_error adds; this runs on 3.11)."""
    flags = [option for action in serve._actions for option in action.option_strings]
    hints = []
    for arg in unknown:
        name = arg.split("=", 1)[0]
        nearest = difflib.get_close_matches(name, flags, n=1) if name.startswith("-") else []
        hints += [f"{name}: did you mean {nearest[0]}?"] if nearest else []
    return "; ".join([f"unrecognized arguments: {' '.join(unknown)}", *hints])


def _serve_error(message: str) -> NoReturn:
    """Exit 2 with ``serve``'s usage and ``message`` (argparse's own form of a usage error)."""
    build_parsers({})[1].error(message)


def parse(argv: list[str] | None = None, environ=os.environ, *,
          resolve_device: bool = True) -> tuple[str, ServerConfig | None]:
    """``(command, config)`` from the command line and environment. A value its flag's type or
    ServerConfig refuses, and an unknown flag, exit 2 with ``serve``'s usage naming the flag (or
    the environment variable the value came from), before torch is imported. ``resolve_device``:
    no --device becomes this host's default (importing torch, seconds); main leaves that to the
    server as it starts (ServerConfig.resolved_device), so the files are checked first."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        parser, serve = build_parsers(environ, _given(argv))
    except _BadVariable as exc:
        _serve_error(str(exc))
    args, unknown = parser.parse_known_args(argv)
    if args.command != "serve":
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        return args.command, None
    if unknown:
        serve.error(_unrecognized(serve, unknown))
    try:
        config = config_from_args(args)
    except ValueError as exc:
        serve.error(_in_flag_names(str(exc), argv, environ))
    if resolve_device and config.device is None and not config.devices:  # --devices: a --device per process
        config = config.replace(device=default_device())
    return args.command, config


# The flags naming a file the server reads as it starts.
_FILE_FLAGS = ("--tls-cert", "--tls-key", "--tls-client-ca", "--auth-token-file")


def check_files(config: ServerConfig, argv: list[str], environ=os.environ) -> None:
    """Exit 2 with ``serve``'s usage, naming the flag (or its variable) and the file, where a file
    the config names cannot be read here. Apart from parse(), which reads deployment manifests
    whose files exist in their pods only (tests/test_deploy.py)."""
    for flag in _FILE_FLAGS:
        path = getattr(config, field_name(flag))
        if path is None:
            continue
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            _serve_error(f"{_source(flag, argv, environ)}: cannot read {path}: {exc.strerror}")


def _server_extra_missing() -> str | None:
    """The first package of the server extra this environment lacks (a client-only install)."""
    for module in ("torch", "triton", "grpc_health", "grpc_reflection", "prometheus_client"):
        try:
            __import__(module)
        except ModuleNotFoundError:
            return module
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command, config = parse(argv, resolve_device=False)
    if command == "version":
        print(__version__)
        return 0
    check_files(config, argv)  # before the server extra's check imports torch (seconds)
    missing = _server_extra_missing()
    if missing is not None:
        print(f"logitserve serve: needs the server extra ({missing} is not installed here): "
              f"pip install 'logitserve[server]'", file=sys.stderr)
        return 2
    worker = os.environ.get(WORKER_ENV)
    supervisor = config.workers > 1 or bool(config.devices)
    configure(config.log_level, worker=worker if worker is not None else ("supervisor" if supervisor else None))
    _warn_if_open(config)
    if config.devices:
        from .devices import run_devices

        return run_devices(config)
    if config.workers > 1:
        from .workers import run_workers

        return run_workers(config)
    try:
        with asyncio.Runner(loop_factory=event_loop_factory(config.busy_poll_us)) as runner:
            return runner.run(serve(config))
    except (OSError, RuntimeError, ValueError) as exc:  # a taken port, a missing TLS file, no such GPU
        # At error level (shown at every --log-level), naming the flag (app.StartupError).
        log_event(log, "failed to start", level=logging.ERROR, error=str(exc))
        return 2


if __name__ == "__main__":
    sys.exit(main())
