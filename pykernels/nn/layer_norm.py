"""Drop-in modules over :func:`pykernels.layer_norm`.

``LayerNorm`` / ``RMSNorm`` subclass ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm``: same constructor,
same parameters and ``state_dict`` keys (checkpoints load either way), plus an optional fused
``residual``: ``forward(x, residual=None)`` returns ``norm(x + residual)``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ..layer_norm import layer_norm


def _flat(x: Tensor, residual: Optional[Tensor], shape: tuple) -> tuple[Tensor, Optional[Tensor]]:
    """Fold a multi-dim normalized_shape into one last dim (the kernels normalise over one dim)."""
    if len(shape) == 1:
        return x, residual
    if tuple(x.shape[-len(shape):]) != tuple(shape):
        raise ValueError(f"x must end with normalized_shape {tuple(shape)}, got {tuple(x.shape)}")
    n = math.prod(shape)
    lead = x.shape[:-len(shape)]
    return x.reshape(*lead, n), residual.reshape(*lead, n) if residual is not None else None


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` running :func:`pykernels.layer_norm` (post-LN fusion with ``residual``).

    ``forward(x, residual=None)``: x ``(..., *normalized_shape)``; returns ``LN(x + residual)`` with x's
    shape and dtype. ``backend`` (attribute, default None = the current default) picks the backend."""

    backend: Optional[str] = None

    def forward(self, x: Tensor, residual: Optional[Tensor] = None) -> Tensor:
        shape = self.normalized_shape
        if len(shape) == 1:
            # the common case: no reshapes (each would be one more view op and autograd node per call)
            return layer_norm(x, self.weight, self.bias, self.eps, residual=residual, backend=self.backend)
        x2, r2 = _flat(x, residual, tuple(shape))
        w = self.weight.reshape(-1) if self.weight is not None else None
        b = self.bias.reshape(-1) if self.bias is not None else None
        return layer_norm(x2, w, b, self.eps, residual=r2, backend=self.backend).reshape(x.shape)


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` running :func:`pykernels.layer_norm` with ``rms_norm=True``.

    ``eps=None`` means ``torch.finfo(x.dtype).eps``, as in torch. ``forward(x, residual=None)`` returns
    ``RMSNorm(x + residual)``."""

    backend: Optional[str] = None

    def forward(self, x: Tensor, residual: Optional[Tensor] = None) -> Tensor:
        shape = self.normalized_shape
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        if len(shape) == 1:
            return layer_norm(x, self.weight, None, eps, residual=residual, rms_norm=True, backend=self.backend)
        x2, r2 = _flat(x, residual, tuple(shape))
        w = self.weight.reshape(-1) if self.weight is not None else None
        return layer_norm(x2, w, None, eps, residual=r2, rms_norm=True, backend=self.backend).reshape(x.shape)


def replace_layer_norms(model: torch.nn.Module) -> torch.nn.Module:
    """Swap, in place, every ``torch.nn.LayerNorm`` of ``model`` (exactly that class, any
    normalized_shape) for a :class:`LayerNorm` that shares the same parameter tensors (optimizer state
    and weight tying stay valid). Returns ``model`` (or the replacement, if ``model`` itself is a
    ``torch.nn.LayerNorm``). Hooks registered on the replaced modules are not carried over."""

    def convert(m: torch.nn.LayerNorm) -> LayerNorm:
        new = LayerNorm.__new__(LayerNorm)
        torch.nn.Module.__init__(new)
        new.normalized_shape = m.normalized_shape
        new.eps = m.eps
        new.elementwise_affine = m.elementwise_affine
        # the same Parameter objects (or None), registered under the same names
        new.weight = m.weight
        new.bias = m.bias
        new.train(m.training)
        return new

    if type(model) is torch.nn.LayerNorm:
        return convert(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.LayerNorm:
                setattr(parent, name, convert(child))
    return model
