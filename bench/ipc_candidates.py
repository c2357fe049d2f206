"""Same-host request/response channels for issue 35, measured side by side.

    python -m bench.ipc_candidates [--round-trips 20000] [--poll-us 50] [--candidates ...] [--out FILE]

A server process and a client process (spawned, so nothing is shared but what the channel
carries) exchange 64-byte requests and echoed replies. After a warm-up the client times
``--round-trips`` calls and reads the server's CPU time before and after; the parent then
leaves the connection idle for a second and reads the server's CPU again, which shows whether
a way of waiting holds a core when nothing comes. The candidates are ``CANDIDATES`` below: grpc
(logitserve's transport today, the baseline), pyzmq over ipc:// two ways, iceoryx2, and a
hand-written shared-memory channel (``bench.ipc_shm_reference``) as a reference point only:
issue 35 asks for a kept library.
A candidate whose library is not importable gets a row saying so.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import functools
import importlib.metadata
import importlib.util
import multiprocessing
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

PAYLOAD_BYTES = 64
# In-band shutdown: the server answers it and returns, so each library releases what it holds.
# A killed iceoryx2 node leaves its files in /dev/shm and /tmp/iceoryx2 behind.
STOP = b"\xff" * PAYLOAD_BYTES
IDLE_SECONDS = 1.0
START_TIMEOUT_S = 60.0


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds used so far by process ``pid``, all its threads (live and exited) together.

    The kernel's per-process CPU clock, MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED) in
    include/linux/posix-timers.h: nanosecond resolution where /proc/<pid>/stat counts 10 ms
    ticks. A thread running on another core has its time folded in at ticks and switches, so
    a sample may lag by a tick (a few ms): small against the default run's seconds.
    """
    return time.clock_gettime(((~pid) << 3) | 2)


def poll_then_block(try_receive: Callable[[], object], block: Callable[[], object], poll_ns: int):
    """The next message: ``try_receive()`` (None while there is none) for up to ``poll_ns``,
    then ``block()`` until woken, and again. A wake may be stale (a notification sent while the
    receiver was still polling), so after one the receiver polls and, if need be, blocks again."""
    while True:
        deadline = time.perf_counter_ns() + poll_ns
        while True:
            message = try_receive()
            if message is not None:
                return message
            if time.perf_counter_ns() >= deadline:
                break
        block()


# ---- grpc.aio over a Unix domain socket ---------------------------------------------------

ECHO_SERVICE, ECHO_METHOD = "bench.Echo", "Call"


async def _serve_grpc(address: str, poll_ns: int, ready) -> None:
    import grpc

    stopped = asyncio.Event()

    async def echo(request: bytes, context) -> bytes:
        if request == STOP:
            stopped.set()
        return request

    server = grpc.aio.server()
    # No (de)serialisers: the handler sees and returns raw bytes, so only the transport is timed.
    methods = {ECHO_METHOD: grpc.unary_unary_rpc_method_handler(echo)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(ECHO_SERVICE, methods),))
    server.add_insecure_port(f"unix:{address}")
    await server.start()
    ready.send(None)
    await stopped.wait()
    await server.stop(grace=1.0)


@contextlib.asynccontextmanager
async def _connect_grpc(address: str, poll_ns: int):
    import grpc

    async with grpc.aio.insecure_channel(f"unix:{address}") as channel:
        yield channel.unary_unary(f"/{ECHO_SERVICE}/{ECHO_METHOD}")


# ---- Symmetric channels: the same send and receive on both sides ----------------------------
# endpoint(address, side, poll_ns) is a context manager of (send(bytes), receive() -> bytes).

def _serve_endpoint(endpoint, address: str, poll_ns: int, ready) -> None:
    with endpoint(address, "server", poll_ns) as (send, receive):
        ready.send(None)
        while True:
            request = receive()
            send(request)
            if request == STOP:
                return


@contextlib.contextmanager
def _connect_endpoint(endpoint, address: str, poll_ns: int):
    with endpoint(address, "client", poll_ns) as (send, receive):
        def call(request: bytes) -> bytes:
            send(request)
            return receive()

        yield call


