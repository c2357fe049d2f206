"""Issue 43, items 4 to 6 and 11: sequence requests a server must refuse are refused before any
work is done for them, none stalls the other connections, the bytes sequences hold are bounded,
and idle sequences leave memory while nobody calls.

A subprocess server on the CPU; each case checks the refusal names the bound it is refused by
(checked before anything is built) and the server's RSS barely moved, and prints the time the
refusal took and how long another connection, calling GetServerInfo every 20 ms meanwhile,
waited: figures for docs/RELIABILITY.md, not assertions (a loaded machine moves them). The old
code took 16-31 s and +0.8-1.0 GiB to refuse 150k specs, and walked 20 M ids on the event loop.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from logitserve.server.process import ServerProcess
from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

MIB = 1 << 20
BIG = [("grpc.max_receive_message_length", 512 * MIB), ("grpc.max_send_message_length", 512 * MIB)]
MAX_SEQUENCES = 64
MAX_SEQUENCE_BYTES = 256 * MIB
# What the fixed server's RSS may grow by refusing (a few MiB here; the old code grew by 0.4-1.0 GiB).
GROWTH_MIB = 64


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--max-sequences", str(MAX_SEQUENCES), "--max-sequence-bytes", str(MAX_SEQUENCE_BYTES),
                       "--warmup-dtypes", "none", "--busy-poll-us", "0", "--max-message-bytes", str(256 * MIB)) as server:
        yield server


class StallProbe:
    """GetServerInfo on a connection of its own every 20 ms while the block runs: ``longest`` is
    the slowest answer, how long the server kept the other connections waiting."""

    def __init__(self, target: str):
        self.target = target
        self.longest = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with grpc.insecure_channel(self.target) as channel:
            stub = pb_grpc.LogitServeStub(channel)
            stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)  # connected before the block
            self._ready.set()
            while not self._done.is_set():
                start = time.perf_counter()
                stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=60)
                self.longest = max(self.longest, time.perf_counter() - start)
                time.sleep(0.02)

    def __enter__(self) -> "StallProbe":
        self._ready = threading.Event()
        self._thread.start()
        assert self._ready.wait(30)
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(60)


def _refused(server, method: str, request: bytes, label: str) -> tuple[grpc.StatusCode, str]:
    """``request`` (serialized) sent to ``method``: its status and details, with the time it took,
    the RSS it left (checked) and the stall it caused printed."""
    with grpc.insecure_channel(server.target, options=BIG) as channel:
        call = channel.unary_unary(f"/logitserve.v1.LogitServe/{method}", request_serializer=None,
                                   response_deserializer=None)
        grpc.channel_ready_future(channel).result(timeout=30)
        rss = server.rss_kib() / 1024
        with StallProbe(server.target) as probe:
            start = time.perf_counter()
            try:
                call(request, timeout=120)
                code, details = grpc.StatusCode.OK, ""
            except grpc.RpcError as exc:
                code, details = exc.code(), exc.details()
            took = time.perf_counter() - start
        grown = server.rss_kib() / 1024 - rss
    print(f"{label}: {code.name} in {took:.2f} s, RSS {grown:+.1f} MiB, another connection waited up to "
          f"{probe.longest:.3f} s")
    assert grown < GROWTH_MIB, f"{label}: RSS grew {grown:.0f} MiB"
    return code, details


def test_an_open_past_max_sequences_is_refused_before_building_any(server):
    specs = [pb.SequenceSpec(id=i) for i in range(150_000)]  # 0.9 MB of bare specs
    request = pb.OpenSequencesRequest(sequences=specs).SerializeToString()
    code, details = _refused(server, "OpenSequences", request, "OpenSequences of 150k specs, --max-sequences 64")
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-sequences 64" in details, details


def test_an_update_of_ids_not_open_is_refused_before_building_any(server):
    updates = [pb.SequenceUpdate(id=i, temperature=0.5, banned_token_ids=pb.TokenIds(ids=[1, 2, 3]))
               for i in range(300_000)]
    request = pb.UpdateSequencesRequest(updates=updates).SerializeToString()
    code, details = _refused(server, "UpdateSequences", request, "UpdateSequences of 300k ids not open")
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-sequences 64" in details, details  # more than can be open
    request = pb.UpdateSequencesRequest(updates=updates[:MAX_SEQUENCES]).SerializeToString()
    code, details = _refused(server, "UpdateSequences", request, f"UpdateSequences of {MAX_SEQUENCES} ids not open")
    assert code == grpc.StatusCode.NOT_FOUND, details


def _packed_ids(count: int) -> bytes:
    """A CloseSequencesRequest of ``count`` ids 1, built as bytes (one byte an id)."""
    payload = b"\x01" * count
    length, size = bytearray(), len(payload)
    while True:
        byte, size = size & 0x7F, size >> 7
        length.append(byte | (0x80 if size else 0))
        if not size:
            break
    return b"\x0a" + bytes(length) + payload  # field 1 (ids), packed


def test_a_close_of_millions_of_ids_is_refused_without_walking_them(server):
    code, details = _refused(server, "CloseSequences", _packed_ids(20_000_000), "CloseSequences of 20 M ids")
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "20000000 sequences named" in details, details


def test_long_prompts_open_up_to_max_sequence_bytes(server):
    """Twelve sequences of a 5 M-token prompt (40 MB each on the device): the old code opened all
    twelve (458 MiB); six fit in 256 MiB, the others are refused before their lists are copied."""
    prompt = [1] * 5_000_000
    codes = []
    with grpc.insecure_channel(server.target, options=BIG) as channel:
        stub = pb_grpc.LogitServeStub(channel)
        rss = server.rss_kib() / 1024
        for i in range(12):
            request = pb.OpenSequencesRequest(sequences=[pb.SequenceSpec(id=1000 + i, prompt_token_ids=prompt)])
            try:
                stub.OpenSequences(request, timeout=120)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.append(exc.code())
                assert "--max-sequence-bytes 268435456" in exc.details()
        held = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30).stats.sequence_bytes
        grown = server.rss_kib() / 1024 - rss
        stub.CloseSequences(pb.CloseSequencesRequest(ids=range(1000, 1012)), timeout=30)
    print(f"12 opens of 5 M-token prompts, --max-sequence-bytes 256 MiB: {codes.count(grpc.StatusCode.OK)} open "
          f"({held / MIB:.1f} MiB), {codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)} refused, RSS {grown:+.0f} MiB")
    assert codes == [grpc.StatusCode.OK] * 6 + [grpc.StatusCode.RESOURCE_EXHAUSTED] * 6
    assert held == 6 * 8 * len(prompt) <= MAX_SEQUENCE_BYTES


def test_idle_sequences_leave_memory_while_nobody_calls():
    """Four 6 M-token prompts (183 MiB), idle for 2 s, then nobody calls for 5 s: the old code
    kept them resident until the next call swept them."""
    with ServerProcess("--sequence-idle-s", "2", "--warmup-dtypes", "none", "--busy-poll-us", "0",
                       env={"MALLOC_MMAP_THRESHOLD_": str(MIB)}) as server, \
            grpc.insecure_channel(server.target, options=BIG) as channel:
        stub = pb_grpc.LogitServeStub(channel)
        rss = server.rss_kib() / 1024
        for i in range(4):
            spec = pb.SequenceSpec(id=i, prompt_token_ids=[1] * 6_000_000)
            stub.OpenSequences(pb.OpenSequencesRequest(sequences=[spec]), timeout=120)
        held = server.rss_kib() / 1024 - rss
        time.sleep(2 + 0.5 + 5)  # idle time, the sweep's period (a quarter of it), then nobody calls
        idle = server.rss_kib() / 1024 - rss
    print(f"4 sequences of 6 M tokens, --sequence-idle-s 2: RSS {held:+.0f} MiB open, {idle:+.0f} MiB 5 s after "
          f"their idle time with no call")
    assert idle < GROWTH_MIB, f"RSS still {idle:+.0f} MiB with every sequence expired"
