"""Attention: ``scaled_dot_product_attention``, ``varlen_attention``, ``unpad_input``/``pad_input``.

Layers: the Triton kernels and launchers live in ``pykernels._kernels.attention`` (design note
there); the CUDA C++ implementation is ``torch.ops.pykernels_cuda.attention`` (``csrc/attention.cpp``, its
kernels in ``csrc/attention.cuh``), which eager calls that name ``backend="cuda"`` run, and ``auto``'s eager calls
with dropout (``_use_cuda``, ``_lane_cuda``: :data:`AUTO_CUDA_DROPOUT`), and on Hopper without dropout at head dims
that Triton has no Hopper kernel for (``_lane_cuda_head_dim``: :data:`AUTO_CUDA_HEAD_DIMS`). This
module holds the input checks, the eager reference (``attention_reference``), the dropout-mask helper that
reproduces the kernels' Philox stream (``attention_dropout_mask``), the torch custom ops
``pykernels::attention_fwd/bwd`` and ``pykernels::varlen_attention_fwd/bwd`` with fake impls and autograd, and the
documented public functions.

Causal alignment (``is_causal=True``) is TOP-LEFT, exactly like
``torch.nn.functional.scaled_dot_product_attention`` (``tril(diagonal=0)``): query i sees keys
j <= i, whatever Sq and Sk are::

    Sq=3, Sk=5 (1 = attends)       Sq=5, Sk=3
        k0 k1 k2 k3 k4                 k0 k1 k2
    q0   1  0  0  0  0             q0   1  0  0
    q1   1  1  0  0  0             q1   1  1  0
    q2   1  1  1  0  0             q2   1  1  1
                                   q3   1  1  1
                                   q4   1  1  1

(flash-attn >= 2.1 aligns bottom-right instead; we follow torch.) ``varlen_attention(causal=True)``
uses the same top-left rule inside each sequence.
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch
from torch import Tensor

from . import _checks
from ._backend import CUDA_TRACED, BackendUnavailableError, check_backend_name, cuda_ops_ready, default_backend, select
from ._backend import use_cuda_op
from ._backend import warn_once
from ._backend import _availability as _backend_availability
from ._op import custom_op
from ._rng import fake_seed, op_seed

_OP = "scaled_dot_product_attention"
_VOP = "varlen_attention"
MAX_HEAD_DIM = 256  # the Triton kernels' limit; larger head dims fall back to the reference
# float64 is accepted (the reference serves it, e.g. for gradcheck); the kernels decline it.
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _kernels():
    from ._kernels import attention as k  # imported lazily: importing triton costs time
    return k


# ---------------------------------------------------------------------------------------------
# Dropout RNG: an eager copy of Triton's Philox-4x32 (``tl.randint4x``) at seven rounds and the kernels' dropout bits
# ---------------------------------------------------------------------------------------------
_M32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
# Philox's rounds in every dropout mask (kernels/_dropout.py's PHILOX_ROUNDS, csrc/philox.cuh's kPhiloxRounds): seven,
# as FlashAttention-2 and torch's flash backend draw them (Salmon et al., SC'11: Philox-4x32-7 passes TestU01's
# BigCrush; ten is Random123's default, with margin). Three rounds fewer cut the Philox share of the dropout's work
# by 30%; the masks of every backend change together (tests/test_attention.py checks them against each other and
# Random123's known answers).
PHILOX_ROUNDS = 7


def _mulhilo(a: int, b: Tensor) -> tuple[Tensor, Tensor]:
    """(high, low) 32-bit halves of the 64-bit product of the constant a and the uint32 values b,
    computed with 16-bit limbs in int64 so nothing overflows."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    b_hi, b_lo = b >> 16, b & 0xFFFF
    lo_lo = a_lo * b_lo
    hi_lo = a_hi * b_lo
    lo_hi = a_lo * b_hi
    cross = (lo_lo >> 16) + (hi_lo & 0xFFFF) + (lo_hi & 0xFFFF)
    hi = a_hi * b_hi + (hi_lo >> 16) + (lo_hi >> 16) + (cross >> 16)
    lo = ((cross & 0xFFFF) << 16) | (lo_lo & 0xFFFF)
    return hi, lo


