"""The low-overhead launcher (kernels/_launch.py).

CPU: the interpreter takes the normal path with identical results; the launch key is at least as
fine as Triton's own specialisation (checked against Triton's binder, ``native_specialize_impl``
with a CUDA backend object, which needs no GPU); the cached path's argument order, grid evaluation,
key separation and fallbacks, on a real JITFunction whose launches are stubbed.
GPU: for each op, fast launches are bitwise equal to normal ones (also for a misaligned view after
an aligned one), and host microseconds per call are printed.
"""
import time

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

import pykernels
from pykernels._kernels import _launch

HAS_CUDA = torch.cuda.is_available()


def _copy_scaled(X, Y, n, scale, FLAG: tl.constexpr, BLOCK: tl.constexpr = 32):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + o, mask=o < n, other=0.0)
    if FLAG:
        x = x * scale
    tl.store(Y + o, x, mask=o < n)


_copy_kernel = triton.jit(_copy_scaled)


# ---------------------------------------------------------------------------------------------------
# CPU


def test_interpreter_uses_normal_path(device):
    if HAS_CUDA:
        pytest.skip("interpreter behaviour only")
    x = torch.randn(77, device=device)
    y_slow = torch.full_like(x, float("nan"))
    y_fast = torch.full_like(x, float("nan"))
    grid = lambda m: (triton.cdiv(77, m["BLOCK"]),)  # noqa: E731
    _copy_kernel[grid](x, y_slow, 77, 2.0, FLAG=True)
    before = _launch.stats(_copy_kernel)
    for _ in range(2):
        _launch.launch(_copy_kernel, grid, x, y_fast, 77, 2.0, FLAG=True)
    after = _launch.stats(_copy_kernel)
    assert torch.equal(y_fast, y_slow) and torch.equal(y_fast, 2 * x)
    assert after[0] == before[0] and after[1] == before[1] + 2


def test_interpreter_ops_unchanged(device):
    """An op through the launcher equals itself with the launcher switched off (interpreter: both normal)."""
    x = torch.randn(5, 48, device=device)
    w = torch.randn(48, device=device)
    tgt = torch.randint(0, 48, (5,), device=device)
    outs = []
    for flag in (True, False):
        _launch.set_enabled(flag)
        try:
            outs.append((pykernels.layer_norm(x, w), pykernels.cross_entropy(x, tgt)))
        finally:
            _launch.set_enabled(None)
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def _cuda_backend():
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    return CUDABackend(GPUTarget("cuda", 90, 32))


def test_spec_at_least_as_fine_as_triton():
    """Whenever two values get the same launcher spec, Triton's binder specialises them identically."""
    from triton._C.libtriton import native_specialize_impl
    backend = _cuda_backend()
    ints = [0, 1, 2, 3, 15, 16, 17, 32, 48, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -2**31,
            -2**31 - 1, 2**40, 2**63 - 1, 2**63, 2**63 + 16, 2**64 - 1, True, False]
    base = torch.zeros(64, dtype=torch.float32)
    tensors = [base[i:] for i in range(8)] + [base.half()[i:] for i in range(9)] + [torch.zeros(3, dtype=torch.int64)]
    values = ints + tensors + [1.0, 0.5, None]
    for dns in (False, True):
        seen = {}
        for v in values:
            ours = (type(v).__name__, _launch._spec(v))
            theirs = native_specialize_impl(backend, v, False, not dns, not dns)
            if ours in seen:
                assert seen[ours] == theirs, f"{v!r}: {ours} shared by Triton's {seen[ours]} and {theirs}"
            seen[ours] = theirs


