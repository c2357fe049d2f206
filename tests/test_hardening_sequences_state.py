"""Issue 43 on the sequences a server keeps, through in-process CPU servers (torch backend).

Item 11: an idle sequence is freed by the table's timer, not at the next table operation (the
old code kept 183 MiB of expired sequences until some later call).

Item 10: GetServerInfo answers a caller its own sequences' figures only (the old code showed
token B the bytes of the prompt token A had just opened); everyone's are in /metrics.

Item 9: a process sharing its port with other server processes (--workers: each holds its own
table, and a connection reaches any of them) refuses to open a sequence, naming why and what to
do: the old code opened it, and 3 to 7 of 12 other connections then found it NOT_FOUND.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from logitserve.client import Client, LogitServeError
from logitserve.kserve import grpc_service_pb2_grpc as kpb_grpc
from logitserve.server import ServerConfig
from logitserve.server.testing import ServerThread
from test_sequences_kserve import _request


def _config(**changes) -> ServerConfig:
    return ServerConfig(**{"host": "127.0.0.1", "port": 0, "device": "cpu", "backend": "torch", "warmup_dtypes": (),
                           "busy_poll_us": 0, **changes})


def test_an_idle_sequence_is_freed_while_nobody_calls():
    with ServerThread(_config(sequence_idle_s=0.4)) as s, Client(s.target, timeout=30) as c:
        c.open_sequences([{"id": 1, "prompt_token_ids": [1] * 100_000}])
        table = s.service.sequences
        assert table.bounds.total.bytes == 800_000
        deadline = time.monotonic() + 10
        while table.expired == 0 and time.monotonic() < deadline:  # reading the counters sweeps nothing
            time.sleep(0.05)
        assert table.expired == 1 and table.bounds.total.sequences == 0 and table.bounds.total.bytes == 0


def test_server_info_shows_a_caller_its_own_sequences_only(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("alice-token\nbob-token\n")
    with ServerThread(_config(auth_token_file=str(path))) as s, \
            Client(s.target, token="alice-token", timeout=30) as alice, \
            Client(s.target, token="bob-token", timeout=30) as bob:
        before = bob.server_info().stats
        alice.open_sequences([{"id": 1, "prompt_token_ids": [1] * 12_345}])
        assert bob.server_info().stats == before  # the old code: bob saw alice's +98,760 bytes
        assert bob.server_info().stats["open_sequences"] == 0
        mine = alice.server_info().stats
        assert mine["open_sequences"] == 1 and mine["sequence_bytes"] == 8 * 12_345


def test_a_process_sharing_its_port_opens_no_sequence():
    """What --workers gives each of its processes (reuse_port), in process."""
    with ServerThread(_config(reuse_port=True)) as s, Client(s.target, timeout=30) as c:
        with pytest.raises(LogitServeError) as info:
            c.open_sequences([{"id": 1}])
        err = info.value
        assert err.code == grpc.StatusCode.FAILED_PRECONDITION
        assert err.details.startswith("OpenSequences: this server process shares its port with other server "
                                      "processes (--workers, or --reuse-port on), each holding its own sequences")
        assert "Run one server process per port (--workers 1), or one per GPU with --devices" in err.details
        with grpc.insecure_channel(s.target) as channel:
            with pytest.raises(grpc.RpcError) as info:
                kpb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
                    _request(np.zeros((1, 48), np.float32), 1, start=True), timeout=30)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert info.value.details().startswith("parameters[sequence_start]: this server process shares its port")
        assert c.server_info().stats["open_sequences"] == 0


def test_a_devices_process_keeps_sequences():
    """--devices gives each process a port of its own (reuse_port only to take it over from the
    supervisor, which held it): sequences open there."""
    with ServerThread(_config(reuse_port=True, device_endpoints=("cpu=127.0.0.1:1",))) as s, \
            Client(s.target, timeout=30) as c:
        assert c.open_sequences([{"id": 1}]).ids == [1]
