"""Issue 43 on the sequences a server keeps, through in-process CPU servers (torch backend).

Item 11: an idle sequence is freed by the table's timer, not at the next table operation (the
old code kept 183 MiB of expired sequences until some later call).

Item 10: GetServerInfo answers a caller its own sequences' figures only (the old code showed
token B the bytes of the prompt token A had just opened); everyone's are in /metrics.
"""

from __future__ import annotations

import time

from logitserve.client import Client
from logitserve.server import ServerConfig
from logitserve.server.testing import ServerThread


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
