"""Masked-position LM loss benchmark: pykernels (Triton) against eager PyTorch, torch.compile,
Liger-Kernel's fused linear cross-entropy and Cut Cross-Entropy, on the anchors of ../shared/ANCHORS.md.

What is measured, per case (bf16 hidden and weight from ``randn``, no bias, mean reduction):

* forward and forward+backward time (``common.bench_fwd_bwd``: ``do_bench`` medians; backward =
  forward+backward minus forward; Liger computes its gradients in the forward, so compare totals),
  and useful TFLOP/s over forward+backward from counted FLOPs: ``6 * M * V * H`` (three matmuls of
  M x V x H: logits, dhidden, dweight; M = rows with a target). ``floor_ms`` is that count at the card's
  measured bf16 matmul rate (``common.ceilings()``, once per run).
* peak memory above the inputs during one forward+backward (``common.peak_extra_mib``; the gradients
  dhidden and dweight, 69 MiB for BERT-base, are part of it for every implementation).
* ``dh_rel_err``: ||dhidden - ref|| / ||ref|| against an fp32 reference (masked rows gathered, fp32
  logits), and the same for the loss and dweight. Before any timing each implementation is validated
  against that reference (loss rel. error < 1e-2, dhidden and dweight < 4e-2, all finite); a failing one
  is recorded INVALID and not timed, so a wrong fast kernel is never reported.
* pykernels by default (the sized backward: the forward copies the valid count to the host without
  waiting, the backward sizes its buffers and cuBLAS GEMMs for the valid rows) with its dlogits budget
  of 16 MiB and at 64 MiB (``pykernels._kernels.masked_lm_loss.SIZED_DLOGITS_BUDGET_BYTES``), and
  with ``graph_safe=True`` (nothing waits for the device; buffers sized for all rows) and with
  ``dense=True`` (every position a row, the ignored ones masked: nothing waits, capturable, the sized
  kernels; meant for the causal LM, N / M times the work at 15% masking).
* ``gpu_ms``: GPU time of one forward+backward, the sum of its kernels' and copies' device time
  (``common.gpu_kernel_ms``, torch.profiler), for every implementation: host time and idle gaps left
  out, host syncs allowed.
* pykernels with ``z_loss=1e-4`` (PaLM's auxiliary loss; validated against the reference with that term): the
  default call plus the term's elementwise ops.
* pykernels with ``max_valid`` (a bound of 20% of the tokens for MLM, N for the causal LM): the sized
  backward for the bound, no count copy and no wait, so it also replays from a CUDA graph at that speed.
* ``total_ms_graph``: forward+backward replayed from a CUDA graph (GPU time, no host overhead). A call
  captured in a graph never waits for the device: the default row's captured backward follows the valid count
  its eager calls before the capture saw (``pykernels.masked_lm_loss._ValidSeen``): the bounded backward at
  15% (the capacity path for that count plus 8 standard deviations, graph-safe kernels for any rows past it),
  the dense one for the causal LM; the graph-safe row captures the graph-safe path (named), the dense and
  max_valid rows their own (the do_bench columns of the default row are the sized path).

Peers (same run, same inputs): eager full logits with ``ignore_index``; eager with the masked rows
gathered first (boolean indexing: a host sync); the same compiled with ``torch.compile`` (the
gather stays eager, the matmul+loss is compiled); Liger ``LigerFusedLinearCrossEntropyFunction`` on
the gathered rows; Cut Cross-Entropy ``linear_cross_entropy(..., impl="cce")`` on all rows with
``ignore_index``. A peer whose import fails is recorded "unavailable".

Usage (GPU): ``PYTHONPATH=/tmp/site python benchmarks/masked_lm_loss.py [--budget-s 160] [--cases a,b]``
(cases: bert-base-mlm, bert-large-mlm, gpt2-lm). Rows go to
``benchmarks/results/masked_lm_loss_<card>_<date>.csv`` and ``$OUT/masked_lm_loss.csv``, rewritten
after every case so a timeout keeps what was measured. Past 60% of the budget torch.compile (whose
compilation dominates) is skipped; past 100% everything left is (implementations run most important
first: pykernels, CCE, Liger, torch.compile, eager, then the pykernels budget variants). ``--smoke`` runs the script's
logic on tiny fp32 shapes on CPU under the Triton interpreter (timings meaningless); without CUDA and
without ``--smoke`` it prints a note and exits 0.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

WARMUP, REP = 10, 50  # do_bench milliseconds: modest, the whole GPU batch is bounded
IGN = -100


@dataclass(frozen=True)
class Case:
    name: str
    n: int          # tokens
    h: int          # hidden width
    v: int          # vocabulary
    m: int | None   # rows with a target (None: all)


CASES = [
    Case("bert-base-mlm", 16384, 768, 30522, 2446),
    Case("bert-large-mlm", 16384, 1024, 30522, 2377),
    Case("gpt2-lm", 8192, 768, 50257, None),
]
SMOKE_CASES = [Case("smoke-mlm", 64, 32, 517, 11), Case("smoke-lm", 32, 32, 517, None)]


def make_inputs(c: Case, device, dtype):
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(c.n, c.h, generator=g).to(device=device, dtype=dtype)
    weight = (torch.randn(c.v, c.h, generator=g) * c.h**-0.5).to(device=device, dtype=dtype)
    target = torch.randint(0, c.v, (c.n,), generator=g)
    if c.m is not None:
        keep = torch.zeros(c.n, dtype=torch.bool)
        keep[torch.randperm(c.n, generator=g)[:c.m]] = True
        target = torch.where(keep, target, torch.full_like(target, IGN))
    return hidden, weight, target.to(device)


# ---- implementations: each maps (hidden, weight, target) to a scalar mean loss --------------------------

def impl_pykernels(h, w, t):
    import pykernels
    return pykernels.masked_lm_loss(h, w, t, backend="triton")


def impl_pykernels_graph_safe(h, w, t):
    import pykernels
    return pykernels.masked_lm_loss(h, w, t, backend="triton", graph_safe=True)


def impl_pykernels_max_valid(h, w, t):
    # what a caller sets for 15% masking: a bound of 20% of the tokens (every token for the causal LM, whose
    # targets are all valid here); the row name says so
    import pykernels
    bound = t.numel() if _ALL_VALID[0] else t.numel() // 5
    return pykernels.masked_lm_loss(h, w, t, backend="triton", max_valid=bound)


_ALL_VALID = [False]  # set per case by run_case


Z_LOSS = 1e-4  # PaLM's coefficient


def impl_pykernels_z_loss(h, w, t):
    # the default call with z_loss: the forward's one extra elementwise op and the backward's shifted lse
    import pykernels
    return pykernels.masked_lm_loss(h, w, t, backend="triton", z_loss=Z_LOSS)


def impl_pykernels_dense(h, w, t):
    import pykernels
    return pykernels.masked_lm_loss(h, w, t, backend="triton", dense=True)


def impl_pykernels_cuda(h, w, t):
    # the CUDA C++ op (csrc/masked_lm_loss.cu): cuBLAS over the compacted rows, one host sync for their count
    import pykernels
    return pykernels.masked_lm_loss(h, w, t, backend="cuda")


def impl_eager_full(h, w, t):
    return F.cross_entropy(h @ w.t(), t, ignore_index=IGN)


def impl_eager_gather(h, w, t):
    keep = t != IGN
    return F.cross_entropy(h[keep] @ w.t(), t[keep])


def _loss_on_rows(hg, w, tg):
    return F.cross_entropy(hg @ w.t(), tg)


_compiled = None


def impl_compile_gather(h, w, t):
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_loss_on_rows, dynamic=False)
    keep = t != IGN
    return _compiled(h[keep], w, t[keep])


def _liger():
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    return LigerFusedLinearCrossEntropyFunction


def impl_liger(h, w, t):
    keep = t != IGN
    # positional: input, weight, target, bias, ce_weight, ignore_index, lse_square_scale,
    # label_smoothing, reduction
    return _liger().apply(h[keep], w, t[keep], None, None, IGN, 0.0, 0.0, "mean")[0]


def _cce():
    from cut_cross_entropy import linear_cross_entropy
    return linear_cross_entropy


def impl_cce(h, w, t):
    return _cce()(h, w, t, ignore_index=IGN, reduction="mean", impl="cce")


# pykernels' sized backward with other dlogits budgets than the default 16 MiB (smaller: less memory,
# more and narrower vocabulary chunks; larger: the reverse): the rows show the trade-off in the same run.
BUDGET_VARIANTS = {"pykernels (sized budget 64 MiB)": ("SIZED_DLOGITS_BUDGET_BYTES", 64 * 2**20)}

# Most important first: a run that hits its time budget drops the tail of this list.
IMPLS = [
    ("pykernels", impl_pykernels, None),
    ("pykernels graph_safe=True", impl_pykernels_graph_safe, None),
    ("pykernels dense=True", impl_pykernels_dense, None),
    ("pykernels max_valid=N/5 (MLM) or N", impl_pykernels_max_valid, None),
    ("pykernels z_loss=1e-4", impl_pykernels_z_loss, None),
    ("pykernels cuda (C++ op)", impl_pykernels_cuda, None),
    ("Cut Cross-Entropy (all rows)", impl_cce, _cce),
    ("Liger fused linear CE (masked rows)", impl_liger, _liger),
    ("torch.compile gather-first", impl_compile_gather, None),
    ("eager gather-first", impl_eager_gather, None),
    ("eager full logits", impl_eager_full, None),
    *[(name, impl_pykernels, None) for name in BUDGET_VARIANTS],
]


def reference(h, w, t, z_loss=0.0):
    """fp32 reference on the gathered rows: loss, dhidden (N, H), dweight (V, H); with ``z_loss`` PaLM's term."""
    hh = h.detach().float().requires_grad_(True)
    ww = w.detach().float().requires_grad_(True)
    keep = t != IGN
    if bool(keep.any()):
        logits = hh[keep] @ ww.t()
        loss = F.cross_entropy(logits, t[keep])
        if z_loss:
            loss = loss + z_loss * torch.logsumexp(logits, -1).square().mean()
    else:
        loss = hh.sum() * 0
    dh, dw = torch.autograd.grad(loss, [hh, ww])
    return loss.detach(), dh, dw