def test_generated_key_matches_spec(monkeypatch):
    """The generated positional key (with its fast branch for i32 ints) classes ints as _int_code does."""
    monkeypatch.setattr(_launch, "_driver_fns", (lambda: 0, lambda dev: 0))
    monkeypatch.setattr(_launch, "_interpret", lambda: False)
    fk = _launch.FastKernel(JITFunction(_copy_scaled))
    x = torch.zeros(8)
    vals = [0, 1, 2, 15, 16, 17, -1, -16, -17, 2**31 - 1, 2**31, -2**31, -2**31 - 1, 2**40 + 3, 2**63, 2**64 - 1]
    for v in vals:
        for w in vals:
            same_key = fk._key((x, x, v), {}) == fk._key((x, x, w), {})
            assert same_key == (_launch._int_code(v) == _launch._int_code(w)), (v, w)


def test_spec_distinguishes_alignment_and_ints():
    s = _launch._spec
    x = torch.zeros(64, dtype=torch.float32)
    assert s(x) == s(x[4:])              # 16-byte offset: still aligned
    assert s(x) != s(x[1:])              # 4-byte offset: misaligned
    assert s(x) != s(x.half())           # dtype
    assert s(1) != s(2) and s(1) != s(17)  # Triton turns 1 into a constexpr
    assert s(16) != s(17) and s(0) == s(32)  # divisibility by 16
    assert s(17) == s(33) and s(3) == s(2**31 - 13)  # same key for same residue and range: no needless compiles
    assert s(2**31 - 16) != s(2**31)     # i32 vs i64
    assert s(2**40 + 16) != s(2**63)     # i64 vs u64
    assert s(2**40) == s(2**50 + 2**33) and s(2**31 + 5) == s(-2**40 + 5)  # bounded: one code per class
    with pytest.raises(_launch._Unsupported):
        s(np.int64(3))


class _FakeCompiled:
    def __init__(self, log, fail=False):
        self.log, self.fail = log, fail
        self.function, self.packed_metadata = "fn", "meta"
        self.metadata = type("Meta", (), {"num_warps": 4, "num_stages": 3})()

    @property
    def run(self):
        def run(g0, g1, g2, stream, function, packed, launch_md, enter, exit_, *args):
            if self.fail:
                raise RuntimeError("launch failed")
            self.log.append(("fast", (g0, g1, g2), stream, args))
        return run


class _FakeKernel:
    """Stands in for a compiled JITFunction: binds like Triton, hands the bound dict to the grid."""

    def __init__(self, jit, log, fail=False, tuner=None, config=None):
        self.jit, self.log, self.compiled = jit, log, _FakeCompiled(log, fail)
        self.tuner, self.config = tuner, config

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            if self.tuner is not None:   # what Autotuner.run does: pick the config, set best_config
                self.tuner.best_config = self.config
                kwargs = {**kwargs, **self.config.kwargs}
            bound = self.jit.signature.bind(*args, **kwargs)
            bound.apply_defaults()
            meta = dict(bound.arguments)
            g = grid(meta) if callable(grid) else grid
            self.log.append(("slow", tuple(g) + (1,) * (3 - len(g)), None, tuple(meta.values())))
            return self.compiled
        return call


@pytest.fixture
def stubbed(monkeypatch):
    """A FastKernel over a real JITFunction whose normal path is _FakeKernel, as on a GPU."""
    monkeypatch.setattr(_launch, "_interpret", lambda: False)
    monkeypatch.setattr(_launch, "_driver_fns", (lambda: 0, lambda dev: 1234 + dev))
    monkeypatch.setattr(_launch, "_on", True)
    jit = JITFunction(_copy_scaled)
    fk = _launch.FastKernel(jit)
    assert fk.usable
    log = []
    fk.kernel = _FakeKernel(jit, log)
    return fk, log


def test_fast_path_args_and_grid(stubbed):
    fk, log = stubbed
    x, y = torch.zeros(64), torch.zeros(64)
    grid = lambda m: (triton.cdiv(50, m["BLOCK"]), 3)  # noqa: E731
    r1 = fk[grid](x, y, 50, 2.0, FLAG=True)
    r2 = fk[grid](x, y, 50, 2.0, FLAG=True)
    assert r1 is r2 is fk.kernel.compiled
    assert [e[0] for e in log] == ["slow", "fast"]
    assert log[1][1] == log[0][1] == (2, 3, 1)
    assert log[1][2] == 1234
    assert log[1][3] == log[0][3] == (x, y, 50, 2.0, True, 32)   # signature order, default constexpr
    # new runtime values with the same specialisation reuse the entry; the grid is re-evaluated
    y2 = torch.zeros(64)
    fk[(7,)](x, y2, 66, 3.0, FLAG=True)
    assert log[-1] == ("fast", (7, 1, 1), 1234, (x, y2, 66, 3.0, True, 32))
    assert fk.launches == [2, 1]


