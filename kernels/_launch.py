"""Low-overhead launches of Triton kernels: ``launch(kernel, grid, *args, **kw)`` or ``fast(kernel)[grid](...)``.

Why. ``kernel[grid](...)`` costs ~60-85 us of host time per launch on the GPU machine's slow host CPU
(Autotuner.run -> JITFunction.run: the binder specialises every argument in C++, the cache key is
built and stringified, used globals are re-checked, a LazyDict of launch metadata is built, and the
empty hook chains are called from C). Our kernels run in 10-30 us, so the ops were host-bound.

How. The first call for a given *launch key* goes through the normal path (which compiles and, for
an Autotuner, tunes). Its callable grid is wrapped so that Triton hands us the bound argument dict
(all signature parameters in order, including the config's constexprs and the defaults); with the
CompiledKernel that ``JITFunction.run`` returns (``Autotuner.run`` returns the same object) we keep
``(kernel.run, kernel.function, kernel.packed_metadata)`` and the constant tail of the argument
list. Later calls with the same key build the argument list in signature order (the caller's
positional args, then its keywords or the recorded constants), evaluate the grid (a callable grid
gets the same name -> value dict Triton would give it) and call the launcher directly with the
current device's current stream; no launch metadata and no hooks (we only get here when none are set).

The launch key must be at least as fine as everything Triton specialises on, so a cached kernel is
never reused where Triton would have compiled another (a finer key only costs one more slow call):
  * the current device index; every positional argument's type; the keyword names in call order;
  * constexpr parameters, an Autotuner's key parameters and compile options: their value;
  * other parameters: tensors -> (dtype, data_ptr() % 16 == 0); ints -> (% 16, == 1, i32 / i64 /
    u64 range) (Triton: constexpr 1, "D" divisibility, the type); bools, floats, None -> their type.
    ``do_not_specialize`` only makes Triton's key coarser, so ours stays safe. Anything else (numpy
    scalars, SymInts, tl dtypes at runtime positions...) -> the normal path.
The key is computed by functions generated once per tuple of positional argument types (and per
tuple of keyword names), with each argument's expression inlined: no Python call per argument.
Tensor dtypes are in the key, so an Autotuner's key (its key args plus every tensor's dtype) is a
function of ours: each of our entries maps to one tuned config.

The normal path is used whenever: ``TRITON_INTERPRET=1`` (the interpreter has no compiled kernels);
``PYKERNELS_FAST_LAUNCH=0`` (read at import and by ``set_enabled(None)``; ``set_enabled(False)``
turns it off at run time); a launch enter/exit hook is registered in ``triton.knobs.runtime``; the JITFunction has pre-run hooks; the Autotuner has
a user pre/post hook or any config has a ``pre_hook`` (restore_value / reset_to_zero only act while
tuning, which the first, normal, call of each key does); the kernel is neither a JITFunction nor
an Autotuner over one; the key cannot be computed; or the first call returned no compiled kernel.
If a fast launch raises, that key is sent to the normal path for good and the call is redone there.

An Autotuner's ``best_config`` is set on fast launches too (callers read it after a launch).

Not re-checked on fast calls (as Triton's own ``CompiledKernel[grid]`` does not): changes of
module globals a kernel reads (Triton raises for those; ours are constants) and of the
``triton.knobs`` debug / instrumentation switches after the first launch of a key.

Thread safety: the per-kernel caches are plain dicts written with single assignments under the GIL
(autograd's backward thread may race the forward; at worst both take the normal path once).

Cost (this repo's CPU dev box, attention's dQ kernel: 41 runtime args of which 15 tensors, 14
constexpr keywords, launcher stubbed): key 5 us, whole fast call 9 us (tuple grid) / 12 us (callable
grid, which gets a 55-entry dict); Triton's ``native_specialize_impl`` alone over the same args is
9 us there, before the rest of JITFunction.run and Autotuner.run.
"""
from __future__ import annotations

import os

import torch

