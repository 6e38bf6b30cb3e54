"""Softmax cross-entropy on materialised logits: :func:`cross_entropy` (fused Triton forward and
backward, custom ops ``pykernels::cross_entropy_fwd`` / ``cross_entropy_bwd`` /
``cross_entropy_bwd_inplace``) and its eager :func:`cross_entropy_reference`.

The forward op works on the flattened (N, V) logits and returns the loss (reduced in the op: a
second one-program kernel sums the row losses in a fixed order and divides by the valid count,
counted on the device, or by ``num_valid``), the saved logsumexp (fp32) and the backward's scale
(1/denominator): no host sync, two launches. The kernels and their design note are in
``kernels/cross_entropy.py``.

The ``cuda`` backend is the CUDA C++ op ``torch.ops.pykernels_cuda.cross_entropy`` (``csrc/cross_entropy.cu``:
the same algorithm, its autograd in C++), which serves plain eager calls (``cross_entropy`` routes them to
it before the custom op, as ``layer_norm`` does); traced calls (torch.compile, dispatch modes) take the
Triton custom op.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import Tensor

from . import _checks
from ._backend import CUDA_TRACED, check_backend_name, select, use_cuda_op
from ._op import _plain_eager, custom_op

_OP = "cross_entropy"
_REDUCTIONS = ("mean", "sum", "none")
_REDUCTION_CODES = {"none": 0, "sum": 1, "mean": 2}  # the C++ op's (csrc/cross_entropy.cu)


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------

def _check_target_range(target: Tensor, V: int, ignore_index: int) -> None:
    """Eager (host-syncing) range check used by the reference paths."""
    bad = (target != ignore_index) & ((target < 0) | (target >= V))
    if bool(bad.any()):
        vals = target[bad][:5].tolist()
        raise ValueError(f"target values must be in [0, {V}) or equal ignore_index={ignore_index}; "
                         f"got out-of-range values {vals}")


def cross_entropy_reference(logits: Tensor, target: Tensor, *, ignore_index: int = -100,
                            reduction: str = "mean", label_smoothing: float = 0.0, z_loss: float = 0.0,
                            num_valid=None, upcast: bool = False) -> Tensor:
    """Eager PyTorch cross-entropy with the semantics of :func:`cross_entropy`.

    Computes in the logits' dtype (``upcast=True``: in fp32, returning fp32, as users write
    ``F.cross_entropy(logits.float(), ...)``). Differentiable. Out-of-range targets raise ValueError
    (this check syncs with the device).
    """
    if logits.dim() < 1:
        raise ValueError(f"logits must have at least 1 dim (..., V), got shape {tuple(logits.shape)}")
    V = logits.shape[-1]
    x = logits.reshape(-1, V)
    t = target.reshape(-1).long()
    if upcast:
        x = x.float()
    _check_target_range(t, V, ignore_index)
    valid = t != ignore_index
    rows = F.cross_entropy(x, t, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
    if z_loss:
        lse = torch.logsumexp(x, dim=-1)
        rows = rows + torch.where(valid, z_loss * lse * lse, torch.zeros_like(lse))
    if reduction == "none":
        return rows.reshape(target.shape)
    total = rows.sum()
    if reduction == "sum":
        return total
    denom = valid.sum() if num_valid is None else num_valid
    if isinstance(denom, Tensor):
        return total / denom.clamp_min(1).to(total.dtype)
    return total / max(int(denom), 1)


# ---------------------------------------------------------------------------------------------
# Custom ops
# ---------------------------------------------------------------------------------------------

def _support(logits: Tensor, target: Tensor) -> dict:
    reason = None
    if logits.dtype == torch.float64:
        reason = "float64 logits (the kernel computes in fp32)"
    return {"triton": reason, "cuda": reason or CUDA_TRACED}


def _cuda_cover(x: Tensor, t: Tensor, num_valid: Tensor | None) -> str | None:
    """None when the CUDA C++ op ``pykernels_cuda::cross_entropy`` covers the (N, V) call, else why not."""
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {x.dtype} (the CUDA kernels take float16, bfloat16 and float32)"
    n, v = x.shape
    if n >= 2**31 or v >= 2**31:
        return f"(N, V) = {(n, v)}: the CUDA kernels take N and V below 2^31"
    if not _plain_eager((x, t, num_valid)):
        return "under torch.compile and dispatch modes the op is the Triton custom op (pykernels::cross_entropy_fwd)"
    return None


def _use_cuda(backend: str | None, x: Tensor, t: Tensor, num_valid: Tensor | None) -> bool:
    """Whether this call runs the CUDA C++ op (``_backend.use_cuda_op``: named, or ``auto`` in eager mode where it is
    built and covers the call, outside CUDA-graph capture: it is as fast as the Triton kernels and costs no Python
    host time)."""
    return use_cuda_op(_OP, backend, x.device, lambda: _cuda_cover(x, t, num_valid))


def _ref_fwd(logits: Tensor, target: Tensor, num_valid: Tensor | None, ignore_index: int,
             label_smoothing: float, z_loss: float, reduction: str, num_valid_int: int):
    """The reference backend of the fused op: the kernels' outputs (loss in the logits' dtype, fp32
    lse that is 0 at ignored rows, fp32 scale) from eager PyTorch with fp32 statistics (fp64 for
    fp64 logits, which only this backend takes)."""
    V = logits.shape[1]
    _check_target_range(target, V, ignore_index)
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(acc)
    valid = target != ignore_index
    lse = torch.logsumexp(x, dim=-1)
    x_t = x.gather(1, torch.where(valid, target, 0).long()[:, None])[:, 0]
    loss = lse - x_t
    if label_smoothing > 0:
        loss = (1 - label_smoothing) * loss + label_smoothing * (lse - x.mean(dim=-1))
    if z_loss > 0:
        loss = loss + z_loss * lse * lse
    zero = torch.zeros((), dtype=acc, device=logits.device)
    loss, lse = torch.where(valid, loss, zero), torch.where(valid, lse, zero)
    if reduction == "none":
        return loss.to(logits.dtype), lse, torch.ones((), dtype=acc, device=logits.device)
    total = loss.sum()
    if reduction == "sum":
        return total.to(logits.dtype), lse, torch.ones((), dtype=acc, device=logits.device)
    if num_valid is not None:
        denom = num_valid.to(acc)
    elif num_valid_int >= 0:
        denom = torch.full((), float(num_valid_int), dtype=acc, device=logits.device)
    else:
        denom = valid.sum().to(acc)
    denom = denom.clamp_min(1)
    return (total / denom).to(logits.dtype), lse, 1 / denom


def _ref_bwd(grad: Tensor, logits: Tensor, target: Tensor, lse: Tensor, scale: Tensor, ignore_index: int,
             label_smoothing: float, z_loss: float) -> Tensor:
    V = logits.shape[1]
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(acc)
    lse = lse.to(acc)[:, None]
    p = torch.exp(x - lse)
    if z_loss > 0:
        p = p * (1 + 2 * z_loss * lse)
    valid = target != ignore_index
    onehot = F.one_hot(torch.where(valid, target, 0).long(), V).to(acc)
    d = p - (1 - label_smoothing) * onehot - label_smoothing / V
    g = grad.to(acc) * scale.to(acc)
    d = d * (g[:, None] if g.dim() else g)
    d = torch.where(valid[:, None], d, torch.zeros((), dtype=acc, device=d.device))
    return d.to(logits.dtype)


@custom_op("pykernels::cross_entropy_fwd", mutates_args=())
def _fwd(logits: Tensor, target: Tensor, num_valid: Tensor | None, ignore_index: int, label_smoothing: float,
         z_loss: float, reduction: str, num_valid_int: int, inplace_backward: bool,
         backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, lse, scale): loss in the logits' dtype ((N,) for reduction "none", else 0-dim); lse (N,)
    fp32, saved; scale 0-dim fp32 = d(loss)/d(row loss), saved (1/denominator for the mean)."""
    # backend "" means the current default, resolved here at run time (use_backend works under compile).
    impl = select(_OP, backend or None, logits.device, _support(logits, target))
    if impl == "triton":
        from ._kernels import cross_entropy as kernels
        return kernels.cross_entropy_fwd(logits, target, ignore_index=ignore_index,
                                         label_smoothing=label_smoothing, z_loss=z_loss, reduction=reduction,
                                         num_valid=num_valid, num_valid_int=num_valid_int)
    return _ref_fwd(logits, target, num_valid, ignore_index, label_smoothing, z_loss, reduction, num_valid_int)