def test_fast_path_callable_grid_meta(stubbed):
    """A fast launch's callable grid gets the constexprs (the entry's, by value) and, if it reads another
    name, the whole bound dict as Triton gives it: the same grid either way."""
    fk, log = stubbed
    x, y = torch.zeros(64), torch.zeros(64)
    seen = []

    def by_block(m):
        seen.append(dict(m))
        return (triton.cdiv(50, m["BLOCK"]),)

    def by_n(m):  # reads a runtime argument
        return (m["n"] + m["BLOCK"],)
    for _ in range(2):
        fk[by_block](x, y, 50, 2.0, FLAG=True)
        fk[by_n](x, y, 50, 2.0, FLAG=True)
    assert [e[0] for e in log] == ["slow", "fast", "fast", "fast"]  # (one key: the grid is not in it)
    assert [e[1] for e in log] == [(2, 1, 1), (82, 1, 1)] * 2
    assert seen[-1] == {"FLAG": True, "BLOCK": 32}  # the fast launch's meta: constexprs only


@pytest.mark.parametrize("change", ["misaligned", "int_one", "div16", "constexpr", "dtype", "kwarg", "kwarg_order",
                                    "device"])
def test_fast_path_new_key_takes_normal_path(stubbed, monkeypatch, change):
    fk, log = stubbed
    x, y = torch.zeros(64), torch.zeros(64)
    fk[(1,)](x, y, 50, 2.0, FLAG=True)
    fk[(1,)](x, y, 50, 2.0, FLAG=True)
    args, kw = [x, y, 50, 2.0], {"FLAG": True}
    if change == "misaligned":
        args[0] = x[1:]
    elif change == "int_one":
        args[2] = 1
    elif change == "div16":
        args[2] = 48
    elif change == "constexpr":
        kw["FLAG"] = False
    elif change == "dtype":
        args[1] = y.double()
    elif change == "kwarg":
        kw["BLOCK"] = 64
    elif change == "kwarg_order":
        kw = {"BLOCK": 64, "FLAG": True}
    else:
        monkeypatch.setattr(_launch, "_driver_fns", (lambda: 1, lambda dev: 1234 + dev))
    fk[(1,)](*args, **kw)
    assert log[-1][0] == "slow"
    assert log[-1][3][:4] == tuple(args)
    fk[(1,)](*args, **kw)
    assert log[-1][0] == "fast" and log[-1][3] == log[-2][3]  # the binder's values, in signature order


def test_runtime_args_by_keyword(stubbed):
    fk, log = stubbed
    x, y = torch.zeros(64), torch.zeros(64)
    for yy, n in ((y, 50), (y, 50), (y[1:], 50), (y[1:], 50), (y, 1), (y, 1), (y[4:], 50)):
        fk[(1,)](x, Y=yy, n=n, scale=2.0, FLAG=True)
        assert log[-1][3] == (x, yy, n, 2.0, True, 32)
    assert [e[0] for e in log] == ["slow", "fast", "slow", "fast", "slow", "fast", "fast"]


