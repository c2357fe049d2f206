"""examples/hf_decode.py (issue 34, item 1): a decode loop over a transformers causal LM whose
tokens come from logitserve, checked against ``model.generate`` with transformers' own logits
processors, through an in-process CPU server (torch backend).

The model is a random 2-layer Llama (no download); three prompts of different lengths decode as
one left-padded batch. transformers applies sequence_bias -> repetition_penalty -> bad_words ->
min_new_tokens, logitserve penalties -> bias -> banned / min_tokens (docs/DESIGN.md): each
processor is compared alone, then the combinations whose order cannot matter (the masks come
last in both), and repetition penalty with bias through transformers' processor classes listed
in logitserve's order. Every setting is chosen so that it changes the greedy output, so no
comparison passes because the setting did nothing.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import grpc
import numpy as np
import pytest
import torch

from transformers import (LogitsProcessorList, MinNewTokensLengthLogitsProcessor, NoBadWordsLogitsProcessor,
                          RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor)

from logitserve.client import Client, LogitServeError
from logitserve.server import ServerConfig
from logitserve.server.process import ServerProcess
from logitserve.server.testing import ServerThread

_spec = importlib.util.spec_from_file_location(
    "hf_decode", pathlib.Path(__file__).resolve().parents[1] / "examples" / "hf_decode.py")
hf_decode = sys.modules["hf_decode"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up there
_spec.loader.exec_module(hf_decode)

# Greedy decoding picks 181 and 235 here: the repetition penalty's reading of the prompt shows.
PROMPTS = [[1, 5, 9, 5, 181], [7, 3, 167], [4, 235, 4, 4, 4, 6]]
# A token greedy decoding never picks here (checked): transformers before 5 penalise the padding
# of left-padded prompts too, which then changes nothing.
PAD = 254
STEPS = 12


@pytest.fixture(scope="module")
def server():
    config = ServerConfig(host="127.0.0.1", port=0, device="cpu", backend="torch", warmup_dtypes=())
    with ServerThread(config) as s:
        yield s


@pytest.fixture(scope="module")
def model():
    return hf_decode.tiny_llama(vocab_size=256, seed=0)


@pytest.fixture(scope="module")
def plain(model):
    """Greedy tokens with no processor (and no eos), [B, STEPS]."""
    return _generate(model, eos=None)


def _generate(model, *, eos, logits_processor=None, **settings) -> np.ndarray:
    """model.generate's new tokens (pad after eos), settings as transformers names them with
    single-token bad words and sequence bias given as {id: bias} / [ids]."""
    ids, mask = hf_decode.left_pad(PROMPTS, PAD, "cpu")
    if "sequence_bias" in settings:
        settings["sequence_bias"] = [[[t], b] for t, b in settings["sequence_bias"].items()]
    if "bad_words_ids" in settings:
        settings["bad_words_ids"] = [[t] for t in settings["bad_words_ids"]]
    out = model.generate(ids, attention_mask=mask, max_new_tokens=STEPS, do_sample=False, eos_token_id=eos,
                         pad_token_id=PAD, logits_processor=logits_processor, **settings)
    return out[:, ids.shape[1]:].numpy()


def _decode(model, client, **options) -> hf_decode.DecodeResult:
    options.setdefault("max_new_tokens", STEPS)
    return hf_decode.decode(model, client, PROMPTS, hf_decode.DecodeOptions(pad_token_id=PAD, **options))


def _eos(plain) -> int:
    """An eos that greedy decoding meets early: row 0's second token (so rows end at different
    steps, and min_new_tokens changes the output)."""
    return int(plain[0, 1])


# Settings that each change the greedy output of the model above (checked by the test).
CASES = {
    "repetition_penalty": dict(repetition_penalty=1.8),
    "bad_words": dict(bad_words_ids="plain"),
    "min_new_tokens": dict(min_new_tokens=5),
    "sequence_bias": dict(sequence_bias={17: 3.0, 99: 2.5}),
    "penalty+bad+min": dict(repetition_penalty=1.8, bad_words_ids="plain", min_new_tokens=5),
    "bias+bad+min": dict(sequence_bias={17: 3.0, 99: 2.5}, bad_words_ids="plain", min_new_tokens=5),
}


def _settings(name, plain) -> dict:
    settings = dict(CASES[name])
    if settings.get("bad_words_ids") == "plain":  # ban the rows' first greedy tokens
        settings["bad_words_ids"] = sorted({int(t) for t in plain[:, 0]} - {_eos(plain)})
    return settings


@pytest.mark.parametrize("use_sequences", [True, False], ids=["sequences", "stateless"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_greedy_matches_generate(server, model, plain, name, use_sequences):
    settings, eos = _settings(name, plain), _eos(plain)
    expected = _generate(model, eos=eos, **settings)
    with Client(server.target, timeout=60) as client:
        result = _decode(model, client, eos_token_id=eos, use_sequences=use_sequences, **settings)
        assert client.server_info().stats["open_sequences"] == 0  # the loop closed its sequences
    np.testing.assert_array_equal(result.token_ids, expected, err_msg=name)
    assert not np.array_equal(expected, _generate(model, eos=eos)), f"{name}: changes nothing, compares nothing"
    if name == "repetition_penalty":  # and the prompt's tokens are among those it penalises
        ids, _ = hf_decode.left_pad(PROMPTS, PAD, "cpu")
        output_only = RepetitionPenaltyLogitsProcessor(settings[name], prompt_ignore_length=ids.shape[1])
        assert not np.array_equal(expected, _generate(model, eos=eos, logits_processor=LogitsProcessorList(
            [output_only]))), "the prompt's tokens change nothing"
    ended = (expected == eos).any(axis=1)
    np.testing.assert_array_equal(result.lengths < STEPS, ended)  # rows end at their eos
    before_end = np.arange(result.token_ids.shape[1])[None, :] < result.lengths[:, None]
    assert not (result.token_ids[before_end] == PAD).any(), "the pad token was picked: choose another PAD"


def test_penalty_then_bias_in_logitserve_order(server, model, plain):
    """Repetition penalty and bias on the same tokens: logitserve penalises, then adds the bias;
    transformers' generate adds the bias first. The reference is transformers' own processors
    listed in logitserve's order (the penalty skipping the padding as generate's does)."""
    eos = _eos(plain)
    bias = {int(t): 1.5 for t in plain[:, :3].flatten()}  # tokens the output repeats: penalised and biased
    ids, mask = hf_decode.left_pad(PROMPTS, PAD, "cpu")
    processors = LogitsProcessorList([
        RepetitionPenaltyLogitsProcessor(1.8, prompt_ignore_length=(mask == 0).sum(dim=1)),
        SequenceBiasLogitsProcessor(sequence_bias=[[[t], b] for t, b in bias.items()]),
        NoBadWordsLogitsProcessor([[200]], eos_token_id=eos),
        MinNewTokensLengthLogitsProcessor(ids.shape[1], 5, eos),
    ])
    expected = _generate(model, eos=eos, logits_processor=processors)
    with Client(server.target, timeout=60) as client:
        result = _decode(model, client, eos_token_id=eos, repetition_penalty=1.8, sequence_bias=bias,
                         bad_words_ids=[200], min_new_tokens=5)
    np.testing.assert_array_equal(result.token_ids, expected)
    generate_order = _generate(model, eos=eos, repetition_penalty=1.8, sequence_bias=bias, bad_words_ids=[200],
                               min_new_tokens=5)
    assert not np.array_equal(generate_order, expected), "the orders agree here: the test shows no difference"


def test_bfloat16_model(server, plain):
    """A bfloat16 model: the loop sends bfloat16 logits, logitserve processes them in float32, as
    generate upcasts them to float32 before its processors."""
    model = hf_decode.tiny_llama(vocab_size=256, seed=0, dtype=torch.bfloat16)
    eos = _eos(plain)
    settings = dict(repetition_penalty=1.8, bad_words_ids=[17], min_new_tokens=3)
    with Client(server.target, timeout=60) as client:
        result = _decode(model, client, eos_token_id=eos, transport="shm", **settings)
    np.testing.assert_array_equal(result.token_ids, _generate(model, eos=eos, **settings))


@pytest.mark.parametrize("transport", ["bytes", "shm"])
def test_logprobs_are_log_softmax_of_the_model(server, model, transport):
    ids, mask = hf_decode.left_pad(PROMPTS, PAD, "cpu")
    out = model.generate(ids, attention_mask=mask, max_new_tokens=STEPS, do_sample=False, pad_token_id=PAD,
                         eos_token_id=None, repetition_penalty=1.3, return_dict_in_generate=True,
                         output_logits=True)
    with Client(server.target, timeout=60) as client:
        result = _decode(model, client, logprobs=2, transport=transport, repetition_penalty=1.3)
    raw = torch.stack(out.logits, dim=1).log_softmax(dim=-1)  # [B, steps, V], before any processor
    expected = raw.gather(2, torch.as_tensor(result.token_ids)[..., None])[..., 0]
    np.testing.assert_allclose(result.token_logprobs, expected.numpy(), rtol=0, atol=1e-5)


def test_seeded_sampling_replays(server, model):
    settings = dict(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.2, max_new_tokens=16)
    with Client(server.target, timeout=60) as client:
        first = _decode(model, client, seed=1234, **settings)
        again = _decode(model, client, seed=1234, **settings)
        stateless = _decode(model, client, seed=1234, use_sequences=False, transport="shm", **settings)
        other = _decode(model, client, seed=99, **settings)
    assert first.seeds == [1234, 1235, 1236]
    np.testing.assert_array_equal(again.token_ids, first.token_ids)
    np.testing.assert_array_equal(stateless.token_ids, first.token_ids)  # sequences sample as stateless calls
    assert not np.array_equal(other.token_ids, first.token_ids)


def test_server_drawn_seeds_are_returned(server, model):
    """Without a seed the server draws one per row; the result names them."""
    with Client(server.target, timeout=60) as client:
        first = _decode(model, client, temperature=1.0, max_new_tokens=8)
        stateless = _decode(model, client, temperature=1.0, max_new_tokens=8, use_sequences=False)
    assert len(first.seeds) == len(PROMPTS) and None not in first.seeds
    assert len(stateless.seeds) == len(PROMPTS) and None not in stateless.seeds


def test_a_row_with_no_token_left_names_it(server, model, plain):
    eos = _eos(plain)
    every_other = [t for t in range(256) if t != eos]
    with Client(server.target, timeout=60) as client:
        with pytest.raises(RuntimeError, match=r"row 0, step 0: no token left to draw"):
            _decode(model, client, eos_token_id=eos, bad_words_ids=every_other, min_new_tokens=1)
        assert client.server_info().stats["open_sequences"] == 0  # closed on the way out


def test_command_line(server, capsys):
    hf_decode.main(["--tiny", "--prompt", "1,2,3", "--prompt", "4,5", "--max-new-tokens", "4", "--server",
                    server.target, "--transport", "shm", "--seed", "3", "--temperature", "0.7"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("[0] [") and lines[1].startswith("[1] [")
    assert "tokens/s" in lines[2] and "% of the loop in logitserve calls (shm, sequences)" in lines[2]


@pytest.mark.cuda
@pytest.mark.parametrize("transport", ["cuda", "ordered"])
def test_decoding_on_the_gpu_matches_generate(transport):
    """The model on the GPU, its logits in a CUDA IPC region the server reads in place; with
    ``ordered``, the draws ordered on the GPU and the tokens read by the next forward there."""
    if transport == "ordered":
        pytest.importorskip("cuda.bindings")
        sys.path.insert(0, str(pathlib.Path(hf_decode.__file__).parent))  # hf_decode_ordered, beside it
    model = hf_decode.tiny_llama(vocab_size=256, seed=0).to("cuda")
    ids, mask = hf_decode.left_pad(PROMPTS, PAD, "cuda")
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=STEPS, do_sample=False, pad_token_id=PAD,
                              eos_token_id=None, repetition_penalty=1.5)[:, ids.shape[1]:].cpu().numpy()
    # A server process of its own: CUDA opens no IPC handle in the process that exported it.
    with ServerProcess("--warmup-dtypes", "none", device="cuda:0", backend="triton") as s, \
            Client(s.target, timeout=300) as client:
        result = _decode(model, client, repetition_penalty=1.5, transport=transport)
    assert result.transport == transport
    np.testing.assert_array_equal(result.token_ids, expected)


def test_a_refused_call_raises_its_error_and_frees_the_region(server, model):
    """A call the server refuses mid-loop raises the server's error (not a complaint about the
    shared memory its traceback still views), and the loop's region is unregistered."""
    with Client(server.target, timeout=60) as client:
        with pytest.raises(LogitServeError, match=r"top_p: must be in \(0, 1\]") as info:
            _decode(model, client, temperature=1.0, top_p=1.5, use_sequences=False, transport="shm")
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert client.shared_memory_status() == []
