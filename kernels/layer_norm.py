"""Fused residual add + LayerNorm / RMSNorm (forward and backward) in Triton.

Design note
-----------
Forward, per row of ``N`` features (``M`` rows):

    b = dropout(x) = x * keep / (1 - p)          (keep regenerated from a Philox seed, never stored)
    s = b + residual                             (or s = b without a residual)
    LayerNorm: mean = sum(s) / N,  var = sum((s - mean)^2) / N,  rstd = 1 / sqrt(var + eps)
               y = (s - mean) * rstd * weight + bias
    RMSNorm:   rstd = 1 / sqrt(sum(s^2) / N + eps),  y = s * rstd * weight + bias

``s`` is computed and normalised in fp32 (loads are upcast); mean and rstd are saved in fp32 for the
backward. ``s`` is written out only when the caller keeps it (pre-LN, "prenorm"), in the residual
stream's dtype (fp32 with ``residual_in_fp32``). Masked lanes load 0 and the centred values are
filled with 0 after the subtraction, so padding never leaks into mean or variance. The variance is
the two-pass (centred) form, not E[s^2] - E[s]^2, so rows with a large mean keep their precision.

Backward, with xhat = (s - mean) * rstd and g = dy * weight:

    ds = rstd * (g - xhat * mean(xhat * g) - mean(g))     (RMSNorm: no "- mean(g)" term)
    ds += ds_out                                           (pre-LN: the gradient arriving through s)
    dresidual = ds,  dx = ds * keep / (1 - p)
    dweight = sum_rows(dy * xhat),  dbias = sum_rows(dy)

``s`` is re-read from the saved ``s`` (pre-LN) or recomputed from ``x`` and ``residual`` with the
regenerated dropout mask (post-LN), so the post-LN forward writes only ``y``. dweight / dbias are
accumulated in fp32 registers by a persistent grid (1 to 8 programs per SM, tuned with the tile),
each program looping over a strided set of row blocks, and written once into a ``(2, programs, N)``
fp32 partial buffer (dweight and dbias rows) that a single ``sum(1)`` and one cast reduce (2 launches
after the kernel, returned stacked; the autograd formula splits them): no atomics, deterministic.
Launchers keep host work small (no device switch when the tensors' device is current, plain-int
grid arithmetic, configs derived once per width bucket). A memory-bound loop
needs bytes in flight: they come from co-resident programs and, in the PREFETCH configs, from the
next row block's loads issued (into registers, raw) before the current block's math.

Configuration: the forward tiles ``BLOCK_M`` rows x ``BLOCK_N = next_pow2(N)`` columns per program;
both kernels autotune (keyed on N, short tuning runs; ``PYKERNELS_AUTOTUNE=0``, set by the tests,
takes the first config of each list, the default) over 1-4 configs per power-of-two width
bucket, sized from sm_90 register counts measured offline with ptxas (8-16 elements per thread; no
spills, except 40-80 bytes in the 8192-wide backward with dropout). Under TRITON_INTERPRET=1 a
single small config runs.

Traffic (element size e, M x N, no dropout): forward reads x (+ residual) and writes y (+ s):
pre-LN 4*M*N*e bytes, post-LN 3*M*N*e. Backward reads dy, s (or x and residual), (ds_out) and writes
dresidual (and dx only when it differs from dresidual: dropout, or a residual stream of another
dtype). About 8 FLOPs per element forward and 12 backward, so both are memory bound; the goal is
copy bandwidth.

Limits. Rows up to ``MAX_FUSED_N`` features (16384 forward, 8192 backward) are held in registers
(one block of ``BLOCK_M`` rows x ``BLOCK_N`` columns per program). Wider rows (up to any N) use a
chunked path: the forward loops over column chunks three times per row (sum, centred sum of
squares, write; re-reads hit L2), the backward runs a row-statistics kernel (the two row sums of
the formula above) and then a 2-D grid over (row groups, column chunks). Row offsets are int64
(row index cast before multiplying by the row stride), as are the dropout counters (element index
row * ceil(N / 8) + col / 8), so tensors over 2**31 elements are addressed correctly. The last dim must be
contiguous; rows may be strided.

Dropout: ``_dropout.dropout_keep`` over the logical (M, N) array, as the attention's: one Philox 4x32-7 call
(``tl.randint4x``) per 8 columns of a row at counter ``row * ceil(N / 8) + col // 8``, 16 bits a column, p rounded
to a multiple of 2^-16 (a call per element had taken the fused BERT-base forward to 69 us a call, twice its bytes'
time, run243). ``pykernels.layer_norm.layer_norm_dropout_mask`` reproduces the exact same mask in eager PyTorch.

References: Triton tutorial 05-layer-norm (per-row kernel, partial dW sums); FlashAttention's
``flash_attn/ops/triton/layer_norm.py`` (residual/prenorm/dropout fusion, fp32 statistics, per-SM
partial dW/dB); Apex/llm.c ``layernorm.cuh`` (recompute instead of storing activations); Salmon et
al. 2011 (Philox).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
import triton.testing

from pykernels._alloc import empty

from . import _launch
from . import _tuning
from ._dropout import dropout_keep as _dropout_keep
from ._dropout import load_seed, seed_arg
from ._dropout import dropout_rate as _dropout_rate

MAX_FUSED_N_FWD = 16384  # widest row held in registers by the forward
MAX_FUSED_N_BWD = 8192  # the backward keeps ~6 row-sized fp32 values live per row, so it goes chunked earlier
CHUNK_N = 4096  # column chunk of the looped (wide-row) paths


_cdiv = _tuning.cdiv  # plain-int host helpers (triton.cdiv is slow on the host)
_next_pow2 = _tuning.next_pow2
_on_device = _tuning.on_device


def _interpret() -> bool:
    return _tuning.interpret()


# ----------------------------------------------------------------------------------------------------
# shared helpers
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _load_s(X, R, seed, rows64, cols, mask, stride_x_row, stride_r_row, N, dropout_p, dropout_scale,
            HAS_RESIDUAL: tl.constexpr, HAS_DROPOUT: tl.constexpr):
    """s = dropout(x) + residual for a (BLOCK_M, BLOCK_N) tile, in fp32; masked lanes are 0.

    rows64: int64 row indices (BLOCK_M,); cols: column indices (BLOCK_N,)."""
    x = tl.load(X + rows64[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        # counters row * ceil(N / 8) + col // 8 of the logical (M, N) array, int64: > 2**31 elements stay unique
        keep = _dropout_keep(seed, 0, rows64, cols, N, dropout_p)
        x = tl.where(keep, x * dropout_scale, 0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + rows64[:, None] * stride_r_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = x + r
    return x


# ----------------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _store_y(y, W, B, Y, rows64, cols, col_mask, mask, stride_y_row, HAS_WEIGHT: tl.constexpr,
             HAS_BIAS: tl.constexpr):
    """y = xhat * weight + bias for a tile of normalised values ``y`` (fp32), stored in Y's dtype."""
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = y * w[None, :]
    if HAS_BIAS:
        b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = y + b[None, :]
    tl.store(Y + rows64[:, None] * stride_y_row + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["eps", "dropout_p", "dropout_scale"])
