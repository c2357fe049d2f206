"""The answer checks of ``bench.processors_service``: every answer a case times is checked (tokens
in [0, V), valid, allowed by the grammar bitmask; VerifyDraft's accepted prefix equal to the
draft; RouteExperts' experts distinct and in range)."""

from __future__ import annotations

import numpy as np

EXPERTS, TOP_EXPERTS = 8, 2  # bench.processors_service's RouteExperts floor


def _numpy(x) -> np.ndarray:
    return x.cpu().numpy() if hasattr(x, "cpu") else np.asarray(x)


def check_sample(result, rows: int, vocab: int, bitmask: np.ndarray | None = None) -> None:
    tokens, valid = _numpy(result.token_ids), _numpy(result.valid)
    if tokens.shape != (rows,) or not ((tokens >= 0) & (tokens < vocab)).all():
        raise AssertionError(f"token_ids: expected {rows} in [0, {vocab}), got shape {tokens.shape}, {tokens[:8]}")
    if not valid.all():
        raise AssertionError(f"valid: {int((~valid).sum())} rows false")
    if bitmask is not None:
        allowed = (bitmask[np.arange(rows), tokens // 32] >> (tokens % 32)) & 1
        if not allowed.all():
            raise AssertionError(f"token_ids: {int((allowed == 0).sum())} rows drew a token the grammar bitmask masks")


def check_verify(result, draft: np.ndarray, vocab: int) -> None:
    tokens, accepted, valid = _numpy(result.token_ids), _numpy(result.num_accepted), _numpy(result.valid)
    b, n = draft.shape
    if tokens.shape != (b, n + 1) or not ((accepted >= 0) & (accepted <= n)).all():
        raise AssertionError(f"VerifyDraft: token_ids {tokens.shape}, num_accepted {accepted[:8]} (n {n})")
    cols = np.arange(n + 1)[None, :]
    live = cols <= accepted[:, None]
    if not np.where(live, (tokens >= 0) & (tokens < vocab), tokens == -1).all():
        raise AssertionError(f"VerifyDraft: token_ids outside [0, {vocab}) before the end or not -1 after it")
    if not np.where(cols[:, :n] < accepted[:, None], tokens[:, :n] == draft, True).all():
        raise AssertionError("VerifyDraft: an accepted token differs from the draft")
    if not valid.all():
        raise AssertionError(f"valid: {int((~valid).sum())} rows false")


def check_route(answer) -> None:
    weights, experts = (_numpy(a) for a in answer)
    if experts.shape != (1, TOP_EXPERTS) or not ((experts >= 0) & (experts < EXPERTS)).all() \
            or len(set(experts[0].tolist())) != TOP_EXPERTS or not np.isfinite(weights).all():
        raise AssertionError(f"RouteExperts: experts {experts}, weights {weights}")
