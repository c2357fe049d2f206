"""Sampling: one token id per row of ``logits [B, V]``, by temperature, top-k, top-p and min-p.

The public API is ``logitserve.kernels.sample`` (``api.py``) and ``SamplePlan`` (``plan.py``).
This ``__init__`` imports nothing, so that ``params.py`` (the parameters' table, read by the
server and the torch reference) comes without the kernels.

The algorithm
-------------
The draw is the exponential race ``argmax_i p_i / E_i`` over the kept tokens, with ``E_i`` an
exponential variable that is a pure function of ``(seed, step, i)`` (``noise.py``): no sort, no
cumulative sum, and a row draws the same token whatever its batch, its neighbours or the
backend. In base-2 logs it is ``argmax log2(w_i) + gumbel_i`` with ``w = p / max(p)``
(``weights.py``).

Every filter keeps the tokens at or above some value (ties with the boundary kept), so the kept
set is ``{key >= t_k} & {key >= t_p} & {w >= min_p}``, on order keys that sort like the logits
(``top_k.py``). A bound ``L`` at or below the k-th largest logit gathers a short candidate list
that holds every token at or above it; with top-k (or a peaked distribution) the thresholds and
the draw come from that list, a few hundred values instead of the row.

The pipeline, in the order a call runs it
-----------------------------------------
0. Check the arguments against the parameters' table (``api.py`` / ``params.py``) and find the
   plan for the layout; the plan picks the launches below from the scalar parameters
   (``plan.py``; ``launcher.py`` relaunches compiled kernels without Triton's per-call work).
1. Candidate statistics (``stats.py``, grid rows x chunks of 4096): each program reduces its
   chunk to max, first arg-max, softmax partial and group maxima; the last program of a row
   merges them into the row's max and softmax total, answers greedy and invalid rows (-1),
   checks per-row CUDA parameters, and sets the bound ``L`` (the k-th largest group max).
2. Candidate gather (``gather.py``, same grid): the tokens at or above ``L`` are appended to the
   row's list. Rows the list may not decide (no top_k, a flat distribution) also run the walk's
   first pass here, chunk by chunk (``top_p.py``).
3. The walk's first check (``top_p.py``, rows x groups of chunks), only without a top_k in
   reach and with top_p: the mass above the first-pass winner, summed by chunks.
4. The draw (``draw.py``, a program per row): top_k's threshold (``top_k.py``), the race's
   winner over the candidates or the row, and top_p's walk (``top_p.py``): while the mass
   strictly above the winner reaches top_p of the reference mass, the winner is outside the
   nucleus and the next is the winner over the tokens above it. min_p has no step of its own:
   it is the ``w >= min_p`` condition of the race's scores.

Logits processors (penalties, bias, token masks, grammar bitmask; ``processors.py``, kernels in
``process_kernels.py``) run before step 1 as two launches of their own (a dense pass over rows x
column blocks and a list kernel a row) that write the processed logits, float32, for the steps
above to read; logprobs (``logprobs.py``) run after the draw, as a pass over rows x chunks and a
merge a row. A call with neither takes steps 0-4 alone.

Greedy calls take step 1 alone; pure temperature sampling skips the gather (nothing to filter);
``random_val`` mode (InfiniCore's ``random_sample``, ``random_val.py``) replaces steps 2-4 with
one launch that selects by cumulative mass. Steps 1-3 spread a row over many programs because a
single row (the latency case) would otherwise run on one SM.

All launches share one zero-filled byte workspace, laid out in one table (``workspace.py``).
The torch backend runs ``kernels/reference/sample.py`` instead: the same semantics with a sort,
and the same noise. The semantics each parameter has are stated in ``docs/DESIGN.md``.
"""