@contextlib.contextmanager
def _zmq_endpoint(kinds: tuple[str, str], address: str, side: str, poll_ns: int):
    """pyzmq over ipc://; ``kinds`` are the server's and the client's socket types. REQ and REP
    block in recv; PAIR polls with NOBLOCK, then blocks in a Poller. Either way libzmq's I/O
    thread sleeps in epoll and hands each message over, which polling here cannot skip."""
    import zmq

    with zmq.Context.instance().socket(getattr(zmq, kinds[side == "client"])) as sock:
        sock.setsockopt(zmq.LINGER, 1000)  # bounds how long closing waits to deliver the STOP answer
        if side == "server":
            sock.bind(address)
        else:
            sock.connect(address)
        if sock.type != zmq.PAIR:
            yield sock.send, sock.recv
            return
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)

        def try_receive():
            try:
                return sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return None

        yield sock.send, lambda: poll_then_block(try_receive, poller.poll, poll_ns)


# ---- iceoryx2 request-response, an event per message to wake the peer -----------------------

@contextlib.contextmanager
def _iceoryx2_endpoint(service: str, side: str, poll_ns: int):
    """The server receives a request and answers on it; the client sends one and receives the
    answer on what sending returned. iceoryx2's request-response has no blocking receive, so an
    event service per direction (as its request_response_with_events example) lets a side sleep."""
    import iceoryx2 as iox2

    class Descriptor(ctypes.Structure):
        _fields_ = [("data", ctypes.c_uint8 * PAYLOAD_BYTES)]

    # Every process would warn that it runs on the default config (it has no file); that is intended.
    iox2.set_log_level_from_env_or(iox2.LogLevel.Error)
    node = iox2.NodeBuilder.new().create(iox2.ServiceType.Ipc)
    rr = node.service_builder(iox2.ServiceName.new(service)).request_response(Descriptor, Descriptor).open_or_create()
    events = [node.service_builder(iox2.ServiceName.new(f"{service}/to_{to}")).event().open_or_create()
              for to in (side, "client" if side == "server" else "server")]
    listener, notifier = events[0].listener_builder().create(), events[1].notifier_builder().create()
    port = rr.server_builder().create() if side == "server" else rr.client_builder().create()
    exchange = None  # the request being answered (server), the answer awaited (client)

    def send(payload: bytes) -> None:
        nonlocal exchange
        if side == "server":
            exchange.send_copy(Descriptor.from_buffer_copy(payload))
            exchange.delete()  # samples stay in shared memory until deleted; the pool is finite
        else:
            exchange = port.send_copy(Descriptor.from_buffer_copy(payload))
        notifier.notify()

    def receive() -> bytes:
        nonlocal exchange
        message = poll_then_block(port.receive if side == "server" else exchange.receive, listener.blocking_wait,
                                  poll_ns)
        payload = bytes(message.payload().contents)
        if side == "server":
            exchange = message
        else:
            message.delete()
            exchange.delete()
        return payload

    yield send, receive


def _shm_endpoint(directory: str, side: str, poll_ns: int):
    # Hand-written, so kept in a module of its own, apart from the library candidates.
    from bench.ipc_shm_reference import shm_endpoint

    return shm_endpoint(directory, side, poll_ns)


# ---- The candidates, the client's timing loop, the parent ---------------------------------

@dataclass(frozen=True)
class Candidate:
    """One channel under test: ``serve`` runs in the server process, ``connect`` in the client's."""

    label: str
    waits: str  # how each side waits for a message
    module: str  # the import it needs
    serve: Callable  # (address, poll_ns, ready) in the server process; sends None on ready
    connect: Callable  # (address, poll_ns) -> context manager yielding call(bytes) -> bytes
    address: Callable[[str], str]  # from a fresh temporary directory
    is_async: bool = False


def _symmetric(label: str, waits: str, module: str, endpoint, address: Callable[[str], str]) -> Candidate:
    return Candidate(label, waits, module, functools.partial(_serve_endpoint, endpoint),
                     functools.partial(_connect_endpoint, endpoint), address)


