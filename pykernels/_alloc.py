"""Output allocation. With ``PYKERNELS_POISON=1`` (the test suite sets it; read at import) every output
buffer a kernel is meant to fill is first filled with NaN (integers with -1), so a kernel that leaves an
element unwritten fails the tests instead of passing on leftover memory."""
from __future__ import annotations

import os

import torch


_POISON = os.environ.get("PYKERNELS_POISON", "0") not in ("", "0")  # read once: every output asks


def poisoning() -> bool:
    return _POISON


def _poison(t: torch.Tensor) -> torch.Tensor:
    if poisoning() and t.numel():
        t.fill_(float("nan") if t.is_floating_point() else -1)
    return t


def empty(*shape, dtype, device) -> torch.Tensor:
    return _poison(torch.empty(*shape, dtype=dtype, device=device))


def empty_strided(shape, stride, *, dtype, device) -> torch.Tensor:
    return _poison(torch.empty_strided(shape, stride, dtype=dtype, device=device))


def empty_like(t: torch.Tensor, *, dtype=None) -> torch.Tensor:
    return _poison(torch.empty_like(t, dtype=dtype, memory_format=torch.contiguous_format))


def empty_like_layout(t: torch.Tensor) -> torch.Tensor:
    """Like ``t``, with ``t``'s memory layout when it is dense and non-overlapping (e.g. the
    (B, S, H, D).transpose(1, 2) views transformers passes to attention), else contiguous: a gradient or
    output laid out like its input needs no copy when autograd or the caller views it back."""
    return _poison(torch.empty_like(t, memory_format=torch.preserve_format))