def philox4x32(seed, offsets: Tensor, rounds: int = PHILOX_ROUNDS) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Exactly ``tl.randint4x(seed, offsets, n_rounds=rounds)`` for int64 ``offsets``, in eager PyTorch: the four
    uint32 words of Philox-4x32-``rounds`` (the dropout's seven by default: ``PHILOX_ROUNDS``) at counter (offset lo,
    offset hi, 0, 0), key (seed lo, seed hi), as int64 tensors. ``seed``: an
    int, or the (1,) int64 seed tensor an op drew (read on ``offsets``' device by tensor ops: no ``.item()``, no
    sync, so the reference backend's dropout can be captured in a CUDA graph too)."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"philox4x32: rounds must be a positive int (the dropout's: {PHILOX_ROUNDS}), got {rounds!r}")
    offsets = offsets.to(torch.int64)
    if isinstance(seed, Tensor):
        seed = seed.reshape(-1)[:1].to(device=offsets.device, dtype=torch.int64)
    else:
        seed = int(seed)
    c0 = offsets & _M32
    c1 = (offsets >> 32) & _M32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(rounds):
        hi_b, lo_b = _mulhilo(_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return c0, c1, c2, c3


def dropout_rate(p: float) -> float:
    """The dropout rate the kernels (attention and LayerNorm) realise for a requested ``p``: ``p`` rounded to a
    multiple of 2^-16 (each element's decision compares 16 random bits with ``p * 65536``). Kept elements are scaled by
    ``1 / (1 - dropout_rate(p))``, so the expectation is exact. 0.1 -> 0.1000061."""
    p = float(p)
    return min(round(p * 65536), 65535) / 65536 if p > 0 else 0.0  # (p < 1: a rate of 1 would scale by 1 / 0)


def dropout_bits(seed, rows: Tensor, sk: int, device=None) -> Tensor:
    """The 16 random bits (int64 in [0, 65536)) of every key j < sk of each flat query row r in ``rows``
    ((b * heads + h) * seqlen_q + i): Philox-4x32-7 at counter r * ceil(sk / 8) + j // 8 (one call per 8 keys),
    word (j % 8) // 2, low half for even j. Shape (len(rows), sk)."""
    sk8 = -(-sk // 8)
    rows = rows.to(torch.int64).to(device)
    counters = rows[:, None] * sk8 + torch.arange(sk8, dtype=torch.int64, device=device)[None, :]
    words = torch.stack(philox4x32(seed, counters), dim=-1)  # (R, sk8, 4)
    halves = torch.stack((words & 0xFFFF, words >> 16), dim=-1)  # (R, sk8, 4, 2): key j at [j // 8, j % 8 // 2, j % 2]
    return halves.reshape(rows.shape[0], sk8 * 8)[:, :sk]


def attention_dropout_mask(seed, batch: int, heads: int, seqlen_q: int, seqlen_k: int, p: float,
                           device=None) -> Tensor:
    """The exact dropout keep-mask (bool, (batch, heads, seqlen_q, seqlen_k), True = kept) that the
    attention kernels (Triton and CUDA C++) use for ``seed`` (an int or the seed tensor the forward returns).
    Element (b, h, i, j) is kept where :func:`dropout_bits` of row (b * heads + h) * seqlen_q + i, key j, is
    ``>= dropout_rate(p) * 65536``; for ``varlen_attention`` use seqlen_q/k = max_seqlen_q/k and positions
    inside each sequence."""
    rows = torch.arange(batch * heads * seqlen_q, dtype=torch.int64, device=device)
    keep = dropout_bits(seed, rows, seqlen_k, device) >= round(dropout_rate(p) * 65536)
    return keep.view(batch, heads, seqlen_q, seqlen_k)


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------
def _ref_core(q, k, v, mask, dropout_p, is_causal, scale, dropout_mask):
    """(o, lse) for 4-D-or-more q (..., Hq, Sq, D), k/v (..., Hkv, Sk, D/Dv) in their own dtype."""
    hq = q.shape[-3] if q.dim() >= 3 else 1
    hkv = k.shape[-3] if k.dim() >= 3 else 1
    if hq != hkv and q.dim() >= 3 and k.dim() >= 3:
        if hq % hkv == 0:
            k = k.repeat_interleave(hq // hkv, dim=-3)
            v = v.repeat_interleave(hq // hkv, dim=-3)
        elif hq == 1:
            q = q.expand(*q.shape[:-3], hkv, *q.shape[-2:])
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    sq, sk = s.shape[-2], s.shape[-1]
    if mask is not None:
        if mask.dtype == torch.bool:
            s = s.masked_fill(~mask, float("-inf"))
        else:
            s = s + mask.to(s.dtype)
    if is_causal:
        causal = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(diagonal=0)
        s = s.masked_fill(~causal, float("-inf"))
    dead = torch.isneginf(s).all(-1, keepdim=True)  # True for Sk = 0 too
    lse = torch.logsumexp(s.float(), -1)
    p = torch.softmax(s.masked_fill(dead, 0.0), -1).masked_fill(dead, 0.0)
    if dropout_p > 0:
        if dropout_mask is None:
            p = torch.nn.functional.dropout(p, dropout_p)
        else:
            p = p.masked_fill(~dropout_mask, 0.0) / (1.0 - dropout_rate(dropout_p))
    return torch.matmul(p, v), lse


def _ref_bwd_core(do, q, k, v, mask, dropout_p, is_causal, scale, dropout_mask):
    """Eager attention backward written out (custom-op implementations run below autograd, so the
    reference backend cannot differentiate through ``_ref_core``): returns (dq, dk, dv)."""
    hq, hkv = q.shape[-3], k.shape[-3]
    group = hq // hkv
    kr = k.repeat_interleave(group, dim=-3) if group > 1 else k
    vr = v.repeat_interleave(group, dim=-3) if group > 1 else v
    s = torch.matmul(q, kr.transpose(-2, -1)) * scale
    sq, sk = s.shape[-2], s.shape[-1]
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.to(s.dtype)
    if is_causal:
        causal = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(diagonal=0)
        s = s.masked_fill(~causal, float("-inf"))
    dead = torch.isneginf(s).all(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(dead, 0.0), -1).masked_fill(dead, 0.0)
    keep_scale = None
    if dropout_p > 0:
        keep_scale = dropout_mask.to(p.dtype) / (1.0 - dropout_rate(dropout_p))
    pd = p * keep_scale if keep_scale is not None else p
    dv = torch.matmul(pd.transpose(-2, -1), do)
    dp = torch.matmul(do, vr.transpose(-2, -1))
    if keep_scale is not None:
        dp = dp * keep_scale
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dq = torch.matmul(ds, kr) * scale
    dk = torch.matmul(ds.transpose(-2, -1), q) * scale
    if group > 1:
        dk = dk.unflatten(-3, (hkv, group)).sum(-3)
        dv = dv.unflatten(-3, (hkv, group)).sum(-3)
    return dq, dk, dv


def attention_reference(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                        enable_gqa=False, *, dropout_mask=None, upcast=False):
    """Eager matmul + softmax attention with the semantics of ``scaled_dot_product_attention``.

    Shapes: q (..., Hq, Sq, D), k (..., Hkv, Sk, D), v (..., Hkv, Sk, Dv); GQA when Hq is a multiple
    of Hkv. ``attn_mask``: bool (True = take part) or additive float, broadcastable to
    (..., Hq, Sq, Sk). Fully masked rows give 0 (torch's SDPA gives NaN there). ``dropout_mask``:
    an explicit keep-mask (bool, broadcastable to the scores), e.g. from :func:`attention_dropout_mask`;
    without one, ``dropout_p > 0`` draws torch's own dropout. ``upcast``: compute in float32 and cast
    the result back to q's dtype. Returns (..., Hq, Sq, Dv) in q's dtype.
    """
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            attn_mask = attn_mask.float()
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    o, _ = _ref_core(q, k, v, attn_mask, dropout_p, is_causal, scale, dropout_mask)
    return o.to(dtype)


def _ref_dense_fwd(q, k, v, mask, dropout_p, is_causal, scale, seed):
    dmask = None
    if dropout_p > 0:
        b, h, sq, sk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        dmask = attention_dropout_mask(seed, b, h, sq, sk, dropout_p, q.device)
    return _ref_core(q, k, v, mask, dropout_p, is_causal, scale, dmask)


def _ref_varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, scale, seed):
    """Per-sequence loop (host sync on cu_seqlens: reference only). o rows past cu_q[-1] are 0."""
    o = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        qs, qe, ks, ke = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if qe == qs:
            continue
        qb = q[qs:qe].transpose(0, 1).unsqueeze(0)
        kb = k[ks:ke].transpose(0, 1).unsqueeze(0)
        vb = v[ks:ke].transpose(0, 1).unsqueeze(0)
        dmask = None
        if dropout_p > 0:
            full = attention_dropout_mask(seed, len(cq) - 1, q.shape[1], max_q, max_k, dropout_p, q.device)
            dmask = full[b:b + 1, :, :qe - qs, :ke - ks]
        ob, lb = _ref_core(qb, kb, vb, None, dropout_p, causal, scale, dmask)
        o[qs:qe] = ob[0].transpose(0, 1)
        lse[:, qs:qe] = lb[0]
    return o, lse


def _ref_varlen_bwd(do, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, scale, seed):
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    full = None
    if dropout_p > 0:
        full = attention_dropout_mask(seed, len(cq) - 1, q.shape[1], max_q, max_k, dropout_p, q.device)
    for b in range(len(cq) - 1):
        qs, qe, ks, ke = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if qe == qs or ke == ks:
            continue
        sl = lambda t, a, e: t[a:e].transpose(0, 1).unsqueeze(0)  # noqa: E731 - (1, H, S, D)
        dmask = full[b:b + 1, :, :qe - qs, :ke - ks] if full is not None else None
        g = _ref_bwd_core(sl(do, qs, qe), sl(q, qs, qe), sl(k, ks, ke), sl(v, ks, ke), None, dropout_p, causal,
                          scale, dmask)
        dq[qs:qe] = g[0][0].transpose(0, 1)
        dk[ks:ke] = g[1][0].transpose(0, 1)
        dv[ks:ke] = g[2][0].transpose(0, 1)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# Custom ops: dense
# ---------------------------------------------------------------------------------------------
def _support(q: Tensor, k: Tensor, v: Tensor) -> dict:
    """What the custom ops' backends say to this call: None (covered) or why not. The custom ops' "cuda" entry
    is reached only by traced calls (eager calls that name "cuda" run the C++ op before them: ``_use_cuda``)."""
    reason = _triton_decline(q, k, v)
    return {"triton": reason, "cuda": reason or CUDA_TRACED}


def _triton_decline(q: Tensor, k: Tensor, v: Tensor) -> str | None:
    d, dv = q.shape[-1], v.shape[-1]
    if q.dtype == torch.float64:
        return "float64 inputs (the kernels take fp16, bf16, fp32)"
    if d > MAX_HEAD_DIM or dv > MAX_HEAD_DIM:
        return f"head dim {max(d, dv)} > {MAX_HEAD_DIM}"
    if d == 0 or dv == 0:
        return "empty head dim"
    if q.dim() == 4 and (q.shape[0] > 65535 or q.shape[1] > 65535):
        return f"batch {q.shape[0]} or heads {q.shape[1]} > 65535 (grid y/z limit)"
    if q.dim() == 3 and q.shape[1] > 65535:
        return f"heads {q.shape[1]} > 65535 (grid y limit)"
    return None


def _cuda_cover(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, batch: int) -> str | None:
    """None when the CUDA C++ op ``pykernels_cuda::attention`` (``csrc/attention.cpp``, ``csrc/attention.cuh``) covers
    the call (q, k, v as the custom ops take them: (B, H, S, D), or (tokens, H, D) for varlen with ``batch``
    sequences), else why not."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype} (the CUDA C++ kernels take float16 and bfloat16)"
    d, dv = q.shape[-1], v.shape[-1]
    if dv != d:
        return f"value head dim {dv} != query head dim {d} (the CUDA C++ kernels take one head dim)"
    if d == 0 or d % 8 or d > MAX_HEAD_DIM:
        return f"head dim {d} (the CUDA C++ kernels take multiples of 8 up to {MAX_HEAD_DIM})"
    if batch > 65535 or q.shape[1] > 65535:
        return f"batch {batch} or heads {q.shape[1]} > 65535 (grid y/z limit)"
    if mask is not None and mask.dtype not in (torch.bool, torch.float16, torch.bfloat16, torch.float32,
                                               torch.float64):
        return f"attn_mask dtype {mask.dtype}"
    return None


def _use_cuda(op: str, backend: str | None, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
              batch: int, dropout_p: float, causal: bool | None = None) -> bool:
    """Whether this eager call runs the C++ op (``_backend.use_cuda_op``): when named, and under ``auto`` for a call
    with dropout only (:data:`AUTO_CUDA_DROPOUT`). Without dropout the Triton path runs (its backward the faster;
    at BERT-like shapes on Hopper with the C++ forward kernel: :data:`AUTO_CUDA_FWD`), and with dropout where the
    Gluon backward draws it (:data:`AUTO_SM90_DROPOUT`; ``causal`` None: a varlen call, never)."""
    auto = dropout_p > 0.0 and AUTO_CUDA_DROPOUT
    if auto and causal is not None and not torch.compiler.is_compiling() and (backend or default_backend()) == "auto" \
            and _auto_sm90_dropout_kind(q, k, v, mask, causal, "auto"):
        auto = False  # (not under torch.compile: its graphs keep the C++ pair, as dynamo would not trace the rule)
    if not auto and dropout_p == 0.0 and causal is not None and not torch.compiler.is_compiling() \
            and (backend or default_backend()) == "auto":
        auto = _auto_cuda_head_dim_kind(q, k, v, mask)
    return use_cuda_op(op, backend, q.device, lambda: _cuda_cover(q, k, v, mask, batch),
                       auto=auto, traced=True, capture=True)


# ``auto`` runs attention calls with dropout on the C++ op where it is built and covers them (eager, and under
# torch.compile through its compiled pair). Dropout is training, where the host time a step matters: the C++ op's
# forward and backward are one dispatcher call each (autograd in C++), against the Triton path's Python (under
# CUDA-graph capture too: both paths read the seed from device memory). Its kernels with dropout
# are also the faster ones on the GPU since run255-256 (H200, a call at BERT-base: 156 / 484 us forward / backward
# against the Triton kernels' 177 / 547; GPT-2 91 / 286 against 120 / 359), still after the Triton kernels drew their
# keep bits by PTX (H200 run457, graph replay: BERT-base 135.2 / 317.0 against 142.3 / 336.1, GPT-2 85.7 / 194.0
# against 99.1 / 231.3; run459's Triton tables 143.2 / 329.1 and 99.3 / 214.7, in another call; with key padding
# about level, 143.0 / 301.4 against 143.9 / 309.3); before that they had been slower (H100:
# 3.2 + 7.8 ms a BERT-base step against Triton's 2.2 + 6.1), and whole eager training steps were faster with them
# all the same (run249: transformers' BERT-base MLM step 48.7 ms against 56.9, GPT-2 59.5 against 69.5).
# ``PYKERNELS_AUTO_CUDA_DROPOUT=0`` keeps auto on Triton (read once).
AUTO_CUDA_DROPOUT = os.environ.get("PYKERNELS_AUTO_CUDA_DROPOUT", "1") not in ("", "0")


# ``auto`` without dropout runs the Triton backend's pair, but at BERT-like shapes on Hopper its forward kernel is the
# C++ one (the Triton backward takes the C++ forward's output and lse: the same natural-log (B, H, Sq) fp32 lse, -inf
# at fully masked rows): there the C++ forward's three consumer warpgroups, each softmax beside its own P V, are the
# faster forward (H200 run350, graph replay, BERT-base: 348 against 336 TFLOP/s; run351, kernel time: 69.5-69.9
# against 72.6-72.9 us), while the Triton backward is the faster backward (304 against 271 TFLOP/s; 219 against 237
# us). With a boolean key-padding mask too (run352, auto's forward: 81.1-81.9 against 82.2-83.0 us; the backward's key
# ranges then come from the Triton kernel that the Triton forward would have run). ``PYKERNELS_AUTO_CUDA_FWD=0`` keeps auto's
# forward on Triton (read once).
AUTO_CUDA_FWD = os.environ.get("PYKERNELS_AUTO_CUDA_FWD", "1") not in ("", "0")

# Unmasked at D = 64, where the Triton path's forward is the Gluon kernel (from 512 keys: ``attention_sm90.preferred``),
# the C++ forward is taken only where its rounds over the SMs do not lose to the Gluon kernel's (``_cpp_fwd_rounds_win``):
# its three consumers' tiles (192 rows, or three 64-row units mixing heads) are this much faster a 64-row unit than
# the Gluon kernel's two consumers' 128-row tiles, but there are fewer of them to spread over the SMs. H200 run477
# (``benchmarks/dev/attention_cuda_fwd_rule.py``, both forwards alone, graph replay, bf16, best of 3 alternating
# rounds; C++ / Gluon speed): at 512 keys B32 H12 1.057x, B24 H16 1.055, B64 H12 1.057, B48 H16 1.062, B16 H12 1.064
# (equal rounds: 8 / 12 ...), B32 H16 1.031 (11 x 3 units against 16 x 2), but B16 H16 (BERT-large) 0.949 and B8 H16
# 0.985 (6 x 3 against 8 x 2, 3 x 3 against 4 x 2); at 1024 keys B8 H12 1.088, B16 H16 1.095, B8 H16 0.973; B4 H16
# S2048 0.970. The model below (1.055 a unit, rounds of 132 SMs) orders all twelve shapes as measured.
CPP_FWD_UNIT_SPEEDUP = 1.055


def _cpp_fwd_rounds_win(batch: int, heads: int, sq: int, sms: int) -> bool:
    """Whether the C++ three-consumer forward's rounds over ``sms`` SMs, each 3 units of 64 query rows a tile, take no
    longer than the Gluon forward's, each 2 units, at :data:`CPP_FWD_UNIT_SPEEDUP` the cost of a unit (csrc's
    ``fwd_three_consumers`` / ``fwd_mix``: tiles mixing heads where a head's units are 3 or more and no multiple of 3,
    else 192 rows of one head where that pads the rows to at most 1.25x 128-row tiles; else two consumers, which lose
    to the Gluon kernel: False)."""
    n_u = -(-sq // 64)
    mix = n_u >= 3 and n_u % 3 != 0
    if not (mix or 4 * (-(-sq // 192) * 192) <= 5 * (-(-sq // 128) * 128)):
        return False
    tiles_c = -(-(batch * heads * n_u) // 3) if mix else batch * heads * -(-sq // 192)
    tiles_g = batch * heads * -(-sq // 128)
    return 3 * -(-tiles_c // sms) <= 2 * -(-tiles_g // sms) * CPP_FWD_UNIT_SPEEDUP


def _auto_cuda_fwd_kind(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, requested: str) -> bool:
    """What ``_auto_cuda_fwd`` requires of a kind of call (its shapes, strides, dtypes, device, flags: the eager
    lane remembers it per key): :data:`AUTO_CUDA_FWD`, ``auto``, the extension built with sm_90a code on a compute
    capability 9.0 device, at D <= 64, not causal, no mask or a boolean key-padding one (the C++ forward's warp-
    specialised kernels there), fp16 / bf16, strides that TMA takes (``_tma_strides_ok``); unmasked at D = 64 where
    the Gluon forward would run, only where the C++ kernel's rounds do not lose (``_cpp_fwd_rounds_win``)."""
    if not AUTO_CUDA_FWD or requested != "auto" or causal:
        return False
    if mask is not None and not (mask.dtype == torch.bool and _is_key_padding(mask)):
        return False
    if not (q.shape[-1] <= 64 and _hopper_cpp_kernels(q, k, v, mask)):
        return False
    if mask is None and q.shape[-1] == 64 and k.shape[2] >= 512:
        from ._kernels import attention_sm90 as a9
        bm, bn, _ = a9.CONFIGS[64]
        # (where the Gluon forward runs on host descriptors: otherwise each CTA makes its own, 1.9x slower, run34)
        if a9.preferred(q, k, False) and all(a9._flat_geometry(t.shape, t.stride(), rows) is not None
                                             for t, rows in ((q, bm), (k, bn), (v, bn))):
            return _cpp_fwd_rounds_win(q.shape[0], q.shape[1], q.shape[2], a9._num_sms(q.device))
    return True


def _hopper_cpp_kernels(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> bool:
    """Whether the C++ op's Hopper kernels can take a kind of call (what the rules for ``auto``'s C++ forward ask
    of it: :data:`AUTO_CUDA_FWD`, :data:`AUTO_SM90_DROPOUT`): dense (B, H, S, D) fp16 / bf16 on a CUDA device of
    compute capability 9.0, the extension built with sm_90a code and covering the case (``_cuda_cover``), strides
    that TMA takes (``_tma_strides_ok``, as the Gluon kernels check it). Shapes, strides and dtypes only."""
    if q.device.type != "cuda" or q.dim() != 4 or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if not cuda_ops_ready() or _cuda_cover(q, k, v, mask, q.shape[0]) is not None:
        return False
    from ._kernels import _tuning
    from ._kernels.attention_sm90 import _tma_strides_ok
    if not (_tma_strides_ok(q.stride()) and _tma_strides_ok(k.stride()) and _tma_strides_ok(v.stride())):
        return False
    import pykernels._C as ext  # (built: cuda_ops_ready)
    props = _tuning.device_properties(q.device)  # (cached: torch.cuda.get_device_capability costs microseconds)
    return bool(ext.sm90a) and (props.major, props.minor) == (9, 0)


# ``auto`` with dropout at D = 128 on Hopper, where the Gluon backward takes the case (``sm90_backward``: its dK/dV
# kernel draws the dropout mask itself, fused with dQ or beside Triton's dQ kernel): the C++ forward kernel (with its
# dropout) and that backward, instead of the C++ op's backward. H200 run447 (``benchmarks/dev/
# attention_bwd_dropout_ab.py``, p = 0.1, the whole backward's graph replay, us, Gluon / C++ op / cuDNN): causal
# 4 x 16 x 2048 596.9 / 676.6 / - (cuDNN's capture failed there), full 8 x 16 x 1024 507.4 / 597.4 / 505.0, full
# 4 x 16 x 4096 3377.4 / 4012.0 / 3402.4, causal 4 x 16 x 4096 2028.8 / 2214.7 / 1820.0, causal 1 x 16 x 8192 1966.7 /
# 2168.6 / 1751.9 (the Triton kernels 2.0-2.4x the Gluon time). Its first version (flags unpacked, 45% over its time
# without dropout) lost at causal 4 x 16 x 4096 (run445); with the flags packed between the asm blocks 1.27-1.40x.
# ``PYKERNELS_AUTO_SM90_DROPOUT=0`` keeps those calls on the C++ op (read once).
AUTO_SM90_DROPOUT = os.environ.get("PYKERNELS_AUTO_SM90_DROPOUT", "1") not in ("", "0")


# ``auto`` without dropout at the head dims where neither Triton nor Gluon has a Hopper kernel (64 < D < 128) runs
# the C++ op on Hopper: dense calls, unmasked or with a boolean key-padding mask. H200 run469
# (``benchmarks/attention.py --matrix``, graph replay, TFLOP/s forward / backward, the C++ op against the Triton
# backend that auto took before; cuDNN in the same call): 8 x 16 x 2048 D80 371.5 / 263.0 against 275.5 / 250.0
# (cuDNN 396.9 / 325.3), D80 causal (32 heads) 326.2 / 228.6 against 220.8 / 183.8 (343.1 / 276.2), D96 441.1 /
# 309.6 against 328.3 / 290.6 (482.8 / 376.4), D96 causal 377.6 / 260.9 against 253.8 / 212.9 (387.2 / 314.5): its
# warpgroup-MMA kernels (D computed as 96) against Triton's FlashAttention-2 kernels (D computed as 128); run471 with
# key padding (8 x 16 x 2048 D96) 469.8 / 399.6 against 331.1 / 355.2 (cuDNN 302.7 / 265.4). Above D = 128 the
# seventy-seventh session took calls with a backward to come too (its backward then 1.6-1.7x Triton's small tiles);
# since the Triton D = 256 tiles of run471 (``kernels/attention.py``: forward 1.5x, backward 2.2-3.8x) Triton is the
# faster there both ways, so auto stays on it (4 x 8 x 4096 D256 causal: the C++ op 207.8 / 132.9 in run471).
# Eager calls (and their CUDA-graph capture); compiled graphs keep the Triton pair there.
# ``PYKERNELS_AUTO_CUDA_HEAD_DIMS=0`` keeps auto on Triton at these head dims (read once).
AUTO_CUDA_HEAD_DIMS = os.environ.get("PYKERNELS_AUTO_CUDA_HEAD_DIMS", "1") not in ("", "0")


def _auto_cuda_head_dim_kind(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> bool:
    """What ``auto``'s call without dropout needs to run the C++ op at a head dim Triton has no Hopper kernel for
    (:data:`AUTO_CUDA_HEAD_DIMS`): 64 < D < 128, no mask or a boolean key-padding one, and the C++ op's Hopper kernels
    taking the kind of call (``_hopper_cpp_kernels``), but not where the Gluon kernels take D = 80 / 96 unmasked on
    their D = 128 tiles both ways (``attention_sm90.zero_fill_on``; the backward's rule wants enough CTAs). Shapes,
    strides and dtypes only."""
    d = q.shape[-1]
    if not AUTO_CUDA_HEAD_DIMS or not 64 < d < 128:
        return False
    if mask is not None and not (mask.dtype == torch.bool and _is_key_padding(mask)):
        return False
    if mask is None and d in (80, 96):
        from ._kernels import attention as katt
        # the Gluon kernels on the D = 128 tiles (``attention_sm90.TILE_D``; ``PYKERNELS_ATTN_SM90_D80_96``) both ways:
        # where the backward's rule takes them too (enough CTAs to fill the card; H200 run487-488 measured those)
        if katt.sm90_forward(q, k, v, None, dropout_p=0.0, scale=1.0) \
                and katt.sm90_backward(q, k, v, q, None, dropout_p=0.0, scale=1.0):
            return False
    return _hopper_cpp_kernels(q, k, v, mask)


def _auto_sm90_dropout_kind(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool,
                            requested: str) -> bool:
    """What ``auto``'s call with dropout needs to run the C++ forward and the Gluon backward
    (:data:`AUTO_SM90_DROPOUT`): ``auto``, no mask, dense (B, H, S, 128) fp16 / bf16 on a compute capability 9.0
    device, the extension built with sm_90a code and covering the case, TMA-able strides, and the Gluon backward's
    rule taking it (``sm90_backward``'s, less what needs the data: a call's own tensors are checked again, the
    forward's alignment by ``_aligned16`` and the backward's by ``sm90_backward``). Shapes, strides and dtypes only
    (no data pointer). Not under torch.compile's tracing, whose graphs keep the C++ pair for auto with dropout. Off
    with :data:`AUTO_CUDA_DROPOUT` too (no C++ kernel for auto's calls with dropout)."""
    if not (AUTO_SM90_DROPOUT and AUTO_CUDA_DROPOUT) or requested != "auto" or mask is not None:
        return False
    if q.shape[-1] != 128 or k.dtype != q.dtype or v.dtype != q.dtype or k.shape[-1] != 128 or v.shape[-1] != 128 \
            or q.numel() == 0 or k.numel() == 0 or not _hopper_cpp_kernels(q, k, v, mask):
        return False
    from ._kernels import attention_sm90 as a9
    from ._kernels import attention_sm90_bwd as kb
    if not (kb.DROPOUT_KERNELS and a9.enabled()):
        return False
    which = kb.kernels(q, k, causal, a9._num_sms(q.device))
    return which == "fused" or "dkdv" in which.split(",")


def _auto_cuda_fwd_call(q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> bool:
    """What ``_auto_cuda_fwd`` requires of each call: no dropout, and q, k, v 16-byte aligned (TMA's maps)."""
    return dropout_p == 0.0 and _aligned16(q, k, v)


def _auto_cuda_fwd(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float, causal: bool,
                   requested: str) -> bool:
    """Whether ``auto``'s Triton path takes the C++ forward kernel (:data:`AUTO_CUDA_FWD`; the two parts above; with
    dropout :data:`AUTO_SM90_DROPOUT`)."""
    if dropout_p > 0:
        return _aligned16(q, k, v) and _auto_sm90_dropout_kind(q, k, v, mask, causal, requested)
    return _auto_cuda_fwd_call(q, k, v, dropout_p) and _auto_cuda_fwd_kind(q, k, v, mask, causal, requested)


def _aligned16(q: Tensor, k: Tensor, v: Tensor) -> bool:
    return not (q.data_ptr() % 16 or k.data_ptr() % 16 or v.data_ptr() % 16)


def _lane_cuda(lkey, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, batch: int, dropout_p: float,
               requested: str, causal: bool | None = None) -> bool:
    """Whether a call the lane covers goes to the C++ op under ``auto`` (a call with dropout, the extension built
    and covering it: remembered per lane key; captured in CUDA graphs too, where its kernels are faster as well)."""
    if not (dropout_p > 0.0 and requested == "auto" and AUTO_CUDA_DROPOUT):
        return False
    return _lane_remember(_LANE_CUDA, lkey, lambda: use_cuda_op(
        _OP, "auto", q.device, lambda: _cuda_cover(q, k, v, mask, batch), capture=True) and not (
            causal is not None and _auto_sm90_dropout_kind(q, k, v, mask, causal, requested)))


def _cuda_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, cu_q: Tensor | None, cu_k: Tensor | None,
                    max_q: int, max_k: int, dropout_p: float, causal: bool, scale: float,
                    deterministic: bool = False) -> Tensor:
    """The C++ op (its autograd in C++), with the seed drawn as the custom ops draw it (``op_seed``): the same seed,
    hence the same dropout mask, as the Triton backend's for one ``torch.manual_seed``. Without dropout no seed
    is drawn (nor op_seed's placeholder tensor allocated). ``deterministic`` (or torch's deterministic mode, which
    the op reads itself) keeps the backward off its fused kernel, whose dQ reductions add in no fixed order."""
    if torch.compiler.is_compiling():  # the compiled pair (its forward draws the seed)
        return _CudaAttention.apply(q, k, v, mask, cu_q, cu_k, max_q, max_k, dropout_p, causal, scale, deterministic)
    seed = op_seed(dropout_p, q.device) if dropout_p > 0 else None
    return torch.ops.pykernels_cuda.attention(q, k, v, mask, cu_q, cu_k, max_q, max_k, dropout_p, causal, scale, seed,
                                              deterministic)


class _CudaAttention(torch.autograd.Function):
    """The C++ kernels as torch.compile's graphs hold them: ``pykernels_cuda::attention_fwd`` and ``attention_bwd``
    (csrc/attention.cpp; fake impls in ``pykernels._cuda_ops``), which dynamo traces through this Function, so the
    compiled forward and backward call them with no Python at run time. The forward draws the dropout seed (as
    ``op_seed`` does) and returns it for the backward. Eager calls take the one-call op instead."""

    @staticmethod
    def forward(ctx, q, k, v, mask, cu_q, cu_k, max_q, max_k, dropout_p, causal, scale, deterministic):
        o, lse, seed = torch.ops.pykernels_cuda.attention_fwd(q, k, v, mask, cu_q, cu_k, max_q, max_k, dropout_p,
                                                              causal, scale)
        ctx.save_for_backward(q, k, v, o, lse, mask, cu_q, cu_k, seed)
        ctx.args = (max_q, max_k, dropout_p, causal, scale, deterministic)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, mask, cu_q, cu_k, seed = ctx.saved_tensors
        max_q, max_k, dropout_p, causal, scale, deterministic = ctx.args
        dq, dk, dv = torch.ops.pykernels_cuda.attention_bwd(do, q, k, v, o, lse, mask, cu_q, cu_k, max_q, max_k,
                                                            dropout_p, causal, scale, seed, deterministic)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


def _last_dim_contig(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _is_key_padding(mask: Tensor | None) -> bool:
    """A (B, H, Sq, Sk) mask view that depends only on (batch, key): strides 0 over heads and rows."""
    return (mask is not None and mask.shape[0] > 0 and mask.shape[-1] > 0
            and (mask.shape[1] == 1 or mask.stride(1) == 0) and (mask.shape[2] == 1 or mask.stride(2) == 0))


def _key_padding_range(mask: Tensor | None, use_kernel: bool = True) -> Tensor:
    """Per-batch valid key range as int32 (B, 3) on the mask's device (no host sync) for a key-padding
    mask, else an empty (0,) tensor: lo, hi (keys outside [lo, hi) are masked for every query and head, so
    the kernels skip their blocks; a batch with no valid key gets lo = Sk, hi = 0) and dense (1 when every
    key in [lo, hi) is valid: the sm_90 forward then masks by index, without reading the mask). On a GPU with
    ``use_kernel`` (the Triton backend runs the call) one Triton kernel computes it
    (``attention.key_padding_range``), else eager ops."""
    if not _is_key_padding(mask):
        device = mask.device if mask is not None else None
        return torch.empty(0, dtype=torch.int32, device=device)
    row = mask[:, 0, 0, :]
    if row.is_cuda and use_kernel:
        return _kernels().key_padding_range(row)
    valid = row if row.dtype == torch.bool else row != float("-inf")
    sk = valid.shape[-1]
    pos = torch.arange(sk, device=valid.device, dtype=torch.int32)
    lo = torch.where(valid, pos, sk).amin(-1)
    hi = torch.where(valid, pos + 1, 0).amax(-1)
    dense = valid.sum(-1) == hi - lo
    return torch.stack([lo, hi, dense.to(lo.dtype)], -1).to(torch.int32)


@custom_op("pykernels::attention_fwd", mutates_args=())
def _attention_fwd(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], dropout_p: float,
                   is_causal: bool, scale: float, backend: str,
                   deterministic: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns (o, lse, seed, kv_range); kv_range (int32 (B, 3) for a key-padding mask, else empty) is
    computed once here and saved for the backward. ``deterministic`` is the backward's (saved with it)."""
    impl = select(_OP, backend or None, q.device, _support(q, k, v))
    if impl == "triton":
        cuda_fwd = _auto_cuda_fwd(q, k, v, attn_mask, dropout_p, is_causal, backend or default_backend())
        return _triton_fwd(q, k, v, attn_mask, dropout_p, is_causal, scale, cuda_fwd)
    seed = op_seed(dropout_p, q.device)
    kv_range = _key_padding_range(attn_mask, use_kernel=False)
    o, lse = _ref_dense_fwd(q, k, v, attn_mask, dropout_p, is_causal, scale, seed)
    return _out_layout(o, q), lse.contiguous(), seed, kv_range


def _triton_fwd(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], dropout_p: float, is_causal: bool,
                scale: float, cuda_fwd: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``_attention_fwd`` on the Triton backend (also what the eager lane calls): (o, lse, seed, kv_range).
    ``cuda_fwd`` (``_auto_cuda_fwd``: no dropout, no mask or a key-padding one; or with dropout, no mask, where the
    Gluon backward draws it): the C++ forward kernel instead, for the Triton backward (which takes the key ranges that
    the Triton forward would have computed, and the seed the C++ forward drew: the same mask)."""
    if cuda_fwd:  # (the key ranges first: the C++ forward splits a key-padding mask by them, csrc's fwd_key_ranges)
        kv_range = _key_padding_range(attn_mask, use_kernel=True)
        o, lse, seed = torch.ops.pykernels_cuda.attention_fwd(q, k, v, attn_mask, None, None, q.shape[2], k.shape[2],
                                                               dropout_p, bool(is_causal), scale,
                                                               kv_range if kv_range.numel() else None)
        return _out_layout(o, q), lse, seed if dropout_p > 0 else op_seed(0.0, q.device), kv_range
    seed = op_seed(dropout_p, q.device)
    kv_range = _key_padding_range(attn_mask, use_kernel=True)
    o, lse = _kernels().attention_fwd(q, k, v, attn_mask, causal=is_causal, scale=scale, dropout_p=dropout_p,
                                      seed=seed,
                                      kv_range=kv_range if kv_range.numel() else None)
    return o, lse, seed, kv_range


def _out_layout(o: Tensor, q: Tensor) -> Tensor:
    """``o`` in the layout every backend (and the fake impl) gives the attention output: q's layout when
    it is dense and Dv == D (the kernels allocate it so: transformers' transposed views reshape back
    for free), else contiguous."""
    if o.shape != q.shape:
        return o.contiguous()
    return _like_layout(o, q)


def _like_layout(t: Tensor, like: Tensor) -> Tensor:
    """``t`` (shaped like ``like``) with the strides ``torch.empty_like(like)`` gives."""
    out = torch.empty_like(like, dtype=t.dtype)
    if out.stride() == t.stride():
        return t
    return out.copy_(t)


@_attention_fwd.register_fake
def _(q, k, v, attn_mask, dropout_p, is_causal, scale, backend, deterministic):
    b, h, sq = q.shape[0], q.shape[1], q.shape[2]
    kv_range = (q.new_empty(b, 3, dtype=torch.int32) if _is_key_padding(attn_mask)
                else q.new_empty(0, dtype=torch.int32))
    o = torch.empty_like(q) if v.shape[-1] == q.shape[-1] else q.new_empty(b, h, sq, v.shape[-1])
    return (o, q.new_empty(b, h, sq, dtype=torch.float32), fake_seed(dropout_p, q.device), kv_range)


@custom_op("pykernels::attention_bwd", mutates_args=())
def _attention_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, seed: Tensor,
                   kv_range: Tensor, attn_mask: Optional[Tensor], dropout_p: float, is_causal: bool, scale: float,
                   backend: str, deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    impl = select(_OP, backend or None, q.device, _support(q, k, v))
    if impl == "triton":
        return _triton_bwd(do, q, k, v, o, lse, seed, kv_range, attn_mask, dropout_p, is_causal, scale, deterministic)
    dmask = None
    if dropout_p > 0:
        dmask = attention_dropout_mask(seed, q.shape[0], q.shape[1], q.shape[2], k.shape[2], dropout_p, q.device)
    grads = _ref_bwd_core(do, q, k, v, attn_mask, dropout_p, is_causal, scale, dmask)
    return tuple(_like_layout(g, t) for g, t in zip(grads, (q, k, v)))  # the kernels' (and fake's) layout


def _triton_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, seed: Tensor, kv_range: Tensor,
                attn_mask: Optional[Tensor], dropout_p: float, is_causal: bool, scale: float,
                deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``_attention_bwd`` on the Triton backend (also what the eager lane's backward calls)."""
    return _kernels().attention_bwd(_last_dim_contig(do), q, k, v, o, lse, attn_mask, causal=is_causal, scale=scale,
                                    dropout_p=dropout_p, seed=seed,
                                    kv_range=kv_range if kv_range.numel() else None, deterministic=deterministic)


@_attention_bwd.register_fake
def _(do, q, k, v, o, lse, seed, kv_range, attn_mask, dropout_p, is_causal, scale, backend, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fwd_setup(ctx, inputs, output):
    q, k, v, attn_mask, dropout_p, is_causal, scale, backend, deterministic = inputs
    o, lse, seed, kv_range = output
    ctx.save_for_backward(q, k, v, o, lse, seed, kv_range, attn_mask)
    ctx.args = (dropout_p, is_causal, scale, backend, deterministic)


def _fwd_backward(ctx, do, dlse, dseed, dkv_range):
    q, k, v, o, lse, seed, kv_range, attn_mask = ctx.saved_tensors
    dropout_p, is_causal, scale, backend, deterministic = ctx.args
    dq, dk, dv = _attention_bwd(do, q, k, v, o, lse, seed, kv_range, attn_mask, dropout_p, is_causal, scale,
                                backend, deterministic)
    return dq, dk, dv, None, None, None, None, None, None


_attention_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup)


# ---------------------------------------------------------------------------------------------
# Custom ops: varlen
# ---------------------------------------------------------------------------------------------
@custom_op("pykernels::varlen_attention_fwd", mutates_args=())
def _varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                max_seqlen_k: int, dropout_p: float, causal: bool, scale: float,
                backend: str) -> tuple[Tensor, Tensor, Tensor]:
    impl = select(_VOP, backend or None, q.device, _support(q, k, v))
    if impl == "triton":
        return _varlen_triton_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, causal,
                                  scale)
    seed = op_seed(dropout_p, q.device)
    o, lse = _ref_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, causal,
                             scale, seed)
    return o, lse, seed


def _varlen_triton_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                       max_seqlen_k: int, dropout_p: float, causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """``_varlen_fwd`` on the Triton backend (also what the eager lane calls): (o, lse, seed)."""
    seed = op_seed(dropout_p, q.device)
    o, lse = _kernels().attention_fwd(q, k, v, None, causal=causal, scale=scale, dropout_p=dropout_p,
                                      seed=seed, cu_seqlens_q=cu_seqlens_q,
                                      cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    return o, lse, seed


@_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, causal, scale, backend):
    return (q.new_empty(q.shape[0], q.shape[1], v.shape[-1]),
            q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32),
            fake_seed(dropout_p, q.device))


@custom_op("pykernels::varlen_attention_bwd", mutates_args=())
def _varlen_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, seed: Tensor,
                cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                dropout_p: float, causal: bool, scale: float, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    impl = select(_VOP, backend or None, q.device, _support(q, k, v))
    if impl == "triton":
        return _varlen_triton_bwd(do, q, k, v, o, lse, seed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, causal, scale)
    return _ref_varlen_bwd(do, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, causal,
                           scale, seed)


def _varlen_triton_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, seed: Tensor,
                       cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                       dropout_p: float, causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """``_varlen_bwd`` on the Triton backend (also what the eager lane's backward calls)."""
    return _kernels().attention_bwd(_last_dim_contig(do), q, k, v, o, lse, None, causal=causal, scale=scale,
                                    dropout_p=dropout_p, seed=seed,
                                    cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                    max_seqlen_k=max_seqlen_k)


@_varlen_bwd.register_fake
def _(do, q, k, v, o, lse, seed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, causal, scale,
      backend):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _varlen_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, scale, backend = inputs
    o, lse, seed = output
    ctx.save_for_backward(q, k, v, o, lse, seed, cu_q, cu_k)
    ctx.args = (max_q, max_k, dropout_p, causal, scale, backend)


def _varlen_backward(ctx, do, dlse, dseed):
    q, k, v, o, lse, seed, cu_q, cu_k = ctx.saved_tensors
    max_q, max_k, dropout_p, causal, scale, backend = ctx.args
    dq, dk, dv = _varlen_bwd(do, q, k, v, o, lse, seed, cu_q, cu_k, max_q, max_k, dropout_p, causal, scale, backend)
    return dq, dk, dv, None, None, None, None, None, None, None, None


_varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup)


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------
def _check_scale(scale):
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    return float(scale)