CANDIDATES = {
    "grpc": Candidate("grpc.aio unary, Unix socket", "event loop", "grpc", _serve_grpc, _connect_grpc,
                      lambda d: os.path.join(d, "grpc.sock"), is_async=True),
    "zmq-req-rep": _symmetric("pyzmq REQ/REP, ipc://", "blocking recv", "zmq",
                              functools.partial(_zmq_endpoint, ("REP", "REQ")), lambda d: f"ipc://{d}/zmq.sock"),
    "zmq-pair-poll": _symmetric("pyzmq PAIR, ipc://", "poll, then block", "zmq",
                                functools.partial(_zmq_endpoint, ("PAIR", "PAIR")), lambda d: f"ipc://{d}/zmq.sock"),
    "iceoryx2": _symmetric("iceoryx2 request-response + events", "poll, then block", "iceoryx2",
                           _iceoryx2_endpoint, lambda d: f"logitserve-bench/{os.path.basename(d)}"),
    "shm-reference": _symmetric("shared_memory + FIFO (hand-written reference)", "poll, then block", "ctypes",
                                _shm_endpoint, lambda d: d),
}


def _round_trips(n: int, warmup: int, server_pid: int):
    """A generator: yields each request, takes its reply through ``send()``, returns the figures."""
    latencies = []
    for i in range(warmup + n):
        if i == warmup:
            server_cpu, client_cpu = process_cpu_seconds(server_pid), time.process_time()
        request = i.to_bytes(8, "little") * (PAYLOAD_BYTES // 8)  # unique, so a stale reply is caught
        start = time.perf_counter_ns()
        reply = yield request
        elapsed = time.perf_counter_ns() - start
        if reply != request:
            raise RuntimeError(f"round trip {i}: reply {bytes(reply[:8]).hex()}... is not the request echoed")
        if i >= warmup:
            latencies.append(elapsed)
    server_cpu = process_cpu_seconds(server_pid) - server_cpu
    client_cpu = time.process_time() - client_cpu
    latencies.sort()
    figures = {f"p{q}": latencies[min(n - 1, n * q // 100)] / 1e3 for q in (50, 90, 99)}
    return figures | {"server_cpu_us": server_cpu / n * 1e6, "client_cpu_us": client_cpu / n * 1e6}


def _client_main(name: str, address: str, poll_ns: int, n: int, warmup: int, server_pid: int, conn) -> None:
    """Runs the round trips and sends the figures, stays connected while the parent measures the
    idle server, then stops the server in-band. A failure is sent as text for the table."""
    try:
        asyncio.run(_drive(CANDIDATES[name], address, poll_ns, _round_trips(n, warmup, server_pid), conn))
    except Exception as exc:  # noqa: BLE001 - reported in the candidate's row
        conn.send(f"{type(exc).__name__}: {exc}")


async def _drive(candidate: Candidate, address: str, poll_ns: int, trips, conn) -> None:
    """One loop for every client. A blocking ``call`` never yields to the event loop, so running
    it inside one costs nothing; only grpc.aio's call is awaited."""
    async with contextlib.AsyncExitStack() as stack:
        connection = candidate.connect(address, poll_ns)
        call = await stack.enter_async_context(connection) if candidate.is_async else stack.enter_context(connection)
        request = next(trips)
        try:
            while True:
                reply = call(request)
                request = trips.send(await reply if candidate.is_async else reply)
        except StopIteration as done:
            conn.send(done.value)
        conn.recv()
        stopped = call(STOP)
        if candidate.is_async:
            await stopped


def _server_main(name: str, address: str, poll_ns: int, ready) -> None:
    try:
        served = CANDIDATES[name].serve(address, poll_ns, ready)
        if asyncio.iscoroutine(served):
            asyncio.run(served)
    except Exception as exc:  # noqa: BLE001 - the parent reports it in the candidate's row
        ready.send(f"{type(exc).__name__}: {exc}")


def _expect(conn, who: str, timeout: float):
    """The next object from ``who``; its failure text raised as an error."""
    if not conn.poll(timeout):
        raise TimeoutError(f"{who}: no answer within {timeout:.0f} s")
    try:
        message = conn.recv()
    except EOFError:
        raise RuntimeError(f"{who}: ended without answering") from None
    if isinstance(message, str):
        raise RuntimeError(f"{who}: {message}")
    return message


def measure(name: str, round_trips: int, warmup: int, poll_us: float, idle_s: float = IDLE_SECONDS) -> dict:
    """One candidate's figures: latency percentiles (us), CPU us per round trip, and the server's
    CPU % over ``idle_s`` of a connected, idle channel. ModuleNotFoundError where its library is
    not installed."""
    candidate = CANDIDATES[name]
    if importlib.util.find_spec(candidate.module) is None:
        raise ModuleNotFoundError(f"{candidate.module}: not installed, skipped")
    poll_ns = int(poll_us * 1000)
    spawn = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="ipc-") as directory:
        address = candidate.address(directory)
        ready, ready_end = spawn.Pipe(duplex=False)
        conn, client_end = spawn.Pipe()
        server = spawn.Process(target=_server_main, args=(name, address, poll_ns, ready_end), daemon=True)
        server.start()
        ready_end.close()  # the server's copy only: if it dies before answering, recv sees EOF
        client = None
        try:
            _expect(ready, "server", START_TIMEOUT_S)
            client = spawn.Process(target=_client_main, daemon=True,
                                   args=(name, address, poll_ns, round_trips, warmup, server.pid, client_end))
            client.start()
            client_end.close()
            # Generous: at 1 ms a round trip on a loaded machine, 20000 take 20 s.
            figures = _expect(conn, "client", START_TIMEOUT_S + round_trips * 5e-3)
            before, start = process_cpu_seconds(server.pid), time.monotonic()
            time.sleep(idle_s)
            idle = (process_cpu_seconds(server.pid) - before) / (time.monotonic() - start)
            conn.send("stop")
            client.join(START_TIMEOUT_S)
            server.join(START_TIMEOUT_S)
            if server.exitcode != 0:
                raise RuntimeError(f"server: did not stop cleanly (exit code {server.exitcode})")
        finally:
            for process in (client, server):
                if process is not None and process.is_alive():
                    process.kill()
                    process.join()
    return figures | {"server_idle_pct": idle * 100}


def _load_average() -> str:
    return " ".join(f"{load:.2f}" for load in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--round-trips", type=int, default=20000, help="timed round trips per candidate")
    parser.add_argument("--warmup", type=int, default=1000, help="untimed round trips first")
    parser.add_argument("--poll-us", type=float, default=50.0, help="how long a poll-then-block side polls")
    parser.add_argument("--candidates", nargs="+", choices=list(CANDIDATES), default=list(CANDIDATES))
    parser.add_argument("--out", help="also write the table (markdown) to this file")
    args = parser.parse_args(argv)
    if args.round_trips < 1 or args.warmup < 0 or args.poll_us < 0:
        parser.error("--round-trips: must be at least 1; --warmup, --poll-us: must not be negative")
    libraries = [f"{dist} {importlib.metadata.version(dist)}" for dist in ("grpcio", "pyzmq", "iceoryx2")
                 if importlib.util.find_spec({"grpcio": "grpc", "pyzmq": "zmq"}.get(dist, dist))]
    lines = [f"{platform.node()}: {os.cpu_count()} cores, load average {_load_average()};"
             f" Python {platform.python_version()}; {', '.join(libraries)}",
             f"{PAYLOAD_BYTES}-byte echo, {args.round_trips} round trips after {args.warmup} of warm-up;"
             f" idle CPU over {IDLE_SECONDS:g} s\n",
             "| candidate | waits by | p50 us | p90 us | p99 us | server CPU us/trip | client CPU us/trip"
             " | server CPU % idle |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    print("\n".join(lines), flush=True)
    for name in args.candidates:
        candidate = CANDIDATES[name]
        row = f"| {name}: {candidate.label} | {candidate.waits.replace('poll,', f'poll {args.poll_us:g} us,')} |"
        try:
            f = measure(name, args.round_trips, args.warmup, args.poll_us)
            row += (f" {f['p50']:.0f} | {f['p90']:.0f} | {f['p99']:.0f} | {f['server_cpu_us']:.1f}"
                    f" | {f['client_cpu_us']:.1f} | {f['server_idle_pct']:.1f} |")
        except Exception as exc:  # noqa: BLE001 - one failing candidate must not hide the others
            row += f" {type(exc).__name__}: {str(exc)[:100]} | | | | | |"
        lines.append(row)
        print(row, flush=True)
    lines.append(f"\nload average after: {_load_average()}")
    print(lines[-1])
    if args.out:
        with open(args.out, "w") as out:
            out.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