@_fwd.register_fake
def _(logits, target, num_valid, ignore_index, label_smoothing, z_loss, reduction, num_valid_int,
      inplace_backward, backend):
    N = logits.shape[0]
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    loss = logits.new_empty((N,) if reduction == "none" else ())
    return loss, logits.new_empty(N, dtype=acc), logits.new_empty((), dtype=acc)


@custom_op("pykernels::cross_entropy_bwd", mutates_args=())
def _bwd(grad: Tensor, logits: Tensor, target: Tensor, lse: Tensor, scale: Tensor, ignore_index: int,
         label_smoothing: float, z_loss: float, backend: str) -> Tensor:
    impl = select(_OP, backend or None, logits.device, _support(logits, target))
    if impl == "triton":
        from ._kernels import cross_entropy as kernels
        return kernels.cross_entropy_bwd(grad, logits, target, lse, scale, ignore_index=ignore_index,
                                         label_smoothing=label_smoothing, z_loss=z_loss)
    return _ref_bwd(grad, logits, target, lse, scale, ignore_index, label_smoothing, z_loss)


@_bwd.register_fake
def _(grad, logits, target, lse, scale, ignore_index, label_smoothing, z_loss, backend):
    return logits.new_empty(logits.shape)


@custom_op("pykernels::cross_entropy_bwd_inplace", mutates_args=("logits",))
def _bwd_inplace(grad: Tensor, logits: Tensor, target: Tensor, lse: Tensor, scale: Tensor, ignore_index: int,
                 label_smoothing: float, z_loss: float, backend: str) -> None:
    """Overwrites ``logits`` with dlogits (the memory-saving backward of ``inplace_backward=True``)."""
    impl = select(_OP, backend or None, logits.device, _support(logits, target))
    if impl == "triton":
        from ._kernels import cross_entropy as kernels
        kernels.cross_entropy_bwd(grad, logits, target, lse, scale, ignore_index=ignore_index,
                                  label_smoothing=label_smoothing, z_loss=z_loss, dlogits=logits)
        return
    logits.copy_(_ref_bwd(grad, logits, target, lse, scale, ignore_index, label_smoothing, z_loss))


