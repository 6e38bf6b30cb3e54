"""Softmax cross-entropy on materialised logits: forward (per-row loss + logsumexp) and backward
(dlogits), each one streaming pass over the logits.

Design
------
Forward, one program per row (grid ``(N,)``). The row is read once, in ``BLOCK_V`` chunks, with an
*online logsumexp*: a running maximum ``m`` and running sum ``s = sum exp(x - m)`` in fp32, rescaled
by ``exp2(m_old - m_new)`` whenever a chunk raises the maximum (Milakov & Gimelshein 2018, "Online
normalizer calculation for softmax"). Everything runs in the log2 domain: each logit is multiplied
by log2(e) once as it is loaded, so the inner loop has one ``exp2`` per element and no ``exp``.
Hence any vocabulary size works (V = 1 ... 256000 and beyond) with registers bounded by
``BLOCK_V``. In the same pass, when label smoothing is on, the row sum of the logits is accumulated
(the smoothing term needs ``mean_v(-log p_v) = lse - mean_v(x_v)``). The target logit is one masked
scalar load. Per row the kernel writes

    loss = (1 - eps) * (lse - x[t]) + eps * (lse - mean(x)) + z_loss * lse**2      (fp32)
    lse  = log(sum_v exp(x_v))                                                     (fp32, saved)

and both are 0 at rows whose target is ``ignore_index`` (those rows are not read at all: the loop
bound is 0, which matters for masked-LM batches where ~85% of rows are ignored). The reduction
(sum / mean over valid rows) is a tiny follow-up in PyTorch on the (N,) fp32 vector, so it stays
deterministic and needs no atomics or host sync.

Backward, grid ``(N * ceil(V / BLOCK_V),)``: each program owns one chunk of one row and computes

    dlogits = g_row * (softmax * (1 + 2 z_loss lse) - (1 - eps) onehot(t) - eps / V)

from the saved lse (``softmax = exp2(x log2e - lse log2e)``, one FMA and one ``exp2``), reading the
logits once and writing dlogits once. ``g_row`` is the incoming gradient of the row loss (a stride-0
scalar for sum/mean reductions, already divided by the valid count for mean). Ignored rows write
zeros without reading. The 2-D decomposition keeps every SM busy even when N is small. The
gradient may be written over the logits (``dlogits_ptr == logits_ptr``): each element is read
before it is written by the same program, so in-place is safe.

Cost (fewest bytes; b = bytes per logit): forward reads N*V*b (+16 N bytes of targets, loss, lse),
~4 FLOPs + 1 exp2 per logit; backward reads N*V*b and writes N*V*b, ~5 FLOPs + 1 exp2 per logit.
Both are bandwidth-bound on H100/H200 (bf16: ~1 exp2 per 2 bytes is well under the SFU rate).

Numerics: loads upcast to fp32; all statistics fp32; masked lanes loaded as -inf (max/sum-exp)
and replaced by 0 before the smoothing sum. Offsets: row index cast to int64 before multiplying by
the row stride, so N*V > 2**31 works; within a row, column offsets are int32 (V < 2**31).

Limits: the logits' column stride must be 1 (the launcher's caller makes a copy otherwise; any row
stride is fine, so slices of a padded buffer need no copy). Targets outside [0, V) that are not
``ignore_index`` are never dereferenced (the load is masked); their row loss and gradient are NaN,
so the error is visible without a host sync. A row whose logits are all -inf gives NaN (as torch).
Forward parallelism is one program per row: for N much smaller than the number of SMs with a very
large V the forward under-fills the GPU (a split-V forward would fix it; not needed for training
shapes).

References: Liger-Kernel ``ops/cross_entropy.py`` (single-row online softmax, gradient in place);
llm.c ``fused_classifier.cuh`` (loss and dlogits in one pass); PaLM (Chowdhery et al. 2022, z-loss);
FlashAttention-2 (exp2 with log2(e) folded into the scale).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from pykernels import _alloc

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _cross_entropy_fwd_kernel(
    logits_ptr,       # (N, V) fp16/bf16/fp32, column stride 1
    target_ptr,       # (N,) int32/int64, contiguous
    loss_ptr,         # (N,) fp32 out: per-row loss (0 at ignored rows, NaN at out-of-range targets)
    lse_ptr,          # (N,) fp32 out: natural-log logsumexp of the row (0 at ignored rows)
    stride_n,         # logits row stride, in elements (>= V for padded rows)
    V,                # vocabulary size (row length)
    ignore_index,     # target value whose row contributes nothing
    label_smoothing,  # eps in [0, 1]
    z_loss,           # coefficient of lse**2
    HAS_SMOOTHING: tl.constexpr,  # eps > 0: accumulate the row sum of the logits
    HAS_Z_LOSS: tl.constexpr,     # z_loss > 0
    BLOCK_V: tl.constexpr,        # columns per loop step
):
    row = tl.program_id(0).to(tl.int64)  # int64 before the stride multiply: N*V may exceed 2**31
    target = tl.load(target_ptr + row).to(tl.int64)
    active = target != ignore_index
    in_range = (target >= 0) & (target < V)
    row_ptr = logits_ptr + row * stride_n
    # Ignored rows are not read at all: their loop runs zero times.
    v_end = tl.where(active, V, 0)

    m = tl.full((), float("-inf"), tl.float32)   # running max, log2 units
    s = tl.zeros((), tl.float32)                 # running sum of exp2(x*log2e - m)
    sum_x = tl.zeros((), tl.float32)             # row sum of x (for label smoothing)
    for start in range(0, v_end, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        cmask = cols < V
        x = tl.load(row_ptr + cols, mask=cmask, other=float("-inf"),
                    eviction_policy="evict_first").to(tl.float32)
        x2 = x * 1.4426950408889634  # log2(e): exp(x) == exp2(x * log2e)
        m_new = tl.maximum(m, tl.max(x2, axis=0))
        s = s * tl.exp2(m - m_new) + tl.sum(tl.exp2(x2 - m_new), axis=0)
        m = m_new
        if HAS_SMOOTHING:
            sum_x += tl.sum(tl.where(cmask, x, 0.0), axis=0)

    # Ignored rows never ran the loop (m = -inf, s = 0): keep their unused lse finite.
    m = tl.where(active, m, 0.0)
    s = tl.where(active, s, 1.0)
    lse = (m + tl.log2(s)) * 0.6931471805599453  # back to natural log
    # The target logit: one scalar load, masked so an out-of-range target is never dereferenced.
    t_ok = active & in_range
    x_t = tl.load(row_ptr + tl.where(t_ok, target, 0), mask=t_ok, other=0.0).to(tl.float32)
    loss = lse - x_t
    if HAS_SMOOTHING:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - sum_x / V)
    if HAS_Z_LOSS:
        loss += z_loss * lse * lse
    loss = tl.where(in_range, loss, float("nan"))
    tl.store(loss_ptr + row, tl.where(active, loss, 0.0))
    tl.store(lse_ptr + row, tl.where(active, lse, 0.0))


@triton.jit
def _cross_entropy_bwd_kernel(
    dlogits_ptr,      # (N, V) out, logits dtype; may be logits_ptr itself (in-place)
    logits_ptr,       # (N, V) fp16/bf16/fp32, column stride 1
    target_ptr,       # (N,) int32/int64, contiguous
    lse_ptr,          # (N,) fp32 saved by the forward
    grad_ptr,         # fp32 incoming gradient of the row losses, read at row * stride_g
    stride_n,         # logits row stride
    stride_dn,        # dlogits row stride
    stride_g,         # grad stride (0: one scalar for every row)
    V,                # vocabulary size
    n_chunks,         # ceil(V / BLOCK_V): programs per row
    ignore_index,
    label_smoothing,  # eps
    z_loss,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0)
    row = (pid // n_chunks).to(tl.int64)
    chunk = pid % n_chunks
    target = tl.load(target_ptr + row).to(tl.int64)
    active = target != ignore_index
    in_range = (target >= 0) & (target < V)
    lse2 = tl.load(lse_ptr + row) * 1.4426950408889634
    g = tl.load(grad_ptr + row * stride_g).to(tl.float32)

    cols = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    cmask = cols < V
    # Ignored rows: the load is fully masked (no memory traffic) and zeros are written.
    x = tl.load(logits_ptr + row * stride_n + cols, mask=cmask & active, other=float("-inf"),
                eviction_policy="evict_first").to(tl.float32)
    p = tl.exp2(x * 1.4426950408889634 - lse2)  # softmax from the saved lse: one FMA + exp2
    if HAS_Z_LOSS:
        # d(z lse^2)/dx = 2 z lse softmax
        p = p * (1.0 + 2.0 * z_loss * (lse2 * 0.6931471805599453))
    d = p - tl.where(cols == target, 1.0 - label_smoothing, 0.0)
    if HAS_SMOOTHING:
        d -= label_smoothing / V
    d = d * g
    d = tl.where(in_range, d, float("nan"))
    d = tl.where(active, d, 0.0)
    tl.store(dlogits_ptr + row * stride_dn + cols, d.to(dlogits_ptr.dtype.element_ty), mask=cmask)


# Forward tuning: tile and warps only, pruned by V so a small vocabulary never tries tiles far
# larger than its row. Keyed on V (and, by the autotuner, on the dtypes).
_FWD_CONFIGS = [
    triton.Config({"BLOCK_V": 1024}, num_warps=4),
    triton.Config({"BLOCK_V": 4096}, num_warps=8),
    triton.Config({"BLOCK_V": 8192}, num_warps=8),
    triton.Config({"BLOCK_V": 8192}, num_warps=16),
    triton.Config({"BLOCK_V": 16384}, num_warps=16),
]


def _prune_fwd(configs, named_args, **kwargs):
    V = named_args["V"]
    cap = max(1024, triton.next_power_of_2(V))
    kept = [c for c in configs if c.kwargs["BLOCK_V"] <= cap and not (V >= 8192 and c.kwargs["BLOCK_V"] < 4096)]
    return kept or configs[:1]


_cross_entropy_fwd_tuned = triton.autotune(
    configs=_FWD_CONFIGS, key=["V", "HAS_SMOOTHING", "HAS_Z_LOSS"],
    prune_configs_by={"early_config_prune": _prune_fwd},
)(_cross_entropy_fwd_kernel)


def _interpret_block(V: int) -> int:
    # The CPU interpreter: one config, small enough that a row of a few hundred columns spans
    # several chunks (the loop and its tail mask are exercised), large enough for V = 50257.
    return 128 if V <= 4096 else 4096


@functools.lru_cache(maxsize=None)
def _bwd_launch(V: int, elem_size: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) of the backward: an elementwise stream, so 32 bytes per thread per
    direction (two 16-byte vector accesses) with 8 warps; smaller tiles for short rows."""
    if _interpret():
        return _interpret_block(V), 1
    block = 8192 if elem_size <= 2 else 4096
    block = min(block, max(128, triton.next_power_of_2(V)))
    return block, max(1, min(8, block // 512))


def cross_entropy_fwd(logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int,
                      label_smoothing: float, z_loss: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and logsumexp.

    logits: (N, V) fp16/bf16/fp32 with ``stride(1) == 1`` (any row stride); target: (N,) int32/int64
    contiguous. Returns ``(loss, lse)``, both (N,) fp32 (0 at ignored rows; loss NaN where the target
    is out of range).
    """
    N, V = logits.shape
    loss = _alloc.empty(N, dtype=torch.float32, device=logits.device)
    lse = _alloc.empty(N, dtype=torch.float32, device=logits.device)
    if N == 0:
        return loss, lse
    args = (logits, target, loss, lse, logits.stride(0), V, ignore_index, float(label_smoothing),
            float(z_loss))
    flags = dict(HAS_SMOOTHING=label_smoothing > 0, HAS_Z_LOSS=z_loss > 0)
    if _interpret():
        _cross_entropy_fwd_kernel[(N,)](*args, **flags, BLOCK_V=_interpret_block(V), num_warps=1)
    else:
        _cross_entropy_fwd_tuned[(N,)](*args, **flags)
    return loss, lse


def cross_entropy_bwd(grad: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                      *, ignore_index: int, label_smoothing: float, z_loss: float,
                      dlogits: torch.Tensor | None = None) -> torch.Tensor:
    """dlogits from the saved lse.

    grad: (N,) fp32 gradient of the row losses (any stride, 0 allowed); logits (N, V) with
    ``stride(1) == 1``; target (N,); lse (N,) fp32 from :func:`cross_entropy_fwd`. ``dlogits``: where
    to write (N, V) with ``stride(1) == 1``; pass ``logits`` itself to overwrite it in place. Returns
    dlogits (logits dtype).
    """
    N, V = logits.shape
    if dlogits is None:
        dlogits = _alloc.empty(N, V, dtype=logits.dtype, device=logits.device)
    if N == 0:
        return dlogits
    block, warps = _bwd_launch(V, logits.element_size())
    n_chunks = triton.cdiv(V, block)
    grad = grad.float()
    _cross_entropy_bwd_kernel[(N * n_chunks,)](
        dlogits, logits, target, lse, grad, logits.stride(0), dlogits.stride(0), grad.stride(0), V,
        n_chunks, ignore_index, float(label_smoothing), float(z_loss),
        HAS_SMOOTHING=label_smoothing > 0, HAS_Z_LOSS=z_loss > 0, BLOCK_V=block, num_warps=warps)
    return dlogits
