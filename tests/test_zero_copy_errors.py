"""Zero-copy tensors on the request path, CPU: bad input (each a clear status naming the field),
a hostile client, and lease lifetimes (no lease outlives its call, whatever ends it; none ends
before the device is done with the memory). The server is a `logitserve serve` process, the
client this test process."""

from __future__ import annotations

import os
import time

import grpc
import numpy as np
import pytest

from logitserve.client import LogitServeError
from logitserve.client.keys import scoped_key
from logitserve.v1 import logitserve_pb2 as pb
from test_zero_copy import Arena, Caller, data, in_region, start_server, value

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # --token-share 1: the server-wide bounds checked here, a token's share in tests/test_hardening_sequences_bounds.py.
    with start_server(tmp_path_factory.mktemp("zc-errors"), "--max-regions", "4", "--token-share", "1") as s:
        yield s


@pytest.fixture
def alice(server):
    c = Caller(server.target, "alice")
    c.arena = Arena(c, "in", 1 << 16)
    yield c
    c.client.unregister()
    c.arena.close()
    c.close()


def status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises((grpc.RpcError, LogitServeError)) as info:
        call()
    exc = info.value
    return (exc.code(), exc.details()) if isinstance(exc, grpc.RpcError) else (exc.code, exc.details)


def ref(region: str, offset: int, byte_size: int) -> pb.RegionRef:
    return pb.RegionRef(region=region, offset=offset, byte_size=byte_size)


def f32(shape, region: str = "in", offset: int = 0, byte_size: int | None = None) -> pb.Tensor:
    nbytes = int(np.prod(shape)) * 4
    return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=list(shape),
                     region=ref(region, offset, nbytes if byte_size is None else byte_size))


INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND


# ------------------------------------------------------------------------------ references


def test_bad_references_name_the_field(alice):
    cases = [
        (pb.SampleRequest(logits=f32((2, 8), "nope")), NOT_FOUND,
         "logits.region: no region 'nope' registered (by this caller)"),
        (pb.SampleRequest(logits=f32((2, 8), offset=(1 << 16) - 32)), INVALID,
         "logits.region: offset 65504 + byte_size 64 = 65568, past the end of region 'in' (65536 bytes)"),
        (pb.SampleRequest(logits=f32((2, 8), offset=1 << 62)), INVALID, "logits.region: offset 4611686018427387904"),
        (pb.SampleRequest(logits=f32((2, 8), offset=2)), INVALID,
         "logits.region.offset: 2 is not a multiple of the itemsize 4 of float32"),
        (pb.SampleRequest(logits=f32((2, 8), byte_size=60)), INVALID,
         "logits.region.byte_size: 60, but shape [2, 8] of float32 needs 64 bytes"),
        (pb.SampleRequest(logits=f32((1 << 40, 1 << 20))), INVALID, "logits.region: offset 0 + byte_size 4611686018427387904"),
        (pb.SampleRequest(logits=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2], data=b"\0" * 8, region=ref("in", 0, 8))),
         INVALID, "logits: both data and region are set"),
        (pb.SampleRequest(logits=f32((2, 8)), temperature_rows=f32((2,), "nope")), NOT_FOUND,
         "temperature_rows.region: no region 'nope'"),
        (pb.RouteExpertsRequest(gate_logits=f32((2, 8), "gone"), k=2), NOT_FOUND, "gate_logits.region: no region"),
        (pb.SoftmaxRequest(x=f32((2, 8), offset=6)), INVALID, "x.region.offset: 6 is not a multiple"),
        (pb.CausalSoftmaxRequest(x=f32((2, 8), "nope")), NOT_FOUND, "x.region: no region 'nope'"),
        (pb.SiluRequest(x=f32((2, 8)), up=f32((2, 8), offset=1)), INVALID, "up.region.offset: 1 is not a multiple"),
        (pb.StepRequest(sample=pb.SampleRequest(logits=f32((2, 8), "nope"))), NOT_FOUND,
         "sample.logits.region: no region 'nope'"),
        (pb.StepRequest(silu=pb.SiluRequest(x=f32((2, 8)), up=f32((2, 8), "x"))), NOT_FOUND, "silu.up.region: no region"),
    ]
    for request, code, message in cases:
        rpc = type(request).__name__.removesuffix("Request")
        got = status_of(lambda: getattr(alice, rpc)(request))
        assert got[0] == code and got[1].startswith(message), (request, got)
    got = status_of(lambda: list(alice.StreamSteps(iter([pb.StepRequest(softmax=pb.SoftmaxRequest(x=f32((2, 8), "n")))]))))
    assert got[0] == NOT_FOUND and got[1].startswith("softmax.x.region: no region 'n'")
    assert alice.in_use() == {"in": 0}