def test_fast_path_disabled_and_hooks(stubbed, monkeypatch):
    fk, log = stubbed
    x, y = torch.zeros(64), torch.zeros(64)
    fk[(1,)](x, y, 50, 2.0, FLAG=True)
    monkeypatch.setenv("PYKERNELS_FAST_LAUNCH", "0")
    _launch.set_enabled(None)
    try:
        fk[(1,)](x, y, 50, 2.0, FLAG=True)
        assert log[-1][0] == "slow"
        _launch.set_enabled(True)
        fk[(1,)](x, y, 50, 2.0, FLAG=True)
        assert log[-1][0] == "fast"
        _launch.set_enabled(False)
        fk[(1,)](x, y, 50, 2.0, FLAG=True)
        assert log[-1][0] == "slow"
    finally:
        monkeypatch.setenv("PYKERNELS_FAST_LAUNCH", "1")
        _launch.set_enabled(None)
    from triton import knobs
    hook = lambda md: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        fk[(1,)](x, y, 50, 2.0, FLAG=True)
        assert log[-1][0] == "slow"
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    fk[(1,)](x, y, 50, 2.0, FLAG=True)
    assert log[-1][0] == "fast"


def test_fast_launch_error_falls_back_for_good(stubbed):
    fk, log = stubbed
    fk.kernel.compiled.fail = True
    x, y = torch.zeros(64), torch.zeros(64)
    fk[(1,)](x, y, 50, 2.0, FLAG=True)
    fk[(1,)](x, y, 50, 2.0, FLAG=True)   # fast launch raises -> redone on the normal path
    fk[(1,)](x, y, 50, 2.0, FLAG=True)   # and the key stays there
    assert [e[0] for e in log] == ["slow", "slow", "slow"]
    assert fk.launches == [0, 3]


def test_unsupported_argument_takes_normal_path(stubbed):
    fk, log = stubbed
    x, y = torch.zeros(64), torch.zeros(64)
    for _ in range(2):
        fk[(1,)](x, y, np.int32(50), 2.0, FLAG=True)
    assert [e[0] for e in log] == ["slow", "slow"]


def test_autotuner_setup(monkeypatch):
    """Autotuner key args are keyed by value; config pre_hooks disable the fast path (as does the
    interpreter)."""
    jit = JITFunction(_copy_scaled)
    monkeypatch.setattr(_launch, "_interpret", lambda: True)
    assert not _launch.FastKernel(jit).usable
    monkeypatch.setattr(_launch, "_interpret", lambda: False)
    tuned = triton.autotune([triton.Config({"BLOCK": 32}), triton.Config({"BLOCK": 64})], key=["n"])(jit)
    fk = _launch.FastKernel(tuned)
    assert fk.usable and fk.jit is jit
    assert fk.modes[2] is _launch._value and fk.modes[0] is _launch._spec
    hooked = triton.autotune([triton.Config({"BLOCK": 32}, pre_hook=lambda a: None)], key=["n"])(jit)
    assert not _launch.FastKernel(hooked).usable
    assert not _launch.FastKernel(lambda: None).usable


def test_autotuner_best_config_kept(monkeypatch):
    """Fast launches leave ``best_config`` as Autotuner.run would (layer_norm's backward reads it)."""
    monkeypatch.setattr(_launch, "_interpret", lambda: False)
    monkeypatch.setattr(_launch, "_driver_fns", (lambda: 0, lambda dev: 0))
    monkeypatch.setattr(_launch, "_on", True)
    jit = JITFunction(_copy_scaled)
    cfg_a, cfg_b = triton.Config({"BLOCK": 32}), triton.Config({"BLOCK": 64})
    tuned = triton.autotune([cfg_a, cfg_b], key=["n"])(jit)
    fk = _launch.FastKernel(tuned)
    log = []
    fk.kernel = _FakeKernel(jit, log, tuner=tuned, config=cfg_a)
    x, y = torch.zeros(64), torch.zeros(64)
    grid = lambda m: (triton.cdiv(50, m["BLOCK"]),)  # noqa: E731
    fk[grid](x, y, 50, 2.0, FLAG=True)
    tuned.best_config = cfg_b            # another key launched in between
    fk[grid](x, y, 50, 2.0, FLAG=True)
    assert log[-1] == ("fast", (2, 1, 1), 0, (x, y, 50, 2.0, True, 32))   # BLOCK from the config
    assert tuned.best_config is cfg_a
    # a recorded launch whose config does not match best_config (a race) gets no entry
    fk2 = _launch.FastKernel(tuned)
    fk2.kernel = _FakeKernel(jit, log, tuner=tuned, config=cfg_a)
    orig = fk2.kernel.__getitem__

    class Racy:
        def __getitem__(self, g):
            def call(*a, **k):
                r = orig(g)(*a, **k)
                tuned.best_config = cfg_b
                return r
            return call
    fk2.kernel = Racy()
    fk2[grid](x, y, 50, 2.0, FLAG=True)
    fk2[grid](x, y, 50, 2.0, FLAG=True)
    assert [e[0] for e in log[-2:]] == ["slow", "slow"]


