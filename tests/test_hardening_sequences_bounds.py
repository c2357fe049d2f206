"""Issue 43 on the bounds of what sequences hold, through in-process CPU servers (torch backend
and the interpreted Triton kernels, small vocabulary).

Item 6: the bytes the open sequences' buffers hold (lists, the outputs' whole room) are bounded
by --max-sequence-bytes: an open, an update or an output's growth past it is RESOURCE_EXHAUSTED
before it is made (the old code accepted twelve 5 M-token prompts, 458 MiB, and had no bound).
"""

from __future__ import annotations

import grpc
import pytest
import torch

from logitserve.client import Client, LogitServeError
from logitserve.server import ServerConfig
from logitserve.server.testing import ServerThread

V = 48
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def _config(**changes) -> ServerConfig:
    return ServerConfig(**{"host": "127.0.0.1", "port": 0, "device": "cpu", "backend": "torch", "warmup_dtypes": (),
                           "busy_poll_us": 0, **changes})


def _error(fn, *args, **kwargs) -> LogitServeError:
    with pytest.raises(LogitServeError) as info:
        fn(*args, **kwargs)
    return info.value


def _bytes(client) -> int:
    return client.server_info().stats["sequence_bytes"]


def test_an_open_or_an_update_past_max_sequence_bytes_is_refused_before_it_is_built():
    with ServerThread(_config(max_sequence_bytes=4096)) as s, Client(s.target, timeout=30) as c:
        c.open_sequences([{"id": 1, "prompt_token_ids": [1] * 400}])  # 3,200 bytes
        assert _bytes(c) == 3200
        built = []
        s.service.sequences.open = lambda sequences, *a, **k: built.append(sequences)  # reached only once built
        err = _error(c.open_sequences, [{"id": 2, "prompt_token_ids": [1] * 200}])
        assert err.code == EXHAUSTED and "--max-sequence-bytes 4096" in err.details, err.details
        assert "1600 more bytes would make the sequences' 4800" in err.details
        assert built == []
        del s.service.sequences.open
        err = _error(c.update_sequences, [{"id": 1, "prompt_token_ids": [1] * 600}])
        assert err.code == EXHAUSTED and "--max-sequence-bytes 4096" in err.details, err.details
        assert _bytes(c) == 3200  # nothing changed
        assert c.update_sequences([{"id": 1, "prompt_token_ids": [2] * 300}]) == [0]
        assert _bytes(c) == 2400
        c.open_sequences([{"id": 2, "logit_bias": {3: 1.0}, "banned_token_ids": [4, 5]}])
        assert _bytes(c) == 2400 + 8 + 4 + 16


@pytest.mark.parametrize("backend", ["torch", "interpret"])
def test_an_output_grows_within_the_bound_then_its_sample_is_refused_before_the_draw(backend):
    prompt = 480  # 3,840 of the 4,096 bytes: room for 32 tokens of output
    with ServerThread(_config(backend=backend, max_sequence_bytes=4096)) as s, Client(s.target, timeout=120) as c:
        seqs = c.open_sequences([{"id": 5, "seed": 3, "prompt_token_ids": [7] * prompt}])
        x = torch.randn(1, V, generator=torch.Generator().manual_seed(0))
        drawn = [seqs.sample(x).token_ids.tolist()[0] for _ in range(32)]  # 16 tokens of room, then 16 more
        assert -1 not in drawn and _bytes(c) == 4096
        err = _error(seqs.sample, x)
        assert err.code == EXHAUSTED, err.details
        assert ("sequence_ids[0]: sequence 5 has no room for this call's token (its output is full at 32 tokens; "
                "nothing was drawn)") in err.details and "--max-sequence-bytes 4096" in err.details
        assert c.update_sequences([{"id": 5, "prompt_token_ids": []}]) == [32]  # the refused call drew nothing
        token = seqs.sample(x).token_ids.tolist()
        assert token == c.sample(x, seed=3, step=32).token_ids.tolist()
        assert _bytes(c) == 8 * 64  # the output's room doubled
