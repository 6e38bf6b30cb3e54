"""Seeds for the in-kernel counter-based (Philox) dropout RNG.

A seed is drawn from torch's default CPU generator, so ``torch.manual_seed(s)`` makes a run
reproducible, and no device sync happens. The forward returns the seed as a CPU int64 tensor that
autograd saves, and the backward regenerates the same mask from it: the mask is never stored.
"""
from __future__ import annotations

import torch


def new_seed() -> torch.Tensor:
    """A fresh seed: a CPU int64 tensor of shape (1,), in [0, 2**31)."""
    return torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64)
