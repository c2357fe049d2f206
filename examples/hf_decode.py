"""A decode loop over a Hugging Face transformers causal LM whose next tokens come from logitserve.

The model runs here (prefill once, then one token a step on its KV cache); each step's last-position
logits go to logitserve in one ``Sample`` call, which applies the logits processors and draws. By
default the loop opens one server-side sequence per prompt (``OpenSequences``) with its sampling
parameters, prompt, banned and stop lists and bias, so each step sends only the logits and the
sequence ids; ``use_sequences=False`` sends every row's parameters and lists each step instead
(stateless ``Sample``; the same tokens). The logits travel as the request's bytes, through a POSIX
shared-memory region (``transport="shm"``, server on this host) or a CUDA IPC region
(``transport="cuda"``, the model and the server on this host's GPU, cuda-python installed: the
``cuda`` extra; the default when the model is on CUDA); rows still decoding are packed into the
region's first rows. ``transport="ordered"``: calls ordered on the GPU (hf_decode_ordered.py).

    python examples/hf_decode.py --tiny --prompt 1,2,3 --prompt 4,5 --max-new-tokens 16
    python examples/hf_decode.py --model path/to/checkpoint --prompt "Hello" --server 127.0.0.1:50051 \
        --temperature 0.8 --top-p 0.9 --seed 7 --repetition-penalty 1.1

Without ``--server`` a server runs in this process (logitserve.server.testing.ServerThread) on the
model's device. The run prints the tokens (and text with a tokenizer), tokens/s and the share of
the loop's time spent in the logitserve call.

Settings as transformers' ``generate`` names them: ``bad_words_ids`` and ``sequence_bias`` take
single tokens only (logitserve bans and biases token ids, not multi-token sequences);
``min_new_tokens`` bans the eos tokens while a row's output is shorter (logitserve's
``min_tokens`` with the eos ids as stop tokens); the repetition penalty covers the prompt (without
its padding) and the output, as transformers' does. Unlike ``generate``: an eos id among
``bad_words_ids`` is banned (transformers drops it from the list); logitserve applies the penalty
before the bias (transformers the bias first: they differ on a token both seen and biased); sampled
tokens come from logitserve's seeded draw, so they replay with the seed but are not the tokens
``generate(do_sample=True)`` draws from torch's generator.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import secrets
import sys
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import torch

from logitserve.client import Client
from logitserve.client.regions import shared_tensor

TRANSPORTS = ("auto", "bytes", "shm", "cuda", "ordered")  # ordered: examples/hf_decode_ordered.py
TINY_VOCAB = 256  # tiny_llama's vocabulary: --tiny's prompts are token ids below it


@dataclass
class DecodeOptions:
    max_new_tokens: int = 32
    temperature: float = 0.0            # 0: greedy (top_k, top_p and seed unused)
    top_k: int = 0                      # 0: off
    top_p: float = 1.0                  # 1: off
    seed: int | None = None             # row i draws with seed + i; None: the server draws each row's
    repetition_penalty: float = 1.0
    bad_words_ids: Sequence[int] = ()   # banned token ids
    min_new_tokens: int = 0             # eos banned while the output is shorter
    sequence_bias: Mapping[int, float] = field(default_factory=dict)  # {token id: added to its logit}
    eos_token_id: int | Sequence[int] | None = None
    pad_token_id: int = 0               # left padding of the prompts, and the tokens after a row's eos
    logprobs: int | None = None         # top-n logprobs of the raw logits (0: the chosen token's only)
    use_sequences: bool = True          # server-side sequences; False: stateless Sample calls
    transport: str = "auto"             # auto, bytes, shm, cuda (CUDA IPC), ordered (calls ordered on the GPU)

    def eos_ids(self) -> list[int]:
        eos = self.eos_token_id
        return [] if eos is None else [int(eos)] if isinstance(eos, int) else [int(i) for i in eos]


@dataclass
class DecodeResult:
    token_ids: np.ndarray               # int64 [B, steps]: each row's new tokens, pad_token_id after its eos
    lengths: np.ndarray                 # int64 [B]: each row's new tokens, its eos included
    token_logprobs: np.ndarray | None   # float32 [B, steps] (with logprobs; nan after the row's end)
    seeds: list[int]                    # the seed each row drew with
    transport: str                      # how the logits travelled: bytes, shm or cuda
    seconds: float                      # the whole loop, prefill included
    logitserve_seconds: float           # of which in logitserve calls (the logits' copy into a region included)

    @property
    def tokens_per_second(self) -> float:
        return float(self.lengths.sum()) / self.seconds if self.seconds > 0 else float("inf")


class LogitsChannel:
    """Where each step's logits go: returns what to pass to ``client.sample`` for the rows given.
    bytes: the rows themselves (the client copies them into the request once); shm / cuda: the rows
    copied into the first rows of a region registered once, which the client sends by reference."""

    def __init__(self, client: Client, transport: str, rows: int, vocab: int, dtype: torch.dtype,
                 device: torch.device):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport: must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        if transport == "auto":
            transport = "cuda" if device.type == "cuda" else "bytes"
        self.transport, self._stack = transport, contextlib.ExitStack()
        if transport == "shm":
            shared = self._stack.enter_context(shared_tensor((rows, vocab), dtype, key=client.shm_key()))
            self.buffer = shared.tensor
            client.register("hf_decode.logits", shared)
            self._stack.callback(client.unregister, "hf_decode.logits")
        elif transport == "cuda":
            if device.type != "cuda":
                raise ValueError(f"transport: cuda needs the model on a CUDA device, got {device}")
            self.buffer = torch.empty(rows, vocab, dtype=dtype, device=device)
            client.register("hf_decode.logits", self.buffer)
            self._stack.callback(client.unregister, "hf_decode.logits")
        else:
            self.buffer = None

    def put(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        if self.buffer is None:
            return logits[rows].cpu()
        block = self.buffer[: rows.numel()]
        torch.index_select(logits.to(self.buffer.device), 0, rows.to(self.buffer.device), out=block)
        return block

    def close(self) -> None:
        self.buffer = None  # the shared tensor's views go before its memory is unmapped
        self._stack.close()


def _ragged(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """A ragged list as the wire's ids + [B + 1] offsets."""
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(r) for r in rows])
    return np.asarray([t for r in rows for t in r], dtype=np.int64), offsets