@_bwd_inplace.register_fake
def _(grad, logits, target, lse, scale, ignore_index, label_smoothing, z_loss, backend):
    return None


def _setup_context(ctx, inputs, output):
    (logits, target, num_valid, ignore_index, label_smoothing, z_loss, reduction, num_valid_int,
     inplace_backward, backend) = inputs
    _, lse, scale = output
    ctx.save_for_backward(logits, target, lse, scale)
    ctx.mark_non_differentiable(lse, scale)
    ctx.ignore_index, ctx.label_smoothing, ctx.z_loss = ignore_index, label_smoothing, z_loss
    ctx.inplace_backward, ctx.backend = inplace_backward, backend


def _backward(ctx, grad_loss, grad_lse, grad_scale):
    logits, target, lse, scale = ctx.saved_tensors
    args = (ctx.ignore_index, ctx.label_smoothing, ctx.z_loss, ctx.backend)
    if ctx.inplace_backward:
        _bwd_inplace(grad_loss, logits, target, lse, scale, *args)
        dlogits = logits
    else:
        dlogits = _bwd(grad_loss, logits, target, lse, scale, *args)
    return dlogits, None, None, None, None, None, None, None, None, None


_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# Public function
# ---------------------------------------------------------------------------------------------

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def cross_entropy(logits: Tensor, target: Tensor, *, ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0, z_loss: float = 0.0, num_valid=None,
                  inplace_backward: bool = False, backend: str | None = None) -> Tensor:
    """Fused softmax cross-entropy, equal to ``torch.nn.functional.cross_entropy`` (plus z-loss).

    Args:
        logits: (N, V) or (..., V), float16/bfloat16/float32 (float64 runs the reference). Any row
            stride (e.g. a slice of a padded buffer) is used without a copy; a last-dim stride other
            than 1 costs a copy. The math is fp32 whatever the dtype.
        target: (N,) or (...) matching ``logits.shape[:-1]``, any integer dtype. Each value is in
            [0, V) or equals ``ignore_index``. Out-of-range values raise ValueError on the reference
            backend (which checks eagerly, syncing); the Triton kernel cannot check without a host
            sync, so it never reads out of bounds and makes that row's loss and gradient NaN.
        ignore_index: rows with this target contribute 0 to the loss and get a zero gradient (the
            kernel does not even read them).
        reduction: ``"mean"`` (sum over rows / number of valid rows, counted on the device; 0 when
            every target is ignored, never NaN), ``"sum"``, or ``"none"`` (per-row loss of shape
            ``target.shape``, 0 at ignored rows).
        label_smoothing: eps in [0, 1]: ``loss = (1 - eps) * nll + eps * mean_v(-log p_v)``, as torch.
        z_loss: adds ``z_loss * lse**2`` per valid row (PaLM's auxiliary loss keeping the softmax
            normaliser near 1; 1e-4 in PaLM). Included in the returned loss and its gradient; it is
            not returned separately (fixed arity: one output).
        num_valid: only with ``reduction="mean"``: divide the sum by this (an int or a 0-dim tensor,
            e.g. the number of valid targets over all micro-batches of a gradient-accumulation step)
            instead of this call's count; values below 1 count as 1. Under torch.compile prefer a
            tensor (an int that changes every step is a new constant to the compiler).
        inplace_backward: if True the backward writes dlogits into the logits' own buffer instead
            of allocating a new (N, V) tensor. The logits tensor's contents are then overwritten by
            its gradient during backward, so the caller must not use them afterwards (autograd
            raises if another op saved them for its backward). Default False: never in place.
        backend: ``"auto" | "triton" | "cuda" | "reference"`` or None (the current default). ``"cuda"`` is
            the CUDA C++ op (built with the extension; eager calls only), which ``"auto"`` takes for plain
            eager calls on a GPU where it is built, outside CUDA-graph capture; else the Triton kernels.

    Returns:
        The loss in the logits' dtype: a 0-dim tensor, or ``target.shape`` for ``reduction="none"``
        (accumulated in fp32 and cast once at the end).
    """
    _checks.check_tensor("logits", logits, min_dim=1, dtypes=_checks.FLOAT_DTYPES + (torch.float64,))
    if not isinstance(target, Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype not in _INT_DTYPES:
        raise TypeError(f"target must have an integer dtype (class indices), got {target.dtype}")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"target must have shape logits.shape[:-1] = {tuple(logits.shape[:-1])}, "
                         f"got {tuple(target.shape)} (logits shape {tuple(logits.shape)})")
    V = logits.shape[-1]
    if V < 1:
        raise ValueError(f"logits must have a non-empty last (vocabulary) dim, got shape {tuple(logits.shape)}")
    _checks.check_same([("logits", logits), ("target", target)])
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
        raise TypeError(f"label_smoothing must be a float in [0, 1], got {type(label_smoothing).__name__}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    z_loss = _checks.check_nonneg_float("z_loss", z_loss)
    if num_valid is not None:
        if reduction != "mean":
            raise ValueError(f"num_valid applies only to reduction='mean', got reduction={reduction!r}")
        if isinstance(num_valid, Tensor):
            if num_valid.dim() != 0:
                raise ValueError(f"num_valid must be an int or a 0-dim tensor, got shape {tuple(num_valid.shape)}")
            if num_valid.dtype == torch.bool or num_valid.is_complex():
                raise TypeError(f"num_valid must be a real number tensor, got dtype {num_valid.dtype}")
        elif isinstance(num_valid, bool) or not isinstance(num_valid, int):
            raise TypeError(f"num_valid must be an int or a 0-dim tensor, got {type(num_valid).__name__}")
        elif num_valid < 0:
            raise ValueError(f"num_valid must be >= 0, got {num_valid}")
    if not isinstance(inplace_backward, bool):
        raise TypeError(f"inplace_backward must be a bool, got {type(inplace_backward).__name__}")
    check_backend_name(backend)

    # (N, V): a view for (..., V) inputs whose rows are regular; 2-d inputs as they are (a reshape
    # costs host time on every call)
    x = logits if logits.dim() == 2 else logits.reshape(-1, V)
    if V > 1 and x.stride(1) != 1:
        x = x.contiguous()                # the kernel needs unit column stride; any row stride is fine
    t = target if target.dim() == 1 else target.reshape(-1)  # (N,)
    if t.dtype not in (torch.int32, torch.int64):
        t = t.long()
    t = t.contiguous()

    nv_tensor, nv_int = None, -1
    if isinstance(num_valid, Tensor):
        nv_tensor = num_valid.to(device=logits.device, dtype=torch.float64 if logits.dtype == torch.float64
                                 else torch.float32)
    elif num_valid is not None:
        nv_int = int(num_valid)
    if _use_cuda(backend, x, t, nv_tensor):
        loss = torch.ops.pykernels_cuda.cross_entropy(x, t, nv_tensor, ignore_index, float(label_smoothing),
                                                      float(z_loss), _REDUCTION_CODES[reduction], nv_int,
                                                      inplace_backward)
    else:
        loss, _, _ = _fwd(x, t, nv_tensor, ignore_index, float(label_smoothing), float(z_loss), reduction, nv_int,
                          inplace_backward, backend or "")
    return loss.reshape(target.shape) if reduction == "none" and target.dim() != 1 else loss
