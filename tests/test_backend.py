"""Backend plumbing: interpreted launches must leave triton.language as they found it.

Compiled and interpreted kernels share a process (the suite on a GPU machine runs both); an
interpreted launch that leaves ``tl.core.program_id`` patched makes the next compilation fail.
"""

from __future__ import annotations

import pytest
import torch

import logitserve.kernels as K
from logitserve.kernels._backend import _language_namespaces, resolve_backend


def _snapshot():
    return [(obj, dict(vars(obj))) for obj in _language_namespaces()]


def _changed(before) -> list[str]:
    changed = []
    for obj, attrs in before:
        now = vars(obj)
        changed += [f"{getattr(obj, '__name__', obj)}.{n}" for n in set(now) | set(attrs)
                    if now.get(n) is not attrs.get(n)]
    return changed


def test_interpreted_launches_restore_triton_language():
    before = _snapshot()
    x = torch.randn(3, 50)
    K.softmax(x, backend="interpret")
    K.causal_softmax(x[:2], backend="interpret")
    K.topk_softmax(x, 2, backend="interpret")
    K.silu(x, backend="interpret")
    K.sample(x, temperature=0.8, top_k=5, top_p=0.9, min_p=0.1, seed=1, backend="interpret")
    assert _changed(before) == []


@pytest.mark.parametrize("backend, device, rule", [
    ("triton", "cpu", "needs CUDA tensors"),
    ("interpret", "meta", "needs CPU tensors"),
    ("cuda", "cpu", "backend must be one of"),
])
def test_resolve_backend_names_the_rule(backend, device, rule):
    with pytest.raises(ValueError, match=rule):
        resolve_backend(backend, torch.device(device))


def test_auto_backend_follows_the_device():
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_backend("auto", torch.device("cuda", 0)) == "triton"
