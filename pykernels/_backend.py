"""Backend choice shared by every op.

Every public op takes ``backend="auto" | "triton" | "cuda" | "reference"`` (``None`` means the
current default, set by :func:`use_backend` or the ``PYKERNELS_BACKEND`` environment variable, else
``"auto"``).

* ``reference`` is eager PyTorch: the truth in tests, and what ``auto`` uses on CPU tensors.
* ``auto`` takes the first backend in the op's preference order that is available on the tensors'
  device and covers the call; if an available kernel backend declines the call it falls back to the
  reference and warns once per (op, reason) with a :class:`FallbackWarning` naming why.
* An explicitly requested backend that cannot serve the call raises :class:`BackendUnavailableError`.

The choice is made inside the ops' eager implementations (at run time, also under torch.compile for the Triton
custom ops), so a :func:`use_backend` block around a compiled function takes effect. Whether a compiled graph holds an
op's C++ pair (attention, layer_norm: ``use_cuda_op``) is decided when dynamo traces, from a process-wide mirror of
the innermost :func:`use_backend` block that dynamo guards on: a compiled function called inside another block is
traced again for it (threads share the mirror, unlike the ContextVar eager calls read).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch

from ._kernels._tuning import capturing

BACKENDS = ("auto", "triton", "cuda", "reference")
KERNEL_BACKENDS = ("cuda", "triton")

_default: contextvars.ContextVar[str | None] = contextvars.ContextVar("pykernels_backend", default=None)
# What use_backend set last, process-wide: torch.compile cannot read a ContextVar, so the routing it traces (the
# choice of an op's C++ pair, ``use_cuda_op``) reads this global instead; dynamo guards on it, so a compiled function
# called inside another use_backend block is traced again for that block.
_traced_default: str | None = None
_warned: set[tuple[str, ...]] = set()
_warned_lock = threading.Lock()


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot serve this call (not installed, wrong device, or a case it
    does not cover)."""


class FallbackWarning(UserWarning):
    """``backend="auto"`` fell back to the eager reference for a case no kernel covers."""


class PerformanceWarning(UserWarning):
    """A call was served exactly, but by a slower path than this machine could take; the message says why and how
    to get the faster one."""


@dataclass(frozen=True)
class BackendInfo:
    available: bool
    reason: str | None  # why it is not available (None when available)


def check_backend_name(name: str | None, argname: str = "backend") -> str | None:
    if name is None:
        return None
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"{argname} must be one of {BACKENDS} or None, got {name!r}")
    return name


