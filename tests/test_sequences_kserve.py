"""Sequences on the KServe front (issue 33, item 3): Triton's sequence parameters
(``sequence_id``, ``sequence_start``, ``sequence_end``) on the ``sample`` model, through raw
``inference.GRPCInferenceService`` stubs against an in-process CPU server (torch backend).

A decode through KServe draws the tokens logitserve.v1's sequence calls draw; the same table
serves both fronts (a sequence opened by OpenSequences is sampled by KServe, per bearer token);
an unknown id is NOT_FOUND with the hint, sequence_end closes, a failed sequence_start leaves
nothing open, and broken requests name the parameter and the rule.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from logitserve.kserve import grpc_service_pb2 as kpb
from logitserve.kserve import grpc_service_pb2_grpc as kpb_grpc
from logitserve.server.testing import ServerThread
from test_sequences import INVALID, NOT_FOUND, V, _config, server  # noqa: F401 (the server fixture)


@pytest.fixture
def kserve(server):
    with grpc.insecure_channel(server.target) as channel:
        yield kpb_grpc.GRPCInferenceServiceStub(channel)


def _request(logits: np.ndarray, seq_id=None, start=False, end=False, **params) -> kpb.ModelInferRequest:
    """A ``sample`` request as tritonclient builds it: the three sequence parameters when an id is given."""
    request = kpb.ModelInferRequest(
        model_name="sample",
        inputs=[kpb.ModelInferRequest.InferInputTensor(name="LOGITS", datatype="FP32", shape=list(logits.shape))],
        raw_input_contents=[np.ascontiguousarray(logits, np.float32).tobytes()])
    if seq_id is not None:
        if isinstance(seq_id, str):
            request.parameters["sequence_id"].string_param = seq_id
        else:
            request.parameters["sequence_id"].int64_param = seq_id
        request.parameters["sequence_start"].bool_param = start
        request.parameters["sequence_end"].bool_param = end
    for key, value in params.items():
        kind = {bool: "bool_param", int: "int64_param", float: "double_param", str: "string_param"}[type(value)]
        setattr(request.parameters[key], kind, value)
    return request


def _tokens(answer: kpb.ModelInferResponse, name: str = "TOKEN_IDS") -> list[int]:
    index = [o.name for o in answer.outputs].index(name)
    return np.frombuffer(answer.raw_output_contents[index], np.int64).tolist()


def _error(fn, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn(request, timeout=30)
    return info.value


def test_a_kserve_decode_draws_the_tokens_of_logitserve_v1s_sequence(server, kserve, client):
    steps = [np.random.default_rng(step).standard_normal((1, V)).astype(np.float32) * 3 for step in range(10)]
    params = dict(temperature=0.8, top_k=12, top_p=0.95, seed=1234, step=5)
    got = []
    for step, logits in enumerate(steps):
        first, last = step == 0, step == len(steps) - 1
        answer = kserve.ModelInfer(_request(logits, 77, start=first, end=last, **(params if first else {})),
                                   timeout=30)
        got += _tokens(answer)
        assert _tokens(answer, "SEEDS") == [1234]
    with client.open_sequences([{"id": 77, **params}]) as seqs:  # ended over KServe: the id is free again
        want = [t for logits in steps for t in seqs.sample(torch.from_numpy(logits)).token_ids.tolist()]
    assert got == want
    stateless = [client.sample(torch.from_numpy(logits), temperature=0.8, top_k=12, top_p=0.95, seed=1234,
                               step=5 + step).token_ids.tolist()[0] for step, logits in enumerate(steps)]
    assert got == stateless  # no penalty: the step counter alone carries the state
    assert client.server_info().stats["open_sequences"] == 0


def test_both_fronts_share_one_table_and_stream_requests_sample_too(server, kserve, client):
    x = np.random.default_rng(3).standard_normal((1, V)).astype(np.float32)
    client.open_sequences([{"id": 5, "seed": 9, "banned_token_ids": list(range(V - 1))}])  # draws V - 1 only
    assert _tokens(kserve.ModelInfer(_request(x, 5), timeout=30)) == [V - 1]
    answers = list(kserve.ModelStreamInfer(iter([_request(x, 5), _request(x, 5, end=True), _request(x, 5)]),
                                           timeout=30))
    assert [_tokens(a.infer_response) for a in answers[:2]] == [[V - 1], [V - 1]]
    assert "no open sequence 5 for this caller" in answers[2].error_message  # the stream went on
    assert client.close_sequences([5]) == []  # sequence_end closed it


def test_an_unknown_id_is_not_found_with_the_hint(kserve):
    err = _error(kserve.ModelInfer, _request(np.zeros((1, V), np.float32), 404))
    assert err.code() == NOT_FOUND
    assert err.details().startswith("parameters[sequence_id]: no open sequence 404 for this caller")
    assert "open it first with OpenSequences, or by a request with parameters[sequence_start] true" in err.details()


def test_a_failed_start_leaves_nothing_open(server, kserve, client):
    bad = _request(np.zeros((1, 0), np.float32), 8, start=True, seed=1)  # opens, then LOGITS is refused
    err = _error(kserve.ModelInfer, bad)
    assert err.code() == INVALID and "LOGITS" in err.details(), err.details()
    assert client.server_info().stats["open_sequences"] == 0
    x = np.zeros((1, V), np.float32)
    kserve.ModelInfer(_request(x, 8, start=True, seed=1), timeout=30)  # the retry starts it
    err = _error(kserve.ModelInfer, _request(x, 8, start=True))
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS
    assert err.details().startswith("parameters[sequence_id]: sequence 8 is open already"), err.details()
    kserve.ModelInfer(_request(x, 8, end=True), timeout=30)  # the refused start closed nothing
    assert client.server_info().stats["open_sequences"] == 0


@pytest.mark.parametrize("request_of, code, message", [
    (lambda x: _request(np.zeros((2, V), np.float32), 1, start=True), INVALID,
     "LOGITS: shape [2, 48] has 2 rows, but a request with parameters[sequence_id] samples its one sequence"),
    (lambda x: _request(x, "corr-1", start=True), INVALID,
     "parameters[sequence_id]: must be an int64 (logitserve's sequence ids are numbers"),
    (lambda x: _request(x, sequence_start=True), INVALID,
     "parameters[sequence_start]: needs parameters[sequence_id]"),
    (lambda x: _request(x, 1, start=True, temperature=-1.0), INVALID, "parameters[temperature]: must be"),
    (lambda x: _request(x, 1, start=True, random_val=0.5), INVALID,
     "parameters[random_val]: not taken with parameters[sequence_id]"),
    (lambda x: _request(x, 1, temperature=0.5), INVALID,
     "parameters[temperature]: must be unset on a sequence's later requests"),
    (lambda x: _request(x, 1, start=True, sequence_end=1), INVALID, "parameters[sequence_end]: must be bool"),
])
def test_bad_sequence_requests(server, kserve, client, request_of, code, message):
    err = _error(kserve.ModelInfer, request_of(np.zeros((1, V), np.float32)))
    assert err.code() == code and message in err.details(), err.details()
    assert client.server_info().stats["open_sequences"] == 0


def test_per_row_inputs_and_other_models_are_refused(kserve):
    request = _request(np.zeros((1, V), np.float32), 1, start=True)
    request.inputs.add(name="TEMPERATURE", datatype="FP32", shape=[1])
    request.raw_input_contents.append(np.ones(1, np.float32).tobytes())
    err = _error(kserve.ModelInfer, request)
    assert err.code() == INVALID and "input TEMPERATURE: not taken with parameters[sequence_id]" in err.details()
    request = kpb.ModelInferRequest(
        model_name="softmax", inputs=[kpb.ModelInferRequest.InferInputTensor(name="X", datatype="FP32", shape=[1, 4])],
        raw_input_contents=[np.zeros(4, np.float32).tobytes()])
    request.parameters["sequence_id"].int64_param = 3
    err = _error(kserve.ModelInfer, request)
    assert err.code() == INVALID and "model 'softmax' keeps no sequences" in err.details()


def test_a_bearer_token_sees_only_its_own_sequences_over_kserve(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("alice-token\nbob-token\n")
    x = np.zeros((1, V), np.float32)
    with ServerThread(_config(auth_token_file=str(path))) as s, grpc.insecure_channel(s.target) as channel:
        stub = kpb_grpc.GRPCInferenceServiceStub(channel)
        alice, bob = [("authorization", "Bearer alice-token")], [("authorization", "Bearer bob-token")]
        stub.ModelInfer(_request(x, 1, start=True), metadata=alice, timeout=30)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(_request(x, 1), metadata=bob, timeout=30)
        assert info.value.code() == NOT_FOUND
        stub.ModelInfer(_request(x, 1, end=True), metadata=alice, timeout=30)
