"""The features axis of ``bench.decode_loop``: the ways of sampling a cell runs, the step times
each runs at, and the logits processors' tensors the ``penalties_bitmask`` feature samples with.

``plain``: T 0.8, top_k 50, top_p 0.9. ``penalties_bitmask``: the same, after repetition (1.1),
frequency (0.2) and presence (0.3) penalties over each row's 256 prompt and 1,024 output tokens,
and a grammar bitmask allowing about half the vocabulary (token 0 in every row). The lists are
random token ids, fixed for the run (a real engine's output list grows by a token a step: these
stand for its length at one point of a decode, the call's work as it is there). Every tensor lives
on the engine's device, registered as a CUDA region of every client: an ordered call refuses a
processor field sent as bytes (the server could not copy it to the device without waiting for the
caller's mark), and a synchronous call should not pay a copy that an engine keeping its lists on
the device would not. ``sequences``: those lists held by the server as each row's sequence
(bench/decode_sequences.py).
"""

from __future__ import annotations

import argparse
import dataclasses

PROMPT_TOKENS = 256
OUTPUT_TOKENS = 1024
LISTS_SEED = 44  # the lists' and the bitmask's generator: every run of a batch size samples alike


@dataclasses.dataclass(frozen=True)
class Feature:
    params: dict  # the scalar keywords every mode's call passes
    step_ms: tuple[float, ...] | None  # the step times it runs at; None: every one
    lists: bool  # whether it also passes the processors' tensors (processor_tensors)
    about: str  # for the report's header
    sequences: bool = False  # rows drawn by sequence ids holding those lists (bench/decode_sequences.py)


PLAIN = dict(temperature=0.8, top_k=50, top_p=0.9)
PENALTIES = dict(PLAIN, repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.3)
FEATURES = {
    "plain": Feature(PLAIN, None, False, "T 0.8, top_k 50, top_p 0.9"),
    # Issue 44: "the whole matrix at a 5 ms step; 2 and 20 ms with plain sampling only".
    "penalties_bitmask": Feature(
        PENALTIES, (5.0,), True,
        f"plain after repetition 1.1, frequency 0.2 and presence 0.3 penalties over {PROMPT_TOKENS} prompt and "
        f"{OUTPUT_TOKENS:,} output tokens a row and a grammar bitmask allowing about half the vocabulary, every "
        f"tensor in a CUDA region"),
    "sequences": Feature(
        PENALTIES, (5.0,), True,
        "penalties_bitmask's lists and parameters held by the server as each row's sequence, its output growing "
        "by every draw, the calls naming the rows' sequence ids and the bitmask", sequences=True),
}


def names(text: str) -> list[str]:
    """An argparse type: comma-separated feature names, in FEATURES' order."""
    asked = set(text.split(","))
    unknown = asked - set(FEATURES)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown features {sorted(unknown)}; choose from {', '.join(FEATURES)}")
    return [name for name in FEATURES if name in asked]


def runs_at(name: str, step_ms: float) -> bool:
    only = FEATURES[name].step_ms
    return only is None or step_ms in only


def resolve(asked: list[str] | None, step_ms: list[float], error) -> list[str]:
    """The features to run: ``asked`` (None: every one) less those that run at none of
    ``step_ms``; ``error(message)`` (the parser's) when ``asked`` named such a one, which would
    otherwise not run without a word."""
    chosen = [name for name in asked or FEATURES if any(runs_at(name, ms) for ms in step_ms)]
    missing = [name for name in asked or () if name not in chosen]
    if missing:
        error(f"--features {missing[0]} runs at {where(missing[0])}, none of --step-ms "
              f"{','.join(f'{ms:g}' for ms in step_ms)}")
    return chosen


def cell_features(step_ms: float, chosen: list[str]) -> list[str]:
    """The features of ``chosen`` that a cell at ``step_ms`` runs, in order."""
    return [name for name in chosen if runs_at(name, step_ms)]


def where(name: str) -> str:
    only = FEATURES[name].step_ms
    return "every step time" if only is None else f"{', '.join(f'{ms:g}' for ms in only)} ms only"


def choices() -> str:
    """The features and their step times, for ``--help``."""
    return ", ".join(f"{name} ({where(name)})" for name in FEATURES)


def describe(chosen: list[str]) -> str:
    """The header's account of the features run: each one's sampling and its step times."""
    return "; ".join(f"{name} ({FEATURES[name].about}) at {where(name)}" for name in chosen)


def processor_tensors(batch: int, vocab: int, device) -> dict:
    """``kernels.sample``'s and ``Client.sample``'s processor keywords for ``batch`` rows, on
    ``device``, from a seeded generator: each row's prompt and output ids (int64, flat) with
    their offsets ``[batch + 1]``, and the grammar bitmask int32 ``[batch, ceil(vocab / 32)]``.
    Made on the current stream and synchronized: the engine's stream and the server read them."""
    import torch

    generator = torch.Generator(device=device).manual_seed(LISTS_SEED)
    tensors = {}
    for kind, length in (("prompt", PROMPT_TOKENS), ("output", OUTPUT_TOKENS)):
        tensors[f"{kind}_token_ids"] = torch.randint(0, vocab, (batch * length,), generator=generator,
                                                     device=device, dtype=torch.int64)
        tensors[f"{kind}_offsets"] = torch.arange(batch + 1, device=device, dtype=torch.int64) * length
    words = (vocab + 31) // 32
    allowed = torch.rand(batch, words * 32, generator=generator, device=device) < 0.5
    allowed[:, vocab:] = False
    allowed[:, 0] = True  # no row is left with nothing to draw, however small --vocab
    bits = (allowed.view(batch, words, 32).to(torch.int64) << torch.arange(32, device=device)).sum(2)
    tensors["grammar_bitmask"] = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    if torch.device(device).type == "cuda":  # the tests and the CPU smoke make them on the CPU
        torch.cuda.synchronize(device)
    return tensors


def register(client, batch: int, tensors: dict) -> None:
    """Each of ``tensors`` as a CUDA region of ``client``, named apart from the engine's
    (``logits-B``, ``tokens-B``) and from the other batch sizes'."""
    for name, tensor in tensors.items():
        client.register_cuda(f"{name}-{batch}", tensor)


class Lists:
    """Each feature's keywords for a batch size; the processors' tensors made at a batch size's
    first cell that needs them and kept for the run (they stay registered, as the engine's
    buffers do), ``register_all(register)`` calling ``register(client)`` for every client."""

    def __init__(self, vocab: int, device, register_all):
        self.vocab, self.device, self.register_all = vocab, device, register_all
        self.by_batch: dict[int, dict] = {}

    def params(self, name: str, batch: int) -> dict:
        feature = FEATURES[name]
        if not feature.lists:
            return feature.params
        if batch not in self.by_batch:
            tensors = self.by_batch[batch] = processor_tensors(batch, self.vocab, self.device)
            self.register_all(lambda client: register(client, batch, tensors))
        return dict(feature.params, **self.by_batch[batch], **({"sequences": True} if feature.sequences else {}))
