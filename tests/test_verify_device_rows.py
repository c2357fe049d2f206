"""VerifyDraft's per-row parameters in CUDA regions (issue 45, item 5): copied to the host and
checked on a worker thread before the call queues (``VerifyDraftCall.checked``), as Sample's are,
not on the event loop where the call is parsed. No GPU here: the stand-in regions of
test_processors_path_device_rows resolve each reference to a "CUDA" lease over a CPU tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_processors_path_device_rows import _DeviceRegions, _parsed_then_checked, reads  # noqa: F401 (a fixture)

from logitserve.client import messages
from logitserve.server.ops.verify_draft import VerifyDraftCall
from logitserve.v1 import logitserve_pb2 as pb

ROWS, N, VOCAB = 3, 2, 16


def _request(**rows_fields: torch.Tensor) -> pb.VerifyDraftRequest:
    rng = np.random.default_rng(0)
    probs = rng.random((ROWS, N, VOCAB), dtype=np.float32)
    msg = messages.verify_draft_request(np.ones((ROWS, N), np.int64), rng.standard_normal((ROWS, N + 1, VOCAB),
                                                                                          dtype=np.float32),
                                        draft_probs=probs / probs.sum(-1, keepdims=True))
    for field, t in rows_fields.items():
        getattr(msg, field).CopyFrom(pb.Tensor(dtype=pb.DTYPE_FLOAT32 if t.is_floating_point() else pb.DTYPE_INT64,
                                               shape=[ROWS], region=pb.RegionRef(region=field)))
        msg.ClearField(field.removesuffix("_rows"))
    return msg


def test_device_rows_are_read_off_the_loop_and_decide_the_key(reads):
    top_k = torch.tensor([0, 5, 0])
    seeds = torch.tensor([11, 2**62, 3])
    call, loop_thread = _parsed_then_checked(_request(top_k_rows=top_k, seed_rows=seeds),
                                             _DeviceRegions(top_k_rows=top_k, seed_rows=seeds), VerifyDraftCall)
    assert len(reads) == 2 and loop_thread not in reads
    assert call.values["top_k"] == [0, 5, 0] and call.seeds() == [11, 2**62, 3]
    assert call.filtered  # read from the rows: a row sets top_k 5
    floats, ints = call.columns()
    assert ints.torch()[:, 0].tolist() == [0, 5, 0] and ints.torch()[:, 1].tolist() == [11, 2**62, 3]


def test_a_bad_device_row_is_named_by_its_checks():
    top_p = torch.tensor([0.5, 1.5, 1.0])
    with pytest.raises(ValueError, match=r"^top_p_rows\[1\]: must be .*got 1.5$"):
        _parsed_then_checked(_request(top_p_rows=top_p), _DeviceRegions(top_p_rows=top_p), VerifyDraftCall)
