"""Fake (meta) implementations of the CUDA extension's compiled pairs, so torch.compile can trace them.

``pykernels_cuda::layer_norm_fwd`` / ``layer_norm_bwd`` (csrc/layer_norm.cu) and ``pykernels_cuda::attention_fwd`` /
``attention_bwd`` (csrc/attention.cpp) are the C++ kernels as a forward and a backward op with no autograd of their
own. Under torch.compile, ``pykernels.layer_norm`` and ``pykernels.scaled_dot_product_attention`` /
``varlen_attention`` call them from an ``autograd.Function`` (``_CudaLayerNorm``, ``_CudaAttention``) that dynamo
traces, so the compiled graphs hold the two ops and call them straight into C++: no Python between the graph and
the kernels at run time (the Triton custom ops' Python bodies, called through the dispatcher, cost a compiled
BERT-base step more host time than its GPU time: run248).

Each fake gives the shapes, dtypes, devices and strides the C++ op returns (inductor checks strides of what an
extern op returns against them). Registered once, by ``_backend.cuda_ops_ready`` after ``pykernels._C`` imports.
"""
from __future__ import annotations

import threading

import torch
from torch import Tensor

from ._checks import param_dtype
from ._rng import fake_seed  # draw_seed's result (csrc/dispatch.h) is op_seed's

_lock = threading.Lock()
_registered = False


def _aligned_like(t: Tensor) -> Tensor:
    """``torch.empty_like`` of what csrc/attention.cpp's ``aligned`` makes of ``t``: ``t`` itself where its last dim
    is contiguous and its start and strides are 16-byte multiples, else a contiguous copy; ``empty_like`` keeps the
    strides of a dense tensor, else it is contiguous (as ATen's)."""
    esz = t.element_size()
    ok = (t.stride(-1) == 1 and (t.storage_offset() * esz) % 16 == 0
          and all((t.stride(i) * esz) % 16 == 0 for i in range(t.dim() - 1)))
    return torch.empty_like(t) if ok else t.new_empty(t.shape)


def _layer_norm_fwd(x, weight, bias, residual, eps, dropout_p, prenorm, rms_norm):
    m, n = x.shape
    f32 = torch.float32
    return (x.new_empty(m, n), x.new_empty((m, n) if prenorm else (0,)), x.new_empty(0 if rms_norm else m, dtype=f32),
            x.new_empty(m, dtype=f32), fake_seed(dropout_p, x.device))


def _layer_norm_bwd(dy, ds, a, residual, weight, bias, mean, rstd, seed, dropout_p, prenorm, rms_norm):
    m, n = a.shape
    pdt = param_dtype(weight, bias, a)
    return (a.new_empty((m, n) if dropout_p > 0.0 else (0,)), a.new_empty(m, n),
            a.new_empty(n if weight is not None else 0, dtype=pdt), a.new_empty(n if bias is not None else 0, dtype=pdt))


def _attention_fwd(q, k, v, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, causal,
                   scale, kv_range=None):
    f32 = torch.float32
    if cu_seqlens_q is not None:  # varlen: o zeroed and contiguous, lse (heads, tokens)
        o = q.new_empty(q.shape)
        lse = q.new_empty(q.shape[1], q.shape[0], dtype=f32)
    else:
        o = _aligned_like(q)
        lse = q.new_empty(q.shape[0], q.shape[1], q.shape[2], dtype=f32)
    return o, lse, fake_seed(dropout_p, q.device)


def _attention_bwd(dout, q, k, v, o, lse, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   dropout_p, causal, scale, seed, deterministic=False):
    if cu_seqlens_q is not None:
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    return _aligned_like(q), _aligned_like(k), _aligned_like(v)


def register_fakes() -> None:
    """Register the fakes (once; the ops must be loaded: ``import pykernels._C``)."""
    global _registered
    with _lock:
        if _registered:
            return
        for name, fn in (("layer_norm_fwd", _layer_norm_fwd), ("layer_norm_bwd", _layer_norm_bwd),
                         ("attention_fwd", _attention_fwd), ("attention_bwd", _attention_bwd)):
            torch.library.register_fake(f"pykernels_cuda::{name}")(fn)
        _registered = True
