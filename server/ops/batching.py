"""What every op's batched launch shares: its calls' host tensors moved to the device in one
transfer, and its outputs split back into one piece per call."""

from __future__ import annotations

import numpy as np
import torch

from ..staging import Staging
from ..tensors import HostTensor


def split(t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """``t`` split along dim 0 into pieces of ``sizes`` rows."""
    return list(torch.split(t, sizes)) if len(sizes) > 1 else [t]


def split_rows(a: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    """``a`` split along dim 0 into pieces of ``sizes`` rows."""
    return np.split(a, np.cumsum(sizes[:-1])) if len(sizes) > 1 else [a]


def to_device(handle, *groups: list[HostTensor]) -> list[torch.Tensor]:
    """Each group of host tensors (one per call) stacked along dim 0; all moved in one transfer."""
    stage = Staging()
    for group in groups:
        stage.add(group)
    return stage.to(handle.device)