from . import _tuning

_interpret = _tuning.interpret  # module attribute so tests can force the compiled-kernel path

__all__ = ["launch", "fast", "set_enabled", "enabled", "stats"]


def _env_enabled() -> bool:
    return os.environ.get("PYKERNELS_FAST_LAUNCH", "1") not in ("", "0")


_on = _env_enabled()  # the switch, read at import (a per-call os.environ read costs ~0.7 us)
_SLOW = object()  # cache value: this key always takes the normal path
_MAX_ENTRIES = 4096  # per kernel; the cache starts over when full


def set_enabled(flag: bool | None) -> None:
    """Turn the fast path on (True) or off (False); None re-reads ``PYKERNELS_FAST_LAUNCH``."""
    global _on
    _on = _env_enabled() if flag is None else bool(flag)


def enabled() -> bool:
    return _on


class _Unsupported(Exception):
    pass


# One int per int argument, as fine as Triton's int specialisation and with a bounded range (so
# varying values such as seeds do not grow the cache): bits 0-3 x % 16 (divisibility by 16), bit 4
# x == 1 (Triton makes 1 a constexpr), bit 5 outside i32, bit 6 >= 2**63 (u64). Inlined as source
# into the generated key functions.
_INT_EXPR = ("({a} & 15 | ({a} == 1) << 4 | ({a} > 2147483647 or {a} < -2147483648) << 5"
             " | ({a} > 9223372036854775807) << 6)")
_int_code = eval("lambda x: " + _INT_EXPR.format(a="x"))


def _spec(x):
    """What Triton's binder specialises a non-constexpr argument on (or finer); used for keyword args
    and, through the same expressions, by the generated positional key functions."""
    t = type(x)
    if t is int:
        return ("i", _int_code(x))
    if t is bool:
        return "b"
    if t is float:
        return "f"
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return (x.dtype, not x.data_ptr() & 15)
    raise _Unsupported(t)


def _value(x):
    return x


_knobs = None


def _hooks_active() -> bool:
    global _knobs
    if _knobs is None:
        from triton import knobs
        from triton.knobs import HookChain
        _knobs = (knobs.runtime, HookChain)
    rt, chain = _knobs
    for h in (rt.launch_enter_hook, rt.launch_exit_hook):
        if h is not None and not (type(h) is chain and not h.calls):
            return True
    return False


_driver_fns = None


def _driver():
    global _driver_fns
    if _driver_fns is None:
        from triton.runtime import driver
        _driver_fns = (driver.active.get_current_device, driver.active.get_current_stream)
    return _driver_fns