def _check_deterministic(deterministic):
    if deterministic is not None and not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool or None, got {type(deterministic).__name__}")


def _broadcasts_to(shape, full) -> bool:
    """Whether ``shape`` broadcasts to exactly ``full`` (plain ints, no torch call)."""
    if len(shape) > len(full):
        return False
    return all(s == f or s == 1 for s, f in zip(reversed(tuple(shape)), reversed(tuple(full))))


# ---------------------------------------------------------------------------------------------
# The eager lane: repeated calls of one kind skip the layers between the public function and the
# Triton backend's body
# ---------------------------------------------------------------------------------------------
# An eager BERT-base forward spent 196-289 us of host time in those layers and the launch (run131,
# run133) against a 74 us kernel and torch SDPA's 29-58 us of host time: host-bound in eager code. The
# lane remembers, per key of everything the full path's checks and backend choice read (shapes, strides,
# dtypes and devices of the tensors and the mask, the flags, the default backend), that a call is valid
# and served by the Triton backend, and then runs that backend's body (``_triton_fwd``: the seed, the
# key-padding range, the kernel-level forward) with the arguments the full path would give it, under an
# autograd node whose backward runs ``_triton_bwd`` the same way (the same kernels, the same results and
# the same dropout seeds). A covered call is valid (what ``_lane_scale`` requires implies every check of
# the full path) and needs no fallback warning. The full path runs whenever the lane does not cover the
# call: q, k, v not four-dimensional or broadcast over batch or query heads, a mask that needs its gradient,
# ``deterministic=True``, the reference backend, tracing, tensor subclasses...
_LANE_ON = os.environ.get("PYKERNELS_EAGER_LANE", "1") not in ("", "0")  # read once (tests flip the attribute)
_LANE: dict = {}
_LANE_CUDA_HEAD_DIM: dict = {}  # lane key -> whether auto's calls without dropout take the C++ op (_lane_cuda_head_dim)
_LANE_CUDA: dict = {}  # lane key -> whether auto's calls with dropout take the C++ op (_lane_cuda)
_LANE_SM90_DROPOUT: dict = {}  # lane key -> whether auto's calls with dropout take the C++ forward and Gluon backward
_LANE_CUDA_FWD: dict = {}  # lane key -> whether auto's calls of that kind take the C++ forward (_auto_cuda_fwd_kind)
_LANE_MAX = 1024  # the cache starts over when full (bounded whatever the callers vary)


