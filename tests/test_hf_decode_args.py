"""examples/hf_decode.py's arguments: a --tiny prompt that is not token ids of the tiny model
(``--prompt hello`` ended in a raw ValueError traceback), a --bias that is not TOKEN=VALUE and
token-id lists that are not ids are usage errors naming the argument and its rule."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

_spec = importlib.util.spec_from_file_location(
    "hf_decode", pathlib.Path(__file__).resolve().parents[1] / "examples" / "hf_decode.py")
hf_decode = sys.modules["hf_decode"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up there
_spec.loader.exec_module(hf_decode)

TINY_RULE = "with --tiny, a prompt is token ids from 0 to 255, comma-separated (1,2,3); text needs --model"


def usage_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        hf_decode._arguments(list(argv))
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith("usage: "), err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("prompts, bad", [
    (["hello"], "'hello'"),
    (["1,2", "300"], "'300'"),  # past the tiny model's vocabulary
    (["-1"], "'-1'"),
    ([","], "','"),  # no token at all
])
def test_a_tiny_prompt_that_is_not_token_ids_names_the_rule(prompts, bad, capsys):
    argv = ["--tiny", *(a for p in prompts for a in ("--prompt", p))]
    assert usage_error(capsys, *argv).endswith(f"argument --prompt: {bad}: {TINY_RULE}")


def test_tiny_prompts_become_token_ids_and_model_prompts_stay_text():
    assert hf_decode._arguments(["--tiny", "--prompt", "1,2,3", "--prompt", " 4, 255"]).prompt == [[1, 2, 3], [4, 255]]
    assert hf_decode._arguments(["--model", "m", "--prompt", "hello"]).prompt == ["hello"]


@pytest.mark.parametrize("argv, message", [
    (["--bias", "x"], "argument --bias: 'x': must be TOKEN=VALUE, a token id and a number (42=-1.5)"),
    (["--bias", "5=high"], "argument --bias: '5=high': must be TOKEN=VALUE"),
    (["--bad-words", "a,b"], "argument --bad-words: 'a,b': must be comma-separated token ids"),
    (["--eos", "-2"], "argument --eos: '-2': must be comma-separated token ids"),
])
def test_bias_and_id_lists_name_their_form(argv, message, capsys):
    assert message in usage_error(capsys, "--tiny", "--prompt", "1", *argv)


def test_bias_pairs_are_read():
    assert dict(hf_decode._arguments(["--tiny", "--prompt", "1", "--bias", "42=-1.5", "--bias", "7=2"]).bias) == \
        {42: -1.5, 7: 2.0}
