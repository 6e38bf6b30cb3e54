"""Residual add + LayerNorm benchmark: pykernels (Triton) against eager, torch.compile and Liger-Kernel.

What is measured, per case (bf16 x, residual, weight, bias from ``randn``; eps 1e-5; no dropout):

* ``pre`` (GPT-2, pre-LN): ``s = x + r; y = LN(s)``, returning ``(y, s)``; the backward gets upstream
  gradients for both y and s. ``post`` (BERT, post-LN): ``y = LN(x + r)``, returning ``y``.
* forward time and forward+backward time (``common.bench``: ``do_bench`` medians, L2 flushed). The
  step is ``outs = f(x, r); torch.autograd.grad(outs, (x, r, w, b), upstream)`` so no ``.grad``
  accumulation is timed. Inputs require grad in both timings (training forward).
* achieved bandwidth from the *fewest* bytes any implementation must move (the same count for all):
  forward pre reads x, r and writes y, s: 4*M*N*2 bytes; post 3*M*N*2. Backward pre reads dy, ds, s
  and writes dx (= dresidual): 4*M*N*2; post reads dy and x, r (or a saved s) and writes dx: the
  forward+backward minimum is 8*M*N*2 (pre) and 7*M*N*2 (post). Weight-sized traffic is ignored.
  Compared with the card's copy bandwidth measured in the same run (``common.ceilings()``).
* the same forward and forward+backward replayed from a CUDA graph (``do_bench_cudagraph``, no L2
  flush; every working set here is >= 100 MB, twice the L2): GPU time without the host's launch
  overhead, which at these sizes can rival the kernels' time. Goals use the ``do_bench`` numbers
  (as ANCHORS.md does); the graph columns say how much of a gap is host overhead. Next to them, a
  ``copy_`` of the forward's bytes (half read, half written) replayed the same way
  (``copy_same_bytes_us_graph``, and the forward's time as a share of it): what a kernel that moves
  those bytes reaches at that size, launch ramp and tail included, where ``common.ceilings()`` copies 1 GiB.
* peak memory above the inputs during one forward+backward (``common.peak_extra_mib``).
* peers in the same run: eager (``x + r`` then ``F.layer_norm``), ``torch.compile`` of that same
  function (compiled and warmed up per shape before timing), Liger-Kernel (eager add +
  ``LigerLayerNormFunction``). A peer that fails to import is recorded "unavailable".
* validation before timing: every output and gradient (dx, dresidual, dweight, dbias) of every
  implementation is compared with the float64 reference (``layer_norm_reference(upcast=True)``).
  pykernels must meet the three-way rule (error <= 2x eager bf16's error + atol, as in the tests)
  or its row is marked INVALID and not timed; peers' status records whether they meet it.

Goals (reported as ratios on the pykernels rows): forward >= 90% of copy bandwidth; forward+backward
>= 3x eager and >= 1.5x Liger and torch.compile.

Usage (GPU): ``python benchmarks/layer_norm.py [--no-compile] [--no-graph] [--budget-s 80]``; rows go to
``benchmarks/results/layer_norm_<card>_<date>.csv`` (and ``$OUT/layer_norm.csv``), rewritten after
each case. ``--smoke`` runs the plumbing on CPU under the Triton interpreter with tiny fp32 shapes
(timings meaningless, nothing written). Without CUDA and without ``--smoke`` it prints a note and
exits 0.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

WARMUP, REP = 10, 50
GRAPH_REP = 10  # ms of unrolled calls per CUDA graph (do_bench_cudagraph)
EPS = 1e-5
# (variant, M, N): the four ANCHORS shapes pre-LN, then the two BERT shapes post-LN (last: past 60%
# of --budget-s the compile peer is skipped)
CASES = [("pre", 16384, 768), ("pre", 16384, 1024), ("pre", 8192, 4096), ("pre", 65536, 768),
         ("post", 16384, 768), ("post", 16384, 1024)]
SMOKE_CASES = [("pre", 8, 96), ("post", 5, 1000)]
PEERS = ("eager", "compile", "liger")


def main() -> int:
    import common  # (imports torch, not triton)
    args = common.bandwidth_args("layer_norm", __doc__, 80.0)
    if args is None:
        return 0
    import torch
    import torch.nn.functional as F
    import triton.testing

    import pykernels
    from pykernels.layer_norm import layer_norm_reference

    t_start = time.time()
    dev = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    ceil = {"copy_TBps": float("nan"), "matmul_bf16_TFLOPs": float("nan")} if args.smoke else common.ceilings()
    print(f"ceilings: {ceil}")

    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        liger_reason = None
    except Exception as e:  # noqa: BLE001 - any import failure: record the peer unavailable
        LigerLayerNormFunction = None
        liger_reason = f"unavailable ({type(e).__name__}: {e})"[:120]

    def make_fns(variant):
        pre = variant == "pre"

        def ours(x, r, w, b):
            return pykernels.layer_norm(x, w, b, EPS, residual=r, prenorm=pre, backend="triton")

        def eager(x, r, w, b):
            s = x + r
            y = F.layer_norm(s, (s.shape[-1],), w, b, EPS)
            return (y, s) if pre else y

        fns = {"pykernels": ours, "eager": eager}
        if pykernels.backends()["cuda"].available:  # the CUDA C++ op (N <= 1024; wider rows record the reason)
            def ours_cuda(x, r, w, b):
                return pykernels.layer_norm(x, w, b, EPS, residual=r, prenorm=pre, backend="cuda")
            fns["pykernels cuda"] = ours_cuda
        if not args.no_compile and not args.smoke:
            fns["compile"] = torch.compile(eager, dynamic=False)
        if LigerLayerNormFunction is not None and not args.smoke:
            def liger(x, r, w, b):
                s = x + r
                y = LigerLayerNormFunction.apply(s, w, b, EPS)
                return (y, s) if pre else y
            fns["liger"] = liger
        return fns

    compiled_fns = {v: make_fns(v) for v in ("pre", "post")}
    rows: list[dict] = []

    def as_tuple(o):
        return tuple(o) if isinstance(o, (tuple, list)) else (o,)

    def max_err(a, b):
        return (a.double() - b.double()).abs().max().item()

    for variant, M, N in (SMOKE_CASES if args.smoke else CASES):
        torch.manual_seed(0)
        pre = variant == "pre"
        x = torch.randn(M, N, device=dev, dtype=dtype, requires_grad=True)
        r = torch.randn(M, N, device=dev, dtype=dtype, requires_grad=True)
        w = (1 + 0.5 * torch.randn(N, device=dev, dtype=dtype)).requires_grad_()
        b = (0.5 * torch.randn(N, device=dev, dtype=dtype)).requires_grad_()
        inputs = (x, r, w, b)
        upstream = [torch.randn(M, N, device=dev, dtype=dtype) for _ in range(2 if pre else 1)]

        # float64 truth and eager-in-dtype (the three-way rule), outputs and every gradient
        def outs_and_grads(fn, ins):
            o = as_tuple(fn(*ins))
            g = torch.autograd.grad(o, ins, [u.to(t.dtype) for u, t in zip(upstream, o)])
            return [t.detach() for t in o] + list(g)

        hi_ins = tuple(t.detach().double().requires_grad_() for t in inputs)
        ref_hi = outs_and_grads(lambda *a: layer_norm_reference(a[0], a[2], a[3], EPS, residual=a[1], prenorm=pre,
                                                                upcast=True), hi_ins)
        ref_lo = outs_and_grads(lambda *a: layer_norm_reference(a[0], a[2], a[3], EPS, residual=a[1], prenorm=pre),
                                inputs)
        names = (["y", "s"] if pre else ["y"]) + ["dx", "dresidual", "dweight", "dbias"]
        base = [max_err(lo, hi) for lo, hi in zip(ref_lo, ref_hi)]
        del ref_lo
        atol = [1e-5 if dtype == torch.float32 else 1e-3] * len(names)
        for i, nm in enumerate(names):
            if nm in ("dweight", "dbias"):
                atol[i] *= M ** 0.5  # sums over M rows (same allowance as the tests)

        fwd_bytes = (4 if pre else 3) * M * N * x.element_size()
        fb_bytes = (8 if pre else 7) * M * N * x.element_size()
        case_rows = {}
        copy_us = float("nan")  # a copy of the forward's bytes (half read, half written), replayed from a CUDA graph:
        if not args.smoke and not args.no_graph:  # what a kernel of that size reaches (launch ramp and tail included)
            copy_us = round(common.copy_graph_us(fwd_bytes, rep=GRAPH_REP), 1)
        for impl, fn in compiled_fns[variant].items():
            row = {"op": "layer_norm", "variant": variant, "M": M, "N": N, "dtype": str(dtype).replace("torch.", ""),
                   "impl": impl}
            case_rows[impl] = row
            rows.append(row)
            if impl == "compile" and time.time() - t_start > 0.6 * args.budget_s:
                row["status"] = "skipped (time budget)"
                continue
            try:
                got = outs_and_grads(fn, inputs)  # also compiles / autotunes before timing
            except Exception as e:  # noqa: BLE001 - a failing peer is recorded, not fatal
                row["status"] = f"error: {type(e).__name__}: {e}"[:160]
                if impl.startswith("pykernels"):
                    print(f"{impl} failed on {variant} {M}x{N}: {e!r}")
                continue
            errs = [max_err(g, h) for g, h in zip(got, ref_hi)]
            ok = all(e <= 2 * bse + a for e, bse, a in zip(errs, base, atol))
            worst = max(range(len(names)), key=lambda i: errs[i] / (2 * base[i] + atol[i]))
            row["max_err_ratio"] = round(errs[worst] / (base[worst] + 1e-30), 3)  # vs eager's own error
            row["worst"] = names[worst]
            row["status"] = "ok" if ok else ("INVALID" if impl.startswith("pykernels") else "exceeds 2x eager error")
            del got
            if impl.startswith("pykernels") and not ok:
                print(f"INVALID {impl} {variant} {M}x{N}: " +
                      ", ".join(f"{n} {e:.3e} (eager {bse:.3e})" for n, e, bse in zip(names, errs, base)))
                continue
            if args.smoke:
                t0 = time.perf_counter()
                fn(*inputs)
                row["fwd_us"] = round((time.perf_counter() - t0) * 1e6, 1)
                continue

            def fwd():
                return fn(*inputs)

            def step():
                o = as_tuple(fn(*inputs))
                return torch.autograd.grad(o, inputs, upstream[:len(o)])

            f_ms = common.bench(fwd, warmup=WARMUP, rep=REP)
            fb_ms = common.bench(step, warmup=WARMUP, rep=REP)
            if not args.no_graph:
                # the same calls replayed from a CUDA graph: GPU time without host launch overhead
                # (at these sizes a kernel takes ~30-200 us, the Python + launch path of an op ~20-50 us)
                for key, f in (("fwd_us_graph", fwd), ("fwdbwd_us_graph", step)):
                    try:
                        row[key] = round(float(triton.testing.do_bench_cudagraph(f, rep=GRAPH_REP)) * 1e3, 1)
                    except Exception as e:  # noqa: BLE001 - a peer that cannot be captured is recorded
                        row[key] = float("nan")
                        row["graph_note"] = f"{type(e).__name__}: {e}"[:100]
                        torch.cuda.synchronize()
                # bytes / (us * 1e6) is TB/s (bytes per microsecond is MB/s: 1e6 bytes/us = 1 TB/s)
                if row.get("fwd_us_graph") == row.get("fwd_us_graph"):  # not NaN
                    row["fwd_pct_copy_graph"] = round(
                        100 * fwd_bytes / (row["fwd_us_graph"] * 1e6) / ceil["copy_TBps"], 1)
                    row["copy_same_bytes_us_graph"] = copy_us
                    row["fwd_pct_same_bytes_copy_graph"] = round(100 * copy_us / row["fwd_us_graph"], 1)
                if row.get("fwdbwd_us_graph") == row.get("fwdbwd_us_graph"):
                    row["fwdbwd_pct_copy_graph"] = round(
                        100 * fb_bytes / (row["fwdbwd_us_graph"] * 1e6) / ceil["copy_TBps"], 1)
            row.update(fwd_us=round(f_ms * 1e3, 1), fwd_TBps=round(fwd_bytes / f_ms / 1e9, 3),
                       fwd_pct_copy=round(100 * fwd_bytes / f_ms / 1e9 / ceil["copy_TBps"], 1),
                       fwdbwd_us=round(fb_ms * 1e3, 1), fwdbwd_TBps=round(fb_bytes / fb_ms / 1e9, 3),
                       fwdbwd_pct_copy=round(100 * fb_bytes / fb_ms / 1e9 / ceil["copy_TBps"], 1),
                       bwd_us=round(max(fb_ms - f_ms, 0.0) * 1e3, 1),
                       extra_mib=round(common.peak_extra_mib(step), 1))
        for peer in PEERS:
            if peer not in case_rows:
                reason = (liger_reason if peer == "liger" else "disabled (--no-compile)" if peer == "compile"
                          else "not run")
                if args.smoke:
                    reason = "not run (--smoke)"
                row = {"op": "layer_norm", "variant": variant, "M": M, "N": N,
                       "dtype": str(dtype).replace("torch.", ""), "impl": peer, "status": reason}
                rows.append(row)
        for ours in (case_rows.get("pykernels", {}), case_rows.get("pykernels cuda", {})):
            if "fwdbwd_us" not in ours:
                continue
            for peer in PEERS:
                p = case_rows.get(peer, {})
                if "fwdbwd_us" in p:
                    ours[f"fb_speedup_vs_{peer}"] = round(p["fwdbwd_us"] / ours["fwdbwd_us"], 2)
                    ours[f"fwd_speedup_vs_{peer}"] = round(p["fwd_us"] / ours["fwd_us"], 2)
                    if p.get("fwdbwd_us_graph", 0) > 0 and ours.get("fwdbwd_us_graph", 0) > 0:
                        ours[f"fb_graph_speedup_vs_{peer}"] = round(p["fwdbwd_us_graph"] / ours["fwdbwd_us_graph"], 2)
            ours["goal_fwd_90pct_copy"] = ours["fwd_pct_copy"] >= 90
            ours["goal_fb_3x_eager"] = ours.get("fb_speedup_vs_eager", 0) >= 3
            ours["goal_fb_1.5x_liger"] = ours.get("fb_speedup_vs_liger", 0) >= 1.5
            ours["goal_fb_1.5x_compile"] = ours.get("fb_speedup_vs_compile", 0) >= 1.5
        del x, r, w, b, inputs, upstream, hi_ins, ref_hi
        if not args.smoke:
            torch.cuda.empty_cache()
            for row in rows:
                row.setdefault("copy_TBps", ceil["copy_TBps"])
            common.write_rows("layer_norm", rows)  # rewritten after each case: a timeout keeps what ran
        print(f"[{time.time() - t_start:5.1f}s] {variant} {M}x{N} done")

    cols = ["variant", "M", "N", "impl", "status", "fwd_us", "fwd_TBps", "fwd_pct_copy", "bwd_us", "fwdbwd_us",
            "fwdbwd_pct_copy", "fwd_us_graph", "fwd_pct_copy_graph", "copy_same_bytes_us_graph",
            "fwd_pct_same_bytes_copy_graph", "fwdbwd_us_graph", "fwdbwd_pct_copy_graph",
            "extra_mib", "max_err_ratio",
            "fb_speedup_vs_eager", "fb_speedup_vs_compile", "fb_speedup_vs_liger"]
    common.print_table(rows, cols)
    bad = [r for r in rows if r["impl"] == "pykernels" and r.get("status") != "ok"]
    bad += [r for r in rows if r["impl"] == "pykernels cuda" and r.get("status") not in ("ok", None)
            and not str(r.get("status")).startswith("error: BackendUnavailableError")]
    print(f"copy bandwidth {ceil['copy_TBps']} TB/s; total {time.time() - t_start:.1f}s")
    if bad:
        print(f"{len(bad)} pykernels row(s) not ok")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