# ---------------------------------------------------------------------------------------------------
# GPU: fast launches equal normal launches bitwise; host time per call printed


def _host_us(fn, n=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return us


def _grads(fn, inputs):
    for t in inputs:
        t.grad = None
    out = fn(*inputs)
    out.float().sum().backward()
    return [out.detach().clone()] + [t.grad.clone() for t in inputs]


def _ops():
    dev, dt = "cuda", torch.bfloat16

    def ln_case(view):
        base = torch.randn(64 * 96 + 8, device=dev, dtype=dt)
        x = (base[1:1 + 64 * 96] if view else base[:64 * 96]).view(64, 96).requires_grad_()
        w = torch.randn(96, device=dev, dtype=dt, requires_grad=True)
        r = torch.randn(64, 96, device=dev, dtype=dt)
        return (lambda a, b: pykernels.layer_norm(a, b, residual=r, prenorm=True, backend="triton")[0]), [x, w]

    def ce_case(view):
        base = torch.randn(32 * 1000 + 8, device=dev, dtype=dt)
        lg = (base[3:3 + 32 * 1000] if view else base[:32 * 1000]).view(32, 1000).requires_grad_()
        tgt = torch.randint(0, 1000, (32,), device=dev)
        return (lambda a: pykernels.cross_entropy(a, tgt, reduction="sum", backend="triton")), [lg]

    def ml_case(view):
        base = torch.randn(48 * 64 + 8, device=dev, dtype=dt)
        h = (base[1:1 + 48 * 64] if view else base[:48 * 64]).view(48, 64).requires_grad_()
        w = torch.randn(3000, 64, device=dev, dtype=dt, requires_grad=True)
        tgt = torch.randint(0, 3000, (48,), device=dev)
        tgt[::3] = -100
        return (lambda a, b: pykernels.masked_lm_loss(a, b, tgt, reduction="sum")), [h, w]

    def at_case(view):
        n = 2 * 4 * 80 * 64
        base = torch.randn(3 * n + 8, device=dev, dtype=dt)
        off = 1 if view else 0
        q, k, v = (base[off + i * n:off + (i + 1) * n].view(2, 4, 80, 64).requires_grad_() for i in range(3))
        return (lambda a, b, c: pykernels.scaled_dot_product_attention(a, b, c, is_causal=True)), [q, k, v]

    return {"layer_norm": ln_case, "cross_entropy": ce_case, "masked_lm_loss": ml_case, "attention": at_case}


def _fast_launches():
    return sum(fk.launches[0] for fk in list(_launch._wrappers.values()))


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["layer_norm", "cross_entropy", "masked_lm_loss", "attention"])
def test_gpu_fast_equals_normal(op):
    case = _ops()[op]
    fast_before = _fast_launches()
    try:
        for view in (False, True, False):   # aligned, then a misaligned view, then aligned again
            torch.manual_seed(1)
            fn, inputs = case(view)
            _launch.set_enabled(False)
            slow = _grads(fn, inputs)
            _launch.set_enabled(True)
            fast1 = _grads(fn, inputs)       # first call of a key: normal path, entry recorded
            fast2 = _grads(fn, inputs)       # cached fast path
            for a, b, c in zip(slow, fast1, fast2):
                assert torch.equal(a, b) and torch.equal(a, c), f"{op} view={view}: fast launch differs"
        assert _fast_launches() > fast_before, f"{op}: no launch took the fast path"
        fn, inputs = case(False)
        _launch.set_enabled(False)
        slow_us = _host_us(lambda: _grads(fn, inputs))
        _launch.set_enabled(True)
        fast_us = _host_us(lambda: _grads(fn, inputs))
        print(f"\n{op}: fwd+bwd host us per call: normal launches {slow_us:.1f}, fast launches {fast_us:.1f}")
    finally:
        _launch.set_enabled(None)


