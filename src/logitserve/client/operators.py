"""The operator methods, written once for ``Client`` and ``AsyncClient``: each builds its
request (:mod:`.messages`) and hands it to the class's call path, whose answer it reads
(:mod:`.results`); ``client.sample(x)`` returns the result, ``await aclient.sample(x)`` awaits it.
"""

from __future__ import annotations

from logitserve.v1 import logitserve_pb2 as pb

from . import balancing, messages, results
from .construction import ClientBase
from .results import SampleResult, ServerInfo, StepResult, VerifyDraftResult
from .transport import CLIENT_TIMEOUT


class OperatorMethods(ClientBase):
    """Sample, RouteExperts, VerifyDraft, Softmax, CausalSoftmax, Silu (and SwiGLU), Step and
    GetServerInfo; the sending (``_send``, to each call's device's process) is
    :class:`~.devices.DeviceRouting`'s."""

    # ------------------------------------------------------------------------------ operators
    #
    # Tensors: numpy arrays, torch tensors (any device) or array-likes. A contiguous one that lies
    # inside a region registered through this client (register_system with a SharedHostBuffer,
    # register_cuda with a torch CUDA tensor) is sent as a reference to it (Tensor.region), by
    # its address; any other as bytes, copied once into the request. ``out=``: outputs the
    # server writes into registered regions, returned in place of new arrays. ``stream``: the
    # CUDA stream that produced the CUDA tensors a call names (default: each device's current
    # stream), synchronized before the call is sent; the server's writes are complete when the
    # call returns.

    def sample(self, logits, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=None, step=0,
               filter_order="top_k_first", random_val=None, repetition_penalty=None, frequency_penalty=None,
               presence_penalty=None, min_tokens=None, prompt_token_ids=None, prompt_offsets=None,
               output_token_ids=None, output_offsets=None, logit_bias_ids=None, logit_bias_values=None,
               logit_bias_offsets=None, allowed_token_ids=None, allowed_offsets=None, banned_token_ids=None,
               banned_offsets=None, stop_token_ids=None, stop_offsets=None, grammar_bitmask=None, logprobs=None,
               logprobs_mode=None, return_kept=False, sequence_ids=None, sequence_steps=None, out=None, stream=None,
               timeout=CLIENT_TIMEOUT, wait_for_ready=None) -> SampleResult:
        """Next token of every row of ``logits`` ``(batch_size, vocab_size)``.

        Each parameter is a scalar or one value per row (array or tensor of length B), with the
        meaning of ``logitserve.kernels.sample``: ``temperature`` (0 is greedy), ``top_k`` (0 is
        off), ``top_p`` (1 is off), ``min_p`` (0 is off), ``seed`` (None: the server draws one per
        row and returns it in ``.seeds``), ``step``, ``filter_order`` (``"top_k_first"`` or
        ``"joint"``), ``random_val`` (InfiniCore's exact ``random_sample`` mode).

        Logits processors, as ``logitserve.kernels.sample``'s: ``repetition_penalty``,
        ``frequency_penalty``, ``presence_penalty``, ``min_tokens`` (scalar or per row); ragged
        lists as ids + ``[B + 1]`` offsets: ``prompt_token_ids`` / ``prompt_offsets``,
        ``output_token_ids`` / ``output_offsets``, ``logit_bias_ids`` / ``logit_bias_values`` /
        ``logit_bias_offsets``, ``allowed_token_ids`` / ``allowed_offsets``, ``banned_token_ids`` /
        ``banned_offsets``, ``stop_token_ids`` / ``stop_offsets``; ``grammar_bitmask`` int32
        [B, ceil(V / 32)]. ``logprobs`` (top-n, n <= 20), ``logprobs_mode`` ("raw" or
        "processed") and ``return_kept`` (the kept set as ``.kept_bitmask``).

        ``sequence_ids``: one open sequence per row (:meth:`open_sequences`), whose state (the
        parameters, the processors' lists, seed and step) the server samples with; leave the
        parameters and lists above unset (``grammar_bitmask``, ``logprobs``, ``logprobs_mode``,
        ``return_kept``, ``filter_order`` and ``out`` still apply). Each sequence's output and step
        advance, so such a call is not retried after UNAVAILABLE (:mod:`.retrying`): it raises,
        and ``update_sequences`` tells each sequence's step. Refused on a round_robin client.
        ``sequence_steps``: the step each row's sequence is expected to draw: a call repeating
        the last drawn steps is answered what was drawn then, so it may be sent again safely.

        ``out``: a dict (or an object with these attributes) of registered outputs, any of
        ``token_ids`` (int64 [B]), ``seeds`` (int64 [B]), ``valid`` (bool [B]); the server writes
        them in place and they come back as the result's fields. ``stream``, ``timeout`` and
        ``wait_for_ready``: as every method's (the client's docstring).

        Returns a :class:`SampleResult` (``.token_ids`` int64 [B], ``.seeds``, ``.valid``; with
        ``logprobs``: ``.token_logprobs``, ``.token_ranks``, ``.top_token_ids``, ``.top_logprobs``).
        """
        if sequence_ids is not None:
            balancing.require_one_server(self, "sample(sequence_ids=)")
        enc = self._encoder()
        msg = messages.build_sample(
            enc, (), logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, step=step,
            filter_order=filter_order, random_val=random_val, out=out, repetition_penalty=repetition_penalty,
            frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, min_tokens=min_tokens,
            logprobs=logprobs, logprobs_mode=logprobs_mode, return_kept=return_kept, sequence_ids=sequence_ids,
            sequence_steps=sequence_steps,
            prompt_token_ids=prompt_token_ids, prompt_offsets=prompt_offsets, output_token_ids=output_token_ids,
            output_offsets=output_offsets, logit_bias_ids=logit_bias_ids, logit_bias_values=logit_bias_values,
            logit_bias_offsets=logit_bias_offsets, allowed_token_ids=allowed_token_ids,
            allowed_offsets=allowed_offsets, banned_token_ids=banned_token_ids, banned_offsets=banned_offsets,
            stop_token_ids=stop_token_ids, stop_offsets=stop_offsets, grammar_bitmask=grammar_bitmask)
        return self._send("Sample", enc, msg, pb.SampleResponse, results.sample_result, timeout, stream,
                          wait_for_ready)

    def route_experts(self, gate_logits, k: int, renormalize: bool = False, *, scoring: str = "softmax",
                      correction_bias=None, n_group: int = 1, topk_group: int = 1, group_score: str = "top2_sum",
                      routed_scaling_factor: float = 1.0, out=None, stream=None, timeout=CLIENT_TIMEOUT,
                      wait_for_ready=None):
        """``(weights float32 [N, k], indices int32 [N, k])``: the k experts of every token.
        Router options as ``kernels.route_experts``: ``scoring`` ("softmax" or "sigmoid"),
        ``correction_bias`` (float32 [E], selection only), ``n_group`` / ``topk_group`` /
        ``group_score`` ("top2_sum" or "max"), ``routed_scaling_factor``; the defaults are
        softmax top-k. ``out``: registered ``weights`` / ``indices`` (a dict, an object with
        those attributes, or a ``(weights, indices)`` tuple), written in place and returned."""
        enc = self._encoder()
        msg = messages.build_route_experts(enc, (), gate_logits, k, renormalize, scoring=scoring,
                                           correction_bias=correction_bias, n_group=n_group, topk_group=topk_group,
                                           group_score=group_score, routed_scaling_factor=routed_scaling_factor,
                                           out=out)
        return self._send("RouteExperts", enc, msg, pb.RouteExpertsResponse, results.route_experts_result, timeout,
                          stream, wait_for_ready)

    def verify_draft(self, draft_token_ids, target_logits, *, draft_probs=None, draft_logits=None,
                     draft_temperature=None, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=None, step=0,
                     filter_order="top_k_first", out=None, stream=None, timeout=CLIENT_TIMEOUT,
                     wait_for_ready=None) -> VerifyDraftResult:
        """Chain speculative sampling of ``draft_token_ids`` ``(batch_size, n)`` against
        ``target_logits`` ``(batch_size, n + 1, vocab_size)``, as ``logitserve.kernels.verify``.

        The draft's distribution: ``draft_probs`` ``(batch_size, n, vocab_size)``, or
        ``draft_logits`` of that shape with ``draft_temperature`` (scalar or per row; unset: 1.0).
        The target's ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed``, ``step`` and
        ``filter_order`` are :meth:`sample`'s. ``out``: registered outputs, any of ``token_ids``
        (int64 [B, n + 1]), ``num_accepted`` (int64 [B]), ``valid`` (bool [B]), ``seeds`` (int64 [B]).

        Returns a :class:`VerifyDraftResult` (``.token_ids``: the accepted prefix, then the
        correction or bonus token, then -1; ``.num_accepted``, ``.valid``, ``.seeds``).
        """
        enc = self._encoder()
        msg = messages.build_verify_draft(enc, (), draft_token_ids, target_logits, draft_probs=draft_probs,
                                          draft_logits=draft_logits, draft_temperature=draft_temperature,
                                          temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                                          step=step, filter_order=filter_order, out=out)
        return self._send("VerifyDraft", enc, msg, pb.VerifyDraftResponse, results.verify_draft_result, timeout, stream,
                          wait_for_ready)

    def softmax(self, x, dim: int = -1, *, out=None, stream=None, timeout=CLIENT_TIMEOUT, wait_for_ready=None):
        """``softmax(x, dim)`` as a numpy array (bfloat16 input comes back as float32), or
        written into ``out`` (registered, x's dtype and shape) and returned."""
        enc = self._encoder()
        msg = messages.build_softmax(enc, (), x, dim, out=out)
        return self._send("Softmax", enc, msg, pb.SoftmaxResponse, results.tensor_result, timeout, stream,
                          wait_for_ready)

    def causal_softmax(self, x, *, out=None, stream=None, timeout=CLIENT_TIMEOUT, wait_for_ready=None):
        """Causal softmax of scores ``[S, T]`` or ``[B, S, T]`` (row i sees columns j <= T - S + i);
        ``out`` as in :meth:`softmax`."""
        enc = self._encoder()
        msg = messages.build_causal_softmax(enc, (), x, out=out)
        return self._send("CausalSoftmax", enc, msg, pb.CausalSoftmaxResponse, results.tensor_result, timeout, stream,
                          wait_for_ready)

    def silu(self, x, *, out=None, stream=None, timeout=CLIENT_TIMEOUT, wait_for_ready=None):
        """``x * sigmoid(x)``; ``out`` as in :meth:`softmax`."""
        enc = self._encoder()
        msg = messages.build_silu(enc, (), x, out=out)
        return self._send("Silu", enc, msg, pb.SiluResponse, results.tensor_result, timeout, stream, wait_for_ready)

    def swiglu(self, gate, up, *, out=None, stream=None, timeout=CLIENT_TIMEOUT, wait_for_ready=None):
        """``silu(gate) * up``, broadcasting as numpy and torch do; ``out``: registered, gate's
        dtype and the broadcast shape."""
        enc = self._encoder()
        msg = messages.build_swiglu(enc, (), gate, up, out=out)
        return self._send("Silu", enc, msg, pb.SiluResponse, results.tensor_result, timeout, stream, wait_for_ready)

    def step(self, *, id: str = "", sample=None, route_experts=None, softmax=None, causal_softmax=None,
             silu=None, swiglu=None, stream=None, timeout=CLIENT_TIMEOUT, wait_for_ready=None) -> StepResult:
        """Several operators in one round trip; each argument is a dict of that method's arguments,
        ``out`` included, e.g. ``step(sample={"logits": x, "top_p": 0.9}, route_experts={"gate_logits": g, "k": 2})``.
        Returns a :class:`StepResult` whose fields hold what each method returns, by the names asked."""
        enc = self._encoder()
        msg = messages.build_step(enc, id, sample=sample, route_experts=route_experts, softmax=softmax,
                                  causal_softmax=causal_softmax, silu=silu, swiglu=swiglu)
        return self._send("Step", enc, msg, pb.StepResponse, results.step_read(msg), timeout, stream, wait_for_ready)

    def server_info(self, *, timeout=CLIENT_TIMEOUT, wait_for_ready=None) -> ServerInfo:
        """The server's version, device, backend, dtypes, limits and counters."""
        return self._simple("GetServerInfo", pb.GetServerInfoRequest(), pb.GetServerInfoResponse,
                            results.server_info, timeout, wait_for_ready=wait_for_ready)