def test_bad_output_regions_name_the_field(alice):
    logits = f32((4, 8))
    cases = [
        ({"out": ref("in", 512, 32)}, INVALID, "output_regions: 'out' is not an output of Sample (token_ids, seeds, valid)"),
        ({"token_ids": pb.RegionRef()}, INVALID, "output_regions[token_ids].region: required"),
        ({"token_ids": ref("nope", 0, 32)}, NOT_FOUND, "output_regions[token_ids].region: no region 'nope'"),
        ({"token_ids": ref("in", 512, 8)}, INVALID,
         "output_regions[token_ids].region.byte_size: 8, but shape [4] of int64 needs 32 bytes"),
        ({"seeds": ref("in", 516, 32)}, INVALID, "output_regions[seeds].region.offset: 516 is not a multiple of the "
                                                  "itemsize 8 of int64"),
        ({"valid": ref("in", 65535, 4)}, INVALID, "output_regions[valid].region: offset 65535 + byte_size 4"),
    ]
    for outputs, code, message in cases:
        got = status_of(lambda: alice.Sample(pb.SampleRequest(logits=logits, output_regions=outputs)))
        assert got[0] == code and got[1].startswith(message), (outputs, got)
    got = status_of(lambda: alice.RouteExperts(pb.RouteExpertsRequest(gate_logits=logits, k=2, output_regions={
        "weights": ref("in", 512, 4 * 8 * 4)})))
    assert got == (INVALID, "output_regions[weights].region.byte_size: 128, but shape [4, 2] of float32 needs 32 bytes")
    got = status_of(lambda: alice.Silu(pb.SiluRequest(x=logits, output_regions={"token_ids": ref("in", 0, 8)})))
    assert got[0] == INVALID and got[1].startswith("output_regions: 'token_ids' is not an output of Silu (out)")
    got = status_of(lambda: alice.Step(pb.StepRequest(softmax=pb.SoftmaxRequest(x=logits, output_regions={
        "out": ref("nope", 0, 128)}))))
    assert got[0] == NOT_FOUND and got[1].startswith("softmax.output_regions[out].region: no region 'nope'")
    assert alice.in_use() == {"in": 0}


def test_a_validation_error_after_leases_releases_them(alice):
    temps = alice.arena.put(np.array([0.5, -1.0], np.float32))
    got = status_of(lambda: alice.Sample(pb.SampleRequest(logits=f32((2, 8), offset=1024), temperature_rows=temps,
                                                           output_regions={"token_ids": ref("in", 2048, 16)})))
    assert got[0] == INVALID and got[1].startswith("temperature_rows[1]: must be")
    got = status_of(lambda: alice.Sample(pb.SampleRequest(logits=f32((2, 8), offset=1024), min_p=0.5, random_val=0.5,
                                                           output_regions={"token_ids": ref("in", 2048, 16)})))
    assert got[0] == INVALID and got[1].startswith("min_p: must be 0 with random_val")
    got = status_of(lambda: alice.Step(pb.StepRequest(softmax=pb.SoftmaxRequest(x=f32((2, 8))),
                                                      silu=pb.SiluRequest(x=f32((2, 8)), up=f32((3, 8))))))
    assert got[0] == INVALID and got[1].startswith("silu.up.shape: [3, 8] does not broadcast")
    assert alice.in_use() == {"in": 0}


