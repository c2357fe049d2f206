"""What every op's batched launch shares: its outputs split back into one piece per call. (Its
inputs reach the device through server/engine/staging.py, or server/ops/resident.py where some are read
in place.)"""

from __future__ import annotations

import numpy as np
import torch


def split(t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """``t`` split along dim 0 into pieces of ``sizes`` rows."""
    return list(torch.split(t, sizes)) if len(sizes) > 1 else [t]


def split_rows(a: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    """``a`` split along dim 0 into pieces of ``sizes`` rows."""
    return np.split(a, np.cumsum(sizes[:-1])) if len(sizes) > 1 else [a]