@pytest.mark.gpu
def test_gpu_kernel_misaligned_after_aligned():
    """A misaligned pointer after an aligned one of the same dtype must compile its own kernel."""
    base = torch.randn(1024 + 8, device="cuda")
    grid = lambda m: (triton.cdiv(1000, m["BLOCK"]),)  # noqa: E731
    for off in (0, 0, 1, 1, 4, 0):
        x = base[off:off + 1000]
        y_fast = torch.full((1008,), float("nan"), device="cuda")[off:off + 1000]
        y_slow = torch.full((1008,), float("nan"), device="cuda")[off:off + 1000]
        _launch.launch(_copy_kernel, grid, x, y_fast, 1000, 3.0, FLAG=True)
        _copy_kernel[grid](x, y_slow, 1000, 3.0, FLAG=True)
        torch.cuda.synchronize()
        assert torch.equal(y_fast, y_slow) and torch.equal(y_fast, x * 3.0)
    fast, normal = _launch.stats(_copy_kernel)
    assert fast >= 3 and normal >= 2, (fast, normal)
    y = torch.empty(1000, device="cuda")
    slow_us = _host_us(lambda: _copy_kernel[grid](base[:1000], y, 1000, 3.0, FLAG=True))
    fast_us = _host_us(lambda: _launch.launch(_copy_kernel, grid, base[:1000], y, 1000, 3.0, FLAG=True))
    print(f"\nsingle launch host us: normal {slow_us:.1f}, fast {fast_us:.1f}")


def test_autotuners_do_not_time_configs_while_capturing(monkeypatch):
    # During CUDA-graph capture an autotuner's first launch of a key takes its first surviving config
    # without benchmarking (benchmarking synchronises, which capture forbids) and keeps it.
    from pykernels._kernels import _tuning
    from pykernels._kernels import masked_lm_loss as kmod
    tuner = kmod._masked_lm_loss_fwd_kernel
    assert type(tuner).__name__ == "CaptureSafeAutotuner"
    timed = []
    monkeypatch.setattr(type(tuner).__mro__[1], "_bench", lambda self, *a, config, **k: timed.append(config) or [1.0])
    monkeypatch.setattr(_tuning, "capturing", lambda: True)
    bench_during = []

    def fake_run(self, *args, **kwargs):
        bench_during.append(self._bench(config="c0"))
        return "ran"

    monkeypatch.setattr(type(tuner).__mro__[1], "run", fake_run)
    assert tuner.run() == "ran"
    assert bench_during == [[0.0, 0.0, 0.0]] and not timed  # the untimed stand-in, not the real bench
    monkeypatch.setattr(_tuning, "capturing", lambda: False)
    bench_during.clear()
    tuner.run()
    assert bench_during == [[1.0]] and timed == ["c0"]  # outside capture: the real one


def test_device_properties_cached_per_device(monkeypatch):
    # the launchers ask for SM counts and compute capability on every call: one query per device
    from types import SimpleNamespace
    from pykernels._kernels import _tuning
    calls = []

    def fake(index):
        calls.append(index)
        return SimpleNamespace(multi_processor_count=132 + index, major=9)

    monkeypatch.setattr(torch.cuda, "get_device_properties", fake)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    _tuning._properties.cache_clear()
    try:
        for _ in range(3):
            assert _tuning.device_properties(torch.device("cuda", 0)).multi_processor_count == 132
            assert _tuning.device_properties(torch.device("cuda")).multi_processor_count == 133
        assert calls == [0, 1]
    finally:
        _tuning._properties.cache_clear()
