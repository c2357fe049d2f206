"""``logitserve serve``: flags, each also read from a ``LOGITSERVE_*`` environment variable.

A flag on the command line wins over its variable (``--max-delay-us`` over
``LOGITSERVE_MAX_DELAY_US``), which wins over the default. SIGTERM or SIGINT drains (health
NOT_SERVING, new calls UNAVAILABLE, in-flight calls get ``--grace-period-s``) and exits 0;
SIGHUP re-reads ``--auth-token-file``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import sys

from .engine.busy_poll import event_loop_factory
from .config import FLOAT_DTYPE_NAMES, LOG_LEVELS, ServerConfig, default_device
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


def _dtype_list(text: str) -> tuple[str, ...]:
    if text.strip().lower() in ("", "none"):
        return ()
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [n for n in names if n not in FLOAT_DTYPE_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(f"{unknown} not in {', '.join(FLOAT_DTYPE_NAMES)}")
    return names


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
    """Comma-separated entries (``--devices``, ``--device-endpoints``); "none" or "" for none."""
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
    ("--port", int, _D.port, "port to listen on (0 picks a free one)"),
    ("--device", str, None, "torch device: cuda:N or cpu (default: cuda:0 where torch sees a GPU, else cpu)"),
    ("--devices", _name_list, "none", "one server process per GPU: all (every GPU torch sees) or cuda:0,cuda:1,...; "
     "the process of the i-th listens on --port + i (--port 0: free ports), metrics on --metrics-port + i, and "
     "GetServerInfo lists them all (none: one process, on --device)"),
    ("--device-endpoints", _name_list, "none", "internal, set by --devices for its processes: every device's "
     "process as device=host:port,... (GetServerInfo's device_endpoints)"),
    ("--backend", str, _D.backend, "kernel backend: auto (triton on CUDA, torch on CPU), triton, interpret, torch"),
    ("--cuda-graphs", _switch, "on" if _D.cuda_graphs else "off",
     "replay Sample and RouteExperts launches from CUDA graphs (on, off)"),
    ("--max-batch-rows", int, _D.max_batch_rows, "most rows the batcher puts into one launch"),
    ("--max-delay-us", int, _D.max_delay_us, "longest a call waits for others while the device is idle (us; 0: launch at once)"),
    ("--max-queue", int, _D.max_queue, "calls waiting for a launch before new ones get RESOURCE_EXHAUSTED"),
    ("--max-message-bytes", int, _D.max_message_bytes, "largest request or response message"),
    ("--max-vocab", int, _D.max_vocab, "widest row (vocabulary, experts, softmax width) in a request"),
    ("--max-rows", int, _D.max_rows, "most rows in a request"),
    ("--warmup-dtypes", _dtype_list, ",".join(_D.warmup_dtypes),
     "comma-separated dtypes compiled before SERVING ('none' for none)"),
    ("--warmup-widths", _width_list, "auto", "comma-separated row widths (vocabularies) compiled before SERVING "
     "(auto: 32000,128256,151936 with triton, 64 otherwise)"),
    ("--compile-processes", _auto_int, "auto", "processes compiling warm-up's kernels side by side before SERVING "
     "(auto: one per dtype and width, a core left over; 0: the server alone)"),
    ("--compile-cache-dir", str, None, "Triton's compiled-kernel cache (TRITON_CACHE_DIR; default ~/.triton/cache): "
     "keep it across restarts, e.g. on a volume, and warm-up loads instead of compiling"),
    ("--tls-cert", str, None, "PEM certificate chain: serve TLS (with --tls-key)"),
    ("--tls-key", str, None, "PEM private key of --tls-cert"),
    ("--tls-client-ca", str, None, "PEM CA bundle: require client certificates it signed (mutual TLS)"),
    ("--auth-token-file", str, None, "file of bearer tokens, one per line (re-read on SIGHUP)"),
    ("--workers", int, _D.workers, "server processes sharing the port, each with its own event loop, batcher and "
     "CUDA context"),
    ("--reuse-port", _switch, "on" if _D.reuse_port else "off",
     "let other processes bind the same port (set by --workers for its processes)"),
    ("--metrics-port", int, _D.metrics_port, "Prometheus /metrics port, worker i on this port + i (0: off)"),
    ("--metrics-host", str, _D.metrics_host, "address /metrics listens on (no token needed there: loopback "
     "unless a scraper elsewhere needs it)"),
    ("--busy-poll-us", int, _D.busy_poll_us, "how long the event loop polls for the next call before it sleeps "
     "(us; 0: it sleeps at once)"),
    ("--max-regions", int, _D.max_regions, "shared-memory regions mapped at once, all clients together "
     "(0: none)"),
    ("--max-region-bytes", int, _D.max_region_bytes, "bytes of shared-memory regions mapped at once, all clients "
     "together (on CUDA, system regions are page-locked: also the host memory clients can lock)"),
    ("--shm-key-scope", str, _D.shm_key_scope, "which shared-memory objects a client may register: token (keys "
     "starting with its token's prefix), any (any object this server's user can open), auto (token when "
     "--auth-token-file is set)"),
    ("--max-held-answer-bytes", int, _D.max_held_answer_bytes, "bytes of answers held for unfinished (or "
     "unread) calls, all connections together; past it RESOURCE_EXHAUSTED before the work"),
    ("--max-held-answer-bytes-per-connection", int, _D.max_held_answer_bytes_per_connection,
     "bytes of answers held for one connection's unfinished (or unread) calls"),
    ("--max-streams-per-connection", int, _D.max_streams_per_connection,
     "calls (HTTP/2 streams) open at once on one connection"),
    ("--max-connections", int, _D.max_connections, "client connections open at once; newer ones are closed"),
    ("--max-sequences", int, _D.max_sequences, "sequences (OpenSequences) open at once, all clients together "
     "(0: none)"),
    ("--sequence-idle-s", float, _D.sequence_idle_s, "a sequence no call names for this long is closed (seconds)"),
    ("--max-sequence-bytes", int, _D.max_sequence_bytes, "bytes the open sequences' buffers hold (lists, outputs' "
     "room, last answers), all clients together; past it an open, update or output's growth is RESOURCE_EXHAUSTED"),
    ("--channels", _switch, "on" if _D.channels else "off", "same-host channels (OpenChannel): calls through "
     "shared memory (iceoryx2) instead of gRPC (on, off)"),
    ("--max-channels", int, _D.max_channels, "same-host channels open at once, all clients together"),
    ("--channel-idle-s", float, _D.channel_idle_s, "a channel without a call for this long is closed (seconds)"),
    ("--token-share", float, _D.token_share, "with --auth-token-file, the share of each server-wide bound "
     "(channels, sequences and their bytes, regions and their bytes, held answers) one token may hold"),
    ("--grace-period-s", float, _D.grace_period_s, "on SIGTERM, how long in-flight calls get to finish"),
    ("--log-level", str.lower, _D.log_level, f"one of {', '.join(LOG_LEVELS)} (any case)"),
)


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


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


def build_parser(environ=os.environ, given: frozenset = frozenset()) -> argparse.ArgumentParser:
    """The command line. ``_BadVariable`` for an environment variable its flag refuses, unless the
    flag is among those ``given`` on the command line (which win over the variable)."""
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
        serve.add_argument(flag, type=kind, default=value, help=f"{text} [{env}; default: {default}]")
    commands.add_parser("version", help="print the version")
    return parser


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    fields = {flag.lstrip("-").replace("-", "_"): getattr(args, flag.lstrip("-").replace("-", "_"))
              for flag, *_ in FLAGS}
    if not fields["devices"]:  # each process of --devices gets its own --device
        fields["device"] = fields["device"] or default_device()
    return ServerConfig(**fields)


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


def _in_flag_names(message: str, argv: list[str], environ) -> str:
    """A ServerConfig error with its field names as the flags (``max_rows`` -> ``--max-rows``), or
    as the environment variable where the value came from there and not from the command line."""
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}

    def name(match: re.Match) -> str:
        flag = "--" + match.group(0).replace("_", "-")
        env = env_name(flag)
        return f"{env} (--{flag[2:]})" if flag not in given and env in environ else flag
    fields = sorted((flag.lstrip("-").replace("-", "_") for flag, *_ in FLAGS), key=len, reverse=True)
    head, sep, rest = message.partition(":")
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, fields)) + r")\b")
    # the field names before the colon (the subject); in the text only those with an underscore
    underscored = re.compile(r"\b(" + "|".join(re.escape(f) for f in fields if "_" in f) + r")\b")
    return pattern.sub(name, head) + sep + underscored.sub(name, rest)


def parse(argv: list[str] | None = None, environ=os.environ) -> tuple[str, ServerConfig | None]:
    """``(command, config)`` from the command line and environment; bad values exit 2 with usage,
    naming the flag (or the environment variable the value came from)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        parser = build_parser(environ, frozenset(a.split("=", 1)[0] for a in argv if a.startswith("--")))
    except _BadVariable as exc:
        build_parser({}).error(str(exc))
    args = parser.parse_args(argv)
    if args.command != "serve":
        return args.command, None
    try:
        return args.command, config_from_args(args)
    except ValueError as exc:
        parser.error(_in_flag_names(str(exc), argv, environ))


def _server_extra_missing() -> str | None:
    """The first package of the server extra this environment lacks (a client-only install)."""
    for module in ("torch", "triton", "grpc_health", "grpc_reflection", "prometheus_client"):
        try:
            __import__(module)
        except ModuleNotFoundError:
            return module
    return None


def main(argv: list[str] | None = None) -> int:
    command, config = parse(argv)
    if command == "version":
        print(__version__)
        return 0
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