class _Rows:
    """Each row's sampling state, sent once (sequences) or every step (stateless)."""

    def __init__(self, client: Client, prompts: list[list[int]], options: DecodeOptions):
        self.client, self.options, self.prompts = client, options, prompts
        self.outputs: list[list[int]] = [[] for _ in prompts]
        sampled = options.temperature > 0
        self.seeds = [options.seed + i if sampled and options.seed is not None else None for i in range(len(prompts))]
        self.sequences = None
        if options.use_sequences:
            first = secrets.randbits(62)  # ids unique among this caller's open sequences
            self.sequences = client.open_sequences([self._spec(first + i, i) for i in range(len(prompts))])
            self.seeds = list(self.sequences.seeds)

    def _spec(self, id: int, row: int) -> dict:
        o = self.options
        spec = dict(id=id, temperature=o.temperature, top_k=o.top_k, top_p=o.top_p, seed=self.seeds[row],
                    repetition_penalty=o.repetition_penalty, logit_bias=dict(o.sequence_bias),
                    banned_token_ids=list(o.bad_words_ids), min_tokens=o.min_new_tokens)
        if o.repetition_penalty != 1.0:  # the prompt is read only by the penalties
            spec["prompt_token_ids"] = self.prompts[row]
        if o.min_new_tokens > 0:
            spec["stop_token_ids"] = o.eos_ids()
        return spec

    def sample(self, logits, rows: list[int], step: int):
        o = self.options
        extra = {} if o.logprobs is None else {"logprobs": o.logprobs}
        if self.sequences is not None:
            result = self.client.sample(logits, sequence_ids=[self.sequences.ids[r] for r in rows], **extra)
        else:
            n = len(rows)
            lists = {}
            if o.repetition_penalty != 1.0:
                lists["prompt_token_ids"], lists["prompt_offsets"] = _ragged([self.prompts[r] for r in rows])
            if o.repetition_penalty != 1.0 or o.min_new_tokens > 0:
                lists["output_token_ids"], lists["output_offsets"] = _ragged([self.outputs[r] for r in rows])
            if o.sequence_bias:
                lists["logit_bias_ids"], lists["logit_bias_offsets"] = _ragged([list(o.sequence_bias)] * n)
                lists["logit_bias_values"] = np.tile(np.asarray(list(o.sequence_bias.values()), np.float32), n)
            if o.bad_words_ids:
                lists["banned_token_ids"], lists["banned_offsets"] = _ragged([list(o.bad_words_ids)] * n)
            if o.min_new_tokens > 0:
                lists["stop_token_ids"], lists["stop_offsets"] = _ragged([o.eos_ids()] * n)
            seeds = [self.seeds[r] for r in rows]
            result = self.client.sample(
                logits, temperature=o.temperature, top_k=o.top_k, top_p=o.top_p,
                seed=None if None in seeds else seeds, step=step,
                repetition_penalty=o.repetition_penalty if o.repetition_penalty != 1.0 else None,
                min_tokens=o.min_new_tokens or None, **lists, **extra)
            for r, seed in zip(rows, result.seeds):  # seeds the server drew: replayed from the next step on
                self.seeds[r] = int(seed)
        for r, token in zip(rows, result.token_ids):
            self.outputs[r].append(int(token))
        return result

    def close(self) -> None:
        if self.sequences is not None:
            self.sequences.close()


