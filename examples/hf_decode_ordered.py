"""examples/hf_decode.py's loop with its Sample calls ordered on the GPU (``--transport ordered``).

The model and a logitserve server share this host's GPU (the server in a process of its own:
``--server``; CUDA opens no IPC handle in the process that exported it). Each step the last
position's logits go into a CUDA region, ``session.sample`` enqueues the draw behind them, the
tokens land in another CUDA region, and the next forward reads them from there: the host never
waits for the device inside the loop, and the tokens come to the host once, at the end. Every
row decodes every step (a row's tokens after its eos are dropped at the end, as ``generate`` pads
them), so each step's output list is the same length for every row: the penalties read it from
a CUDA region the loop fills on the GPU (row r's tokens at ``[r * n, (r + 1) * n)``).

Stateless calls only (no sequences: their state is advanced by the server's host), without
``min_new_tokens`` and logprobs (the host would read them each step).
"""

from __future__ import annotations

import contextlib
import secrets
import time

import numpy as np
import torch

from logitserve.client import Client


def decode_ordered(model, client: Client, prompts: list[list[int]], options, hf_decode):
    """``hf_decode.decode``'s result for ``options`` (hf_decode.DecodeOptions), the calls ordered on
    the GPU; ``hf_decode`` is that module (its result type and model helpers)."""
    o = options
    cache_name, last_only = hf_decode._cache_name(model), hf_decode._last_logits_keyword(model)
    refused = [name for name, on in (("min_new_tokens", o.min_new_tokens > 0), ("logprobs", o.logprobs is not None))
               if on]
    if refused:
        raise ValueError(f"transport: ordered calls do not take {', '.join(refused)} (the host would read them each "
                         f"step)")
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ValueError(f"transport: ordered needs the model on a CUDA device, got {device}")
    started = time.perf_counter()
    input_ids, mask = hf_decode.left_pad(prompts, o.pad_token_id, device)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, **last_only)
    rows, vocab, steps = len(prompts), out.logits.shape[-1], o.max_new_tokens
    sampled = o.temperature > 0
    first = o.seed if o.seed is not None else secrets.randbits(62)
    seeds = [first + i for i in range(rows)] if sampled else [0] * rows
    stream = torch.cuda.current_stream(device)
    with contextlib.ExitStack() as stack:
        registered = []  # owned by the session: the server unregisters them as it ends, even if this process dies

        def shared(name: str, tensor: torch.Tensor) -> torch.Tensor:
            client.register_cuda(f"hf_decode.{name}", tensor)
            registered.append(f"hf_decode.{name}")
            return tensor

        logits = shared("logits", torch.empty(rows, vocab, dtype=out.logits.dtype, device=device))
        tokens = shared("tokens", torch.full((rows,), -1, dtype=torch.int64, device=device))
        fixed = _fixed_lists(o, prompts, device, shared)
        outputs = shared("outputs", torch.zeros(rows * steps, dtype=torch.int64, device=device))
        output_offsets = shared("output_offsets", torch.zeros(rows + 1, dtype=torch.int64, device=device))
        row_starts = torch.arange(rows + 1, dtype=torch.int64, device=device)
        history = torch.empty(steps, rows, dtype=torch.int64, device=device)
        session = stack.enter_context(client.ordered_session(owned_regions=registered))
        t_calls = 0.0
        for step in range(steps):
            logits.copy_(out.logits[:, -1, :])
            lists = dict(fixed)
            if o.repetition_penalty != 1.0 and step:  # the output so far: rows x step tokens, row-major
                outputs[: rows * step].view(rows, step).copy_(history[:step].T)
                torch.mul(row_starts, step, out=output_offsets)
                lists.update(output_token_ids=outputs[: rows * step], output_offsets=output_offsets)
            t0 = time.perf_counter()
            last = session.sample(logits, out={"token_ids": tokens}, stream=stream, temperature=o.temperature,
                                  top_k=o.top_k, top_p=o.top_p, seed=seeds, step=step, **lists)
            t_calls += time.perf_counter() - t0
            history[step].copy_(tokens)
            if step + 1 == steps:
                break
            mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
            positions = positions[:, -1:] + 1
            cache = out.cache if cache_name == "cache" else out.past_key_values
            out = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=positions, use_cache=True,
                        **{cache_name: cache})
        last.result()
        drawn = history.T.cpu().numpy()
    token_ids, lengths = _until_eos(drawn, o.eos_ids(), o.pad_token_id)
    return hf_decode.DecodeResult(token_ids, lengths, None, seeds if sampled else [None] * rows, "ordered",
                       time.perf_counter() - started, t_calls)


def _fixed_lists(o, prompts: list[list[int]], device, shared) -> dict:
    """The lists every step reads unchanged (prompt for the penalty, bias, banned), in CUDA regions."""
    rows = len(prompts)

    def ragged(name: str, lists: list[list[int]], values: list[float] | None = None) -> dict:
        ids = torch.tensor([t for row in lists for t in row], dtype=torch.int64, device=device)
        offsets = torch.tensor(np.concatenate([[0], np.cumsum([len(r) for r in lists])]), dtype=torch.int64,
                               device=device)
        found = {f"{name}_token_ids" if name != "logit_bias" else "logit_bias_ids": shared(f"{name}.ids", ids),
                 f"{name}_offsets": shared(f"{name}.offsets", offsets)}
        if values is not None:
            found["logit_bias_values"] = shared(f"{name}.values", torch.tensor(values, dtype=torch.float32,
                                                                               device=device))
        return found

    lists = {}
    if o.repetition_penalty != 1.0:
        lists.update(repetition_penalty=o.repetition_penalty, **ragged("prompt", prompts))
    if o.sequence_bias:
        lists.update(ragged("logit_bias", [list(o.sequence_bias)] * rows, list(o.sequence_bias.values()) * rows))
    if o.bad_words_ids:
        lists.update(ragged("banned", [list(o.bad_words_ids)] * rows))
    return lists


def _until_eos(drawn: np.ndarray, eos: list[int], pad: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's tokens up to its first eos (kept), ``pad`` after; the rows' lengths."""
    rows, steps = drawn.shape
    lengths = np.full(rows, steps, dtype=np.int64)
    token_ids = drawn.copy()
    for r in range(rows):
        hits = np.flatnonzero(np.isin(drawn[r], eos)) if eos else []
        if len(hits):
            lengths[r] = hits[0] + 1
            token_ids[r, hits[0] + 1:] = pad
    width = int(lengths.max()) if rows else 0
    return token_ids[:, :width], lengths
