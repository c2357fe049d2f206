"""``bench.decode_loop``'s ``sequences`` feature: the rows drawn by sequence ids, the server
holding each row's lists and growing its output by the token drawn (issue 44's "by sequence ids").

Each row is a sequence opened for the run with ``penalties_bitmask``'s lists (its 256 prompt ids
and its first 1,024 output ids) and parameters, seed ``FIRST_SEED`` + row and step 0, so that its
n-th draw samples with the seed and step ``in_process`` uses; every call also passes the grammar
bitmask (a CUDA region). ``in_process`` keeps the same outputs itself: a ``[B, 1,024 + steps]``
buffer on the engine's device, each step's tokens stored after the row's output on the engine's
stream, the lists passed flat to ``kernels.sample`` (a copy of the buffer's filled part a step: a
few microseconds at B 256, counted in the floor). The other modes open the sequences before the
run, name them by id, and close them after.
"""

from __future__ import annotations

import torch

from logitserve import kernels

from .decode_engine import FIRST_SEED, Engine, Run, decode
from .decode_features import OUTPUT_TOKENS, PROMPT_TOKENS

FIRST_ID = 700_000  # the sequences' ids: row r is FIRST_ID + r
TENSORS = ("prompt_token_ids", "prompt_offsets", "output_token_ids", "output_offsets", "grammar_bitmask")


def _split(params: dict) -> tuple[dict, dict]:
    """The feature's keywords as (scalars, tensors)."""
    scalars = {k: v for k, v in params.items() if k not in TENSORS and k != "sequences"}
    return scalars, {k: params[k] for k in TENSORS}


def specs(batch: int, params: dict) -> list[dict]:
    """One SequenceSpec (as ``Client.open_sequences`` takes it) a row."""
    scalars, tensors = _split(params)
    prompt = tensors["prompt_token_ids"].view(batch, PROMPT_TOKENS).cpu().tolist()
    output = tensors["output_token_ids"].view(batch, OUTPUT_TOKENS).cpu().tolist()
    return [dict(id=FIRST_ID + row, seed=FIRST_SEED + row, prompt_token_ids=prompt[row], output_token_ids=output[row],
                 **scalars) for row in range(batch)]


class Outputs:
    """``in_process``'s copy of the rows' sequences: their outputs ``[B, 1,024 + steps]``, the
    first 1,024 from the feature's lists, each draw stored after them (:meth:`grow`)."""

    def __init__(self, params: dict, batch: int, steps: int):
        self.scalars, self.tensors = _split(params)
        device = self.tensors["output_token_ids"].device
        self.ids = torch.empty(batch, OUTPUT_TOKENS + steps, dtype=torch.int64, device=device)
        self.ids[:, :OUTPUT_TOKENS] = self.tensors["output_token_ids"].view(batch, OUTPUT_TOKENS)
        self.rows = torch.arange(batch + 1, dtype=torch.int64, device=device)
        self.drawn = 0

    def keywords(self) -> dict:
        """``kernels.sample``'s keywords for the next draw: the parameters and the lists now."""
        width = OUTPUT_TOKENS + self.drawn
        t = self.tensors
        return dict(self.scalars, prompt_token_ids=t["prompt_token_ids"], prompt_offsets=t["prompt_offsets"],
                    output_token_ids=self.ids[:, :width].reshape(-1), output_offsets=self.rows * width,
                    grammar_bitmask=t["grammar_bitmask"])

    def grow(self, tokens: torch.Tensor) -> None:
        """A draw's tokens (no row draws nothing: the bitmask always allows token 0)."""
        self.ids[:, OUTPUT_TOKENS + self.drawn].copy_(tokens)
        self.drawn += 1


def in_process(engine: Engine, params: dict, steps: int, warmup: int) -> Run:
    """The floor: ``kernels.sample`` with each row's lists, its output grown by every draw."""
    total = warmup + steps
    outputs = Outputs(params, engine.batch, total)
    torch.cuda.synchronize(engine.tokens.device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(total)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(total)]

    def sample_step(n: int) -> None:
        lists = outputs.keywords()
        starts[n].record(engine.stream)
        ids = kernels.sample(engine.logits, **lists, seed=engine.seed_rows, step=n)
        ends[n].record(engine.stream)
        engine.tokens.copy_(ids)
        outputs.grow(ids)

    run = decode(engine, steps, warmup, sample_step)
    run.kernel_us = [starts[n].elapsed_time(ends[n]) * 1e3 for n in range(warmup, total)]
    return run


def through(mode: str, engine: Engine, params: dict, steps: int, warmup: int, client) -> Run:
    """A ``sync_*``, ``ordered_*`` or ``ordered_standing`` run by sequence ids through ``client``."""
    ids = [FIRST_ID + row for row in range(engine.batch)]
    mask = params["grammar_bitmask"]
    client.open_sequences(specs(engine.batch, params))
    try:
        if mode.startswith("sync_"):
            return decode(engine, steps, warmup, lambda n: client.sample(
                engine.logits, sequence_ids=ids, grammar_bitmask=mask, out={"token_ids": engine.tokens},
                stream=engine.stream))
        with client.ordered_session() as session:
            def sample_step(n: int) -> None:
                if mode != "ordered_standing":
                    session.sample(engine.logits, out={"token_ids": engine.tokens}, stream=engine.stream,
                                   sequence_ids=ids, grammar_bitmask=mask)
                elif n == 0:
                    session.sample(engine.logits, out={"token_ids": engine.tokens}, stream=engine.stream,
                                   sequence_ids=ids, grammar_bitmask=mask, repeat=warmup + steps)
                else:
                    session.step(engine.stream)

            return decode(engine, steps, warmup, sample_step)
    finally:
        client.close_sequences(ids)
