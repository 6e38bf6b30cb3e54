"""Host-side cost of one call of each op, on inputs so small that the GPU finishes first.

Prints microseconds per call (mean of 300, after warm-up): the public function without grad, with
grad (forward + backward), and the eager torch equivalent. A fused kernel only pays off when the
host keeps ahead of the GPU, so this is the floor under every forward time in the benchmarks.
"""
import time

import torch
import torch.nn.functional as F

import pykernels


def per_call_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def main():
    if not torch.cuda.is_available():
        print("no GPU: nothing to measure")
        return
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(4, 64, device=dev, dtype=dt)
    r = torch.randn_like(x)
    w = torch.ones(64, device=dev, dtype=dt)
    xg = x.clone().requires_grad_()
    q = torch.randn(1, 2, 16, 64, device=dev, dtype=dt)
    qg = q.clone().requires_grad_()
    logits = torch.randn(4, 128, device=dev, dtype=dt)
    lg = logits.clone().requires_grad_()
    tgt = torch.randint(0, 128, (4,), device=dev)
    rows = []

    def fb(f, t):
        def g():
            out = f(t)
            out = out[0] if isinstance(out, tuple) else out
            out.float().sum().backward()
        return g

    ln = lambda t: pykernels.layer_norm(t, w, residual=r, prenorm=True, backend="triton")  # noqa: E731
    rows.append(("layer_norm pre-LN", per_call_us(lambda: ln(x)), per_call_us(fb(ln, xg)),
                 per_call_us(lambda: F.layer_norm(x + r, (64,), w)), per_call_us(fb(lambda t: F.layer_norm(t + r, (64,), w), xg))))
    if pykernels.backends()["cuda"].available:  # the C++ op: forward and backward without Python
        lc = lambda t: pykernels.layer_norm(t, w, residual=r, prenorm=True, backend="cuda")  # noqa: E731
        rows.append(("layer_norm pre-LN cuda", per_call_us(lambda: lc(x)), per_call_us(fb(lc, xg)),
                     rows[-1][3], rows[-1][4]))
    at = lambda t: pykernels.scaled_dot_product_attention(t, q, q, is_causal=True)  # noqa: E731
    rows.append(("attention causal", per_call_us(lambda: at(q)), per_call_us(fb(at, qg)),
                 per_call_us(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True)),
                 per_call_us(fb(lambda t: F.scaled_dot_product_attention(t, q, q, is_causal=True), qg))))
    ce = lambda t: pykernels.cross_entropy(t, tgt)  # noqa: E731
    rows.append(("cross_entropy", per_call_us(lambda: ce(logits)), per_call_us(fb(ce, lg)),
                 per_call_us(lambda: F.cross_entropy(logits, tgt)), per_call_us(fb(lambda t: F.cross_entropy(t, tgt), lg))))
    wv = torch.randn(128, 64, device=dev, dtype=dt)
    ml = lambda t: pykernels.masked_lm_loss(t, wv, tgt)  # noqa: E731
    rows.append(("masked_lm_loss", per_call_us(lambda: ml(x)), per_call_us(fb(ml, xg)),
                 per_call_us(lambda: F.cross_entropy((x @ wv.t()).float(), tgt)),
                 per_call_us(fb(lambda t: F.cross_entropy((t @ wv.t()).float(), tgt), xg))))
    print(f"{'op':<20} {'fwd us':>8} {'fwd+bwd us':>11} {'eager fwd':>10} {'eager f+b':>10}")
    for name, a, b, c, d in rows:
        print(f"{name:<20} {a:8.1f} {b:11.1f} {c:10.1f} {d:10.1f}")
    # where autograd's device thread costs: a Python backward doing one torch op, or one Triton launch
    import triton
    import triton.language as tl

    @triton.jit
    def _copy(X, Y, n, BLOCK: tl.constexpr):
        o = tl.arange(0, BLOCK)
        tl.store(Y + o, tl.load(X + o, mask=o < n), mask=o < n)

    class TorchBwd(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    class TritonBwd(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 2

        @staticmethod
        def backward(ctx, g):
            out = torch.empty_like(g)
            _copy[(1,)](g, out, g.numel(), BLOCK=64)
            return out

    for name, fn in (("python bwd, torch op", TorchBwd.apply), ("python bwd, triton launch", TritonBwd.apply)):
        f = lambda: fn(xg).sum().backward()  # noqa: E731
        a = per_call_us(f)
        with torch.autograd.set_multithreading_enabled(False):
            b = per_call_us(f)
        print(f"{name:<28} fwd+bwd {a:7.1f} us (autograd thread)  {b:7.1f} us (calling thread)")
    t = torch.empty(64, device=dev)
    u = torch.empty_like(t)
    print(f"bare triton launch {per_call_us(lambda: _copy[(1,)](t, u, 64, BLOCK=64)):.1f} us; "
          f"torch op {per_call_us(lambda: torch.mul(t, 2, out=u)):.1f} us")

    # fast vs normal (Triton's own) launches per fwd+bwd, backward on autograd's thread and on the caller's
    from pykernels._kernels import _launch

    def launches():
        def name(k):
            while not hasattr(k, "__name__") and hasattr(k, "fn"):
                k = k.fn
            return getattr(k, "__name__", repr(k))
        return {name(fk.kernel): tuple(fk.launches) for fk in _launch._wrappers.values()}

    for mt in (True, False):
        with torch.autograd.set_multithreading_enabled(mt):
            for name, f, t in (("layer_norm", ln, xg), ("attention", at, qg), ("cross_entropy", ce, lg)):
                g = fb(f, t)
                for _ in range(5):
                    g()
                before = launches()
                for _ in range(10):
                    g()
                torch.cuda.synchronize()
                after = launches()
                delta = {k: (v[0] - before.get(k, (0, 0))[0], v[1] - before.get(k, (0, 0))[1])
                         for k, v in after.items() if v != before.get(k, (0, 0))}
                print(f"launches over 10 fwd+bwd of {name} ({'autograd thread' if mt else 'calling thread'}):"
                      f" (fast, normal) {delta}")

    # the backward on the calling thread (autograd's device threads hidden from cProfile otherwise)
    with torch.autograd.set_multithreading_enabled(False):
        print("fwd+bwd, backward on the calling thread: layer_norm %.1f us, attention %.1f us"
              % (per_call_us(fb(ln, xg)), per_call_us(fb(at, qg))))
        import cProfile
        import pstats
        for name, f, t in (("layer_norm", ln, xg), ("attention", at, qg), ("masked_lm_loss", ml, xg)):
            prof = cProfile.Profile()
            g = fb(f, t)
            prof.enable()
            for _ in range(100):
                g()
            torch.cuda.synchronize()
            prof.disable()
            print(f"--- cProfile {name} fwd+bwd x100, by own time")
            pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
