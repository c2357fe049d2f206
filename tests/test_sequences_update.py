"""UpdateSequences (issue 33, item 3): a sequence's parameters, seed, penalties, min_tokens and
lists changed mid-decode, its output and step kept, through an in-process CPU server (torch
backend, small vocabulary). After each update the sequence draws what the stateless Sample
draws with the new values and the output so far; a refused update changes nothing.
"""

from __future__ import annotations

import threading

import grpc
import torch

from test_sample_processors import ragged
from test_sequences import INVALID, V, _error, server  # noqa: F401 (the server fixture)


def _stateless(client, logits, state, step):
    """The Sample without sequences that sends one row's values and lists."""
    lists = {}
    for name in ("prompt", "output", "banned", "stop"):
        ids, offsets = ragged([state.get(name, [])])
        lists[f"{name}_token_ids"], lists[f"{name}_offsets"] = (ids if ids.numel() else None), offsets
    bias = state.get("logit_bias", {})
    ids, offsets = ragged([list(bias)])
    return client.sample(
        logits, seed=state["seed"], step=step, temperature=state.get("temperature", 1.0),
        top_k=state.get("top_k", 0), repetition_penalty=state.get("repetition_penalty", 1.0),
        frequency_penalty=state.get("frequency_penalty", 0.0), min_tokens=state.get("min_tokens", 0),
        logit_bias_ids=ids if ids.numel() else None, logit_bias_offsets=offsets,
        logit_bias_values=list(bias.values()) or None, **lists).token_ids.tolist()


def test_an_update_changes_the_state_and_keeps_output_and_step(server, client):
    gen = torch.Generator().manual_seed(7)
    state = {"seed": 21, "temperature": 0.9, "prompt": [1, 2, 3], "repetition_penalty": 1.4, "output": []}
    changes = {  # step -> the update sent before it, as the client sends it and as the state it makes
        4: ({"temperature": 0.0, "banned_token_ids": list(range(10))}, {"temperature": 0.0, "banned": list(range(10))}),
        8: ({"banned_token_ids": [], "logit_bias": {40: 5.0}, "frequency_penalty": 0.5, "seed": 5},
            {"banned": [], "logit_bias": {40: 5.0}, "frequency_penalty": 0.5, "seed": 5, "temperature": 0.0}),
        12: ({"temperature": 1.2, "top_k": 5, "prompt_token_ids": [40, 41], "min_tokens": 50, "stop_token_ids": [40]},
             {"temperature": 1.2, "top_k": 5, "prompt": [40, 41], "min_tokens": 50, "stop": [40]}),
        16: ({"logit_bias": {}}, {"logit_bias": {}}),
    }
    with client.open_sequences([{"id": 3, "seed": 21, "temperature": 0.9, "prompt_token_ids": [1, 2, 3],
                                 "repetition_penalty": 1.4}]) as seqs:
        for step in range(20):
            if step in changes:
                update, effect = changes[step]
                assert client.update_sequences([{"id": 3, **update}]) == [step]  # the step is kept
                state.update(effect)
            logits = torch.randn(1, V, generator=gen) * 3
            got = seqs.sample(logits).token_ids.tolist()
            assert got == _stateless(client, logits, state, step), f"step {step}"
            state["output"].append(got[0])
    drawn = state["output"]
    assert all(t >= 10 for t in drawn[4:8])  # the ban held, then was lifted (greedy: the arg-max)
    assert all(t != 40 for t in drawn[12:]) and 40 in drawn[8:12]  # the bias drew 40; min_tokens stopped it


def test_a_refused_update_changes_nothing(server, client):
    x = torch.randn(1, V, generator=torch.Generator().manual_seed(2))
    before = client.server_info().stats["sequence_bytes"]
    with client.open_sequences([{"id": 1, "seed": 1}, {"id": 2, "seed": 2}]):
        for updates, code, message in (
                ([{"id": 1, "temperature": 0.0}, {"id": 9}], grpc.StatusCode.NOT_FOUND,
                 "updates[1].id: no open sequence 9 for this caller"),
                ([{"id": 1, "banned_token_ids": list(range(V))}, {"id": 2, "top_p": 0.0}], INVALID,
                 "updates[1].top_p: must be in (0, 1]"),
                ([{"id": 1, "logit_bias": {3: 1e39}}], INVALID, "updates[0].logit_bias.values[0]: must be finite"),
                ([{"id": 1, "stop_token_ids": [2, -4]}], INVALID, "updates[0].stop_token_ids.ids[1]: must be a token"),
                ([{"id": 1}, {"id": 1}], INVALID, "updates[1].id: 1 appears twice in this request")):
            err = _error(client.update_sequences, updates)
            assert err.code == code and message in err.details, err.details
        assert client.sample(x, sequence_ids=[1]).token_ids.tolist() == client.sample(x, seed=1, step=0).token_ids.tolist()
        held = client.server_info().stats["sequence_bytes"]
        client.update_sequences([{"id": 1, "prompt_token_ids": list(range(30))}])
        assert client.server_info().stats["sequence_bytes"] == held + 8 * 30  # the new list is counted
        client.update_sequences([{"id": 1, "prompt_token_ids": []}])
        assert client.server_info().stats["sequence_bytes"] == held
        client.update_sequences([{"id": 2, "banned_token_ids": [V + 3]}])  # below --max-vocab, past this vocabulary
        err = _error(client.sample, x, sequence_ids=[2])
        assert err.code == INVALID and f"holds token id {V + 3}, not below this call's vocabulary" in err.details
    assert client.server_info().stats["sequence_bytes"] == before


def test_an_update_while_a_call_waits_applies_to_that_call(server, client):
    """The launch reads the state (once, whole), not the lookup: an update made while the call
    waits for its launch draws with the new ban and bias together."""
    client.open_sequences([{"id": 4, "temperature": 0.0}])
    entered, release = threading.Event(), threading.Event()
    handle = server.service.handle

    def hold(_calls):
        entered.set()
        release.wait(10)

    x = torch.zeros(1, V)
    x[0, 0] = 10.0  # greedy: 0, unless banned
    answer = {}
    handle.before_launch = hold
    caller = threading.Thread(target=lambda: answer.update(tokens=client.sample(x, sequence_ids=[4]).token_ids))
    try:
        caller.start()
        assert entered.wait(10)
        client.update_sequences([{"id": 4, "banned_token_ids": [0], "logit_bias": {7: 5.0}}])
    finally:
        handle.before_launch = None
        release.set()
        caller.join(10)
    client.close_sequences([4])
    assert answer["tokens"].tolist() == [7]