def _cache_name(model) -> str:
    """The forward's KV-cache keyword: ``cache`` (transformers 5.x) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _last_logits_keyword(model) -> dict:
    """The forward's keyword that keeps the last position's logits only (none: {})."""
    params = inspect.signature(model.forward).parameters
    return next(({name: 1} for name in ("logits_to_keep", "num_logits_to_keep") if name in params), {})


def left_pad(prompts: list[list[int]], pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask [B, longest prompt], prompts right-aligned."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.as_tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def decode(model, client: Client, prompts: Sequence[Sequence[int]], options: DecodeOptions) -> DecodeResult:
    """Generate up to ``options.max_new_tokens`` tokens after each prompt (token ids), a batch of
    rows left-padded; a row ends at an eos token. Each step: one forward of the model on its KV
    cache, then one ``Sample`` call for the rows not ended."""
    prompts = [[int(t) for t in p] for p in prompts]
    if not prompts or not all(prompts):
        raise ValueError("prompts: give at least one prompt, each of at least one token")
    if options.transport == "ordered":
        from hf_decode_ordered import decode_ordered  # beside this file; it takes this module's helpers
        return decode_ordered(model, client, prompts, options, sys.modules[__name__])
    device = next(model.parameters()).device
    eos = torch.tensor(options.eos_ids(), dtype=torch.long)
    cache_name, last_only = _cache_name(model), _last_logits_keyword(model)
    started, in_logitserve = time.perf_counter(), 0.0

    input_ids, mask = left_pad(prompts, options.pad_token_id, device)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # left padding: positions start at each prompt
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, **last_only)
    batch = len(prompts)
    tokens = np.full((batch, options.max_new_tokens), options.pad_token_id, dtype=np.int64)
    logprobs = None if options.logprobs is None else np.full((batch, options.max_new_tokens), np.nan, np.float32)
    lengths = np.zeros(batch, dtype=np.int64)
    running = torch.ones(batch, dtype=torch.bool)
    rows_state = channel = None
    try:
        rows_state = _Rows(client, prompts, options)
        vocab = out.logits.shape[-1]
        channel = LogitsChannel(client, options.transport, batch, vocab, out.logits.dtype, device)
        for step in range(options.max_new_tokens):
            logits = out.logits[:, -1, :]
            rows = running.nonzero().flatten()
            t0 = time.perf_counter()
            result = rows_state.sample(channel.put(logits, rows), rows.tolist(), step)
            in_logitserve += time.perf_counter() - t0
            if not result.valid.all():
                bad = rows[int(np.argmin(result.valid))]
                raise RuntimeError(f"row {int(bad)}, step {step}: no token left to draw (every logit -inf after "
                                   f"the processors: bad_words_ids and min_new_tokens ban all)")
            picked = torch.as_tensor(result.token_ids)
            tokens[rows.numpy(), step] = picked.numpy()
            lengths[rows.numpy()] += 1
            if logprobs is not None:
                logprobs[rows.numpy(), step] = result.token_logprobs
            running[rows] = ~torch.isin(picked, eos)
            if not running.any() or step + 1 == options.max_new_tokens:
                break
            feed = torch.full((batch,), options.pad_token_id, dtype=torch.long)
            feed[rows] = picked
            mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
            positions = positions[:, -1:] + 1
            cache = out.cache if cache_name == "cache" else out.past_key_values
            out = model(input_ids=feed[:, None].to(device), attention_mask=mask, position_ids=positions,
                        use_cache=True, **{cache_name: cache})
    finally:
        if channel is not None:
            channel.close()
        if rows_state is not None:
            rows_state.close()
    steps = int(lengths.max())
    return DecodeResult(tokens[:, :steps], lengths, None if logprobs is None else logprobs[:, :steps],
                        rows_state.seeds, channel.transport, time.perf_counter() - started, in_logitserve)


def tiny_llama(vocab_size: int = TINY_VOCAB, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A 2-layer Llama with random weights (no download): the stand-in for a checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlamaForCausalLM(config).to(dtype).eval()


def _ids(text: str) -> list[int]:
    """Comma-separated token ids (``--bad-words``, ``--eos``, ``--prompt`` with ``--tiny``)."""
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        ids = [-1]
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"{text!r}: must be comma-separated token ids (integers >= 0: 1,2,3)")
    return ids


def _bias(text: str) -> tuple[int, float]:
    """``--bias TOKEN=VALUE``: a token id and the number added to its logit."""
    token, _, value = text.partition("=")
    with contextlib.suppress(ValueError):
        if int(token) >= 0:
            return int(token), float(value)
    raise argparse.ArgumentTypeError(f"{text!r}: must be TOKEN=VALUE, a token id and a number (42=-1.5)")


def _tiny_prompts(parser: argparse.ArgumentParser, prompts: list[str]) -> list[list[int]]:
    """``--prompt`` with ``--tiny``: token ids of the tiny model's vocabulary, else a usage error."""
    ids = []
    for text in prompts:
        try:
            ids.append(_ids(text))
        except argparse.ArgumentTypeError:
            ids.append([])
        if not ids[-1] or max(ids[-1]) >= TINY_VOCAB:
            parser.error(f"argument --prompt: {text!r}: with --tiny, a prompt is token ids from 0 to "
                         f"{TINY_VOCAB - 1}, comma-separated (1,2,3); text needs --model")
    return ids