def _lane_served(q: Tensor, k: Tensor, v: Tensor, requested: str) -> bool:
    """What both lanes require of q, k, v (their dims and shapes checked by the caller): one dtype the kernels
    take, one device, and the Triton backend serving the call (``select``'s answer for "auto" on CUDA or
    "triton"; the interpreter serves CPU tensors for "triton" as the full path does)."""
    dtype, dev = q.dtype, q.device
    if dtype not in (torch.float16, torch.bfloat16, torch.float32) or k.dtype != dtype or v.dtype != dtype:
        return False
    if k.device != dev or v.device != dev or requested not in ("auto", "triton"):
        return False
    if requested == "auto" and dev.type != "cuda":
        return False  # (auto runs the reference off CUDA)
    return _support(q, k, v)["triton"] is None and _backend_availability("triton", dev) is None


def _lane_scale(query: Tensor, key: Tensor, value: Tensor, mask, scale, requested: str):
    """The softmax scale of a call the lane covers, else None: four-dim tensors of one batch, dtype and device
    (CUDA; CPU tensors under the interpreter with ``backend="triton"``, as the full path serves them), Hq a
    multiple of Hkv, unit last strides, nothing empty, a mask (if any) of the device that broadcasts to
    (B, Hq, Sq, Sk), and the Triton backend serving it (``select``'s answer for "auto" or "triton")."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return None
    b, hq, sq, d = query.shape
    _, hk, sk, _ = key.shape
    if (key.shape[0] != b or value.shape[0] != b or key.shape[3] != d or value.shape[1] != hk
            or value.shape[2] != sk or hk == 0 or hq % hk):
        return None
    if query.numel() == 0 or key.numel() == 0 or value.numel() == 0:
        return None
    if query.stride(3) != 1 or key.stride(3) != 1 or value.stride(3) != 1:
        return None
    if mask is not None and (mask.device != query.device or mask.dim() > 4
                             or not (mask.dtype == torch.bool or mask.is_floating_point())
                             or not _broadcasts_to(mask.shape, (b, hq, sq, sk))):
        return None
    if not _lane_served(query, key, value, requested):
        return None
    return float(scale) if scale is not None else 1.0 / math.sqrt(d)


class _LaneFunction(torch.autograd.Function):
    """The lane's autograd node: the registered op's forward and backward bodies on the Triton backend."""

    @staticmethod
    def forward(ctx, q, k, v, mask, dropout_p, causal, scale, backend, deterministic, cuda_fwd=False):
        o, lse, seed, kv_range = _triton_fwd(q, k, v, mask, dropout_p, causal, scale, cuda_fwd)
        _fwd_setup(ctx, (q, k, v, mask, dropout_p, causal, scale, backend, deterministic), (o, lse, seed, kv_range))
        return o

    @staticmethod
    def backward(ctx, do):
        if torch.is_grad_enabled() or (ctx.args[3] or default_backend()) not in ("auto", "triton"):
            # create_graph=True (the registered op records a node that refuses a second backward), or the
            # default backend changed since the forward: the registered op's backward, which selects again
            dq, dk, dv = _fwd_backward(ctx, do, None, None, None)[:3]
        else:  # what that backward runs here: the Triton backend (the forward's answer for these tensors)
            q, k, v, o, lse, seed, kv_range, mask = ctx.saved_tensors
            dropout_p, causal, scale, _, deterministic = ctx.args
            dq, dk, dv = _triton_bwd(do, q, k, v, o, lse, seed, kv_range, mask, dropout_p, causal, scale,
                                     deterministic)
        return dq, dk, dv, None, None, None, None, None, None, None


def _lane_plain(*tensors) -> bool:
    """Plain tensors (no subclass, no parameter) in plain eager execution (no tracing, no dispatch mode)."""
    for t in tensors:
        if type(t) is not Tensor:
            return False
    return not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0


def _lane_lookup(lkey, check):
    """The remembered answer of ``lkey`` (the scale, or None: not covered), from ``check()`` the first time."""
    sc = _LANE.get(lkey)
    if sc is None and lkey not in _LANE:
        if len(_LANE) >= _LANE_MAX:
            _LANE.clear()
        sc = _LANE[lkey] = check()
    return sc


def _lane(query, key, value, mask, dropout_p, is_causal, scale, backend, deterministic):
    """The output of a call the lane covers, else None (then the full path runs: its checks, warnings and
    fallbacks)."""
    if not (_lane_plain(query, key, value) if mask is None else _lane_plain(query, key, value, mask)):
        return None  # (subclasses, parameters, a mask that is not a tensor, tracing: the full path)
    requested = backend or default_backend()
    lkey = (query.shape, query.stride(), key.shape, key.stride(), value.shape, value.stride(), query.dtype,
            key.dtype, value.dtype, query.device, key.device, value.device, is_causal, scale, requested,
            None if mask is None else (mask.shape, mask.stride(), mask.dtype, mask.device))
    sc = _lane_lookup(lkey, lambda: _lane_scale(query, key, value, mask, scale, requested))
    if sc is None:
        return None
    grad = torch.is_grad_enabled()
    if mask is not None:
        if grad and mask.requires_grad:
            return None  # a trainable bias: the full path runs the reference for its gradient
        mask = mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])  # (a view, as the full path's)
    if _lane_cuda(lkey, query, key, value, mask, query.shape[0], dropout_p, requested, bool(is_causal)) or (
            dropout_p == 0.0 and requested == "auto" and _lane_cuda_head_dim(lkey, query, key, value, mask)):
        return _cuda_attention(query, key, value, mask, None, None, 0, 0, dropout_p, bool(is_causal), sc)
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    if dropout_p > 0:  # (auto's calls with dropout that reach here: AUTO_SM90_DROPOUT's, or another backend's)
        cuda_fwd = _aligned16(query, key, value) and _lane_sm90_dropout(lkey, query, key, value, mask, is_causal,
                                                                        requested)
    else:
        cuda_fwd = _auto_cuda_fwd_call(query, key, value, dropout_p) and _lane_cuda_fwd(lkey, query, key, value, mask,
                                                                                        is_causal, requested)
    if grad and (query.requires_grad or key.requires_grad or value.requires_grad):
        return _LaneFunction.apply(query, key, value, mask, dropout_p, is_causal, sc, backend or "", deterministic,
                                   cuda_fwd)
    return _triton_fwd(query, key, value, mask, dropout_p, is_causal, sc, cuda_fwd)[0]


def _lane_sm90_dropout(lkey, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool,
                       requested: str) -> bool:
    """``_auto_sm90_dropout_kind`` of a lane key, remembered."""
    return _lane_remember(_LANE_SM90_DROPOUT, lkey, lambda: _auto_sm90_dropout_kind(q, k, v, mask, causal, requested))


def _lane_cuda_head_dim(lkey, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> bool:
    """``_auto_cuda_head_dim_kind`` of a lane key, remembered (with the C++ op's cover, as ``use_cuda_op`` asks it)."""
    return _lane_remember(_LANE_CUDA_HEAD_DIM, lkey, lambda: _auto_cuda_head_dim_kind(q, k, v, mask) and use_cuda_op(
        _OP, "auto", q.device, lambda: _cuda_cover(q, k, v, mask, q.shape[0]), capture=True))


def _lane_cuda_fwd(lkey, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, requested: str) -> bool:
    """``_auto_cuda_fwd_kind`` of a lane key, remembered."""
    return _lane_remember(_LANE_CUDA_FWD, lkey, lambda: _auto_cuda_fwd_kind(q, k, v, mask, causal, requested))


def _lane_remember(cache: dict, lkey, compute) -> bool:
    """``cache``'s answer for ``lkey``, from ``compute()`` the first time (the cache starts over when full)."""
    ok = cache.get(lkey)
    if ok is None:
        if len(cache) >= _LANE_MAX:
            cache.clear()
        ok = cache[lkey] = compute()
    return ok


def _varlen_lane_scale(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, scale, requested: str):
    """The softmax scale of a kind of varlen call the lane covers, else None: (T, H, D) tensors of one dtype and
    device with unit last strides, Hq a multiple of Hkv, int32 (B+1,) cu_seqlens of the device, and the Triton
    backend serving it. Nothing here depends on the token counts or the max lengths (they change from batch to
    batch): the lane checks those per call."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or cu_q.dim() != 1 or cu_k.dim() != 1:
        return None
    if cu_q.dtype != torch.int32 or cu_k.dtype != torch.int32 or cu_q.numel() < 1 or cu_q.numel() != cu_k.numel():
        return None
    if cu_q.device != q.device or cu_k.device != q.device:
        return None
    if q.shape[2] != k.shape[2] or k.shape[1] != v.shape[1] or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return None
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        return None
    if not _lane_served(q, k, v, requested):
        return None
    return float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[2])


class _VarlenLaneFunction(torch.autograd.Function):
    """The varlen lane's autograd node: the registered varlen op's forward and backward bodies on Triton."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, scale, backend):
        o, lse, seed = _varlen_triton_fwd(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, scale)
        _varlen_setup(ctx, (q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, scale, backend), (o, lse, seed))
        return o

    @staticmethod
    def backward(ctx, do):
        if torch.is_grad_enabled() or (ctx.args[5] or default_backend()) not in ("auto", "triton"):
            dq, dk, dv = _varlen_backward(ctx, do, None, None)[:3]  # (as the dense lane's backward)
        else:
            q, k, v, o, lse, seed, cu_q, cu_k = ctx.saved_tensors
            max_q, max_k, dropout_p, causal, scale, _ = ctx.args
            dq, dk, dv = _varlen_triton_bwd(do, q, k, v, o, lse, seed, cu_q, cu_k, max_q, max_k, dropout_p, causal,
                                            scale)
        return dq, dk, dv, None, None, None, None, None, None, None, None


def _varlen_lane(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, dropout_p, backend):
    """The output of a varlen call the lane covers, else None (then the full path runs)."""
    if (not _lane_plain(q, k, v, cu_q, cu_k) or type(max_q) is not int or type(max_k) is not int
            or max_q < 0 or max_k < 0 or k.shape[0] != v.shape[0]):
        return None
    requested = backend or default_backend()
    lkey = ("varlen", q.shape[1:], q.stride(), k.shape[1:], k.stride(), v.shape[1:], v.stride(), q.dtype, k.dtype,
            v.dtype, q.device, k.device, v.device, cu_q.shape, cu_q.dtype, cu_q.device, cu_k.shape, cu_k.dtype,
            cu_k.device, scale, requested)
    sc = _lane_lookup(lkey, lambda: _varlen_lane_scale(q, k, v, cu_q, cu_k, scale, requested))
    if sc is None:
        return None
    if _lane_cuda(lkey, q, k, v, None, cu_q.shape[0] - 1, dropout_p, requested):
        return _cuda_attention(q, k, v, None, cu_q, cu_k, max_q, max_k, dropout_p, causal, sc)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _VarlenLaneFunction.apply(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, sc, backend or "")
    return _varlen_triton_fwd(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, sc)[0]


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False, *, backend: str | None = None,
                                 deterministic: bool | None = None) -> Tensor:
    """Fused attention with the semantics of ``torch.nn.functional.scaled_dot_product_attention``.

    Shapes: query (..., Hq, Sq, D), key (..., Hkv, Sk, D), value (..., Hkv, Sk, Dv), at least 2 dims
    each (2-D inputs have no head dim); leading (batch) dims broadcast. Returns (..., Hq, Sq, Dv) in
    the inputs' dtype (fp16, bf16 or fp32; all three must match; float64 runs on the reference).

    * ``attn_mask``: bool (True = take part) or additive float, broadcastable to (..., Hq, Sq, Sk);
      read in-kernel through strides (never expanded in memory). A float mask may have any float dtype
      (it is read in fp32; torch requires query's dtype). A key-padding mask that broadcasts
      from (B, 1, 1, Sk) lets the kernels skip key blocks outside each batch's valid range. A float
      mask that requires grad (a trainable bias) runs the eager reference so that it gets its gradient
      (FallbackWarning with "auto" on CUDA; BackendUnavailableError with "triton"/"cuda"). May be combined with ``is_causal`` (both apply; torch forbids the combination).
    * ``is_causal``: top-left aligned, query i sees keys j <= i (diagram in the module docstring).
    * Rows with no key to attend to (fully masked, or Sk = 0) output 0 with gradient 0 (torch: NaN).
    * GQA/MQA: Hq a multiple of Hkv (``enable_gqa`` is accepted; grouped heads work with or without
      it); K/V are never repeated in memory.
    * ``dropout_p``: in-kernel Philox dropout; the seed is drawn on the inputs' device from torch's generator
      there, so ``torch.manual_seed`` makes it reproducible and CUDA-graph replays draw fresh masks;
      :func:`attention_dropout_mask` gives the mask.
    * ``backend``: None (the current default), "auto", "triton", "cuda", "reference". "cuda" is the CUDA C++ op
      (``csrc/attention.cpp`` and ``attention.cuh``: fp16 / bf16, one head dim for q, k, v, a multiple of 8 up to
      256), taken when named, and by "auto" for eager calls with dropout (its autograd runs
      in C++: less host time a training step; :data:`AUTO_CUDA_DROPOUT`) and, on Hopper, for eager calls without
      dropout at head dims that Triton has no Hopper kernel for (64 < D < 128), unmasked or with a boolean
      key-padding mask (:data:`AUTO_CUDA_HEAD_DIMS`); "auto" takes Triton otherwise
      (faster kernels, and capturable in CUDA graphs).
    * ``deterministic``: None = ``torch.are_deterministic_algorithms_enabled()``. True (or torch's
      deterministic mode) makes the backward bitwise reproducible. Otherwise, on Hopper at D = 128 with
      enough work (full attention from 1024 keys, causal from 2048), the backward is one fused kernel that adds dQ by
      bulk TMA reductions into an fp32 buffer, in no fixed order (as FlashAttention-2/3 and cuDNN do; it is
      3-8% faster where it is taken, ``kernels/attention_sm90_bwd.py``), whose dQ may differ in the last bits between runs;
      so is the "cuda" backend's on Hopper at D <= 128, named or taken by "auto" (its dK/dV blocks add dQ by bulk
      reductions:
      ``csrc/attention.cuh``; packed varlen sequences too; stride-0 K / V at D <= 64 with dropout); every other
      case is reproducible in either mode (no atomics).
      ``deterministic=True`` with the developer switch ``PYKERNELS_ATTN_SM90_BWD=fused`` raises ``ValueError``.

    Eager calls with four-dim q, k, v of one batch take the *eager lane*: whether a kind of call (shapes,
    strides, dtypes, devices, mask layout, flags, default backend) is valid and served by Triton is checked once
    and remembered, then its calls run the Triton backend directly: the same kernels, outputs, gradients and
    dropout seeds with less host time (``PYKERNELS_EAGER_LANE=0`` turns it off).
    """
    if (_LANE_ON and type(dropout_p) is float and 0.0 <= dropout_p < 1.0 and type(is_causal) is bool
            and (scale is None or type(scale) is float) and type(enable_gqa) is bool
            and (backend is None or type(backend) is str) and (deterministic is None or deterministic is False)):
        out = _lane(query, key, value, attn_mask, dropout_p, is_causal, scale, backend, deterministic)
        if out is not None:
            return out
    _checks.check_tensor("query", query, min_dim=2, dtypes=_DTYPES)
    _checks.check_tensor("key", key, min_dim=2, dtypes=_DTYPES)
    _checks.check_tensor("value", value, min_dim=2, dtypes=_DTYPES)
    _checks.check_same([("query", query), ("key", key), ("value", value)], what="dtype")
    if attn_mask is not None and not isinstance(attn_mask, Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    _checks.check_same([("query", query), ("key", key), ("value", value), ("attn_mask", attn_mask)],
                       what="device")
    dropout_p = _checks.check_prob("dropout_p", dropout_p)
    scale = _check_scale(scale)
    _check_deterministic(deterministic)
    if deterministic and os.environ.get("PYKERNELS_ATTN_SM90_BWD") == "fused":
        raise ValueError("deterministic=True conflicts with PYKERNELS_ATTN_SM90_BWD=fused (the fused sm_90 "
                         "backward adds dQ by unordered TMA reductions); unset it or pass deterministic=False")
    check_backend_name(backend)
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query and key must have the same head dim (last dim), got query shape "
                         f"{tuple(query.shape)} and key shape {tuple(key.shape)}")
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(f"key and value must have the same sequence length (dim -2), got key shape "
                         f"{tuple(key.shape)} and value shape {tuple(value.shape)}")
    hq = query.shape[-3] if query.dim() >= 3 else 1
    hk = key.shape[-3] if key.dim() >= 3 else 1
    hv = value.shape[-3] if value.dim() >= 3 else 1
    if hk != hv:
        raise ValueError(f"key and value must have the same number of heads, got key shape {tuple(key.shape)} "
                         f"and value shape {tuple(value.shape)}")
    if hq != hk and hq % hk != 0 and hq != 1:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hk}) for grouped-query "
                         f"attention (enable_gqa), got query shape {tuple(query.shape)} and key shape "
                         f"{tuple(key.shape)}")
    try:
        batch = query.shape[:-3]
        if batch != key.shape[:-3] or batch != value.shape[:-3]:  # (torch.broadcast_shapes is slow)
            batch = torch.broadcast_shapes(query.shape[:-3], key.shape[:-3], value.shape[:-3])
    except RuntimeError as e:
        raise ValueError(f"the batch dims of query {tuple(query.shape)}, key {tuple(key.shape)} and value "
                         f"{tuple(value.shape)} do not broadcast: {e}") from None
    sq, sk, d, dv = query.shape[-2], key.shape[-2], query.shape[-1], value.shape[-1]
    h_out = max(hq, hk) if hq == 1 else hq
    out_heads = (h_out,) if max(query.dim(), key.dim(), value.dim()) >= 3 else ()
    full = (*batch, h_out, sq, sk)
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            raise TypeError(f"attn_mask must be bool (True = take part) or a float additive mask, got "
                            f"{attn_mask.dtype}")
        ok = _broadcasts_to(attn_mask.shape, full)
        if not ok:
            raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                             f"(batch..., heads, Sq, Sk) = {full}")
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d > 0 else 1.0

    def to4(t: Tensor, heads: int) -> Tensor:
        if t.dim() == 4 and len(batch) == 1 and t.shape[0] == batch[0] and t.shape[1] == heads:
            return _last_dim_contig(t)  # already (B, H, S, D): no views to make (each costs host time)
        t = t.reshape(t.shape if t.dim() >= 3 else (1, *t.shape))
        t = t.expand(*batch, heads, *t.shape[-2:])  # stride-0 views, no copy
        t = t.unsqueeze(0) if len(batch) == 0 else (t if len(batch) == 1 else t.reshape(-1, *t.shape[-3:]))
        return _last_dim_contig(t)

    q4 = to4(query, hq)
    if hq == 1 and hk > 1:  # broadcast a single query head over the kv heads (torch's broadcasting)
        q4 = q4.expand(q4.shape[0], hk, sq, d)
    k4, v4 = to4(key, hk), to4(value, hk)
    m4 = None
    if attn_mask is not None:
        m4 = attn_mask.expand(full)
        m4 = m4.unsqueeze(0) if len(batch) == 0 else (m4 if len(batch) == 1 else m4.reshape(-1, *full[-3:]))
    if attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled():
        # A trainable additive bias needs its own gradient, which the kernels do not produce: run the
        # eager reference (autograd through the mask) instead of silently dropping that gradient.
        requested = backend or default_backend()
        reason = "attn_mask requires grad (the kernels give no mask gradient)"
        if requested in ("triton", "cuda"):
            raise BackendUnavailableError(f"pykernels.{_OP}: backend {requested!r} cannot serve this call: {reason}")
        if requested == "auto" and query.device.type == "cuda":
            warn_once(_OP, reason)
        return attention_reference(query, key, value, attn_mask, dropout_p, is_causal, scale, hq != hk)
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    if _use_cuda(_OP, backend, q4, k4, v4, m4, q4.shape[0], dropout_p, bool(is_causal)):
        o = _cuda_attention(q4, k4, v4, m4, None, None, 0, 0, dropout_p, bool(is_causal), scale, deterministic)
    else:
        o = _attention_fwd(q4, k4, v4, m4, dropout_p, bool(is_causal), scale, backend or "", deterministic)[0]
    if o.dim() == 4 and len(batch) == 1 and len(out_heads) == 1:
        return o  # already (B, H, Sq, Dv)
    return o.reshape(*batch, *out_heads, sq, dv)


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                     max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False, scale: float | None = None,
                     dropout_p: float = 0.0, backend: str | None = None,
                     deterministic: bool | None = None) -> Tensor:
    """Attention over packed variable-length sequences (flash-attn's varlen interface).

    q (Tq, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv): the sequences concatenated along dim 0;
    ``cu_seqlens_q/k``: int32 (B+1,) prefix sums (sequence b is rows cu[b]:cu[b+1]); ``max_seqlen_q/k``:
    ints at least the longest sequence (they size the grid and key the dropout RNG). Zero-length
    sequences are allowed. Returns (Tq, Hq, Dv); rows past ``cu_seqlens_q[-1]`` are 0, and so are the
    gradient rows past ``cu_seqlens_q/k[-1]``. ``causal``: top-left aligned within each sequence.
    GQA when Hq is a multiple of Hkv. Other options as in :func:`scaled_dot_product_attention` (the eager
    lane too: its key leaves out the token counts and max lengths, which change from batch to batch).
    """
    if (_LANE_ON and type(dropout_p) is float and 0.0 <= dropout_p < 1.0 and type(causal) is bool
            and (scale is None or type(scale) is float) and (backend is None or type(backend) is str)
            and (deterministic is None or deterministic is False)):  # (True: the full path passes it on)
        out = _varlen_lane(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, dropout_p,
                           backend)
        if out is not None:
            return out
    _checks.check_tensor("q", q, ndim=3, dtypes=_DTYPES)
    _checks.check_tensor("k", k, ndim=3, dtypes=_DTYPES)
    _checks.check_tensor("v", v, ndim=3, dtypes=_DTYPES)
    _checks.check_same([("q", q), ("k", k), ("v", v)], what="dtype")
    _checks.check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=(torch.int32,))
    _checks.check_tensor("cu_seqlens_k", cu_seqlens_k, ndim=1, dtypes=(torch.int32,))
    _checks.check_same([("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q),
                        ("cu_seqlens_k", cu_seqlens_k)], what="device")
    dropout_p = _checks.check_prob("dropout_p", dropout_p)
    scale = _check_scale(scale)
    _check_deterministic(deterministic)
    check_backend_name(backend)
    for name, val in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 0:
            raise ValueError(f"{name} must be a non-negative int, got {val!r}")
    if cu_seqlens_q.numel() < 1 or cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must both have B+1 >= 1 entries, got shapes "
                         f"{tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head dim, got q shape {tuple(q.shape)} and k shape "
                         f"{tuple(k.shape)}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must have the same tokens and heads, got k shape {tuple(k.shape)} and "
                         f"v shape {tuple(v.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of k/v heads ({k.shape[1]})")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] > 0 else 1.0
    q, k, v = _last_dim_contig(q), _last_dim_contig(k), _last_dim_contig(v)
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    if _use_cuda(_VOP, backend, q, k, v, None, cu_seqlens_q.shape[0] - 1, dropout_p):
        return _cuda_attention(q, k, v, None, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), max_seqlen_q,
                               max_seqlen_k, dropout_p, bool(causal), scale, deterministic)
    o, _, _ = _varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, bool(causal),
                          scale, backend or "")
    return o


