"""Input checks shared by the public ops: each raises TypeError/ValueError naming the argument and
quoting what was received (never ``assert``: ``python -O`` strips it)."""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_tensor(name: str, t, *, min_dim: int = 0, ndim: int | None = None,
                 dtypes=FLOAT_DTYPES) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {t.dtype}")
    return t


def check_same(names_tensors, *, what: str = "device") -> None:
    """All tensors (name, tensor) have the same device (or dtype)."""
    items = [(n, t) for n, t in names_tensors if t is not None]
    if not items:
        return
    n0, t0 = items[0]
    for n, t in items[1:]:
        a, b = getattr(t0, what), getattr(t, what)
        if a != b:
            raise ValueError(f"{n} is on {what} {b} but {n0} is on {what} {a}; they must match"
                             if what == "device" else
                             f"{n} has {what} {b} but {n0} has {what} {a}; they must match")


def check_prob(name: str, p) -> float:
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"{name} must be a float in [0, 1), got {type(p).__name__}")
    p = float(p)
    if not (0.0 <= p < 1.0):
        raise ValueError(f"{name} must be in [0, 1), got {p}")
    return p


def check_nonneg_float(name: str, x) -> float:
    """A finite non-negative float (e.g. a z-loss coefficient). Comparisons only, no ``math.isfinite``: under
    torch.compile a float argument may be symbolic (automatic dynamic after a recompile), and a comparison is what
    dynamo can guard on."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{name} must be a finite non-negative float, got {type(x).__name__}")
    x = float(x)
    if not (0.0 <= x < float("inf")):
        raise ValueError(f"{name} must be a finite non-negative float, got {x}")
    return x


def param_dtype(weight, bias, rows: torch.Tensor) -> torch.dtype:
    """The dtype a LayerNorm's dweight / dbias come back in: weight's, else bias's, else the rows' (the C++ op's
    ``param_dtype``, csrc/layer_norm.cu); shared by the Triton backward, its fake and the C++ pair's fake."""
    return weight.dtype if weight is not None else (bias.dtype if bias is not None else rows.dtype)
