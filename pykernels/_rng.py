"""Seeds for the in-kernel counter-based (Philox) dropout RNG.

A seed is a (1,) int64 tensor drawn on the op's device from that device's torch generator
(``torch.randint``), so ``torch.manual_seed(s)`` makes a run reproducible and nothing syncs with the host. The
forward returns it; autograd saves it, and the backward regenerates the same mask from it: the mask is never
stored. The kernels (Triton and CUDA C++) read the seed from device memory (``kernels/_dropout.load_seed``,
``csrc/dispatch.h``'s ``seed_ptr``), never as a launch argument, which makes dropout CUDA-graph safe: torch's CUDA
generator registers with a graph being captured and advances its Philox offset on every replay, so each replay
draws a fresh seed, hence a fresh mask, where a seed passed by value would be frozen into the captured launch
(one mask on every replay). ``torch.compile(mode="reduce-overhead")`` and hand-captured training steps with
dropout work this way.

Without dropout the ops return a (0,) placeholder on the inputs' device instead (never read; allocating it
launches nothing).
"""
from __future__ import annotations

import torch


def new_seed(device=None) -> torch.Tensor:
    """A fresh seed: an int64 tensor of shape (1,) in [0, 2**31 - 1) on ``device`` (default CPU), drawn from that
    device's default generator."""
    return torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=device)


def op_seed(dropout_p: float, device: torch.device) -> torch.Tensor:
    """The seed an op's forward returns: :func:`new_seed` on ``device`` with dropout, else an empty (0,)
    placeholder on ``device``."""
    if dropout_p > 0:
        return new_seed(device)
    return torch.empty(0, dtype=torch.int64, device=device)


def fake_seed(dropout_p: float, device: torch.device) -> torch.Tensor:
    """:func:`op_seed`'s result for a fake (meta) implementation."""
    return torch.empty(1 if dropout_p > 0 else 0, dtype=torch.int64, device=device)
