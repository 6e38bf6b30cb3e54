"""Where the host time of the C++ LayerNorm's forward+backward goes (GPU; inputs so small the GPU finishes first).

run265's host_overhead.py: the C++ op's fwd+bwd took 634.6 us of host time against eager's 391.7, the backward about
220 us more. This splits it: the public call with and without grad; the compiled pair's two ops called bare (no
autograd: the forward op, then the backward op on its outputs); the backward on autograd's device thread and on the
calling thread; weight with and without requires_grad; then a CPU-only torch.profiler table of the C++ fwd+bwd with
the backward on the calling thread (so its ATen calls are in the trace), by self CPU time.

Usage (GPU): ``python benchmarks/dev/ln_host_ops.py``
"""
import torch
import torch.nn.functional as F

import pykernels

from host_overhead import per_call_us  # noqa: E402  (benchmarks/dev on sys.path when run as a script)


def main():
    if not torch.cuda.is_available() or not pykernels.backends()["cuda"].available:
        print("no GPU or no C++ extension: nothing to measure")
        return
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(4, 64, device=dev, dtype=dt)
    r = torch.randn_like(x)
    xg = x.clone().requires_grad_()
    rows = []
    # two passes, the first one's numbers dropped: in run267 the rows measured first ran slower than the same
    # rows measured later in the same process
    for _ in range(2):
        rows.clear()
        _measure(rows, x, r, xg, dev, dt)
    _report(rows, x, r, xg, dev, dt)


def _measure(rows, x, r, xg, dev, dt):
    for wgrad in (False, True):
        w = torch.ones(64, device=dev, dtype=dt, requires_grad=wgrad)
        b = torch.zeros(64, device=dev, dtype=dt, requires_grad=wgrad)
        fns = {
            "eager": lambda t: F.layer_norm(t + r, (64,), w, b),
            "cuda": lambda t: pykernels.layer_norm(t, w, b, residual=r, prenorm=True, backend="cuda")[0],
            "triton": lambda t: pykernels.layer_norm(t, w, b, residual=r, prenorm=True, backend="triton")[0],
        }
        for name, f in fns.items():
            def fb(f=f):
                f(xg).sum().backward()
            with torch.no_grad():
                fwd = per_call_us(lambda f=f: f(x))
            a = per_call_us(fb)
            with torch.autograd.set_multithreading_enabled(False):
                c = per_call_us(fb)
            rows.append((f"{name} w.requires_grad={wgrad}", fwd, a, c))


def _report(rows, x, r, xg, dev, dt):
    # the compiled pair, bare: no autograd nodes at all
    w = torch.ones(64, device=dev, dtype=dt)
    b = torch.zeros(64, device=dev, dtype=dt)
    ops = torch.ops.pykernels_cuda
    y, s, mean, rstd, seed = ops.layer_norm_fwd(x, w, b, r, 1e-5, 0.0, True, False)
    dy = torch.randn_like(y)
    f_us = per_call_us(lambda: ops.layer_norm_fwd(x, w, b, r, 1e-5, 0.0, True, False))
    b_us = per_call_us(lambda: ops.layer_norm_bwd(dy, None, s, None, w, b, mean, rstd, seed, 0.0, True, False))
    e_us = per_call_us(lambda: torch.ops.aten.native_layer_norm_backward(dy, s, (64,), mean.view(4, 1),
                                                                         rstd.view(4, 1), w, b, (True, True, True)))
    one = per_call_us(lambda: torch.empty(64, device=dev))
    print(f"{'call':<34} {'no-grad fwd':>11} {'fwd+bwd':>9} {'fwd+bwd, bwd on caller':>23}  (us of host a call)")
    for name, a, c, d in rows:
        print(f"{name:<34} {a:11.1f} {c:9.1f} {d:23.1f}")
    print(f"bare ops: layer_norm_fwd {f_us:.1f} us, layer_norm_bwd {b_us:.1f} us; aten native_layer_norm_backward "
          f"{e_us:.1f} us; torch.empty {one:.1f} us")

    w = torch.ones(64, device=dev, dtype=dt, requires_grad=True)

    def step():
        pykernels.layer_norm(xg, w, residual=r, prenorm=True, backend="cuda")[0].sum().backward()

    from torch.profiler import ProfilerActivity, profile
    with torch.autograd.set_multithreading_enabled(False):
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(50):
                step()
            torch.cuda.synchronize()
    print("--- torch.profiler, C++ fwd+bwd x50 (backward on the calling thread), by self CPU time")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
