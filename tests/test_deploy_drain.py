"""The client half of docs/DEPLOY.md's drain rule, against two real in-process servers.

A headless Service's DNS name resolves to every ready pod; gRPC's address list
``ipv4:127.0.0.1:<a>,127.0.0.1:<b>`` is what such a name gives a channel, without DNS. Through
deploy/client/service-config.json (round_robin, client-side health checking, retries of
UNAVAILABLE), one server drains with a call in flight while four threads keep calling: no call
fails, the call in flight is answered, and the draining server turns away at most a few calls
(the health watch takes it out of the rotation at once, where without health checking it would
keep getting every other pick; its refusals are retried on the other server).

And the recipe for a drained server's sequences: reopened on another server with the seed, the
step and the output so far, a sequence draws what it would have drawn where it was.
"""

from __future__ import annotations

import collections
import pathlib
import threading
import time

import grpc
import numpy as np

from logitserve.client import Client
from logitserve.server import ServerConfig
from logitserve.server.testing import ServerThread
from logitserve.v1 import logitserve_pb2 as pb

SERVICE_CONFIG = pathlib.Path(__file__).resolve().parent.parent / "deploy" / "client" / "service-config.json"
SAMPLE = "/logitserve.v1.LogitServe/Sample"
VOCAB = 64
CALLERS = 4
# Each launch on the draining server takes this long, so its drain lasts about as long.
SLOW_LAUNCH_S = 1.0
# Calls the draining server may turn away: those picked before its NOT_SERVING reached the
# client's health watch, at most one a caller (round_robin without it: dozens in a second).
MAX_REFUSED = CALLERS


def _server() -> ServerThread:
    return ServerThread(ServerConfig(host="127.0.0.1", port=0, device="cpu", backend="torch", warmup_dtypes=()))


def _refused(server: ServerThread) -> int:
    value = server.service.metrics.registry.get_sample_value(
        "logitserve_failures_total", {"rpc": "Sample", "code": "UNAVAILABLE"})
    return int(value or 0)


def test_drain_under_round_robin_loses_no_call():
    draining, staying = _server(), _server()
    try:
        draining.service.handle.before_launch = lambda calls: time.sleep(SLOW_LAUNCH_S)
        logits = np.random.default_rng(0).standard_normal((1, VOCAB), dtype=np.float32)
        request = pb.SampleRequest(logits=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, VOCAB], data=logits.tobytes()),
                                   temperature=0.0).SerializeToString()
        target = f"ipv4:127.0.0.1:{draining.port},127.0.0.1:{staying.port}"
        outcomes: collections.Counter = collections.Counter()
        done = threading.Event()
        with grpc.insecure_channel(target, options=[("grpc.service_config", SERVICE_CONFIG.read_text())]) as channel:
            sample = channel.unary_unary(SAMPLE, response_deserializer=pb.SampleResponse.FromString)

            def call_until_done():
                while not done.is_set():
                    try:
                        sample(request, timeout=30)
                        outcomes["OK"] += 1
                    except grpc.RpcError as exc:
                        outcomes[exc.code().name] += 1

            callers = [threading.Thread(target=call_until_done) for _ in range(CALLERS)]
            for caller in callers:
                caller.start()
            deadline = time.monotonic() + 30
            while draining.service.guard.running == 0:  # a call in flight there when the drain starts
                assert time.monotonic() < deadline, "no call reached the draining server"
                time.sleep(0.01)
            started = time.monotonic()
            draining.run(draining.service.stop(10.0), timeout=60)  # what SIGTERM runs
            drain_s = time.monotonic() - started
            served_before = staying.service.batcher.launches
            time.sleep(0.3)  # the rest keeps being served
            done.set()
            for caller in callers:
                caller.join()
        assert set(outcomes) == {"OK"}, f"calls lost to the drain: {dict(outcomes)}"
        assert staying.service.batcher.launches > served_before
        assert drain_s >= SLOW_LAUNCH_S / 2, f"the drain took {drain_s:.2f} s: no call was in flight"
        assert _refused(draining) <= MAX_REFUSED, f"{_refused(draining)} calls picked the draining server"
    finally:
        draining.close()
        staying.close()


def test_sequence_reopened_elsewhere_draws_the_same_tokens():
    first, second = _server(), _server()
    try:
        rng = np.random.default_rng(1)
        steps = [rng.standard_normal((1, VOCAB), dtype=np.float32) * 3 for _ in range(8)]
        spec = dict(id=5, temperature=0.9, top_p=0.95, seed=1234, repetition_penalty=1.3, prompt_token_ids=[1, 2, 3])
        with Client(first.target, timeout=30) as client:
            client.open_sequences([spec])
            where_it_was = [int(client.sample(x, sequence_ids=[5]).token_ids[0]) for x in steps]
        with Client(first.target, timeout=30) as old, Client(second.target, timeout=30) as new:
            old.open_sequences([{**spec, "id": 6}])
            before = [int(old.sample(x, sequence_ids=[6]).token_ids[0]) for x in steps[:4]]
            # The drained server's sequence, carried over: seed, step and output from the caller's record.
            new.open_sequences([{**spec, "step": len(before), "output_token_ids": before}])
            after = [int(new.sample(x, sequence_ids=[5]).token_ids[0]) for x in steps[4:]]
        assert before + after == where_it_was
    finally:
        first.close()
        second.close()
