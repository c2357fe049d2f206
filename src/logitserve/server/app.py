"""Wiring: the grpc.aio server with LogitServe, SharedMemory, the KServe v2 inference service
(server/api/kserve/), health, reflection (each handler guarded), same-host channels, TLS, metrics.

``create_server(config) -> (service, port)`` builds and binds everything (port 0 picks a free
port, as tests do); then ``await service.start()`` accepts calls with health NOT_SERVING,
``await service.warm_up()`` compiles the kernels and turns health SERVING, and
``await service.stop(grace)`` drains: health NOT_SERVING, new calls UNAVAILABLE, in-flight calls
finish within ``grace`` seconds.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pathlib
import ssl

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

from .api import kserve
from . import ops
from .api import reflection
from .regions import servicer as regions_servicer
from .api.auth import TokenStore
from .engine.batcher import Batcher
from .engine.busy_poll import BusyPollEventLoop
from .api.channel import ChannelService
from .config import ServerConfig, address
from .engine.device import TRITON_WARMUP_WIDTHS, DeviceHandle
from .api.guard import Guard, GuardedRegistrar
from .api.status import status_for
from .api.held import HeldAnswers
from .logs import get_logger, log_event
from .metrics import Metrics
from .engine.occupancy import Occupancy
from .precompile import precompile
from .regions import RegionRegistry
from .sequences.bounds import SequenceBounds
from .sequences.table import SequenceTable
from .ordered import SessionTable
from .tenancy import per_token_bound
from .api.servicer import LogitServeServicer, request_parsers
from .tensors import TORCH_DTYPES
from .version import __version__

log = get_logger("server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["LogitServe"].full_name
HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
_DTYPES_BY_NAME = {str(t).removeprefix("torch."): t for t in TORCH_DTYPES.values()}
# After the drain's grace period: how long the calls still running get to answer UNAVAILABLE,
# and how long the launch under way gets to end before the process exits without it. A process
# exits at most grace + STOP_ANSWER_S + STOP_LAUNCH_S (+ gRPC's and the interpreter's own stop,
# well under a second) after SIGTERM, whatever runs on the device (docs/DESIGN.md, Drain).
STOP_ANSWER_S = 1.0
STOP_LAUNCH_S = 2.0
# Largest request header block (the authorization token travels there).
METADATA_LIMIT_BYTES = 16 * 1024


def _server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    if config.tls_cert is None:
        return None
    # Loaded once by the ssl module first: gRPC would take broken PEM, or a key that is not the
    # certificate's, and fail only at the port, as if it were taken (ssl.SSLError is an OSError).
    check = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    check.load_cert_chain(config.tls_cert, config.tls_key)
    if config.tls_client_ca:
        check.load_verify_locations(config.tls_client_ca)
    ca = pathlib.Path(config.tls_client_ca).read_bytes() if config.tls_client_ca else None
    pair = (pathlib.Path(config.tls_key).read_bytes(), pathlib.Path(config.tls_cert).read_bytes())
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


class StartupError(RuntimeError, ValueError):
    """The server cannot start; the message names the flag (and the port) to fix."""


def _named(exc: Exception, message: str) -> Exception:
    """``exc`` again, of its kind (OSError for a missing file), with the message naming the flag."""
    return type(exc)(message) if isinstance(exc, OSError) else StartupError(message)


class Service:
    """The running service: device handle, batcher, gRPC server, health, metrics."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.version = __version__
        if config.compile_cache_dir is not None:  # before anything compiles; warm-up's processes inherit it
            os.makedirs(config.compile_cache_dir, exist_ok=True)
            os.environ["TRITON_CACHE_DIR"] = config.compile_cache_dir
        self.limits = ops.Limits(max_rows=config.max_rows, max_vocab=config.max_vocab,
                                 max_output_bytes=config.max_message_bytes)
        try:
            self.handle = DeviceHandle(config.resolved_device, config.backend, config.cuda_graphs)
        except Exception as exc:  # noqa: BLE001 - whatever torch raises for a device it cannot use
            raise StartupError(f"--device {config.resolved_device}: cannot use it ({type(exc).__name__}: {exc})") from exc
        # Shared-memory regions of every client; CUDA ones only on this server's device. With
        # tokens on, each token holds at most its --token-share of every bound (server/tenancy.py).
        device = self.handle.device
        tokens_on = config.auth_token_file is not None
        self.regions = RegionRegistry(config.max_regions, config.max_region_bytes,
                                      devices=(device.index,) if device.type == "cuda" else (),
                                      pin_system=device.type == "cuda", key_scope=config.resolved_shm_key_scope,
                                      share=config.token_share, tokens_on=tokens_on)
        # Sampling state of every caller's open sequences (server/sequences/table.py), on the device.
        self.sequences = SequenceTable(SequenceBounds(config.max_sequences, config.max_sequence_bytes,
                                                      config.token_share, tokens_on),
                                       config.sequence_idle_s, device,
                                       # --workers' processes share the port; --devices' have one each
                                       shared_port=config.reuse_port and not config.device_endpoints)
        # Stream-ordered sessions (server/ordered/): calls ordered on the GPU by marks.
        self.ordered = SessionTable(self.handle, config.max_ordered_sessions,
                                    per_token_bound(config.max_ordered_sessions, config.token_share, tokens_on),
                                    config.ordered_wait_s)
        self.metrics = Metrics(device=str(device))
        self.metrics.plan_cache.set_function(lambda: self.handle.plan_cache_size)
        try:
            self.tokens = TokenStore(config.auth_token_file) if config.auth_token_file else None
        except (OSError, ValueError) as exc:
            raise _named(exc, f"--auth-token-file {config.auth_token_file}: {exc}") from exc
        self.occupancy = Occupancy()  # counted by the guard; read by the batcher and busy polling
        self.guard = guard = Guard(self.metrics, is_draining=lambda: self.draining, tokens=self.tokens, occupancy=self.occupancy,
                      max_message_bytes=config.max_message_bytes)
        self.batcher = Batcher(self.handle, max_batch_rows=config.max_batch_rows,
                               max_delay_s=config.max_delay_us * 1e-6, max_queue=config.max_queue,
                               metrics=self.metrics, calls_in_server=lambda: self.occupancy.calls,
                               on_failure=self._after_failed_launch)
        self.metrics.queue_depth.set_function(lambda: self.batcher.queue_depth)
        self.held = HeldAnswers(config.max_held_answer_bytes, config.max_held_answer_bytes_per_connection,
                                config.token_share, tokens_on)
        self.metrics.watch_holdings(self.sequences.holdings, self.regions.holdings, self.held.holdings)
        self.health = health.aio.HealthServicer()
        self.draining = False
        self.device_lost = False
        # Set by stop() when the launch under way outlived the drain (a CPU launch longer than the
        # grace period): the process should exit without waiting for it (cli.serve does).
        self.launch_abandoned = False
        self._stopped: asyncio.Event | None = None

        limit = config.max_message_bytes
        self.server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            # Unless asked to share (--workers), a second server on a taken port fails instead.
            ("grpc.so_reuseport", int(config.reuse_port)),
            # gRPC refuses request headers between its soft (8 KiB) and hard (16 KiB) limits at
            # random; one limit makes the answer deterministic: headers up to 16 KiB reach token
            # auth (UNAUTHENTICATED when wrong), larger ones are always RESOURCE_EXHAUSTED.
            ("grpc.max_metadata_size", METADATA_LIMIT_BYTES),
            ("grpc.absolute_max_metadata_size", METADATA_LIMIT_BYTES),
            ("grpc.max_concurrent_streams", config.max_streams_per_connection),
            ("grpc.max_allowed_incoming_connections", config.max_connections),
        ])
        guarded = GuardedRegistrar(self.server, guard, {**request_parsers(), **kserve.request_parsers()})
        pb_grpc.add_LogitServeServicer_to_server(LogitServeServicer(self), guarded)
        # Same-host channels reach LogitServe's guarded handlers, as gRPC does (server/api/channel/).
        self.channels = ChannelService(config.channels, config.max_channels, config.channel_idle_s,
                                       config.max_message_bytes, guarded.handlers, self.occupancy,
                                       token_share=config.token_share, tokens_on=self.tokens is not None,
                                       registry=self.metrics.registry)
        regions_servicer.add_to_server(self.regions, guarded)
        kserve.add_to_server(self, guarded)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, guarded)
        reflection.add_to_server((SERVICE_NAME, regions_servicer.SERVICE_NAME, kserve.SERVICE_NAME,
                                  HEALTH_SERVICE_NAME), guarded)
        listen_at = address(config.host, config.port)
        try:
            creds = _server_credentials(config)
        except (OSError, ValueError) as exc:
            raise _named(exc, f"--tls-cert / --tls-key / --tls-client-ca: {exc}") from exc
        try:
            self.port = (self.server.add_secure_port(listen_at, creds) if creds is not None
                         else self.server.add_insecure_port(listen_at))
        except RuntimeError as exc:
            raise StartupError(f"--port {config.port}: cannot listen on {listen_at} (in use, or --host "
                               f"{config.host} is not an address of this host): {exc}") from exc
        self.tls = creds is not None

    async def start(self) -> None:
        """Accept calls (health NOT_SERVING until :meth:`warm_up`) and start metrics."""
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        loop = asyncio.get_running_loop()
        busy_poll_us = 0
        if isinstance(loop, BusyPollEventLoop):  # `logitserve serve` with --busy-poll-us
            loop.poll_for_a_lone_client(self.occupancy, lambda: self.handle.thread_busy)
            busy_poll_us = loop.window_us
        self.batcher.start()
        await self.server.start()
        self.channels.start()
        self.sequences.start_sweeping()  # idle sequences freed even while nobody calls
        if self.config.metrics_port:
            try:
                self.metrics.serve(self.config.metrics_port, self.config.metrics_host)
            except OSError as exc:
                raise StartupError(f"--metrics-port {self.config.metrics_port}: cannot serve /metrics on "
                                   f"{self.config.metrics_host}:{self.config.metrics_port}: {exc}") from exc
        log_event(log, "listening", port=self.port, tls=self.tls, mutual_tls=self.config.tls_client_ca is not None,
                  auth=self.tokens is not None, metrics_port=self.config.metrics_port or None,
                  busy_poll_us=busy_poll_us, **self.handle.properties)

    async def warm_up(self) -> None:
        """Compile the kernels for the configured dtypes (on the Triton backend in parallel
        processes first: server/precompile.py), then report SERVING."""
        config = self.config
        dtypes = tuple(_DTYPES_BY_NAME[name] for name in config.warmup_dtypes)
        if self.handle.backend == "triton" and dtypes:
            widths = config.warmup_widths or TRITON_WARMUP_WIDTHS
            await asyncio.to_thread(precompile, str(self.handle.device), self.handle.backend, config.warmup_dtypes,
                                    widths, config.compile_processes)
        await self.handle.warm_up(dtypes, ops.warmup_calls, config.warmup_widths)
        if not self.draining and not self.device_lost:
            for name in ("", SERVICE_NAME):
                await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
            log_event(log, "serving", port=self.port)

    async def _after_failed_launch(self, exc: BaseException) -> None:
        """After a launch failed as a fault (INTERNAL), check the device; a device that can run
        nothing more turns health NOT_SERVING for good, so that load balancers and orchestrators
        (the image's HEALTHCHECK, a Kubernetes probe) take this replica out and restart it."""
        if self.device_lost or status_for(exc)[0] != grpc.StatusCode.INTERNAL:
            return
        try:
            await self.handle.run(self.handle.check)
        except Exception as lost:  # noqa: BLE001 - whatever the driver raises, the device is gone
            self.device_lost = True
            log_event(log, "device lost", level=logging.ERROR, device=str(self.handle.device), error=repr(lost),
                      after=repr(exc))
            for name in ("", SERVICE_NAME):
                await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace: float | None = None) -> None:
        """Drain: NOT_SERVING, refuse new calls, give in-flight calls ``grace`` seconds, release all."""
        if self._stopped is not None:
            await self._stopped.wait()
            return
        self._stopped = asyncio.Event()
        grace = self.config.grace_period_s if grace is None else grace
        log_event(log, "draining", grace_s=grace, queued=self.batcher.queue_depth)
        loop = asyncio.get_running_loop()
        self.draining = True
        self.ordered.end_all("the server is draining")  # their calls end; their waits are released
        self.batcher.flush()
        # Health says NOT_SERVING (to open Watch streams as well) and keeps answering for the whole
        # grace period: gRPC's own stop would refuse every new RPC, health checks included.
        await self.health.enter_graceful_shutdown()
        deadline = loop.time() + grace
        while self.guard.running and loop.time() < deadline:
            await asyncio.sleep(0.02)
        unanswered = self.guard.end_calls()
        if unanswered:
            # They end UNAVAILABLE (never CANCELLED) before gRPC stops.
            log_event(log, "grace period over", level=logging.WARNING, unanswered=unanswered)
            end = loop.time() + STOP_ANSWER_S
            while self.guard.running and loop.time() < end:
                await asyncio.sleep(0.01)
        await self.channels.stop()
        self.sequences.stop_sweeping()
        await self.server.stop(0)
        end = loop.time() + STOP_LAUNCH_S

        async def close_device():  # the batcher waits for the launch under way, then the device thread
            await self.batcher.close()
            await asyncio.to_thread(self.handle.close)
        closing = asyncio.ensure_future(close_device())
        done, _ = await asyncio.wait({closing}, timeout=max(0.0, end - loop.time()))
        if not done:
            self.launch_abandoned = True
            log_event(log, "launch still running at exit", level=logging.WARNING, waited_s=STOP_LAUNCH_S)
        else:
            self.regions.close()  # every call has ended: nothing holds a lease, every region is unmapped
        self.metrics.close()
        log_event(log, "stopped", launches=self.batcher.launches, requests=self.batcher.batched_requests,
                  regions_mapped=self.regions.mapped_count)
        self._stopped.set()

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()

    def reload_tokens(self) -> None:
        if self.tokens is not None:
            self.tokens.reload()

    def info(self, owner: str | None = None) -> ops.ServerInfo:
        """GetServerInfo's answer for a caller of ``owner`` (server/regions/names.py owner_of):
        the server's own figures, and of the sequences only the caller's (all callers' are in
        /metrics)."""
        c = self.config
        return ops.ServerInfo(
            version=self.version, device=str(self.handle.device), device_name=self.handle.name,
            backend=self.handle.backend, warmed_dtypes=list(self.handle.warmed_dtypes),
            limits=dict(max_message_bytes=c.max_message_bytes, max_rows=c.max_rows, max_vocab=c.max_vocab,
                        max_batch_rows=c.max_batch_rows, max_delay_us=c.max_delay_us, max_queue=c.max_queue,
                        max_sequences=c.max_sequences, sequence_idle_s=c.sequence_idle_s),
            stats=dict(launches=self.batcher.launches, batched_requests=self.batcher.batched_requests,
                       queue_depth=self.batcher.queue_depth, plan_cache_size=self.handle.plan_cache_size,
                       **self.sequences.stats(owner)),
            device_endpoints=c.endpoints)


def create_server(config: ServerConfig) -> tuple[Service, int]:
    """Build the service and bind its port; returns ``(service, bound_port)``. Call from a coroutine."""
    service = Service(config)
    return service, service.port
