"""Cross-entropy benchmark: pykernels (Triton) against eager, torch.compile and Liger-Kernel.

What is measured, per case (bf16 logits from ``randn``, every target valid, mean reduction):

* forward time and forward+backward time (``common.bench``: ``do_bench`` medians, L2 flushed); the
  step is ``loss = f(x); torch.autograd.grad(loss, x)`` so no ``.grad`` accumulation (and no copy of
  an in-place gradient) is timed, as when the logits come out of an LM head.
* achieved bandwidth from the *fewest* bytes any implementation must move, the same count for every
  implementation: forward reads N*V*2 bytes; backward reads N*V*2 and writes N*V*2, so forward+
  backward moves 3*N*V*2 bytes. Compared with the card's copy bandwidth measured in the same run
  (``common.ceilings()``, read+write): the goal is >= 85% of it, forward and forward+backward.
* peak memory above the inputs during one forward+backward (``common.peak_extra_mib``).
* the same forward and forward+backward replayed from a CUDA graph (``do_bench_cudagraph``:
  ``fwd_ms_graph``, ``fwd_bwd_ms_graph`` and their % of copy bandwidth): GPU time without host
  overhead. Where a case's GPU work is short (bert_masked: ~150 MB, ~40 us a pass) ``do_bench`` times
  the host (custom-op dispatch, autograd, launches), not the kernels; the graph columns tell which.
  Liger is not captured (its forward calls ``.item()``, a host sync that a capture cannot contain).
* peers in the same run: eager ``F.cross_entropy`` on bf16 and on ``logits.float()`` (what users
  write), ``torch.compile`` of the upcast version, Liger-Kernel's ``LigerCrossEntropyFunction``
  (it writes the gradient during the forward, into the logits, so its "forward" already includes
  the gradient; compare forward+backward). Peers that fail to import are recorded "unavailable".
* validation before timing: every implementation's loss and dlogits are compared with the float64
  reference; pykernels must meet the three-way rule (error <= 2x eager bf16's error + 1e-5) or its
  row is marked INVALID and not timed. Peers' errors are recorded.

Cases: GPT-2 (8192 x 50257), BERT all positions (16384 x 30522), BERT masked positions only
(2446 x 30522; 15% of 16384 tokens).

Usage (GPU): ``python benchmarks/cross_entropy.py [--no-compile] [--budget-s 60]``; rows go to
``benchmarks/results/cross_entropy_<card>_<date>.csv`` (and ``$OUT/cross_entropy.csv``).
``--smoke`` runs the plumbing on CPU under the Triton interpreter with tiny fp32 shapes (timings
meaningless, nothing written). Without CUDA and without ``--smoke`` it prints a note and exits 0.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

WARMUP, REP = 10, 50
GRAPH_REP = 10  # ms of unrolled calls per CUDA graph (do_bench_cudagraph)
NO_GRAPH = ("liger",)  # host-syncing peers: not capturable
CASES = [("gpt2", 8192, 50257), ("bert_all", 16384, 30522), ("bert_masked", 2446, 30522)]
SMOKE_CASES = [("smoke_a", 6, 517), ("smoke_b", 3, 5000)]


def main() -> int:
    import common  # (imports torch, not triton)
    args = common.bandwidth_args("cross_entropy", __doc__, 60.0)
    if args is None:
        return 0
    import torch
    import torch.nn.functional as F

    import pykernels
    from pykernels.cross_entropy import cross_entropy_reference

    t_start = time.time()
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    cases = SMOKE_CASES if args.smoke else CASES

    def bench(fn):
        if args.smoke:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        return common.bench(fn, warmup=WARMUP, rep=REP)

    def peak(fn):
        if args.smoke:
            fn()
            return None
        return round(common.peak_extra_mib(fn), 1)

    try:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
        liger_reason = None
    except Exception as e:  # noqa: BLE001 - any import failure: record it, go on
        LigerCrossEntropyFunction, liger_reason = None, f"unavailable ({type(e).__name__})"

    def liger(x, t):
        # (input, target, weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap,
        #  return_z_loss, return_token_accuracy, return_predicted_tokens) -> (loss, z, acc, pred)
        return LigerCrossEntropyFunction.apply(x, t, None, -100, 0.0, 0.0, "mean", None, False, False, False)[0]

    def upcast(x, t):
        return F.cross_entropy(x.float(), t)

    # (--smoke skips it: Inductor on CPU compiles C++, slow and not what is being checked.)
    compiled = None if args.no_compile or args.smoke else torch.compile(upcast, dynamic=False)

    cuda_reason = pykernels.backends()["cuda"].reason
    impls = [
        ("pykernels", lambda x, t: pykernels.cross_entropy(x, t, backend="triton"), None),
        ("pykernels inplace_backward",
         lambda x, t: pykernels.cross_entropy(x, t, backend="triton", inplace_backward=True), None),
        ("pykernels cuda (C++ op)", lambda x, t: pykernels.cross_entropy(x, t, backend="cuda"),
         None if cuda_reason is None else f"unavailable ({cuda_reason[:60]})"),
        ("eager bf16" if not args.smoke else "eager", lambda x, t: F.cross_entropy(x, t), None),
        ("eager .float()", upcast, None),
        ("torch.compile .float()", compiled, None if compiled is not None else "skipped (--no-compile or --smoke)"),
        ("liger", liger, liger_reason),
    ]

    ceil = {} if args.smoke else common.ceilings()
    copy_tbps = ceil.get("copy_TBps")
    print(f"ceilings: {ceil}")
    rows = []
    for case, N, V in cases:
        torch.manual_seed(0)
        logits = torch.randn(N, V, device=device, dtype=dtype)
        target = torch.randint(0, V, (N,), device=device)
        fwd_bytes, fb_bytes = N * V * 2, 3 * N * V * 2
        if args.smoke:
            fwd_bytes, fb_bytes = N * V * 4, 3 * N * V * 4

        # float64 reference and eager same-dtype error, for the three-way rule.
        x64 = logits.double().requires_grad_()
        ref = cross_entropy_reference(x64, target)
        (g_ref,) = torch.autograd.grad(ref, x64)
        ref, x64 = ref.detach(), None
        xl = logits.clone().requires_grad_()
        lo = cross_entropy_reference(xl, target)
        (g_lo,) = torch.autograd.grad(lo, xl)
        base_loss = abs(lo.double().item() - ref.item())
        base_grad = (g_lo.double() - g_ref).abs().max().item()
        del xl, lo, g_lo

        for name, fn, unavailable in impls:
            row = {"case": case, "N": N, "V": V, "dtype": str(dtype).replace("torch.", ""), "impl": name}
            if unavailable:
                rows.append({**row, "status": unavailable})
                continue
            if name.startswith("torch.compile") and time.time() - t_start > 0.6 * args.budget_s:
                rows.append({**row, "status": "skipped (time budget)"})
                continue
            try:
                # Validate on a private copy (Liger and inplace_backward overwrite their input).
                x = logits.clone().requires_grad_()
                loss = fn(x, target)
                (g,) = torch.autograd.grad(loss, x)
                loss_err = abs(loss.double().item() - ref.item())
                grad_err = (g.double() - g_ref).abs().max().item()
                del g, loss
                row.update(loss_err=f"{loss_err:.2e}", grad_err=f"{grad_err:.2e}",
                           eager_loss_err=f"{base_loss:.2e}", eager_grad_err=f"{base_grad:.2e}")
                ok = loss_err <= 2 * base_loss + 1e-5 and grad_err <= 2 * base_grad + 1e-5
                if name.startswith("pykernels") and not ok:
                    rows.append({**row, "status": "INVALID (three-way rule failed; not timed)"})
                    continue

                def fwd():
                    return fn(x, target)

                def step():
                    return torch.autograd.grad(fn(x, target), x)

                f_ms = bench(fwd)
                fb_ms = bench(step)
                row.update(
                    fwd_ms=round(f_ms, 4), bwd_ms=round(max(fb_ms - f_ms, 0.0), 4), fwd_bwd_ms=round(fb_ms, 4),
                    fwd_TBps=round(fwd_bytes / f_ms / 1e9, 3), fwd_bwd_TBps=round(fb_bytes / fb_ms / 1e9, 3),
                    peak_extra_MiB=peak(step),
                    status="ok" if ok else "ok (peer outside 2x eager error)")
                if copy_tbps:
                    row["fwd_pct_copy"] = round(100 * row["fwd_TBps"] / copy_tbps, 1)
                    row["fwd_bwd_pct_copy"] = round(100 * row["fwd_bwd_TBps"] / copy_tbps, 1)
                if not args.smoke and not args.no_graph and name not in NO_GRAPH:
                    import triton.testing
                    for key, f, nbytes in (("fwd", fwd, fwd_bytes), ("fwd_bwd", step, fb_bytes)):
                        try:
                            ms = float(triton.testing.do_bench_cudagraph(f, rep=GRAPH_REP))
                        except Exception as e:  # noqa: BLE001 - a peer that cannot be captured is recorded
                            torch.cuda.synchronize()
                            row["graph_note"] = f"{type(e).__name__}: {e}"[:100]
                            continue
                        row[f"{key}_ms_graph"] = round(ms, 4)
                        if copy_tbps:
                            row[f"{key}_pct_copy_graph"] = round(100 * nbytes / ms / 1e9 / copy_tbps, 1)
                del x
            except Exception as e:  # noqa: BLE001 - one failing peer must not sink the run
                msg = str(e).strip().splitlines()[0][:100] if str(e).strip() else ""
                row["status"] = f"error: {type(e).__name__}: {msg}"
            rows.append({**row, **{k: v for k, v in ceil.items()}})
            if device == "cuda":
                torch.cuda.empty_cache()
        del logits

    cols = ["case", "impl", "fwd_ms", "bwd_ms", "fwd_bwd_ms", "fwd_TBps", "fwd_pct_copy", "fwd_bwd_TBps",
            "fwd_bwd_pct_copy", "fwd_ms_graph", "fwd_pct_copy_graph", "fwd_bwd_ms_graph", "fwd_bwd_pct_copy_graph",
            "peak_extra_MiB", "loss_err", "grad_err", "status"]
    common.print_table(rows, cols)
    if not args.smoke:
        path = common.write_rows("cross_entropy", rows)
        print(f"wrote {path}")
    print(f"total {time.time() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