def _layer_norm_fwd_kernel(
    X,  # (M, N) input branch, row stride stride_x_row, unit column stride
    R,  # (M, N) residual (unused unless HAS_RESIDUAL)
    W,  # (N,) weight (unused unless HAS_WEIGHT)
    B,  # (N,) bias (unused unless HAS_BIAS)
    Y,  # (M, N) output, x's dtype
    S,  # (M, N) output s = dropout(x) + residual (written only if STORE_S)
    MEAN,  # (M,) fp32 output (written only for LayerNorm)
    RSTD,  # (M,) fp32 output
    Seed,  # (1,) int64 Philox seed of the dropout mask, in device memory (read only with HAS_DROPOUT)
    stride_x_row, stride_r_row, stride_y_row, stride_s_row,  # row strides, in elements
    M, N,  # rows, features
    eps,  # float: added to the variance
    dropout_p,  # float: drop probability
    dropout_scale,  # float: 1 / (1 - dropout_p)
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, STORE_S: tl.constexpr, IS_RMS_NORM: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per program (fused path) - must be 1 on the chunked path
    BLOCK_N: tl.constexpr,  # >= N on the fused path, the chunk width on the chunked path
    CHUNKED: tl.constexpr,  # N > BLOCK_N: loop over column chunks
):
    seed = load_seed(Seed, HAS_DROPOUT)  # (the seed lives in device memory: graph-safe)
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows64 = rows.to(tl.int64)  # row * stride can exceed 2**31
    cols = tl.arange(0, BLOCK_N)
    if not CHUNKED:
        col_mask = cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        s = _load_s(X, R, seed, rows64, cols, mask, stride_x_row, stride_r_row, N, dropout_p, dropout_scale,
                    HAS_RESIDUAL, HAS_DROPOUT)
        if STORE_S:
            tl.store(S + rows64[:, None] * stride_s_row + cols[None, :], s.to(S.dtype.element_ty), mask=mask)
        if IS_RMS_NORM:
            d = s  # masked lanes are already 0
        else:
            mean = tl.sum(s, axis=1) / N
            d = tl.where(mask, s - mean[:, None], 0.0)  # refill masked lanes after the shift
            tl.store(MEAN + rows64, mean, mask=row_mask)
        var = tl.sum(d * d, axis=1) / N
        rstd = 1.0 / tl.sqrt(var + eps)
        tl.store(RSTD + rows64, rstd, mask=row_mask)
        _store_y(d * rstd[:, None], W, B, Y, rows64, cols, col_mask, mask, stride_y_row, HAS_WEIGHT, HAS_BIAS)
    else:
        # Wide rows (BLOCK_M == 1): three passes over the row in chunks; passes 2 and 3 recompute s
        # from x and residual (L2-resident by then) rather than reading back s written by other threads.
        mean = tl.zeros([BLOCK_M], dtype=tl.float32)
        if not IS_RMS_NORM:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for off in range(0, N, BLOCK_N):
                c = off + cols
                mask = row_mask[:, None] & (c < N)[None, :]
                s = _load_s(X, R, seed, rows64, c, mask, stride_x_row, stride_r_row, N, dropout_p,
                            dropout_scale, HAS_RESIDUAL, HAS_DROPOUT)
                if STORE_S:
                    tl.store(S + rows64[:, None] * stride_s_row + c[None, :], s.to(S.dtype.element_ty), mask=mask)
                acc += s
            mean = tl.sum(acc, axis=1) / N
            tl.store(MEAN + rows64, mean, mask=row_mask)
        acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for off in range(0, N, BLOCK_N):
            c = off + cols
            mask = row_mask[:, None] & (c < N)[None, :]
            s = _load_s(X, R, seed, rows64, c, mask, stride_x_row, stride_r_row, N, dropout_p,
                        dropout_scale, HAS_RESIDUAL, HAS_DROPOUT)
            if IS_RMS_NORM:
                if STORE_S:
                    tl.store(S + rows64[:, None] * stride_s_row + c[None, :], s.to(S.dtype.element_ty), mask=mask)
            d = tl.where(mask, s - mean[:, None], 0.0)
            acc2 += d * d
        var = tl.sum(acc2, axis=1) / N
        rstd = 1.0 / tl.sqrt(var + eps)
        tl.store(RSTD + rows64, rstd, mask=row_mask)
        for off in range(0, N, BLOCK_N):
            c = off + cols
            col_mask = c < N
            mask = row_mask[:, None] & col_mask[None, :]
            s = _load_s(X, R, seed, rows64, c, mask, stride_x_row, stride_r_row, N, dropout_p,
                        dropout_scale, HAS_RESIDUAL, HAS_DROPOUT)
            _store_y((s - mean[:, None]) * rstd[:, None], W, B, Y, rows64, c, col_mask, mask, stride_y_row,
                     HAS_WEIGHT, HAS_BIAS)