def _arguments(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", help="a transformers checkpoint (path or hub name) with its tokenizer")
    model.add_argument("--tiny", action="store_true", help="a random 2-layer Llama; prompts as token ids")
    p.add_argument("--prompt", action="append", required=True,
                   help="a prompt (repeat for a batch): text with --model, comma-separated ids with --tiny")
    p.add_argument("--server", help="host:port of a logitserve server (default: one in this process)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    for flag, kind, default in (("--max-new-tokens", int, 32), ("--temperature", float, 0.0), ("--top-k", int, 0),
                                ("--top-p", float, 1.0), ("--seed", int, None), ("--repetition-penalty", float, 1.0),
                                ("--min-new-tokens", int, 0), ("--logprobs", int, None)):
        p.add_argument(flag, type=kind, default=default, help="0: greedy" if flag == "--temperature" else None)
    p.add_argument("--bad-words", type=_ids, default=[], help="banned token ids, comma-separated")
    p.add_argument("--bias", type=_bias, action="append", default=[], help="TOKEN=VALUE added to a token's logit")
    p.add_argument("--eos", type=_ids, help="eos token ids (default: the model's)")
    p.add_argument("--stateless", action="store_true", help="send every row's state each step (no sequences)")
    p.add_argument("--transport", default="auto", choices=TRANSPORTS)
    args = p.parse_args(argv)
    if args.tiny:  # what --prompt holds depends on --tiny: token ids here, text for --model's tokenizer
        args.prompt = _tiny_prompts(p, args.prompt)
    return args


def main(argv=None) -> None:
    args = _arguments(argv)
    dtype = getattr(torch, args.dtype)
    tokenizer = None
    if args.tiny:
        model = tiny_llama(dtype=dtype).to(args.device)
        prompts = args.prompt  # token ids (_arguments)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model).to(args.device, dtype).eval()
        prompts = [tokenizer(p)["input_ids"] for p in args.prompt]
    config = model.generation_config
    options = DecodeOptions(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, repetition_penalty=args.repetition_penalty, bad_words_ids=args.bad_words,
        min_new_tokens=args.min_new_tokens, sequence_bias=dict(args.bias),
        eos_token_id=args.eos if args.eos is not None else config.eos_token_id, logprobs=args.logprobs,
        use_sequences=not args.stateless, transport=args.transport)
    eos_ids = options.eos_ids()
    options.pad_token_id = config.pad_token_id if config.pad_token_id is not None else (eos_ids or [0])[0]
    with contextlib.ExitStack() as stack:
        target = args.server
        if target is None:
            from logitserve.server import ServerConfig
            from logitserve.server.testing import ServerThread

            # Warm up only the dtype and width this model's logits have (on a GPU, Triton compiles each).
            width = model.get_output_embeddings().out_features
            config = ServerConfig(host="127.0.0.1", port=0, device=args.device, warmup_dtypes=(args.dtype,),
                                  warmup_widths=(width,))
            server = stack.enter_context(ServerThread(config))
            target = server.target
        client = stack.enter_context(Client(target, timeout=60))
        result = decode(model, client, prompts, options)
    for row, n in enumerate(result.lengths):
        ids = result.token_ids[row, :n].tolist()
        print(f"[{row}] {ids}" + (f" {tokenizer.decode(ids)!r}" if tokenizer is not None else ""))
        if result.token_logprobs is not None:
            print("    logprobs " + " ".join(f"{v:.3f}" for v in result.token_logprobs[row, :n]))
    print(f"{int(result.lengths.sum())} tokens in {result.seconds:.3f} s: {result.tokens_per_second:.1f} tokens/s, "
          f"{100 * result.logitserve_seconds / result.seconds:.0f}% of the loop in logitserve calls "
          f"({result.transport}, {'stateless' if args.stateless else 'sequences'})")


if __name__ == "__main__":
    main()