def default_backend() -> str:
    """The backend used when an op is called with ``backend=None``."""
    name = _default.get()
    if name is not None:
        return name
    env = os.environ.get("PYKERNELS_BACKEND")
    if env:
        return check_backend_name(env, "PYKERNELS_BACKEND")
    return "auto"


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Context manager: ops called with ``backend=None`` (the default) use ``name`` inside the block (compiled
    functions too: a graph traced under another backend is traced again; see the module docstring).

    >>> with pykernels.use_backend("reference"):
    ...     y = pykernels.layer_norm(x, w)
    """
    if name is None:
        raise ValueError("use_backend needs a backend name, got None")
    check_backend_name(name, "name")
    global _traced_default
    token, traced = _default.set(name), _traced_default
    _traced_default = name
    try:
        yield
    finally:
        _default.reset(token)
        _traced_default = traced


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _import_error(module: str) -> str | None:
    """Why ``module`` does not import, or None. Cached: a failed import searches the whole path, and
    this runs on every op call."""
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any import failure makes the backend unavailable
        return f"{type(e).__name__}: {e}"
    return None


def _triton_reason(device: torch.device | None) -> str | None:
    err = _import_error("triton")
    if err is not None:
        return f"triton is not importable ({err})"
    if device is None:
        if torch.cuda.is_available() or _interpret():
            return None
        return "no CUDA device (set TRITON_INTERPRET=1 to run the Triton kernels on CPU tensors, slowly)"
    if device.type == "cuda":
        if torch.version.hip is not None:
            return "ROCm devices are not tested"
        return None
    if device.type == "cpu" and _interpret():
        return None
    return (f"tensors are on {device.type}; Triton runs on CUDA tensors "
            "(or CPU tensors under TRITON_INTERPRET=1)")


def _cuda_reason(device: torch.device | None) -> str | None:
    err = _import_error("pykernels._C")
    if err is not None:
        return f"the CUDA extension pykernels._C is not built ({err})"
    if device is not None and device.type != "cuda":
        return f"tensors are on {device.type}; the CUDA extension needs CUDA tensors"
    if device is None and not torch.cuda.is_available():
        return "no CUDA device"
    return None


def _availability(name: str, device: torch.device | None) -> str | None:
    if name == "reference":
        return None
    if name == "triton":
        return _triton_reason(device)
    if name == "cuda":
        return _cuda_reason(device)
    raise ValueError(name)


def backends() -> dict[str, BackendInfo]:
    """Which backends are available on this machine, and for each missing one, why."""
    out = {}
    for name in ("triton", "cuda", "reference"):
        reason = _availability(name, None)
        out[name] = BackendInfo(reason is None, reason)
    return out


def _first_time(key: tuple[str, ...]) -> bool:
    with _warned_lock:
        if key in _warned:
            return False
        _warned.add(key)
        return True


def warn_once(op: str, reason: str) -> None:
    if _first_time(("fallback", op, reason)):
        warnings.warn(f"pykernels.{op}: falling back to the eager reference: {reason}", FallbackWarning,
                      stacklevel=4)


def warn_slow_once(op: str, reason: str) -> None:
    """A one-time :class:`PerformanceWarning` for ``op``: ``reason`` says which slower path serves the call, why and
    how to get the faster one."""
    if _first_time(("slow", op, reason)):
        warnings.warn(f"pykernels.{op}: {reason}", PerformanceWarning, stacklevel=4)


def select(op: str, backend: str | None, device: torch.device, support: Mapping[str, str | None]) -> str:
    """Resolve ``backend`` to the concrete backend that runs this call.

    ``support`` maps each kernel backend the op has (in order of preference, fastest first) to
    ``None`` if it covers this call, else a short reason. Backends the op does not implement are
    simply absent from ``support``.
    """
    requested = check_backend_name(backend) or default_backend()
    if requested == "reference":
        return "reference"
    if requested != "auto":
        if requested not in support:
            raise BackendUnavailableError(f"pykernels.{op}: no {requested!r} implementation of this op yet")
        reason = _availability(requested, device) or support[requested]
        if reason is not None:
            raise BackendUnavailableError(f"pykernels.{op}: backend {requested!r} cannot serve this call: {reason}")
        return requested
    # auto: CPU tensors run the reference (the interpreter is for tests, never a default).
    if device.type != "cuda":
        return "reference"
    declined = []
    for name, reason in support.items():
        if _availability(name, device) is not None:
            continue
        if reason is None:
            return name
        declined.append(f"{name}: {reason}")
    if declined:
        warn_once(op, "; ".join(declined))
    else:
        warn_once(op, "no kernel backend is available (" + "; ".join(
            f"{n}: {_availability(n, device)}" for n in support) + ")")
    return "reference"


# The C++ ops (csrc/) serve eager calls, and torch.compile's for the ops with a compiled pair (attention, layer_norm);
# what reaches a custom op with backend="cuda" is traced otherwise (make_fx, dispatch modes, or torch.compile of an
# op without the pair): the ops' ``_support`` give this reason for "cuda" there.
CUDA_TRACED = ("the cuda backend runs in eager mode only (and under torch.compile for attention and layer_norm); "
               "under torch.compile and dispatch modes the op is the Triton custom op (backend 'triton' or 'auto')")


@torch.compiler.assume_constant_result
def cuda_ops_ready() -> bool:
    """Whether the CUDA extension is built and importable here (its ops' fake impls then registered: what
    torch.compile needs to trace them). A constant of the process, so torch.compile takes it as one."""
    if _import_error("pykernels._C") is not None:
        return False
    from . import _cuda_ops
    _cuda_ops.register_fakes()
    return True


def _traced_backend(backend: str | None) -> str:
    """``backend or default_backend()`` in code torch.compile traces (no ContextVar: ``_traced_default``)."""
    if backend:
        return backend
    if _traced_default is not None:
        return _traced_default
    return check_backend_name(os.environ.get("PYKERNELS_BACKEND") or None, "PYKERNELS_BACKEND") or "auto"


def use_cuda_op(op: str, backend: str | None, device: torch.device, cover, *, auto: bool = True,
                traced: bool = False, capture: bool = False) -> bool:
    """Whether a call runs the op's CUDA C++ implementation (``torch.ops.pykernels_cuda.<op>``) instead of its
    custom op. Named (``backend="cuda"`` or the default set to it): yes, or ``BackendUnavailableError`` with
    the reason it cannot serve the call. ``auto`` (where the op's C++ path is as fast as Triton's: ``auto=True``):
    on a CUDA device where the extension is built and ``cover()`` is None, outside CUDA-graph capture (there the
    host time it saves is gone) unless ``capture`` (an op whose C++ kernels are graph-safe and faster on the GPU
    too: the same path captured as in the eager warm-up before it).
    Under torch.compile: the same rule for an op whose C++ kernels have a compiled pair (``traced=True``: a forward
    and a backward op the graph calls directly, with fake impls), decided when the graph is traced (capture is then
    unknown); the Triton custom op for the others. ``cover``: a callable giving None when the C++ op covers the
    call, else why not (called only when needed)."""
    if torch.compiler.is_compiling():
        if not traced:
            return False
        requested = _traced_backend(backend)
        if requested == "cuda":
            if device.type != "cuda" or not cuda_ops_ready():
                raise BackendUnavailableError(f"pykernels.{op}: backend 'cuda' cannot serve this call: "
                                              f"{_cuda_reason(device)}")
            reason = cover()
            if reason is not None:
                raise BackendUnavailableError(f"pykernels.{op}: backend 'cuda' cannot serve this call: {reason}")
            return True
        return auto and requested == "auto" and device.type == "cuda" and cuda_ops_ready() and cover() is None
    requested = backend or default_backend()
    if requested == "cuda":
        select(op, "cuda", device, {"cuda": cover()})
        return True
    if not auto or requested != "auto" or device.type != "cuda" or _availability("cuda", device) is not None:
        return False
    if not capture and capturing(device):
        return False
    return cover() is None