def _fwd_configs(block_n: int) -> list[triton.Config]:
    """Small config list for one BLOCK_N bucket: rows per program from 1 to 16 with 1024..8192
    elements per program, warps for ~8 elements per thread (one 16-byte bf16 vector; 16 for the
    largest blocks: more costs > 128 registers and 8 warps spill at 16384 with dropout, sm_90,
    measured offline). One config under the interpreter."""
    if _interpret():
        return [triton.Config({"BLOCK_M": 1 if block_n >= 64 else 2}, num_warps=1)]
    if block_n >= 16384:
        return [triton.Config({"BLOCK_M": 1}, num_warps=16)]
    out = []
    for bm in (1, 2, 4, 8, 16):
        elems = bm * block_n
        if elems > 8192 or (elems < 1024 and bm != 16):
            continue
        out.append((bm, max(4, min(16, elems // 256))))
    if block_n >= 4096:
        out.append((1, 8))
    return [triton.Config({"BLOCK_M": bm}, num_warps=w) for bm, w in dict.fromkeys(out)]


@functools.lru_cache(maxsize=None)
def _fwd_tuned(block_n: int):
    # One autotuner per BLOCK_N bucket (the config list depends on it); keyed on N within the bucket.
    return _tuning.autotune(configs=_fwd_configs(block_n), key=["N"], do_bench=_bench_quick)(_layer_norm_fwd_kernel)


def layer_norm_fwd(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   residual: torch.Tensor | None, *, eps: float, seed, dropout_p: float,
                   store_s: bool, s_dtype: torch.dtype, rms_norm: bool):
    """Launch the forward.

    x, residual: (M, N), unit column stride (any row stride). weight, bias: (N,) contiguous or None.
    Returns (y (M, N) x.dtype, s (M, N) s_dtype or (0,) when not stored, mean (M,) fp32 or (0,) for
    RMSNorm, rstd (M,) fp32)."""
    dropout_p = _dropout_rate(dropout_p)  # (a multiple of 2^-16: _dropout.dropout_keep's 16 bits)
    M, N = x.shape
    dev = x.device
    y = empty(M, N, dtype=x.dtype, device=dev)
    s = empty(M, N, dtype=s_dtype, device=dev) if store_s else empty(0, dtype=s_dtype, device=dev)
    mean = empty(0 if rms_norm else M, dtype=torch.float32, device=dev)
    rstd = empty(M, dtype=torch.float32, device=dev)
    if M == 0:
        return y, s, mean, rstd
    chunked = N > MAX_FUSED_N_FWD
    common = dict(HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
                  HAS_DROPOUT=dropout_p > 0.0, STORE_S=store_s, IS_RMS_NORM=rms_norm)
    args = (x, residual if residual is not None else x, weight if weight is not None else x,
            bias if bias is not None else x, y, s, mean, rstd, seed_arg(seed, dev, dropout_p > 0.0),
            x.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0),
            s.stride(0) if store_s else 0, M, N, eps, dropout_p,
            1.0 / (1.0 - dropout_p) if dropout_p > 0.0 else 1.0)
    with _on_device(dev):
        if chunked:
            _launch.fast(_layer_norm_fwd_kernel)[(M,)](*args, **common, BLOCK_M=1, BLOCK_N=CHUNK_N,
                                         CHUNKED=True, num_warps=8 if not _interpret() else 1)
        else:
            block_n = max(_next_pow2(N), 16)
            _launch.fast(_fwd_tuned(block_n))[lambda meta: (_cdiv(M, meta["BLOCK_M"]),)](
                *args, **common, BLOCK_N=block_n, CHUNKED=False)
    return y, s, mean, rstd


# ----------------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _bwd_tile_loads(X, R, S, MEAN, RSTD, DY, DS_OUT, rows, cols, M, N,
                    stride_x_row, stride_r_row, stride_s_row, stride_dy_row, stride_dso_row,
                    HAS_RESIDUAL: tl.constexpr, RECOMPUTE_S: tl.constexpr, HAS_DS_OUT: tl.constexpr,
                    IS_RMS_NORM: tl.constexpr):
    """The backward's loads for one row block, raw (storage dtype), so they can be issued one block
    ahead. Returns (a, b, dy, ds_out, mean, rstd): a = x or the saved s, b = residual; an input the
    flags leave out repeats a loaded value (no extra load or register)."""
    row_mask = rows < M
    rows64 = rows.to(tl.int64)
    mask = row_mask[:, None] & (cols < N)[None, :]
    if RECOMPUTE_S:
        a = tl.load(X + rows64[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            b = tl.load(R + rows64[:, None] * stride_r_row + cols[None, :], mask=mask, other=0.0)
        else:
            b = a
    else:
        a = tl.load(S + rows64[:, None] * stride_s_row + cols[None, :], mask=mask, other=0.0)
        b = a
    dy = tl.load(DY + rows64[:, None] * stride_dy_row + cols[None, :], mask=mask, other=0.0)
    if HAS_DS_OUT:
        dso = tl.load(DS_OUT + rows64[:, None] * stride_dso_row + cols[None, :], mask=mask, other=0.0)
    else:
        dso = dy
    rstd = tl.load(RSTD + rows64, mask=row_mask, other=0.0)
    if IS_RMS_NORM:
        mean = rstd
    else:
        mean = tl.load(MEAN + rows64, mask=row_mask, other=0.0)
    return a, b, dy, dso, mean, rstd


@triton.jit
def _store_ds(ds, rows64, cols, mask, N, seed, dropout_p, dropout_scale, DX, DRES, stride_dx_row, stride_dres_row,
              HAS_DROPOUT: tl.constexpr, STORE_DX: tl.constexpr, STORE_DRES: tl.constexpr):
    """Write a tile's gradient of s (fp32): to dresidual as it is (s = dropout(x) + residual), to dx
    through the forward's dropout mask, regenerated from the seed."""
    if STORE_DRES:
        tl.store(DRES + rows64[:, None] * stride_dres_row + cols[None, :], ds.to(DRES.dtype.element_ty), mask=mask)
    if STORE_DX:
        dx = ds
        if HAS_DROPOUT:
            keep = _dropout_keep(seed, 0, rows64, cols, N, dropout_p)
            dx = tl.where(keep, ds * dropout_scale, 0.0)
        tl.store(DX + rows64[:, None] * stride_dx_row + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_tile(a, b, dy, dso, mean, rstd, w, rows, cols, M, N, seed, dropout_p, dropout_scale,
              DX, DRES, stride_dx_row, stride_dres_row,
              HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_DROPOUT: tl.constexpr,
              RECOMPUTE_S: tl.constexpr, HAS_DS_OUT: tl.constexpr, STORE_DX: tl.constexpr,
              STORE_DRES: tl.constexpr, IS_RMS_NORM: tl.constexpr):
    """One row block of the backward from its loaded inputs: writes dresidual / dx, returns this
    block's (dweight, dbias) column sums in fp32."""
    row_mask = rows < M
    rows64 = rows.to(tl.int64)
    mask = row_mask[:, None] & (cols < N)[None, :]
    s = a.to(tl.float32)
    if RECOMPUTE_S:
        if HAS_DROPOUT:
            keep = _dropout_keep(seed, 0, rows64, cols, N, dropout_p)
            s = tl.where(keep, s * dropout_scale, 0.0)
        if HAS_RESIDUAL:
            s = s + b.to(tl.float32)
    if IS_RMS_NORM:
        xhat = s * rstd[:, None]  # masked lanes: s = 0
    else:
        xhat = tl.where(mask, (s - mean[:, None]) * rstd[:, None], 0.0)
    dy = dy.to(tl.float32)
    if HAS_WEIGHT:
        g = dy * w[None, :]
    else:
        g = dy
    c1 = tl.sum(xhat * g, axis=1) / N
    if IS_RMS_NORM:
        ds = (g - xhat * c1[:, None]) * rstd[:, None]
    else:
        c2 = tl.sum(g, axis=1) / N
        ds = (g - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
    if HAS_DS_OUT:
        ds += dso.to(tl.float32)
    _store_ds(ds, rows64, cols, mask, N, seed, dropout_p, dropout_scale, DX, DRES, stride_dx_row, stride_dres_row,
              HAS_DROPOUT, STORE_DX, STORE_DRES)
    return tl.sum(dy * xhat, axis=0), tl.sum(dy, axis=0)


@triton.jit(do_not_specialize=["dropout_p", "dropout_scale"])
def _layer_norm_bwd_kernel(
    X,  # (M, N) forward input branch (read when RECOMPUTE_S)
    R,  # (M, N) forward residual (read when RECOMPUTE_S and HAS_RESIDUAL)
    S,  # (M, N) saved s (read when not RECOMPUTE_S)
    W,  # (N,) weight (if HAS_WEIGHT)
    MEAN, RSTD,  # (M,) fp32 saved statistics (MEAN unused for RMSNorm)
    DY,  # (M, N) gradient of y
    DS_OUT,  # (M, N) gradient arriving through the returned s (if HAS_DS_OUT)
    DX,  # (M, N) output gradient of x (if STORE_DX)
    DRES,  # (M, N) output gradient of residual (if STORE_DRES)
    DW_PARTIAL, DB_PARTIAL,  # (programs, N) fp32 outputs: per-program partial sums
    Seed,  # (1,) int64 Philox seed of the forward's dropout mask (read only with HAS_DROPOUT)
    stride_x_row, stride_r_row, stride_s_row, stride_dy_row, stride_dso_row, stride_dx_row, stride_dres_row,
    M, N,
    dropout_p, dropout_scale,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, RECOMPUTE_S: tl.constexpr, HAS_DS_OUT: tl.constexpr,
    STORE_DX: tl.constexpr, STORE_DRES: tl.constexpr, IS_RMS_NORM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  # rows per block; BLOCK_N >= N
    PREFETCH: tl.constexpr,  # issue the next row block's loads before computing this one
    PROGS_PER_SM: tl.constexpr,  # unused in the body: read by the launcher's grid (tuned with the tile)
):
    """Persistent: program p handles row blocks p, p + P, p + 2P, ... and writes one partial row.

    Nothing overlaps one block's loads with the previous block's math in a plain loop (the bytes in
    flight come only from co-resident programs); PREFETCH keeps the next block's raw loads in
    registers across the iteration instead, for configs with few programs per SM."""
    seed = load_seed(Seed, HAS_DROPOUT)  # (the seed lives in device memory: graph-safe)
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK_M
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    else:
        w = tl.zeros([BLOCK_N], dtype=tl.float32)  # unused
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if PREFETCH:
        na, nb, ndy, ndso, nmean, nrstd = _bwd_tile_loads(
            X, R, S, MEAN, RSTD, DY, DS_OUT, pid * BLOCK_M + tl.arange(0, BLOCK_M), cols, M, N,
            stride_x_row, stride_r_row, stride_s_row, stride_dy_row, stride_dso_row,
            HAS_RESIDUAL, RECOMPUTE_S, HAS_DS_OUT, IS_RMS_NORM)
    for row_start in range(pid * BLOCK_M, M, step):
        rows = row_start + tl.arange(0, BLOCK_M)
        if PREFETCH:
            a, b, dy, dso, mean, rstd = na, nb, ndy, ndso, nmean, nrstd
            # rows past M load nothing (masked), so the last prefetch costs no traffic
            na, nb, ndy, ndso, nmean, nrstd = _bwd_tile_loads(
                X, R, S, MEAN, RSTD, DY, DS_OUT, rows + step, cols, M, N,
                stride_x_row, stride_r_row, stride_s_row, stride_dy_row, stride_dso_row,
                HAS_RESIDUAL, RECOMPUTE_S, HAS_DS_OUT, IS_RMS_NORM)
        else:
            a, b, dy, dso, mean, rstd = _bwd_tile_loads(
                X, R, S, MEAN, RSTD, DY, DS_OUT, rows, cols, M, N,
                stride_x_row, stride_r_row, stride_s_row, stride_dy_row, stride_dso_row,
                HAS_RESIDUAL, RECOMPUTE_S, HAS_DS_OUT, IS_RMS_NORM)
        dw_c, db_c = _bwd_tile(a, b, dy, dso, mean, rstd, w, rows, cols, M, N, seed, dropout_p, dropout_scale,
                               DX, DRES, stride_dx_row, stride_dres_row,
                               HAS_RESIDUAL, HAS_WEIGHT, HAS_DROPOUT, RECOMPUTE_S, HAS_DS_OUT, STORE_DX,
                               STORE_DRES, IS_RMS_NORM)
        dw_acc += dw_c
        db_acc += db_c
    if HAS_WEIGHT:
        tl.store(DW_PARTIAL + pid.to(tl.int64) * N + cols, dw_acc, mask=col_mask)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + pid.to(tl.int64) * N + cols, db_acc, mask=col_mask)


@triton.jit(do_not_specialize=["dropout_p", "dropout_scale"])
def _layer_norm_bwd_row_stats_kernel(
    X, R, S, W, MEAN, RSTD, DY,  # as in _layer_norm_bwd_kernel
    C1, C2,  # (M,) fp32 outputs: mean(xhat * g) and mean(g) of each row (C2 unused for RMSNorm)
    Seed, stride_x_row, stride_r_row, stride_s_row, stride_dy_row, M, N, dropout_p, dropout_scale,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    RECOMPUTE_S: tl.constexpr, IS_RMS_NORM: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Wide rows, step 1: one program per row loops over column chunks for the two row sums."""
    seed = load_seed(Seed, HAS_DROPOUT)  # (the seed lives in device memory: graph-safe)
    row = tl.program_id(0)
    rows64 = (row + tl.arange(0, 1)).to(tl.int64)
    row_mask = rows64 < M
    cols = tl.arange(0, BLOCK_N)
    rstd = tl.load(RSTD + rows64)
    if not IS_RMS_NORM:
        mean = tl.load(MEAN + rows64)
    acc1 = tl.zeros([1, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([1, BLOCK_N], dtype=tl.float32)
    for off in range(0, N, BLOCK_N):
        c = off + cols
        col_mask = c < N
        mask = row_mask[:, None] & col_mask[None, :]
        if RECOMPUTE_S:
            s = _load_s(X, R, seed, rows64, c, mask, stride_x_row, stride_r_row, N, dropout_p, dropout_scale,
                        HAS_RESIDUAL, HAS_DROPOUT)
        else:
            s = tl.load(S + rows64[:, None] * stride_s_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
        if IS_RMS_NORM:
            xhat = s * rstd[:, None]
        else:
            xhat = tl.where(mask, (s - mean[:, None]) * rstd[:, None], 0.0)
        g = tl.load(DY + rows64[:, None] * stride_dy_row + c[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            g = g * tl.load(W + c, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        acc1 += xhat * g
        acc2 += g
    tl.store(C1 + rows64, tl.sum(acc1, axis=1) / N)
    if not IS_RMS_NORM:
        tl.store(C2 + rows64, tl.sum(acc2, axis=1) / N)


@triton.jit(do_not_specialize=["dropout_p", "dropout_scale"])
def _layer_norm_bwd_chunked_kernel(
    X, R, S, W, MEAN, RSTD, DY, DS_OUT, DX, DRES, DW_PARTIAL, DB_PARTIAL,  # as in _layer_norm_bwd_kernel
    C1, C2,  # (M,) fp32 row sums from _layer_norm_bwd_row_stats_kernel
    Seed,
    stride_x_row, stride_r_row, stride_s_row, stride_dy_row, stride_dso_row, stride_dx_row, stride_dres_row,
    M, N, dropout_p, dropout_scale,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, RECOMPUTE_S: tl.constexpr, HAS_DS_OUT: tl.constexpr,
    STORE_DX: tl.constexpr, STORE_DRES: tl.constexpr, IS_RMS_NORM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Wide rows, step 2: grid (row groups P, column chunks); program (p, j) handles rows p, p + P, ...
    of chunk j and writes partial[p, chunk j]."""
    seed = load_seed(Seed, HAS_DROPOUT)  # (the seed lives in device memory: graph-safe)
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_BIAS:
        db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for row in range(pid, M, num_progs):
        rows64 = (row + tl.arange(0, 1)).to(tl.int64)
        mask = (rows64 < M)[:, None] & col_mask[None, :]
        if RECOMPUTE_S:
            s = _load_s(X, R, seed, rows64, cols, mask, stride_x_row, stride_r_row, N, dropout_p, dropout_scale,
                        HAS_RESIDUAL, HAS_DROPOUT)
        else:
            s = tl.load(S + rows64[:, None] * stride_s_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows64)
        if IS_RMS_NORM:
            xhat = s * rstd[:, None]
        else:
            xhat = tl.where(mask, (s - tl.load(MEAN + rows64)[:, None]) * rstd[:, None], 0.0)
        dy = tl.load(DY + rows64[:, None] * stride_dy_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            g = dy * w[None, :]
            dw_acc += tl.sum(dy * xhat, axis=0)
        else:
            g = dy
        if HAS_BIAS:
            db_acc += tl.sum(dy, axis=0)
        c1 = tl.load(C1 + rows64)
        if IS_RMS_NORM:
            ds = (g - xhat * c1[:, None]) * rstd[:, None]
        else:
            ds = (g - (xhat * c1[:, None] + tl.load(C2 + rows64)[:, None])) * rstd[:, None]
        if HAS_DS_OUT:
            ds += tl.load(DS_OUT + rows64[:, None] * stride_dso_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        _store_ds(ds, rows64, cols, mask, N, seed, dropout_p, dropout_scale, DX, DRES, stride_dx_row,
                  stride_dres_row, HAS_DROPOUT, STORE_DX, STORE_DRES)
    if HAS_WEIGHT:
        tl.store(DW_PARTIAL + pid.to(tl.int64) * N + cols, dw_acc, mask=col_mask)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + pid.to(tl.int64) * N + cols, db_acc, mask=col_mask)


def _sms(dev: torch.device) -> int:
    """Streaming multiprocessors of ``dev`` (3 under the interpreter: >1 program, so the partial-sum
    reduction is exercised)."""
    if dev.type != "cuda":
        return 3
    return _tuning.device_properties(dev).multi_processor_count


def _bench_quick(kernel_call, quantiles):
    # short autotuning runs: the whole GPU batch has a time budget
    return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


# registers per thread of the backward at 8 / 16 elements per thread, and with PREFETCH at 8
# (sm_90, measured offline with ptxas); they set how many programs stay resident per SM
_BWD_REGS = {(8, False): 80, (16, False): 128, (8, True): 110}


def _bwd_configs(block_n: int) -> list[triton.Config]:
    """(rows per block, warps, programs per SM, prefetch) candidates for one BLOCK_N bucket. The
    bytes in flight per SM come from co-resident programs (as many as the registers allow: 64K per
    SM) or, with PREFETCH, also from the next block's loads issued before this block's math."""
    if _interpret():
        return [triton.Config({"BLOCK_M": 1 if block_n >= 64 else 2, "PROGS_PER_SM": 1, "PREFETCH": False},
                              num_warps=1)]
    if block_n >= 8192:  # 16 warps: 128 registers, 32: 64 (PREFETCH spills here)
        cands = [(1, 16, 1, False), (1, 32, 1, False)]
    else:
        cands = []
        # (1024, 8, True): one-row blocks with the next row's loads in flight during this row's math and
        # ~4 programs per SM; the first GPU run's backward (16384 x 768) was ~1.8x its traffic floor
        for elems, per_thread, pf in ((1024, 8, False), (2048, 16, False), (4096, 16, False), (2048, 8, True),
                                      (1024, 8, True)):
            bm = max(1, min(16, elems // block_n))
            w = max(1, min(16, bm * block_n // (32 * per_thread)))
            per_thread = bm * block_n // (32 * w)
            regs = _BWD_REGS.get((min(per_thread, 16), pf), 128)
            k = max(1, min(8, 65536 // (regs * 32 * w)))
            cands.append((bm, w, k, pf))
    return [triton.Config({"BLOCK_M": bm, "PROGS_PER_SM": k, "PREFETCH": pf}, num_warps=w)
            for bm, w, k, pf in dict.fromkeys(cands)]


@functools.lru_cache(maxsize=None)
def _bwd_tuned(block_n: int):
    # keyed on N; every config overwrites all outputs (partial rows included), so tuning runs are safe
    tuned = _tuning.autotune(configs=_bwd_configs(block_n), key=["N"], do_bench=_bench_quick)(_layer_norm_bwd_kernel)
    # derived once here (not per call): sizes the partial-sum buffer for the widest candidate grid
    tuned.pk_max_progs_per_sm = max(c.kwargs["PROGS_PER_SM"] for c in tuned.configs)
    return tuned


def layer_norm_bwd(dy: torch.Tensor, ds_out: torch.Tensor | None, x: torch.Tensor | None,
                   residual: torch.Tensor | None, s: torch.Tensor | None, weight: torch.Tensor | None,
                   mean: torch.Tensor, rstd: torch.Tensor, *, has_bias: bool, seed, dropout_p: float,
                   store_dx: bool, dres_dtype: torch.dtype | None, rms_norm: bool,
                   x_dtype: torch.dtype, w_dtype: torch.dtype | None, b_dtype: torch.dtype | None):
    """Launch the backward.

    dy, ds_out: (M, N) (ds_out None without an upstream gradient through s). Either ``s`` (saved,
    (M, N)) or ``x`` (+ ``residual``) to recompute it. Returns (dx (M, N) x_dtype or (0,) when not
    stored, dresidual (M, N) dres_dtype or (0,) when dres_dtype is None, dwb (n, N): dweight and/or
    dbias stacked (n = has_weight + has_bias; row 0 dweight if any, row n - 1 dbias if any), in the
    weight's dtype (the bias's without a weight; a (0, N) x_dtype tensor with neither)."""
    dropout_p = _dropout_rate(dropout_p)  # (a multiple of 2^-16: _dropout.dropout_keep's 16 bits)
    M, N = dy.shape
    dev = dy.device
    seed = seed_arg(seed, dev, dropout_p > 0.0)
    recompute = s is None
    dx = empty(M, N, dtype=x_dtype, device=dev) if store_dx else empty(0, dtype=x_dtype, device=dev)
    store_dres = dres_dtype is not None
    dres = (empty(M, N, dtype=dres_dtype, device=dev) if store_dres
            else empty(0, dtype=x_dtype, device=dev))
    has_weight = weight is not None
    chunked = N > MAX_FUSED_N_BWD
    block_n = min(CHUNK_N, _next_pow2(N)) if chunked else max(_next_pow2(N), 16)
    sms = _sms(dev)
    # the persistent grid depends on the tuned config (rows per block, programs per SM); the partial
    # buffer is sized for the largest and only the rows of the chosen grid are summed. dweight and
    # dbias partials share one (n_sums, progs, N) fp32 buffer, so one sum (and at most one cast)
    # reduces both: 2 launches after the kernel instead of 4.
    max_per_sm = 4 if chunked else _bwd_tuned(block_n).pk_max_progs_per_sm
    progs = max(1, min(M, max_per_sm * sms))
    n_sums = int(has_weight) + int(has_bias)
    partial = empty(n_sums, progs, N, dtype=torch.float32, device=dev) if n_sums else None
    dw_partial = partial[0] if has_weight else None
    db_partial = partial[n_sums - 1] if has_bias else None
    if M == 0:
        if partial is not None:
            partial.zero_()
    else:
        anyt = dy
        ptrs = (x if x is not None else anyt, residual if residual is not None else anyt,
                s if s is not None else anyt, weight if has_weight else anyt, mean if mean.numel() else rstd, rstd,
                dy, ds_out if ds_out is not None else anyt, dx, dres,
                dw_partial if has_weight else anyt, db_partial if has_bias else anyt)
        strides = (x.stride(0) if x is not None else 0, residual.stride(0) if residual is not None else 0,
                   s.stride(0) if s is not None else 0, dy.stride(0),
                   ds_out.stride(0) if ds_out is not None else 0, dx.stride(0) if store_dx else 0,
                   dres.stride(0) if store_dres else 0)
        flags = dict(HAS_RESIDUAL=residual is not None, HAS_WEIGHT=has_weight, HAS_BIAS=has_bias,
                     HAS_DROPOUT=dropout_p > 0.0, RECOMPUTE_S=recompute, HAS_DS_OUT=ds_out is not None,
                     STORE_DX=store_dx, STORE_DRES=store_dres, IS_RMS_NORM=rms_norm)
        scale = 1.0 / (1.0 - dropout_p) if dropout_p > 0.0 else 1.0
        with _on_device(dev):
            if not chunked:
                tuned = _bwd_tuned(block_n)

                def grid(meta):
                    return (max(1, min(_cdiv(M, meta["BLOCK_M"]), meta["PROGS_PER_SM"] * sms)),)

                _launch.fast(tuned)[grid](*ptrs, seed, *strides, M, N, dropout_p, scale, **flags, BLOCK_N=block_n)
                progs = grid(tuned.best_config.kwargs)[0]
            else:
                num_warps = 16 if not _interpret() else 1  # 8 warps: ~200 registers, one program per SM
                # about 4 programs per SM over the whole (row groups, chunks) grid: the partial buffers
                # (progs x N fp32) stay small next to the data
                progs = max(1, min(progs, 4 * sms // _cdiv(N, block_n)))
                c1 = empty(M, dtype=torch.float32, device=dev)
                c2 = empty(M if not rms_norm else 0, dtype=torch.float32, device=dev)
                _launch.fast(_layer_norm_bwd_row_stats_kernel)[(M,)](
                    *ptrs[:7], c1, c2 if not rms_norm else c1, seed, strides[0], strides[1], strides[2], strides[3],
                    M, N, dropout_p, scale, HAS_RESIDUAL=residual is not None, HAS_WEIGHT=has_weight,
                    HAS_DROPOUT=dropout_p > 0.0, RECOMPUTE_S=recompute, IS_RMS_NORM=rms_norm,
                    BLOCK_N=block_n, num_warps=num_warps)
                _launch.fast(_layer_norm_bwd_chunked_kernel)[(progs, _cdiv(N, block_n))](
                    *ptrs, c1, c2 if not rms_norm else c1, seed, *strides, M, N, dropout_p, scale, **flags,
                    BLOCK_N=block_n, num_warps=num_warps)
    if partial is not None:
        # one sum for dweight and dbias, one cast (bias has the weight's dtype when both exist)
        dwb = partial[:, :progs].sum(1).to(w_dtype if has_weight else b_dtype)
    else:
        dwb = empty(0, N, dtype=x_dtype, device=dev)
    return dx, dres, dwb
