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
from .config import ServerConfig, default_device
from .flags import FLAGS, env_name, field_name, shown_default
from .logs import WORKER_ENV, configure, get_logger, log_event
from .version import __version__

log = get_logger("cli")
_LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def _warn_if_open(config: ServerConfig) -> None:
    """A warning when anyone who can reach the address may call: not loopback, no TLS, no tokens."""
    if config.host not in _LOOPBACK and not config.host.startswith("127.") and config.tls_cert is None \
            and config.auth_token_file is None:
        log_event(log, "serving without TLS or tokens on a non-loopback address", level=logging.WARNING,
                  host=config.host, port=config.port,
                  fix="--auth-token-file and --tls-cert/--tls-key, or --host 127.0.0.1 behind a proxy")


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