def unpad_input(hidden: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
    """Remove padding: hidden (B, S, ...) and attention_mask (B, S) (bool or 0/1 ints, nonzero = token)
    -> (hidden_unpad (total, ...), indices (total,) int64 into the flattened (B*S) positions,
    cu_seqlens (B+1,) int32, max_seqlen int). Differentiable in ``hidden``. ``max_seqlen`` (and the
    nonzero() that sizes the output) needs one host sync."""
    if not isinstance(hidden, Tensor) or hidden.dim() < 2:
        raise ValueError(f"hidden must be a tensor of shape (batch, seqlen, ...), got "
                         f"{tuple(hidden.shape) if isinstance(hidden, Tensor) else type(hidden).__name__}")
    if not isinstance(attention_mask, Tensor) or attention_mask.shape != hidden.shape[:2]:
        raise ValueError(f"attention_mask must have shape (batch, seqlen) = {tuple(hidden.shape[:2])}, got "
                         f"{tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else attention_mask}")
    valid = attention_mask != 0
    seqlens = valid.sum(-1, dtype=torch.int32)
    indices = torch.nonzero(valid.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))
    return hidden.reshape(-1, *hidden.shape[2:]).index_select(0, indices), indices, cu_seqlens, max_seqlen


def pad_input(hidden_unpad: Tensor, indices: Tensor, batch: int, seqlen: int) -> Tensor:
    """Inverse of :func:`unpad_input`: (total, ...) -> (batch, seqlen, ...) with zeros at padding.
    Differentiable in ``hidden_unpad``."""
    if not isinstance(hidden_unpad, Tensor) or hidden_unpad.dim() < 1:
        raise ValueError("hidden_unpad must be a tensor of shape (total, ...)")
    if not isinstance(indices, Tensor) or indices.dim() != 1 or indices.shape[0] != hidden_unpad.shape[0]:
        raise ValueError(f"indices must have shape ({hidden_unpad.shape[0]},), got "
                         f"{tuple(indices.shape) if isinstance(indices, Tensor) else indices}")
    out = hidden_unpad.new_zeros(batch * seqlen, *hidden_unpad.shape[1:])
    out = out.index_copy(0, indices, hidden_unpad)
    return out.view(batch, seqlen, *hidden_unpad.shape[1:])


__all__ = ["scaled_dot_product_attention", "varlen_attention", "unpad_input", "pad_input", "attention_reference",
           "attention_dropout_mask", "philox4x32", "dropout_bits", "dropout_rate"]
