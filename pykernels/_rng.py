"""Seeds for the in-kernel counter-based (Philox) dropout RNG.

A seed is drawn from torch's default CPU generator, so ``torch.manual_seed(s)`` makes a run
reproducible, and no device sync happens. The forward returns the seed as a CPU int64 tensor that
autograd saves, and the backward regenerates the same mask from it: the mask is never stored.

Without dropout the ops return a placeholder seed on the inputs' device instead: a CPU tensor among a
graph's outputs makes ``torch.compile(mode="reduce-overhead")`` skip CUDA graphs, and a dropout-free
op has nothing to seed. With dropout, skipping CUDA graphs is right: a captured host-drawn seed would
replay one dropout mask forever, so a dropout op refuses to run under CUDA-graph capture
(:func:`check_not_capturing`).
"""
from __future__ import annotations

import torch

from ._kernels._tuning import capturing


def new_seed() -> torch.Tensor:
    """A fresh seed: a CPU int64 tensor of shape (1,), in [0, 2**31)."""
    return torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64)


def op_seed(dropout_p: float, device: torch.device) -> torch.Tensor:
    """The seed an op's forward returns: :func:`new_seed` (CPU, shape (1,)) with dropout, else an empty
    (0,) placeholder on ``device`` (never read; allocating it launches nothing)."""
    if dropout_p > 0:
        check_not_capturing(device)
        return new_seed()
    return torch.empty(0, dtype=torch.int64, device=device)


def fake_seed(dropout_p: float, device: torch.device) -> torch.Tensor:
    """:func:`op_seed`'s result for a fake (meta) implementation."""
    if dropout_p > 0:
        return torch.empty(1, dtype=torch.int64, device="cpu")
    return torch.empty(0, dtype=torch.int64, device=device)


def check_not_capturing(device: torch.device) -> None:
    """Dropout under CUDA-graph capture would freeze the host-drawn seed into the graph (every replay
    the same mask): refuse it."""
    if capturing(device):
        raise RuntimeError("pykernels: dropout_p > 0 inside CUDA-graph capture would replay one dropout mask "
                           "on every replay (the seed is drawn on the host); capture the dropout-free part only, "
                           "or run this op eagerly")
