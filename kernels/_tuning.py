"""Autotune switches and the small host helpers shared by every kernel.

``PYKERNELS_AUTOTUNE=0`` makes every autotuned kernel use the first config of its (pruned) list
instead of benchmarking them all: the GPU test suite sets it, since each test's new combination of
compile-time flags would otherwise compile and time every config of every kernel. The benchmarks
leave it on; each validates its output before timing, so the configs the tests skip are still
checked where they are used. Under ``TRITON_INTERPRET=1`` kernels use one small config anyway.
"""
from __future__ import annotations

import contextlib
import functools
import os


def cdiv(a: int, b: int) -> int:
    """Ceiling division of host ints. (``triton.cdiv`` and ``triton.next_power_of_2`` are
    ConstexprFunction objects: ~5 us a call on the GPU machines' hosts, several per op call.)"""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), for host ints."""
    return 1 << max(0, n - 1).bit_length()


_SAME_DEVICE = contextlib.nullcontext()


def on_device(dev):
    """``torch.cuda.device(dev)`` only when ``dev`` is a CUDA device other than the current one (Triton
    launches on the current device); the common case costs one cheap query instead of a context switch."""
    import torch
    if dev.type != "cuda" or dev.index is None or dev.index == torch.cuda.current_device():
        return _SAME_DEVICE
    return torch.cuda.device(dev)


def interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def autotune_enabled() -> bool:
    return os.environ.get("PYKERNELS_AUTOTUNE", "1") not in ("", "0")


def configs(lst: list) -> list:
    """The config list to give ``triton.autotune``: all of it, or its first entry (the default)."""
    return list(lst) if autotune_enabled() else list(lst[:1])


def pruner(prune):
    """Wrap an ``early_config_prune`` so that with autotuning off only the first surviving config runs."""
    def wrapped(configs, named_args, **kwargs):
        kept = prune(configs, named_args, **kwargs) if prune is not None else configs
        return list(kept) if autotune_enabled() else list(kept[:1])
    return wrapped


def capturing(device=None) -> bool:
    """Whether the current CUDA stream is capturing a CUDA graph: the one check shared by the autotuners
    (no timing while capturing), the ops' host-side work that syncs, and the ``auto`` routing of the C++ ops.
    With ``device`` (a ``torch.device`` or a string) only a CUDA device can be capturing and CUDA is not asked
    otherwise; without it, False where CUDA is unavailable."""
    import torch
    if device is None:
        if not torch.cuda.is_available():
            return False
    elif (device if isinstance(device, torch.device) else torch.device(device)).type != "cuda":
        return False
    return torch.cuda.is_current_stream_capturing()


@functools.lru_cache(maxsize=None)
def graph_if_support() -> tuple[tuple | None, str | None]:
    """((graph_if_begin, graph_if_end), None): the CUDA extension's IF-node functions (csrc/graph_if.cu); or
    (None, why not) where it is not built."""
    try:
        import importlib
        ext = importlib.import_module("pykernels._C")
        return (ext.graph_if_begin, ext.graph_if_end), None
    except (ImportError, AttributeError) as err:
        return None, f"the CUDA extension pykernels._C has no graph_if ({type(err).__name__}: {err})"


@contextlib.contextmanager
def graph_if(count, start: int, length: int, out):
    """Work issued inside runs at CUDA-graph replay only where it has rows, when that can be captured.

    ``out[0]`` (an int32 tensor) becomes ``clamp(count[0] - start, 0, length)``: how many of the rows ``start`` to
    ``start + length`` a device ``count`` reaches. While a CUDA graph is capturing the current stream (``torch.cuda
    .graph``, ``torch.compile``'s CUDA graphs) and the CUDA extension is built, the block's work is captured into a
    conditional (IF) node of that graph (csrc/graph_if.cu): each replay computes ``out`` in a one-thread kernel and
    runs the block only where it is above 0 (skipped, the block costs that kernel and the node, not its launches).
    Yields True then. Elsewhere (eager calls, CPU tensors, no extension) ``out`` is computed by torch ops, the block
    runs as issued every time and it yields False: so the block must give the same result either way where ``out``
    is 0 (its kernels exit with nothing to do), as the masked-LM loss's overflow blocks do. Nothing may be allocated
    inside a captured block (the caching allocator serves the graph's pool only to the graph's own stream): make
    its buffers before it. Blocks nest."""
    fns = graph_if_support()[0] if count.is_cuda and capturing(count.device) else None
    if fns is not None and fns[0](count, int(start), int(length), out):
        try:
            yield True
        finally:
            fns[1]()
        return
    import torch
    torch.clamp(count[:1] - int(start), min=0, max=int(length), out=out[:1])
    yield False


def _untimed_bench(*args, config, **kwargs):
    return [0.0, 0.0, 0.0]  # equal timings: min() keeps the first pruned config


def _capture_safe(tuner):
    """Make an Autotuner usable during CUDA-graph capture. Benchmarking there is impossible (it
    synchronises), so a key first seen while capturing takes its first surviving config without timing
    it and keeps it (the same default ``PYKERNELS_AUTOTUNE=0`` gives). This happens when a warm-up took
    another path than the captured call, e.g. ``masked_lm_loss``'s sized backward before a capture, whose
    backward is the bounded one (its overflow pass on the graph-safe kernels) or the graph-safe one."""
    base = type(tuner)

    class CaptureSafeAutotuner(base):
        def run(self, *args, **kwargs):
            if capturing():
                own = self.__dict__.get("_bench")  # normally absent: the class's method
                self._bench = _untimed_bench
                try:
                    return base.run(self, *args, **kwargs)
                finally:
                    if own is None:
                        del self._bench
                    else:
                        self._bench = own
            return base.run(self, *args, **kwargs)

    tuner.__class__ = CaptureSafeAutotuner
    return tuner


def autotune(configs, key, prune_configs_by=None, **kwargs):
    """``triton.autotune`` that honours ``PYKERNELS_AUTOTUNE=0`` (first surviving config only) and does
    not time configs during CUDA-graph capture (:func:`_capture_safe`)."""
    import triton
    if not autotune_enabled():
        prune_configs_by = dict(prune_configs_by or {})
        if prune_configs_by.get("early_config_prune") is not None:
            prune_configs_by["early_config_prune"] = pruner(prune_configs_by["early_config_prune"])
        else:
            configs = list(configs[:1])
    deco = triton.autotune(configs=configs, key=key, prune_configs_by=prune_configs_by or None, **kwargs)
    return lambda fn: _capture_safe(deco(fn))


@functools.lru_cache(maxsize=None)
def _properties(index: int):
    import torch
    return torch.cuda.get_device_properties(index)


def device_properties(device):
    """``torch.cuda.get_device_properties`` of a CUDA device, cached (the query costs microseconds, and
    launchers ask on every call): ``.multi_processor_count``, ``.major``..."""
    import torch
    return _properties(device.index if device.index is not None else torch.cuda.current_device())


def _scratch_alloc(size: int, alignment: int, stream):
    import torch
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator() -> None:
    """Device-side tensor descriptors need a global scratch allocator (``triton.set_allocator``). It
    lives in a ContextVar, so each thread (autograd runs the backward on its own) needs its own; a
    user's allocator is left in place."""
    import triton
    from triton.runtime import _allocation
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch_alloc)
