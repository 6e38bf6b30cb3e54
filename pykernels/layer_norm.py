"""Fused (dropout +) residual add + LayerNorm / RMSNorm: the public op, its checks, its eager reference
and its custom-op registration (``pykernels::layer_norm_fwd`` / ``pykernels::layer_norm_bwd``).

Post-LN (BERT, after each sublayer)::

    y = LN(dropout(x) + residual)                      layer_norm(x, w, b, residual=r)        -> y

Pre-LN (GPT-2, before each sublayer; the caller keeps the residual stream s)::

    s = dropout(x) + residual;  y = LN(s)              layer_norm(x, w, b, residual=r, prenorm=True) -> (y, s)

The kernels are in ``pykernels._kernels.layer_norm`` (design note there).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ._backend import CUDA_TRACED, check_backend_name, select, use_cuda_op
from ._op import _plain_eager, custom_op
from ._checks import check_prob, check_same, param_dtype
from ._rng import fake_seed, op_seed
from .attention import dropout_bits, dropout_rate

_OP = "layer_norm"
# float64 is accepted (the reference serves it); the Triton kernels take the three training dtypes.
_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------------------------------
# dropout mask (bit-exact twin of the kernels': the attention's rule, pykernels.attention.dropout_bits)
# ----------------------------------------------------------------------------------------------------
def layer_norm_dropout_mask(seed, shape, p: float, device=None) -> Tensor:
    """The keep-mask (bool, ``shape``) the kernels draw for dropout probability ``p`` and ``seed``.

    ``seed``: int or the (1,) int64 tensor the forward returned. Seen as (rows, N) with N = ``shape[-1]``,
    element (r, c) is kept where ``pykernels.attention.dropout_bits(seed, r, N)[c] >= dropout_rate(p) * 65536``
    (one Philox call per 8 columns of a row, 16 bits a column; the attention's rule). Regenerated, never stored,
    by the kernels; the ``reference`` backend and the tests use this function to get the identical mask."""
    shape = tuple(shape)
    n_cols = shape[-1] if shape else 1
    rows = 1
    for d in shape[:-1]:
        rows *= d
    bits = dropout_bits(seed, torch.arange(rows, dtype=torch.int64), n_cols, device)
    return (bits >= round(dropout_rate(p) * 65536)).reshape(shape)


# ----------------------------------------------------------------------------------------------------
# eager reference
# ----------------------------------------------------------------------------------------------------
def layer_norm_reference(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor] = None, eps: float = 1e-5,
                         *, residual: Optional[Tensor] = None, dropout_mask: Optional[Tensor] = None,
                         dropout_p: float = 0.0, prenorm: bool = False, residual_in_fp32: bool = False,
                         rms_norm: bool = False, upcast: bool = False):
    """Eager PyTorch version of :func:`layer_norm` (same arguments; ``dropout_mask`` is the bool keep-mask,
    shape of ``x``, applied with scale 1 / (1 - dropout_rate(dropout_p)), the rate the kernels realise; without it
    there is no dropout).

    ``upcast=False`` computes in the inputs' dtypes the way an eager model would (the sum rounded to the
    residual stream's dtype, then ``F.layer_norm`` / ``F.rms_norm``); ``upcast=True`` computes and
    returns everything in float64 (the truth in tests). Returns ``y`` or ``(y, s)`` when ``prenorm``."""
    x_dtype = x.dtype
    if upcast:
        x, residual, weight, bias = (t.double() if t is not None else None for t in (x, residual, weight, bias))
    b = x
    if dropout_mask is not None:
        b = x.masked_fill(~dropout_mask, 0) * (1.0 / (1.0 - dropout_rate(dropout_p)))
    s = b + residual if residual is not None else b
    if not upcast:
        s_dtype = torch.float32 if residual_in_fp32 else (residual.dtype if residual is not None else x_dtype)
        s = s.to(s_dtype)
    n = (x.shape[-1],)
    w = weight.to(s.dtype) if weight is not None else None
    if rms_norm:
        y = F.rms_norm(s, n, w, eps)
        if bias is not None:
            y = y + bias.to(s.dtype)
    else:
        y = F.layer_norm(s, n, w, bias.to(s.dtype) if bias is not None else None, eps)
    if not upcast:
        y = y.to(x_dtype)
    return (y, s) if prenorm else y


# ----------------------------------------------------------------------------------------------------
# custom ops
# ----------------------------------------------------------------------------------------------------
def _support(*tensors: Optional[Tensor]) -> dict:
    for t in tensors:
        if t is not None and t.dtype not in _KERNEL_DTYPES:
            return {"triton": f"dtype {t.dtype} is not supported by the Triton kernels (fp16, bf16, fp32)",
                    "cuda": CUDA_TRACED}
    return {"triton": None, "cuda": CUDA_TRACED}


def _cuda_cover(x2: Tensor, w: Optional[Tensor], b: Optional[Tensor], r2: Optional[Tensor], dropout_p: float,
                residual_in_fp32: bool) -> Optional[str]:
    """None when the CUDA C++ op ``pykernels_cuda::layer_norm`` (csrc/layer_norm.cu) covers the call,
    else why it does not."""
    if x2.dtype not in _KERNEL_DTYPES:
        return f"dtype {x2.dtype}"
    if r2 is not None and r2.dtype != x2.dtype:
        return "residual has another dtype than x"
    # weight and bias: x's dtype or float32 (autocast's parameters beside bf16 / fp16 rows); the public checks
    # have made bias's dtype weight's
    for name, t in (("weight", w), ("bias", b)):
        if t is not None and t.dtype not in (x2.dtype, torch.float32):
            return f"{name} has another dtype than x or float32"
    if residual_in_fp32 and x2.dtype != torch.float32:
        return "residual_in_fp32"
    n = x2.shape[1]
    pack, widest = (4, 4096) if x2.dtype == torch.float32 else (8, 8192)
    if n % pack or n > widest:
        return f"N = {n}: the CUDA kernels take multiples of {pack} up to {widest} for {x2.dtype}"
    if not _plain_eager((x2, w, b, r2)) and not torch.compiler.is_compiling():
        return "under dispatch modes other than torch.compile's the op is the Triton custom op (pykernels::layer_norm_fwd)"
    return None


def _use_cuda(backend: Optional[str], x2: Tensor, w, b, r2, dropout_p: float, residual_in_fp32: bool) -> bool:
    """Whether this call runs the CUDA C++ kernels (``_backend.use_cuda_op``: named, or ``auto`` where the extension is
    built and covers the call: eager calls, captured in CUDA graphs or not (its kernels read the dropout seed from
    device memory, and ran 1.09-1.20x the Triton kernels' forward+backward in graph replay at five of the six peer
    shapes, H200 run267), and under torch.compile, through the compiled pair (:class:`_CudaLayerNorm`))."""
    return use_cuda_op(_OP, backend, x2.device, lambda: _cuda_cover(x2, w, b, r2, dropout_p, residual_in_fp32),
                       traced=True, capture=True)


class _CudaLayerNorm(torch.autograd.Function):
    """The C++ kernels as torch.compile's graphs hold them: ``pykernels_cuda::layer_norm_fwd`` and ``layer_norm_bwd``
    (csrc/layer_norm.cu; fake impls in ``pykernels._cuda_ops``), which dynamo traces through this Function, so the
    compiled forward and backward call them with no Python at run time. The forward draws the dropout seed (as
    ``op_seed`` does: one ``torch.manual_seed``, one mask) and returns it for the backward. Eager calls take the
    one-call op ``pykernels_cuda::layer_norm`` (autograd in C++) instead."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, eps, dropout_p, prenorm, rms_norm):
        y, s, mean, rstd, seed = torch.ops.pykernels_cuda.layer_norm_fwd(x, weight, bias, residual, eps, dropout_p,
                                                                         prenorm, rms_norm)
        # pre-LN saves s (an output anyway); post-LN saves x and residual, and the backward recomputes s
        ctx.save_for_backward(s if prenorm else x, None if prenorm else residual, weight, bias, mean, rstd, seed)
        ctx.flags = (dropout_p, prenorm, rms_norm, residual is not None)
        if not prenorm:
            ctx.mark_non_differentiable(s)
        return y, s

    @staticmethod
    def backward(ctx, dy, ds):
        a, residual, weight, bias, mean, rstd, seed = ctx.saved_tensors
        dropout_p, prenorm, rms_norm, has_residual = ctx.flags
        dx, dres, dw, db = torch.ops.pykernels_cuda.layer_norm_bwd(
            dy, ds if prenorm else None, a, residual, weight, bias, mean, rstd, seed, dropout_p, prenorm, rms_norm)
        if not dropout_p > 0.0:  # dx is dresidual (the op returns it once)
            dx = dres
        return (dx, dw if weight is not None else None, db if bias is not None else None,
                dres if has_residual else None, None, None, None, None)


def _s_dtype(x: Tensor, residual: Optional[Tensor], residual_in_fp32: bool) -> torch.dtype:
    if residual_in_fp32:
        return torch.float32
    return residual.dtype if residual is not None else x.dtype


def _stat_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _branch_sum(x: Tensor, residual: Optional[Tensor], seed: Tensor, dropout_p: float, dtype) -> Tensor:
    """s = dropout(x) + residual in ``dtype`` (the reference backend's twin of the kernels' _load_s)."""
    s = x.to(dtype, copy=True)  # never an alias of x (custom ops may not return inputs)
    if dropout_p > 0.0:
        keep = layer_norm_dropout_mask(seed, x.shape, dropout_p, x.device)
        s = torch.where(keep, s * (1.0 / (1.0 - dropout_rate(dropout_p))), 0.0)
    if residual is not None:
        s = s + residual.to(dtype)
    return s


@custom_op("pykernels::layer_norm_fwd", mutates_args=())
def _fwd(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor], eps: float,
         dropout_p: float, prenorm: bool, residual_in_fp32: bool, rms_norm: bool,
         backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x, residual: (M, N). Returns y (M, N) x.dtype; s (M, N) (prenorm, else (0,)); mean (M,) fp32 ((0,)
    for RMSNorm); rstd (M,) fp32; seed (1,) int64 on the device (drawn there with dropout, else a (0,) placeholder)."""
    impl = select(_OP, backend or None, x.device, _support(x, weight, bias, residual))
    seed = op_seed(dropout_p, x.device)
    s_dtype = _s_dtype(x, residual, residual_in_fp32)
    if impl == "triton":
        from ._kernels import layer_norm as kernels
        y, s, mean, rstd = kernels.layer_norm_fwd(
            x, weight, bias, residual, eps=eps, seed=seed,
            dropout_p=dropout_p, store_s=prenorm,
            s_dtype=s_dtype, rms_norm=rms_norm)
        return y, s, mean, rstd, seed
    # reference backend: the same saved state (fp32 statistics, the same dropout mask)
    cdt = _stat_dtype(x)
    s = _branch_sum(x, residual, seed, dropout_p, cdt)
    if rms_norm:
        var = s.square().mean(-1)
        mean = x.new_empty(0, dtype=cdt)
        d = s
    else:
        mean = s.mean(-1)
        d = s - mean[:, None]
        var = d.square().mean(-1)
    rstd = torch.rsqrt(var + eps)
    y = d * rstd[:, None]
    if weight is not None:
        y = y * weight.to(cdt)
    if bias is not None:
        y = y + bias.to(cdt)
    s_out = s.to(s_dtype) if prenorm else x.new_empty(0, dtype=s_dtype)
    return y.to(x.dtype), s_out, mean, rstd, seed


@_fwd.register_fake
def _(x, weight, bias, residual, eps, dropout_p, prenorm, residual_in_fp32, rms_norm, backend):
    M, N = x.shape
    s_dtype = _s_dtype(x, residual, residual_in_fp32)
    cdt = _stat_dtype(x)
    return (x.new_empty(M, N), x.new_empty((M, N) if prenorm else (0,), dtype=s_dtype),
            x.new_empty(0 if rms_norm else M, dtype=cdt), x.new_empty(M, dtype=cdt),
            fake_seed(dropout_p, x.device))


@custom_op("pykernels::layer_norm_bwd", mutates_args=())
def _bwd(dy: Tensor, ds_out: Optional[Tensor], x: Optional[Tensor], residual: Optional[Tensor],
         s: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor], mean: Tensor, rstd: Tensor,
         seed: Tensor, dropout_p: float, store_dx: bool, dres_dtype: Optional[torch.dtype], rms_norm: bool,
         backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`_fwd`. ``s`` is the saved s (pre-LN), else ``x`` and ``residual`` recompute it.
    Returns dx (M, N) dy.dtype (or (0,) when not ``store_dx``: then dx equals dresidual), dresidual (M, N)
    ``dres_dtype`` (or (0,) when None), and dweight / dbias stacked as one (k, N) tensor, k = (weight is
    not None) + (bias is not None): row 0 is dweight if there is a weight, row k - 1 dbias if there is a
    bias, in the weight's dtype (else the bias's; (0, N) dy.dtype with neither). One tensor, so the
    kernel path reduces both partial sums with one launch (custom-op outputs may not alias each other,
    so two rows of one buffer cannot be returned as two outputs); the autograd formula splits it."""
    impl = select(_OP, backend or None, dy.device, _support(dy, ds_out, x, residual, s, weight, bias))
    M, N = dy.shape
    if impl == "triton":
        from ._kernels import layer_norm as kernels
        return kernels.layer_norm_bwd(
            dy, ds_out, x, residual, s, weight, mean, rstd, has_bias=bias is not None,
            seed=seed,
            dropout_p=dropout_p, store_dx=store_dx, dres_dtype=dres_dtype, rms_norm=rms_norm, x_dtype=dy.dtype,
            w_dtype=weight.dtype if weight is not None else None, b_dtype=bias.dtype if bias is not None else None)
    cdt = _stat_dtype(dy)
    s_ = s.to(cdt) if s is not None else _branch_sum(x, residual, seed, dropout_p, cdt)
    xhat = s_ * rstd[:, None] if rms_norm else (s_ - mean[:, None]) * rstd[:, None]
    dy_ = dy.to(cdt)
    g = dy_ * weight.to(cdt) if weight is not None else dy_
    c1 = (xhat * g).mean(-1, keepdim=True)
    ds = g - xhat * c1 if rms_norm else g - xhat * c1 - g.mean(-1, keepdim=True)
    ds = ds * rstd[:, None]
    if ds_out is not None:
        ds = ds + ds_out.to(cdt)
    if store_dx:
        dx = ds
        if dropout_p > 0.0:
            keep = layer_norm_dropout_mask(seed, (M, N), dropout_p, dy.device)
            dx = torch.where(keep, ds * (1.0 / (1.0 - dropout_rate(dropout_p))), 0.0)
        dx = dx.to(dy.dtype)
    else:
        dx = dy.new_empty(0)
    dres = ds.to(dres_dtype) if dres_dtype is not None else dy.new_empty(0)
    sums = ([(dy_ * xhat).sum(0)] if weight is not None else []) + ([dy_.sum(0)] if bias is not None else [])
    pdt = param_dtype(weight, bias, dy)
    dwb = torch.stack(sums).to(pdt) if sums else dy.new_empty(0, N)
    return dx, dres, dwb


@_bwd.register_fake
def _(dy, ds_out, x, residual, s, weight, bias, mean, rstd, seed, dropout_p, store_dx, dres_dtype, rms_norm,
      backend):
    M, N = dy.shape
    k = (weight is not None) + (bias is not None)
    pdt = param_dtype(weight, bias, dy)
    return (dy.new_empty((M, N) if store_dx else (0,)),
            dy.new_empty((M, N) if dres_dtype is not None else (0,), dtype=dres_dtype or dy.dtype),
            dy.new_empty((k, N), dtype=pdt))


def _setup_context(ctx, inputs, output):
    x, weight, bias, residual, eps, dropout_p, prenorm, residual_in_fp32, rms_norm, backend = inputs
    y, s, mean, rstd, seed = output
    # pre-LN keeps s anyway (it is an output), so the backward reads it; post-LN recomputes s from x
    # and residual, so the forward writes nothing but y.
    ctx.save_for_backward(None if prenorm else x, None if prenorm else residual, s if prenorm else None,
                          weight, bias, mean, rstd, seed)
    ctx.flags = (dropout_p, prenorm, rms_norm, backend)
    ctx.dtypes = (x.dtype, residual.dtype if residual is not None else None)


def _backward(ctx, dy, ds, dmean, drstd, dseed):
    x, residual, s, weight, bias, mean, rstd, seed = ctx.saved_tensors
    dropout_p, prenorm, rms_norm, backend = ctx.flags
    x_dtype, res_dtype = ctx.dtypes
    if dy is None:
        dy = torch.zeros(rstd.shape[0], (s if s is not None else x).shape[1], dtype=x_dtype, device=rstd.device)
    # the kernels need unit column stride: gradients of reductions arrive expanded (stride 0)
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    if prenorm and ds is not None and ds.stride(-1) != 1:
        ds = ds.contiguous()
    # dx is a separate tensor only when it differs from dresidual (dropout, or another dtype)
    store_dx = res_dtype is None or dropout_p > 0.0 or res_dtype != x_dtype
    dx, dres, dwb = _bwd(
        dy, ds if prenorm else None, x, residual, s, weight, bias, mean, rstd, seed, dropout_p, store_dx,
        res_dtype, rms_norm, backend)
    if not store_dx:
        dx = dres
    dw = dwb[0] if weight is not None else None
    db = dwb[-1] if bias is not None else None
    return (dx, dw, db,
            dres if res_dtype is not None else None, None, None, None, None, None, None)


_fwd.register_autograd(_backward, setup_context=_setup_context, materialize=())  # dy, ds may be None


# ----------------------------------------------------------------------------------------------------
# public function
# ----------------------------------------------------------------------------------------------------
def _check_bool(name: str, v) -> None:
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {type(v).__name__}")


def _check_param(name: str, t, n: int, x: Tensor, allowed) -> None:
    if t is None:
        return
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.dim() != 1 or t.shape[0] != n:
        raise ValueError(f"{name} must have shape ({n},) (the last dim of x), got {tuple(t.shape)}")
    if t.dtype not in allowed:
        raise TypeError(f"{name} must have dtype {' or '.join(str(d) for d in allowed)} (x is {x.dtype}), "
                        f"got {t.dtype}")


def layer_norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor] = None, eps: float = 1e-5, *,
               residual: Optional[Tensor] = None, dropout_p: float = 0.0, prenorm: bool = False,
               residual_in_fp32: bool = False, rms_norm: bool = False, backend: Optional[str] = None):
    """Fused dropout + residual add + LayerNorm (or RMSNorm) over the last dim.

    ``s = dropout(x) + residual`` (``dropout`` keeps each element with probability ``1 - dropout_p`` and
    scales it by ``1 / (1 - dropout_p)``: training style, pass ``dropout_p=0`` in eval), then
    ``y = (s - mean(s)) / sqrt(var(s) + eps) * weight + bias`` (``rms_norm=True``:
    ``y = s / sqrt(mean(s^2) + eps) * weight + bias``). Statistics are computed in fp32.

    Args:
        x: ``(..., N)`` fp16 / bf16 / fp32 (fp64 runs on the reference). The last dim must be contiguous
            for the kernels (else it is copied); rows may be strided.
        weight, bias: ``(N,)`` or None, dtype of x or fp32 (bias the dtype of weight).
        eps: added to the variance.
        residual: ``(..., N)`` like x (dtype of x or fp32), or None (then ``s = dropout(x)``).
        dropout_p: probability of dropping an element of ``x`` (the branch, not the residual).
        prenorm: also return ``s`` (pre-LN: the caller keeps the residual stream).
        residual_in_fp32: with ``prenorm``, return ``s`` in fp32 (else in residual's dtype, or x's).
        rms_norm: RMSNorm instead of LayerNorm (no mean subtraction; bias still optional).
        backend: ``"auto" | "triton" | "cuda" | "reference"`` or None (the current default).

    Returns:
        ``y`` (shape and dtype of x) when ``prenorm`` is False; ``(y, s)`` when it is True. The return
        arity depends only on ``prenorm``. Gradients flow to x, residual, weight and bias (and into the
        pre-LN ``s``: the gradient arriving through ``s`` is added to the normalisation's).
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _X_DTYPES:
        raise TypeError(f"x must have dtype float16, bfloat16, float32 or float64, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have at least 1 dim and a non-empty last dim, got shape {tuple(x.shape)}")
    n = x.shape[-1]
    _check_param("weight", weight, n, x, (x.dtype, torch.float32) if x.dtype != torch.float32 else (x.dtype,))
    bias_dtypes = (weight.dtype,) if weight is not None else (
        (x.dtype, torch.float32) if x.dtype != torch.float32 else (x.dtype,))
    _check_param("bias", bias, n, x, bias_dtypes)
    if residual is not None:
        if not isinstance(residual, Tensor):
            raise TypeError(f"residual must be a torch.Tensor or None, got {type(residual).__name__}")
        if residual.shape != x.shape:
            raise ValueError(f"residual must have the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
        if residual.dtype not in (x.dtype, torch.float32):
            raise TypeError(f"residual must have dtype {x.dtype} (that of x) or float32, got {residual.dtype}")
    check_same([("x", x), ("weight", weight), ("bias", bias), ("residual", residual)], what="device")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    dropout_p = check_prob("dropout_p", dropout_p)
    for name, v in (("prenorm", prenorm), ("residual_in_fp32", residual_in_fp32), ("rms_norm", rms_norm)):
        _check_bool(name, v)
    check_backend_name(backend)

    shape = x.shape
    two_d = x.dim() == 2  # (M, N) already: no reshape (each costs host time per call)
    x2 = x if two_d else x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    r2 = None
    if residual is not None:
        r2 = residual if two_d else residual.reshape(-1, n)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
    w = weight.contiguous() if weight is not None else None
    b = bias.contiguous() if bias is not None else None
    if _use_cuda(backend, x2, w, b, r2, dropout_p, residual_in_fp32):
        if torch.compiler.is_compiling():  # the compiled pair (its forward draws the seed)
            y, s = _CudaLayerNorm.apply(x2, w, b, r2, float(eps), dropout_p, prenorm, rms_norm)
        else:
            # the seed is drawn as the Triton path draws it (same generator use: the same mask for a seed)
            seed = op_seed(dropout_p, x2.device) if dropout_p > 0.0 else None
            y, s = torch.ops.pykernels_cuda.layer_norm(x2, w, b, r2, float(eps), dropout_p, seed, prenorm, rms_norm)
    else:
        y, s, _, _, _ = _fwd(x2, w, b, r2, float(eps), dropout_p, prenorm, residual_in_fp32, rms_norm,
                             backend or "")
    if x.dim() != 2:  # (a view costs a little host time per call; skip it when not needed)
        y = y.view(shape)
        s = s.view(shape) if prenorm else s
    return (y, s) if prenorm else y