def test_regions_are_visible_only_to_their_token(server, alice):
    bob = Caller(server.target, "bob")
    try:
        got = status_of(lambda: bob.Softmax(pb.SoftmaxRequest(x=f32((2, 8)))))
        assert got[0] == NOT_FOUND and "no region 'in' registered (by this caller)" in got[1]
        got = status_of(lambda: bob.Sample(pb.SampleRequest(logits=data(np.zeros((1, 4), np.float32)),
                                                            output_regions={"token_ids": ref("in", 0, 8)})))
        assert got[0] == NOT_FOUND
        assert bob.client.shared_memory_status() == [] and bob.client.unregister("in") == []
        assert alice.in_use() == {"in": 0}  # still alice's
        # No token: refused before anything is resolved.
        with grpc.insecure_channel(server.target) as channel:
            call = channel.unary_unary("/logitserve.v1.LogitServe/Softmax",
                                       request_serializer=pb.SoftmaxRequest.SerializeToString,
                                       response_deserializer=pb.SoftmaxResponse.FromString)
            got = status_of(lambda: call(pb.SoftmaxRequest(x=f32((2, 8))), timeout=30))
            assert got[0] == grpc.StatusCode.UNAUTHENTICATED
    finally:
        bob.close()


# ------------------------------------------------------------------------------ registration


def test_bad_registrations(server, alice):
    client = alice.client
    arena = alice.arena
    cases = [
        (lambda: client.register_system("in", arena.buf), grpc.StatusCode.ALREADY_EXISTS,
         "name: a region 'in' is already registered"),
        (lambda: client.register_system("a/b", arena.buf), INVALID, "name: 'a/b' is not a valid region name"),
        (lambda: client.register_system("x", "../../etc/passwd", 8), INVALID,
         "key: '../../etc/passwd' is not a plain shared-memory name"),
        (lambda: client.register_system("x", scoped_key(alice.token, "no-such-object-zc"), 8), INVALID,
         "key: no shared-memory object"),
        (lambda: client.register_system("x", "no-such-object-zc", 8), INVALID,
         "key: must start with this token's prefix"),
        (lambda: client.register_system("x", arena.buf.key, 1 << 17), INVALID, "offset + byte_size: 0 + 131072"),
        (lambda: client.register_cuda("x", b"\0" * 64, device_id=0, byte_size=8), INVALID,
         "device_id: 0 is not a device of this server (none)"),
        (lambda: client.register_cuda("x", b"\0" * 3, device_id=0, byte_size=8), INVALID, "device_id: 0 is not"),
    ]
    for call, code, message in cases:
        got = status_of(call)
        assert got[0] == code and got[1].startswith(message), got
    # Limits: --max-regions 4 and --max-region-bytes 8 MiB, all owners together.
    big = Arena(alice, "big", 4 << 20)
    try:
        got = status_of(lambda: client.register_system("big2", big.buf.key, 4 << 20))
        assert got[0] == grpc.StatusCode.RESOURCE_EXHAUSTED and got[1].startswith("byte_size: registering 'big2'")
        client.register_system("two", arena.buf)
        client.register_system("three", arena.buf)
        got = status_of(lambda: client.register_system("five", arena.buf))
        assert got[0] == grpc.StatusCode.RESOURCE_EXHAUSTED and got[1].startswith("name: registering 'five' would map 5")
    finally:
        client.unregister("big")
        client.unregister("two")
        client.unregister("three")
        big.close()


def test_an_object_shrunk_after_registration_is_refused_not_read(server, alice):
    arena = Arena(alice, "shrinks", 1 << 16)
    try:
        os.ftruncate(arena.buf.shm._fd, 4096)
        got = status_of(lambda: alice.Softmax(pb.SoftmaxRequest(x=f32((2, 8), "shrinks"))))
        assert got[0] == INVALID and "shrank to 4096 bytes" in got[1]
        assert value(alice.Softmax(pb.SoftmaxRequest(x=data(np.ones((1, 2), np.float32)))).out).shape == (1, 2)
    finally:
        alice.client.unregister("shrinks")
        arena.close()