class FastKernel:
    """Wraps a JITFunction or an Autotuner; ``fk[grid](*args, **kw)`` == ``kernel[grid](*args, **kw)``."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.cache: dict = {}
        self.keyfns: dict = {}
        self.kwfns: dict = {}
        self.usable = False
        self.launches = [0, 0]  # [fast, normal], for tests and stats
        try:
            self._setup(kernel)
        except Exception:
            self.usable = False

    def _setup(self, kernel):
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import JITFunction
        tuner_keys = ()
        jit = kernel
        self.tuner = None
        if isinstance(kernel, Autotuner):
            self.tuner = kernel
            jit = kernel.fn
            if kernel.user_defined_pre_hook or kernel.user_defined_post_hook:
                return
            if any(getattr(c, "pre_hook", None) is not None for c in kernel.configs):
                return
            tuner_keys = tuple(kernel.keys)
        if not isinstance(jit, JITFunction) or _interpret():
            return
        self.jit = jit
        self.names = [p.name for p in jit.params]
        self.modes = [_value if (p.is_constexpr or p.name in tuner_keys) else _spec for p in jit.params]
        self.kw_modes = dict(zip(self.names, self.modes))
        self.usable = True

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.call(grid, args, kwargs)

    def _keyfn(self, types):
        """Generate ``k(a0, a1, ...) -> tuple`` for one tuple of positional argument types: inline
        expressions, no Python call per argument (the per-call key costs ~1/4 of Triton's binder)."""
        if len(types) > len(self.modes):
            raise _Unsupported("too many positional args")
        names = [f"a{i}" for i in range(len(types))]
        parts = []
        for a, t, mode in zip(names, types, self.modes):
            if mode is _value:
                parts.append(a)
            elif t is int:
                # Fast branch: every i32 value other than 1 has code x % 16 (see _INT_EXPR).
                parts.append(f"({a} & 15 if 1 < {a} <= 2147483647 else _int_code({a}))")
            elif t is bool or t is float or t is type(None):
                pass  # not specialised beyond the type, which is in the key
            elif isinstance(t, type) and issubclass(t, torch.Tensor):
                parts.append(f"{a}.dtype, not {a}.data_ptr() & 15")
            elif getattr(t, "__name__", "") == "TensorDescriptor" and hasattr(t, "__dataclass_fields__"):
                # a host tensor descriptor: Triton specialises it on dtype, block shape and layout (its
                # shape and strides are runtime values; the launcher encodes it on every call)
                parts.append(f"{a}.base.dtype, tuple({a}.block_shape), getattr({a}, 'layout', None), {a}.padding, "
                             f"len({a}.shape)")
            else:
                raise _Unsupported(t)
        src = f"def k({', '.join(names)}):\n    return ({', '.join(parts)}{',' if parts else ''})\n"
        ns: dict = {"_int_code": _int_code}
        exec(src, ns)
        return ns["k"]

    def _key(self, args, kwargs):
        types = tuple(map(type, args))
        fn = self.keyfns.get(types)
        if fn is None:
            fn = self.keyfns[types] = self._keyfn(types)
        if kwargs:
            names = tuple(kwargs)
            kf = self.kwfns.get(names)
            if kf is None:
                kf = self.kwfns[names] = self._kwfn(names)
            return (_driver()[0](), types, fn(*args), names, kf(*kwargs.values()))
        return (_driver()[0](), types, fn(*args))

    def _kwfn(self, names):
        """Generate the key of the keyword values for one tuple of keyword names: constexprs, tuner
        keys and compile options (num_warps...) by value, runtime parameters through ``_spec``."""
        parts = [f"v{i}" if self.kw_modes.get(n, _value) is _value else f"_spec(v{i})" for i, n in enumerate(names)]
        vs = ", ".join(f"v{i}" for i in range(len(names)))
        ns: dict = {"_spec": _spec}
        exec(f"def k({vs}):\n    return ({', '.join(parts)},)\n", ns)
        return ns["k"]

    def call(self, grid, args, kwargs):
        kernel = self.kernel
        if not (self.usable and _on) or self.jit.pre_run_hooks or _hooks_active():
            self.launches[1] += 1
            return kernel[grid](*args, **kwargs)
        try:
            key = self._key(args, kwargs)
            entry = self.cache.get(key)
        except Exception:
            key, entry = None, _SLOW
        if entry is not None and entry is not _SLOW:
            try:
                ret = entry(grid, args, kwargs, key[0])
                self.launches[0] += 1
                return ret
            except Exception:
                self.cache[key] = _SLOW
            entry = _SLOW
        self.launches[1] += 1
        if entry is _SLOW:
            return kernel[grid](*args, **kwargs)
        # First call for this key: the normal path, recording the bound arguments Triton computes.
        seen = []

        def recording_grid(meta):
            seen.append(meta)
            return grid(meta) if callable(grid) else grid

        ret = kernel[recording_grid](*args, **kwargs)
        if len(self.cache) >= _MAX_ENTRIES:  # bounded memory whatever the callers vary
            self.cache = {}
        try:
            self.cache[key] = self._make_entry(ret, seen[-1], len(args), kwargs) if seen else _SLOW
        except Exception:
            self.cache[key] = _SLOW
        return ret

    def _make_entry(self, compiled, meta, n_pos, kwargs):
        if compiled is None or hasattr(compiled, "result"):
            return _SLOW
        names = self.names
        if list(meta.keys()) != names:
            return _SLOW
        run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
        if function is None:
            return _SLOW
        # (name, from the caller's keywords, else the recorded constant); keyword values are not kept
        tail = tuple((n, n in kwargs, None if n in kwargs else meta[n]) for n in names[n_pos:])
        # A callable grid first gets the constexprs only (their values are in the key, so they are this entry's
        # for good): ~15 entries instead of every parameter's; one that reads another name (KeyError) gets the
        # whole dict Triton would give it. (Grid functions index ``meta``; none calls ``meta.get``.)
        constexprs = {p.name: meta[p.name] for p in self.jit.params if p.is_constexpr}
        # Common case: the keywords are exactly the remaining parameters, in signature order.
        kw_is_tail = list(kwargs) == names[n_pos:]
        get_stream = _driver()[1]
        tuner = self.tuner
        config = None
        if tuner is not None:
            # Callers may read ``best_config`` after a launch (layer_norm's backward sizes its partial
            # buffers from it): keep it what Autotuner.run would have set. The config must be the one
            # this launch used (another thread may have launched in between: then no entry).
            config = tuner.best_config
            if any(meta.get(k, _SLOW) != v for k, v in config.kwargs.items()):
                return _SLOW
            md = compiled.metadata
            if (getattr(md, "num_warps", config.num_warps), getattr(md, "num_stages", config.num_stages)) != (
                    config.num_warps, config.num_stages):
                return _SLOW

        def launch_fast(grid, args, kwargs, device):
            if kw_is_tail:
                vals = args + tuple(kwargs.values())
            else:
                vals = args + tuple([kwargs[n] if from_kw else c for n, from_kw, c in tail])
            if callable(grid):
                try:
                    grid = grid(constexprs.copy())
                except KeyError:
                    grid = grid(dict(zip(names, vals)))
            g1 = grid[1] if len(grid) > 1 else 1
            g2 = grid[2] if len(grid) > 2 else 1
            run(grid[0], g1, g2, get_stream(device), function, packed, None, None, None, *vals)
            if tuner is not None:
                tuner.best_config = config
            return compiled

        return launch_fast


_wrappers: dict = {}


def fast(kernel) -> FastKernel:
    """The FastKernel wrapping ``kernel`` (one per kernel object, created on first use)."""
    fk = _wrappers.get(id(kernel))
    if fk is None or fk.kernel is not kernel:
        fk = FastKernel(kernel)
        _wrappers[id(kernel)] = fk
    return fk


_TensorDescriptor = None


def host_descriptor(t: torch.Tensor, shape: list, strides: list, block_shape: list, layout):
    """A Gluon host TMA descriptor (``triton.experimental.gluon.nvidia.hopper.TensorDescriptor``) over ``t``
    with these fields, set directly: ``TensorDescriptor.__post_init__`` re-checks (16-byte base and strides, unit
    last stride, positive shape) what the callers' TMA rules established, at ~2 us a descriptor. A kernel that
    takes it as an argument gets it encoded by the launcher, not made on the device (which cost several us a
    CTA before its first load: the attention forward's run31)."""
    global _TensorDescriptor
    if _TensorDescriptor is None:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        _TensorDescriptor = TensorDescriptor
    desc = object.__new__(_TensorDescriptor)
    desc.base = t
    desc.shape, desc.strides, desc.block_shape, desc.layout = shape, strides, block_shape, layout
    desc.padding = "zero"
    return desc


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)`` with the cached fast path; returns what Triton returns."""
    return fast(kernel).call(grid, args, kwargs)


def stats(kernel) -> tuple[int, int]:
    """(fast launches, normal launches) made through ``fast(kernel)`` so far."""
    fk = _wrappers.get(id(kernel))
    return tuple(fk.launches) if fk is not None and fk.kernel is kernel else (0, 0)