def rel(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def run_case(c: Case, args, ceil, rows, t_start):
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    hidden, weight, target = make_inputs(c, device, dtype)
    m = int((target != IGN).sum())
    _ALL_VALID[0] = c.m is None
    flops = 6 * m * c.v * c.h
    ref_loss, ref_dh, ref_dw = reference(hidden, weight, target)
    floor_ms = flops / (ceil["matmul_bf16_TFLOPs"] * 1e9) if ceil else float("nan")
    for name, fn, probe in IMPLS:
        row = {"case": c.name, "impl": name, "N": c.n, "M": m, "H": c.h, "V": c.v, "dtype": str(dtype)[6:],
               "floor_ms": round(floor_ms, 3)}
        elapsed = time.time() - t_start
        if elapsed > args.budget_s:
            rows.append({**row, "status": "skipped (time budget)"})
            continue
        if "compile" in name and elapsed > 0.6 * args.budget_s:
            rows.append({**row, "status": "skipped (time budget: compilation)"})
            continue
        if probe is not None:
            try:
                probe()
            except Exception as e:  # noqa: BLE001 - a missing peer is recorded, not fatal
                rows.append({**row, "status": f"unavailable ({type(e).__name__})"})
                continue
        if name in BUDGET_VARIANTS:
            from pykernels._kernels import masked_lm_loss as kmod
            attr, value = BUDGET_VARIANTS[name]
            saved_budget = getattr(kmod, attr)
            setattr(kmod, attr, value)
            try:
                time_impl(args, row, rows, name, fn, hidden, weight, target, ref_loss, ref_dh, ref_dw, flops)
            finally:
                setattr(kmod, attr, saved_budget)
        elif fn is impl_pykernels_z_loss:
            time_impl(args, row, rows, name, fn, hidden, weight, target, *reference(hidden, weight, target, Z_LOSS),
                      flops)
        else:
            time_impl(args, row, rows, name, fn, hidden, weight, target, ref_loss, ref_dh, ref_dw, flops)


def _tuned_configs() -> str:
    """The tile configs the autotuners picked on the last launches (fwd / dlogits / bwd), for the CSV:
    which of the Hopper candidates win is what the next round of config pruning needs."""
    from pykernels._kernels import masked_lm_loss as kmod
    out = []
    for tag, k in (("fwd", kmod._masked_lm_loss_fwd_kernel), ("dl", kmod._masked_lm_loss_dlogits_kernel),
                   ("bwd", kmod._masked_lm_loss_bwd_kernel)):
        c = getattr(k, "best_config", None)
        if c is None:
            out.append(f"{tag}:?")
        else:
            tiles = "x".join(str(v) for v in c.kwargs.values())
            out.append(f"{tag}:{tiles}w{c.num_warps}s{c.num_stages}")
    return " ".join(out)


def time_impl(args, row, rows, name, fn, hidden, weight, target, ref_loss, ref_dh, ref_dw, flops):
    """Validate one implementation against the fp32 reference, then time it; appends one row."""
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    try:
        loss = fn(h, w, target)
        dh, dw = torch.autograd.grad(loss, [h, w])
    except Exception as e:  # noqa: BLE001 - e.g. out of memory or a peer that rejects the case
        rows.append({**row, "status": f"error ({type(e).__name__}: {str(e)[:80]})"})
        return
    errs = {"loss_rel_err": abs(loss.float().item() - ref_loss.item()) / max(abs(ref_loss.item()), 1e-30),
            "dh_rel_err": rel(dh, ref_dh), "dw_rel_err": rel(dw, ref_dw)}
    row.update({k: f"{v:.2e}" for k, v in errs.items()})
    finite = all(bool(torch.isfinite(x).all()) for x in (loss, dh, dw))
    if not finite or errs["loss_rel_err"] > 1e-2 or errs["dh_rel_err"] > 4e-2 or errs["dw_rel_err"] > 4e-2:
        rows.append({**row, "status": "INVALID (failed validation; not timed)"})
        return
    del loss, dh, dw
    if name.startswith("pykernels"):
        row["configs"] = _tuned_configs()

    def fwd():
        return fn(h, w, target)

    if args.smoke:
        t0 = time.perf_counter()
        fwd().backward()
        fb = (time.perf_counter() - t0) * 1e3
        f_ms, b_ms, peak = fb, 0.0, float("nan")
    else:
        f_ms, b_ms = common.bench_fwd_bwd(fwd, inputs=(h, w), warmup=WARMUP, rep=REP)
        h.grad = w.grad = None

        def step():
            h.grad = w.grad = None
            fwd().backward()

        peak = common.peak_extra_mib(step)
        h.grad = w.grad = None
        try:
            row["gpu_ms"] = round(common.gpu_kernel_ms(step), 3)
        except Exception as e:  # noqa: BLE001 - record why, keep the run going
            row["gpu_note"] = f"{type(e).__name__}: {e}"[:100]
        h.grad = w.grad = None
        if name.startswith("pykernels") or "compile" in name:
            # forward+backward replayed from a CUDA graph: GPU time without host launch overhead
            # (captured, pykernels takes a no-wait path; peers with .item() inside do not capture)
            try:
                import triton.testing
                row["total_ms_graph"] = round(float(triton.testing.do_bench_cudagraph(step, rep=20)), 3)
            except Exception as e:  # noqa: BLE001 - record why, keep the run going
                row["graph_note"] = f"{type(e).__name__}: {e}"[:100]
            h.grad = w.grad = None
    total = f_ms + b_ms
    row.update({"status": "ok", "fwd_ms": round(f_ms, 3), "bwd_ms": round(b_ms, 3), "total_ms": round(total, 3),
                "TFLOPs": round(flops / total / 1e9, 1) if total > 0 else "",
                "peak_extra_MiB": round(peak, 1)})
    rows.append(row)
    del h, w
    if not args.smoke:
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget-s", type=float, default=160.0)  # (115 left GPT-2's torch.compile out: run180)
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--smoke", action="store_true", help="tiny fp32 shapes on CPU under TRITON_INTERPRET=1")
    args = ap.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        cases = SMOKE_CASES
    else:
        if not torch.cuda.is_available():
            print("masked_lm_loss benchmark: no CUDA device, nothing to time (use --smoke to check the script)")
            return 0
        cases = CASES
    if args.cases:
        wanted = set(args.cases.split(","))
        cases = [c for c in cases if c.name in wanted]
    t_start = time.time()
    ceil = None if args.smoke else common.ceilings()
    if ceil:
        print(f"ceilings: {ceil}")
    rows: list[dict] = []
    cols = ["case", "impl", "M", "status", "fwd_ms", "bwd_ms", "total_ms", "gpu_ms", "floor_ms", "TFLOPs",
            "peak_extra_MiB", "dh_rel_err", "dw_rel_err", "loss_rel_err", "total_ms_graph", "configs"]
    for c in cases:
        run_case(c, args, ceil, rows, t_start)
        if not args.smoke:  # the smoke run writes nothing
            path = common.write_rows("masked_lm_loss", [{**r, **ceil} for r in rows])
    common.print_table(rows, cols)
    print(f"done in {time.time() - t_start:.0f} s" + ("" if args.smoke else f", wrote {path}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