def test_an_output_overlapping_its_input(alice):
    """Partly: the kernels' rule (refused, INVALID_ARGUMENT, where a plan checks it; the torch
    reference computes something); either way the server goes on."""
    x = alice.arena.put(np.ones((2, 8), np.float32))
    at = x.region.offset + 4
    try:
        alice.Softmax(pb.SoftmaxRequest(x=x, output_regions={"out": ref("in", at, 64)}))
    except grpc.RpcError as exc:
        assert exc.code() == INVALID, exc
    # In place (out is x itself) is fine.
    x = alice.arena.put(np.ones((2, 8), np.float32))
    answer = alice.Softmax(pb.SoftmaxRequest(x=x, output_regions={"out": x.region}))
    np.testing.assert_allclose(in_region(answer.out, x.region, alice.arena), np.full((2, 8), 1 / 8))
    assert alice.in_use() == {"in": 0}


# ------------------------------------------------------------------------------ lease lifetimes


@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    """A server whose every launch first sleeps 400 ms (in-process hook), two calls queued at most."""
    with start_server(tmp_path_factory.mktemp("zc-slow"), "--max-queue", "2", launch_delay_ms=400) as s:
        yield s


@pytest.fixture
def carol(slow):
    c = Caller(slow.target, "carol")
    c.arena = Arena(c, "in", 1 << 16)
    yield c
    c.client.unregister()
    c.arena.close()
    c.close()


def softmax(caller: Caller, timeout: float = 60):
    """A call with its input and its output in the region: a future."""
    x = caller.arena.put(np.ones((2, 8), np.float32))
    out = caller.arena.out(np.float32, (2, 8))
    return caller.stub.Softmax.future(pb.SoftmaxRequest(x=x, output_regions={"out": out}), metadata=caller.metadata,
                                      timeout=timeout)


def wait_in_use(caller: Caller, name: str, expect: int, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while caller.in_use().get(name, 0) != expect:
        assert time.monotonic() < deadline, caller.in_use()
        time.sleep(0.02)


def test_no_lease_outlives_a_queue_full_a_deadline_or_a_cancel_before_launch(carol):
    first = softmax(carol)  # launching (400 ms)
    wait_in_use(carol, "in", 2)  # its input and its output
    queued, doomed = softmax(carol), softmax(carol, timeout=0.2)
    time.sleep(0.05)
    full = softmax(carol)
    assert full.exception(30).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    cancelled = softmax(carol)  # refused too (queue full) or queued
    time.sleep(0.05)
    cancelled.cancel()
    assert doomed.exception(30).code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert first.result(30).out.region.region == "in"
    assert queued.result(30).out.region.region == "in"
    wait_in_use(carol, "in", 0)


def test_a_call_cancelled_during_its_launch_holds_its_leases_until_the_device_is_done(carol):
    call = softmax(carol)
    wait_in_use(carol, "in", 2)  # its input and its output, through the launch
    time.sleep(0.1)
    call.cancel()
    time.sleep(0.1)
    # The handler has let go; the launch (still sleeping its 400 ms) has not.
    assert carol.in_use() == {"in": 2}
    assert carol.client.unregister("in") == ["in"]  # out of the table at once; mapped until the launch ends
    assert carol.client.shared_memory_status() == []
    time.sleep(0.6)
    carol.client.register_system("in", carol.arena.buf)  # the name is free again
    assert carol.in_use() == {"in": 0}
    answer = softmax(carol).result(30)
    assert answer.out.region.region == "in"


def test_unregistering_a_region_a_queued_call_uses_keeps_it_mapped_until_that_call_ends(carol):
    blocker = softmax(carol)
    wait_in_use(carol, "in", 2)
    x = np.zeros((2, 8), np.float32)
    x[:, 5] = 9
    queued = carol.arena.put(x)
    out = carol.arena.out(np.int64, (2,))
    call = carol.stub.Sample.future(pb.SampleRequest(logits=queued, temperature=0.0, output_regions={"token_ids": out}),
                                    metadata=carol.metadata, timeout=30)
    wait_in_use(carol, "in", 4)
    assert carol.client.unregister("in") == ["in"]
    assert carol.client.shared_memory_status() == []
    assert blocker.result(30).out.region.region == "in"
    answer = call.result(30)
    assert in_region(answer.token_ids, out, carol.arena).tolist() == [5, 5]  # written into the unregistered region
    carol.client.register_system("in", carol.arena.buf)
    assert carol.in_use() == {"in": 0}
