"""Attention benchmark: pykernels (Triton) against torch's SDPA backends, FlexAttention and eager.

What is measured, per case (bf16, ``randn`` inputs, (B, H, S, D) layout):

* forward and backward time (``common.bench_fwd_bwd``: ``do_bench`` medians, backward = forward+
  backward minus forward) and TFLOP/s from counted FLOPs: forward ``4*B*H*Sq*Sk*D`` (two matmuls of
  2 FLOPs per multiply-add), half of it when causal; backward 2.5x the forward (five matmuls to the
  forward's two). Padding counts as computed work in padded rows (useful FLOPs are fewer); the varlen
  rows count only useful FLOPs (sum over sequences of ``4*H*L^2*D``) for every implementation.
* peers in the same run: torch SDPA flash / cuDNN / memory-efficient (each forced with
  ``torch.nn.attention.sdpa_kernel``; a backend that cannot run a case is recorded as "no kernel"),
  FlexAttention compiled with ``torch.compile`` (block masks from ``create_block_mask`` for causal and
  key padding), and eager matmul+softmax for the BERT shapes only.
* before any timing, pykernels' output and q/k/v gradients are checked against torch SDPA in fp32
  (memory-efficient backend, math as fallback) with the three-way rule: pykernels' max error at most
  2x that of torch's default bf16 SDPA, plus 2^-10 of the largest reference magnitude (under a quarter
  of a bf16 ulp there). A failed
  check marks the row INVALID and it is not timed (a wrong fast kernel is never reported).
* the same forward and forward+backward captured in CUDA graphs and replayed (``graph_*`` columns,
  for pykernels and the SDPA and FlexAttention peers): do_bench times each call with its host cost (Python,
  dispatch, launches), which dominates small shapes; graph replay shows the kernels' own speed. A peer
  whose capture fails keeps its do_bench numbers and gets a ``graph_note`` saying why.
* pykernels' peak extra memory for one forward+backward (should be O(B*H*S) beyond the gradients,
  never O(S^2)), the card's ceilings (``common.ceilings()``) once per run.

Cases are the anchors of ../shared/ANCHORS.md plus a varlen BERT batch (B32 H12 D64, lengths
uniform in 256..512, the same lengths as the key-padding case) that times
``pykernels.varlen_attention`` on the packed tokens against cuDNN SDPA on the same sequences padded
to 512 with a key-padding mask (goal: at most 2/3 of cuDNN's forward+backward time).

Usage (GPU): ``python benchmarks/attention.py [--quick] [--budget-s 170]``; ``--quick`` runs the BERT
and GPT-2 shapes and the varlen batch. Rows go to ``benchmarks/results/attention_<card>_<date>.csv``
(and ``$OUT/attention.csv``). A time budget keeps the run bounded (the GPU batch gives each script
~200 s): FlexAttention, whose compilation dominates, runs after every other measurement, case by
case; past 80% of the budget nothing new starts (skipped rows say so), and the CSV is rewritten
after every step. ``--smoke`` runs the
same code on CPU (tiny fp32 shapes, Triton interpreter, one untimed run each) to check the plumbing.
Without ``--smoke``, on a machine without CUDA it prints that and exits 0.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

WARMUP, REP = 10, 50  # do_bench milliseconds: modest, the whole GPU batch is bounded
DEVICE = "cuda"  # "cpu" only for --smoke (the script's logic on tiny shapes, timings meaningless)
SMOKE = False
DTYPE = torch.bfloat16  # float32 in --smoke (the Triton interpreter mis-computes bf16 tl.dot)


@dataclass(frozen=True)
class Case:
    name: str
    B: int
    H: int
    S: int
    D: int
    causal: bool = False
    key_padding: bool = False  # (B, 1, 1, S) bool mask from lengths uniform in [S/2, S]
    quick: bool = False
    eager: bool = False  # eager matmul+softmax peer (only where the score matrix is cheap)
    Hkv: int = 0  # key / value heads (GQA) where nonzero and below H

    @property
    def label(self) -> str:
        kind = "causal" if self.causal else ("key-padding" if self.key_padding else "bidirectional")
        heads = f"H{self.H}/{self.Hkv}" if self.Hkv and self.Hkv != self.H else f"H{self.H}"
        return f"B{self.B} {heads} S{self.S} D{self.D} {kind}"

    @property
    def fwd_flops(self) -> float:
        return 4.0 * self.B * self.H * self.S * self.S * self.D * (0.5 if self.causal else 1.0)


CASES = [
    Case("bert", 32, 12, 512, 64, quick=True, eager=True),
    Case("bert_keypad", 32, 12, 512, 64, key_padding=True, quick=True, eager=True),
    Case("gpt2", 8, 12, 1024, 64, causal=True, quick=True),
    Case("causal_4k", 4, 16, 4096, 128, causal=True),
    Case("bidir_8k", 2, 16, 8192, 128),
    Case("causal_8k", 2, 16, 8192, 128, causal=True),
]
VARLEN = dict(B=32, H=12, D=64, S=512, lo=256, hi=512)
# --matrix: shapes beyond the anchors that users' models have (head dims 80 / 96 / 256, GQA, short and BERT-large
# sequences), against torch's SDPA flash and cuDNN backends in the same run (no FlexAttention, eager or
# memory-efficient rows: the run stays within one GPU call); every pykernels backend and `auto` a row each
MATRIX = [
    Case("short_128", 128, 12, 128, 64),
    Case("bert_large", 16, 16, 512, 64),
    Case("d80_bidir", 8, 16, 2048, 80),
    Case("d80_causal", 8, 32, 2048, 80, causal=True),
    Case("d96_bidir", 8, 16, 2048, 96),
    Case("d96_causal", 8, 16, 2048, 96, causal=True),
    Case("d96_keypad", 8, 16, 2048, 96, key_padding=True),
    Case("gqa_causal", 4, 32, 4096, 128, causal=True, Hkv=8),
    Case("gqa_d64_causal", 8, 32, 2048, 64, causal=True, Hkv=8),
    Case("d256_causal", 4, 8, 4096, 256, causal=True),
    Case("d256_bidir", 4, 8, 2048, 256),
    Case("d192_bidir", 4, 8, 2048, 192),
    Case("d192_causal", 4, 8, 4096, 192, causal=True),
]
MATRIX_MODE = False


def bert_lengths(B: int, lo: int, hi: int) -> torch.Tensor:
    """Sequence lengths uniform in [lo, hi], fixed seed (the same for the key-padding and varlen cases)."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(lo, hi + 1, (B,), generator=g)


def key_padding_mask(lengths: torch.Tensor, S: int) -> torch.Tensor:
    """(B, 1, 1, S) bool, True = key takes part."""
    return (torch.arange(S)[None, :] < lengths[:, None])[:, None, None, :].to(DEVICE)


def peak_mib(fn) -> float | None:
    if SMOKE:
        fn()
        return None
    return round(common.peak_extra_mib(fn), 1)


def tflops(flops: float, ms: float | None) -> float | None:
    return round(flops / ms / 1e9, 1) if ms else None


def short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg[:70]}"


def no_kernel(e: BaseException) -> bool:
    """torch's SDPA refusing a forced backend for this case (CUDA: "No available kernel", CPU: "No viable
    backend")."""
    msg = str(e).lower()
    return "no available kernel" in msg or "no viable backend" in msg


# ---------------------------------------------------------------------------------------------
# implementations: each is fwd(q, k, v) -> o for fixed mask/causal, on (B, H, S, D) tensors

def gqa(q, k) -> bool:
    """Whether a call has fewer key / value heads than query heads (``enable_gqa``)."""
    return q.shape[1] != k.shape[1]


def pykernels_impl(mask, causal, backend="triton"):
    import pykernels
    return lambda q, k, v: pykernels.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                                   enable_gqa=gqa(q, k), backend=backend)


def cuda_built() -> bool:
    """Whether pykernels' CUDA C++ extension is built here (then its attention gets a row of its own)."""
    import pykernels
    return pykernels.backends()["cuda"].available and not SMOKE


def auto_is_own(case, q, k, v, mask) -> bool:
    """Whether ``backend="auto"`` runs a pair of its own here, neither backend's (pykernels.attention's
    ``_auto_cuda_fwd_kind``: the C++ forward, the Triton backward): then it gets a row of its own."""
    import pykernels.attention as pa
    if not cuda_built():
        return False
    m4 = None if mask is None else mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return pa._auto_cuda_fwd_kind(q, k, v, m4, case.causal, "auto")


def sdpa_impl(mask, causal, backend=None):
    from torch.nn.attention import sdpa_kernel
    import torch.nn.functional as F

    def fwd(q, k, v):
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa(q, k))
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa(q, k))
    return fwd


def eager_impl(mask, causal):
    def fwd(q, k, v):
        s = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        if causal:
            keep = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).tril()
            s = s.masked_fill(~keep, float("-inf"))
        return torch.matmul(torch.softmax(s.float(), dim=-1).to(q.dtype), v)
    return fwd


_flex_compiled = None


def flex_impl(case: Case, lengths: torch.Tensor | None):
    """Compiled FlexAttention with a block mask for the case (one compiled callable for the run)."""
    global _flex_compiled
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if _flex_compiled is None:
        cfg = torch._dynamo.config
        if hasattr(cfg, "recompile_limit"):
            cfg.recompile_limit = max(cfg.recompile_limit, 32)
        else:  # older name
            cfg.cache_size_limit = max(cfg.cache_size_limit, 32)
        # static shapes: one specialised kernel per case, as FlexAttention is meant to be benchmarked;
        # --smoke: eager flex_attention (CPU compilation is slow and not what is being checked)
        _flex_compiled = flex_attention if SMOKE else torch.compile(flex_attention, dynamic=False)
    block_mask = None
    if case.causal:
        def causal_mod(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx
        block_mask = create_block_mask(causal_mod, None, None, case.S, case.S, device=DEVICE)
    elif case.key_padding:
        lens = lengths.to(DEVICE)

        def padding_mod(b, h, q_idx, kv_idx):
            return kv_idx < lens[b]
        block_mask = create_block_mask(padding_mod, case.B, None, case.S, case.S, device=DEVICE)
    return lambda q, k, v: _flex_compiled(q, k, v, block_mask=block_mask)


# ---------------------------------------------------------------------------------------------
# validation

def fwd_bwd(fwd, q, k, v, do):
    """Output and (dq, dk, dv) of one forward+backward on fresh leaf copies."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    o = fwd(q, k, v)
    o.backward(do.to(o.dtype))
    return [o.detach(), q.grad, k.grad, v.grad]


def reference_fp32(mask, causal, q, k, v, do):
    """torch SDPA in fp32: memory-efficient backend, math as fallback for small cases."""
    from torch.nn.attention import SDPBackend
    args = [t.float() for t in (q, k, v)]
    try:
        return fwd_bwd(sdpa_impl(mask, causal, SDPBackend.EFFICIENT_ATTENTION), *args, do.float())
    except RuntimeError:
        if q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] > 2**31:
            raise
        return fwd_bwd(sdpa_impl(mask, causal, SDPBackend.MATH), *args, do.float())


NAMES = ("out", "dq", "dk", "dv")


def three_way(ours: list, peer: list, ref: list) -> tuple[bool, dict]:
    """pykernels' error vs the fp32 reference at most 2x torch bf16's error + 2^-10 of max |reference|."""
    info, ok = {}, True
    for name, a, p, r in zip(NAMES, ours, peer, ref):
        err = (a.float() - r).abs().max().item()
        base = (p.float() - r).abs().max().item()
        atol = 2.0 ** -10 * r.abs().max().item()
        good = math.isfinite(err) and err <= 2 * base + atol
        ok &= good
        info[f"err_{name}"] = f"{err:.2e}"
        info[f"torch_err_{name}"] = f"{base:.2e}"
    return ok, info


def validate(fwd, mask, causal, q, k, v, do) -> tuple[bool, dict]:
    """Three-way check of fwd's output and gradients on (B, H, S, D) inputs (see three_way)."""
    ref = reference_fp32(mask, causal, q, k, v, do)
    peer = fwd_bwd(sdpa_impl(mask, causal), q, k, v, do)
    ours = fwd_bwd(fwd, q, k, v, do)
    return three_way(ours, peer, ref)


# ---------------------------------------------------------------------------------------------

class Budget:
    def __init__(self, seconds: float):
        self.t0, self.seconds = time.time(), seconds

    def used(self) -> float:
        return time.time() - self.t0

    def ok(self) -> bool:  # a case or a FlexAttention compile can take ~20-30 s: start none past 80%
        return self.used() < 0.8 * self.seconds


def time_impl(fwd, q, k, v, do) -> tuple[float, float]:
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    if SMOKE:  # one wall-clock run each: only the plumbing is being checked
        t0 = time.perf_counter()
        o = fwd(q, k, v)
        t1 = time.perf_counter()
        o.backward(do)
        return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3
    return common.bench_fwd_bwd(lambda: fwd(q, k, v), grad=do, inputs=(q, k, v), warmup=WARMUP, rep=REP)


def graph_time(fwd, q, k, v, do) -> dict:
    """Forward and forward+backward captured in CUDA graphs (after warm-up on a side stream, which also
    finishes any autotuning) and timed by replaying them: the kernels' own time without the host's
    per-call cost (Python, dispatch, launches). ``graph_fwd_ms``/``graph_bwd_ms`` (backward =
    forward+backward minus forward, as for do_bench); on a capture failure ``graph_note`` says why."""
    if SMOKE:
        return {"graph_note": "smoke: no CUDA graph"}
    qg, kg, vg = (t.detach().clone() for t in (q, k, v))
    ql, kl, vl = (t.detach().clone().requires_grad_(True) for t in (q, k, v))

    def step():
        for t in (ql, kl, vl):
            t.grad = None  # the captured backward allocates the grads from the graph's pool
        fwd(ql, kl, vl).backward(do)

    out = {}
    g_f = g_fb = None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                with torch.no_grad():
                    fwd(qg, kg, vg)
                step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g_f = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(g_f):
            fwd(qg, kg, vg)
        for t in (ql, kl, vl):
            t.grad = None
        g_fb = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g_fb):
            fwd(ql, kl, vl).backward(do)
        g_f.replay()
        g_fb.replay()
        torch.cuda.synchronize()
        f_ms = common.bench(g_f.replay, warmup=WARMUP, rep=REP)
        fb_ms = common.bench(g_fb.replay, warmup=WARMUP, rep=REP)
        out = {"graph_fwd_ms": round(f_ms, 4), "graph_bwd_ms": round(max(fb_ms - f_ms, 0.0), 4)}
    except Exception as e:  # noqa: BLE001 - capture is best effort: note why and keep the do_bench row
        out = {"graph_note": f"capture failed: {short(e)}"}
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass
    finally:
        del g_f, g_fb
        for t in (ql, kl, vl):
            t.grad = None
    return out


def tuned_configs(D: int, S: int, causal: bool, mask_kind: int, varlen: bool = False, B: int = 1,
                  H: int = 1) -> str:
    """The configs pykernels' autotuner picked for this case's bf16 kernels, e.g. "fwd 128x64/w8/s3;
    dkdv 32x128/w8/s2; dq 128x64/w8/s2", or the sm_90 Gluon kernel's where the case takes it (best effort:
    "?" where the cache has no matching entry)."""
    try:
        from pykernels._kernels import attention as ka
    except ImportError:
        try:
            from kernels import attention as ka
        except ImportError:
            return "?"
    bd = ka._pow2_dim(D)
    want = (bd, bd, ka._seq_bucket(S, S), bool(causal), mask_kind, False, bool(varlen))
    out = []
    for name, kern in (("fwd", ka._attention_fwd_kernel), ("dkdv", ka._attention_bwd_dkdv_kernel),
                       ("dq", ka._attention_bwd_dq_kernel)):
        cfg = "?"
        for key, c in getattr(kern, "cache", {}).items():
            if tuple(key[:7]) == want and "bfloat16" in str(key):
                cfg = f"{c.kwargs.get('BLOCK_M')}x{c.kwargs.get('BLOCK_N')}/w{c.num_warps}/s{c.num_stages}"
        if name == "fwd" and cfg == "?" and sm90_case(D, S, causal, mask_kind, varlen):
            from pykernels._kernels import attention_sm90
            cfgs = attention_sm90.KEY_PAD_CONFIGS if mask_kind else {}
            bm, bn, st = cfgs.get(D, attention_sm90.CONFIGS[D])
            split = attention_sm90.SPLIT_D and D in attention_sm90.SPLIT
            cfg = (f"gluon ping-pong 2x{bm}x{bn}/s{st}{'' if causal else ' persistent'}"
                   f"{f' on {_tile_d(D)}-wide tiles' if _tile_d(D) != D else ''}"
                   f"{' GEMMs on columns {}+{}'.format(*attention_sm90.SPLIT[D]) if split else ''}"
                   f"{' key padding' if mask_kind else ''}{' varlen' if varlen else ''}")
        which = sm90_bwd_kernels(D, S, causal, mask_kind, varlen, B, H) if name != "fwd" else ""
        tile_d = _tile_d(D)  # (D = 80 / 96 / 192 on wider tiles: ``attention_sm90.TILE_D``)
        if which == "fused":
            from pykernels._kernels import attention_sm90_bwd as kb
            bn, bm, st = kb.DKDV_CONFIGS[tile_d]
            cfg = (f"gluon fused ws 2x{bn} keys x {bm} queries/s{st}, dQ by TMA reductions" if name == "dkdv"
                   else "(in the fused kernel)")
        elif name != "fwd" and name in which.split(","):
            from pykernels._kernels import attention_sm90_bwd as kb
            if name == "dkdv" and D in kb.DKDV_D256_CONFIGS:
                bn, bm, st = kb.DKDV_D256_CONFIGS[D]
                cfg = f"gluon ws {bn} keys x {bm} queries/s{st}, dV in one warpgroup, dK in the other"
                if kb.SPLIT_D_BWD and D in kb.SPLIT:
                    cfg += ", GEMMs on columns {}+{}".format(*kb.SPLIT[D])
            elif name == "dkdv":
                bn, bm, st = kb.DKDV_CONFIGS[tile_d]
                cfg = f"gluon ws 2x{bn} keys x {bm} queries/s{st}"
            else:
                bm, bn, st = kb.DQ_CONFIGS[D]
                cfg = f"gluon ping-pong 2x{bm}x{bn}/s{st}"
        elif name == "dq" and cfg != "?" and getattr(ka, "DQ_SPLIT", False) and D in getattr(ka, "DQ_SPLIT_D", {}):
            cfg += " on columns {}+{}".format(ka.DQ_SPLIT_D[D], D - ka.DQ_SPLIT_D[D])  # (Triton's, ``DQ_SPLIT``)
        out.append(f"{name} {cfg}")
    return "; ".join(out)


def _tile_d(D: int) -> int:
    """The tile width the sm_90 Gluon kernels run head dim D on (``attention_sm90.TILE_D``)."""
    try:
        from pykernels._kernels import attention_sm90
    except ImportError:  # (no Gluon in this Triton)
        return D
    return attention_sm90.TILE_D.get(D, D)


def sm90_bwd_kernels(D: int, S: int, causal: bool, mask_kind: int, varlen: bool, B: int, H: int) -> str:
    """The Gluon backward kernels pykernels' dense backward took for this case (bf16, S x S), e.g. "dkdv,dq"."""
    if mask_kind or varlen or not torch.cuda.is_available():
        return ""
    from pykernels._kernels import attention as ka
    q = torch.empty(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    return ka.sm90_backward(q, q, q, q, None, dropout_p=0.0, scale=D ** -0.5, causal=causal)


def sm90_case(D: int, S: int, causal: bool, mask_kind: int, varlen: bool) -> bool:
    """Whether pykernels' forward took the sm_90 Gluon kernel for this case (bf16, S x S; varlen: a packed
    batch whose longest sequence is S)."""
    if mask_kind not in (0, 3) or not torch.cuda.is_available():
        return False
    from pykernels._kernels import attention as ka
    if varlen:
        t = torch.empty(4 * S, 1, D, device="cuda", dtype=torch.bfloat16)
        cu = torch.tensor([0, 4 * S], dtype=torch.int32, device="cuda")
        return ka.sm90_varlen_forward(t, t, t, cu, cu, S, S, dropout_p=0.0, scale=D ** -0.5, causal=causal)
    q = torch.empty(1, 1, S, D, device="cuda", dtype=torch.bfloat16)
    if mask_kind == 3:  # a boolean key-padding mask, with its key range
        mask = torch.ones(1, 1, 1, S, dtype=torch.bool, device="cuda")
        kv = torch.tensor([[0, S, 1]], dtype=torch.int32, device="cuda")
        return ka.sm90_forward(q, q, q, mask, dropout_p=0.0, scale=D ** -0.5, causal=causal, kv_range=kv)
    return ka.sm90_forward(q, q, q, None, dropout_p=0.0, scale=D ** -0.5, causal=causal)


def run_case(case: Case, budget: Budget) -> list[dict]:
    from torch.nn.attention import SDPBackend
    base = dict(case=case.name, shape=case.label, B=case.B, H=case.H, Hkv=case.Hkv or case.H, S=case.S, D=case.D,
                causal=case.causal,
                key_padding=case.key_padding, flops_fwd=f"{case.fwd_flops:.4g}")
    if not budget.ok():
        return [{**base, "impl": "all", "status": f"skipped (time budget {budget.seconds:.0f}s)"}]
    q, k, v, do, lengths, mask = case_inputs(case)
    rows = []

    # pykernels: validate, then time, then memory (the Triton backend; the CUDA C++ one where it is built)
    for backend in ("triton", "cuda") if cuda_built() else ("triton",):
        rows.append(time_ours(case, base, backend, q, k, v, do, mask))
    if MATRIX_MODE or auto_is_own(case, q, k, v, mask):  # auto's own pair: the C++ forward, the Triton backward
        rows.append(time_ours(case, base, "auto", q, k, v, do, mask))

    additive = additive_mask(mask)
    peers = [("sdpa flash", sdpa_impl(mask, case.causal, SDPBackend.FLASH_ATTENTION), None),
             ("sdpa cudnn", sdpa_impl(mask, case.causal, SDPBackend.CUDNN_ATTENTION),
              None if additive is None else sdpa_impl(additive, case.causal, SDPBackend.CUDNN_ATTENTION))]
    if not MATRIX_MODE:
        peers.append(("sdpa mem-efficient", sdpa_impl(mask, case.causal, SDPBackend.EFFICIENT_ATTENTION), None))
    if case.eager:
        peers.append(("eager", eager_impl(mask, case.causal), None))
    for name, fwd, alt in peers:
        row = {**base, "impl": name}
        try:
            # eager is far from the kernels being compared: no graph replay (keeps the run short)
            row.update(time_peer(fwd, alt, q, k, v, do, graph=name != "eager"))
        except Exception as e:  # noqa: BLE001
            row["status"] = f"error: {short(e)}"
        rows.append(row)
    finish_case(case, rows)
    return rows


def run_flex(case: Case, rows: list[dict], budget: Budget) -> bool:
    """Append the FlexAttention row to a case's rows (compiled last: its compilation dominates the run).
    False if the case itself was skipped (nothing appended)."""
    if rows[0].get("impl") == "all":
        return False
    row = {key: rows[0][key] for key in ("case", "shape", "B", "H", "S", "D", "causal", "key_padding", "flops_fwd")}
    row["impl"] = "flex (compiled)"
    if not budget.ok():
        row["status"] = f"skipped (time budget {budget.seconds:.0f}s)"
    else:
        q, k, v, do, lengths, _ = case_inputs(case)
        try:
            row.update(time_peer(flex_impl(case, lengths), None, q, k, v, do))
        except Exception as e:  # noqa: BLE001
            row["status"] = f"error: {short(e)}"
        del q, k, v, do
    rows.append(row)
    finish_case(case, rows)
    return True


def case_inputs(case: Case):
    """q, k, v, do (B, H, S, D) randn (seeded), and for key padding the lengths and the (B, 1, 1, S) mask."""
    torch.manual_seed(0)
    shape = (case.B, case.H, case.S, case.D)
    kv_shape = (case.B, case.Hkv or case.H, case.S, case.D)
    q, k, v, do = (torch.randn(sh, device=DEVICE, dtype=DTYPE) for sh in (shape, kv_shape, kv_shape, shape))
    lengths = bert_lengths(case.B, case.S // 2, case.S) if case.key_padding else None
    mask = key_padding_mask(lengths, case.S) if case.key_padding else None
    return q, k, v, do, lengths, mask


def finish_case(case: Case, rows: list[dict]) -> None:
    set_tflops(rows, case.fwd_flops)
    add_ratios(rows)
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def set_tflops(rows: list[dict], flops: float) -> None:
    """TFLOP/s from the do_bench times and, where captured, from the CUDA-graph replay times."""
    for r in rows:
        if r.get("status") == "ok":
            r["fwd_TFLOPs"] = tflops(flops, r["fwd_ms"])
            r["bwd_TFLOPs"] = tflops(2.5 * flops, r["bwd_ms"])
            if r.get("graph_fwd_ms"):
                r["graph_fwd_TFLOPs"] = tflops(flops, r["graph_fwd_ms"])
                r["graph_bwd_TFLOPs"] = tflops(2.5 * flops, r["graph_bwd_ms"])


def additive_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The bool key-padding mask as an additive (0 / -inf) mask in the inputs' dtype."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=DTYPE, device=mask.device).masked_fill(~mask, float("-inf"))


def time_ours(case: Case, base: dict, backend: str, q, k, v, do, mask) -> dict:
    """pykernels' row for one backend (``base``: the case's columns): validated against the fp32 reference, then
    timed (do_bench and graph replay), then its peak extra memory."""
    row = {**base, "impl": f"pykernels {backend}"}
    ours_fwd = pykernels_impl(mask, case.causal, backend)
    try:
        ok, info = validate(ours_fwd, mask, case.causal, q, k, v, do)
        row.update(info)
        if not ok:
            row["status"] = "INVALID"
            return row
        f_ms, b_ms = time_impl(ours_fwd, q, k, v, do)
        qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        peak = peak_mib(lambda: ours_fwd(qq, kk, vv).backward(do))
        # output + 3 gradients are unavoidable; the rest is the kernels' scratch (lse, delta, ...),
        # which must stay O(B*H*S): compare with one fp32 (B, H, S) tensor
        io_mib = 4 * q.numel() * q.element_size() / 2**20
        row.update(status="ok", fwd_ms=round(f_ms, 4), bwd_ms=round(b_ms, 4), peak_extra_MiB=peak,
                   **graph_time(ours_fwd, q, k, v, do), out_and_grads_MiB=round(io_mib, 1),
                   scratch_MiB=None if peak is None else round(peak - io_mib, 1),
                   fp32_BHS_MiB=round(case.B * case.H * case.S * 4 / 2**20, 2))
        if backend == "triton":
            row["configs"] = tuned_configs(case.D, case.S, case.causal, 3 if case.key_padding else 0, B=case.B,
                                           H=case.H)
    except Exception as e:  # noqa: BLE001 - record and go on with the peers
        row["status"] = f"error: {short(e)}"
    return row


def time_peer(fwd, alt, q, k, v, do, graph: bool = True) -> dict:
    """Run once (compiles FlexAttention; finds out whether a forced SDPA backend has a kernel), then time.
    ``alt``: the same peer given the mask in additive form, tried when the bool form has no kernel."""
    note = {}
    try:
        fwd_bwd(fwd, q, k, v, do)
    except RuntimeError as e:
        if not no_kernel(e):
            raise
        if alt is None:
            return {"status": "no kernel"}
        try:
            fwd_bwd(alt, q, k, v, do)
        except RuntimeError as e2:
            if no_kernel(e2):
                return {"status": "no kernel"}
            raise
        fwd, note = alt, {"note": "additive mask (no kernel for the bool mask)"}
    f_ms, b_ms = time_impl(fwd, q, k, v, do)
    return {"status": "ok", "fwd_ms": round(f_ms, 4), "bwd_ms": round(b_ms, 4), **note,
            **(graph_time(fwd, q, k, v, do) if graph else {})}


def add_ratios(rows: list[dict]) -> None:
    """Each row's TFLOP/s (or speed) over the fastest peer's (not pykernels) in the same case."""
    for r in rows:
        if r.get("status") == "ok" and MATMUL_PEAK and r.get("fwd_TFLOPs"):
            r["fwd_pct_matmul_peak"] = round(100 * r["fwd_TFLOPs"] / MATMUL_PEAK, 1)
    ok_rows = [r for r in rows if r.get("status") == "ok"]
    for key in ("fwd", "bwd", "graph_fwd", "graph_bwd"):
        peers = [r for r in ok_rows if not r["impl"].startswith("pykernels") and r.get(f"{key}_ms")]
        if not peers:
            continue
        best = min(peers, key=lambda r: r[f"{key}_ms"])
        for r in ok_rows:
            if r.get(f"{key}_ms") and best[f"{key}_ms"] > 0:
                r[f"{key}_vs_best_peer"] = round(best[f"{key}_ms"] / r[f"{key}_ms"], 3)
                r[f"{key}_best_peer"] = best["impl"]


def run_varlen(budget: Budget) -> list[dict]:
    """pykernels.varlen_attention on packed tokens vs cuDNN SDPA (and pykernels) on the padded batch."""
    import pykernels
    from torch.nn.attention import SDPBackend
    B, H, D, S = VARLEN["B"], VARLEN["H"], VARLEN["D"], VARLEN["S"]
    lengths = bert_lengths(B, VARLEN["lo"], VARLEN["hi"])
    useful = float(sum(4.0 * H * int(n) ** 2 * D for n in lengths))
    base = dict(case="bert_varlen", shape=f"B{B} H{H} D{D} lengths {VARLEN['lo']}..{VARLEN['hi']} (pad {S})",
                B=B, H=H, S=S, D=D, causal=False, key_padding=True, flops_fwd=f"{useful:.4g}", flops="useful")
    if not budget.ok():
        return [{**base, "impl": "all", "status": f"skipped (time budget {budget.seconds:.0f}s)"}]
    torch.manual_seed(0)
    total = int(lengths.sum())
    cu = torch.zeros(B + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    cu = cu.to(DEVICE)
    max_len = int(lengths.max())
    # indices of the valid rows of the padded (B*S) token axis
    idx = torch.cat([b * S + torch.arange(int(n)) for b, n in enumerate(lengths)]).to(DEVICE)
    mask = key_padding_mask(lengths, S)
    q, k, v, do = (torch.randn(total, H, D, device=DEVICE, dtype=DTYPE) for _ in range(4))

    def to_padded(t):  # (total, H, D) -> (B, H, S, D), zeros in padding; differentiable in t
        z = t.new_zeros(B * S, H, D).index_copy(0, idx, t)
        return z.view(B, S, H, D).transpose(1, 2)

    def from_padded(t):  # (B, H, S, D) -> (total, H, D)
        return t.transpose(1, 2).reshape(B * S, H, D).index_select(0, idx)

    def padded_fn(inner):
        return lambda q_, k_, v_: from_padded(inner(to_padded(q_), to_padded(k_), to_padded(v_)))

    def varlen_impl(backend):
        return lambda q_, k_, v_: pykernels.varlen_attention(q_, k_, v_, cu, cu, max_len, max_len, backend=backend)

    rows = []
    for backend in ("triton", "cuda") if cuda_built() else ("triton",):
        varlen_fwd = varlen_impl(backend)
        name = "pykernels varlen (packed)" if backend == "triton" else "pykernels cuda varlen (packed)"
        row = {**base, "impl": name}
        try:
            ref = fwd_bwd(padded_fn(lambda a, b, c: reference_fp32_fwd(mask, a, b, c)),
                          *(t.float() for t in (q, k, v)), do.float())
            peer = fwd_bwd(padded_fn(sdpa_impl(mask, False)), q, k, v, do)
            ours = fwd_bwd(varlen_fwd, q, k, v, do)
            ok, info = three_way(ours, peer, ref)
            row.update(info)
            del ref, peer, ours
            if not ok:
                row["status"] = "INVALID"
            else:
                f_ms, b_ms = time_impl(varlen_fwd, q, k, v, do)
                qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
                row.update(status="ok", fwd_ms=round(f_ms, 4), bwd_ms=round(b_ms, 4),
                           peak_extra_MiB=peak_mib(lambda: varlen_fwd(qq, kk, vv).backward(do)),
                           **graph_time(varlen_fwd, q, k, v, do))
                if backend == "triton":
                    row["configs"] = tuned_configs(D, max_len, False, 0, varlen=True)
        except Exception as e:  # noqa: BLE001
            row["status"] = f"error: {short(e)}"
        rows.append(row)

    # padded peers time only the attention on already-padded tensors (the padding copies are not theirs)
    qp, kp, vp, dop = (torch.randn(B, H, S, D, device=DEVICE, dtype=DTYPE) for _ in range(4))
    row = {**base, "impl": "sdpa cudnn (padded)"}
    try:
        row.update(time_peer(sdpa_impl(mask, False, SDPBackend.CUDNN_ATTENTION),
                             sdpa_impl(additive_mask(mask), False, SDPBackend.CUDNN_ATTENTION), qp, kp, vp, dop))
    except Exception as e:  # noqa: BLE001
        row["status"] = f"error: {short(e)}"
    rows.append(row)
    row = {**base, "impl": "pykernels triton (padded)"}
    try:
        padded_fwd = pykernels_impl(mask, False)
        ok, info = validate(padded_fwd, mask, False, qp, kp, vp, dop)
        row.update(info)
        if ok:
            f_ms, b_ms = time_impl(padded_fwd, qp, kp, vp, dop)
            row.update(status="ok", fwd_ms=round(f_ms, 4), bwd_ms=round(b_ms, 4),
                       **graph_time(padded_fwd, qp, kp, vp, dop))
        else:
            row["status"] = "INVALID"
    except Exception as e:  # noqa: BLE001
        row["status"] = f"error: {short(e)}"
    rows.append(row)
    set_tflops(rows, useful)
    add_ratios(rows)
    varlen_ratios(rows)
    return rows


def varlen_ratios(rows: list[dict]) -> None:
    """Each packed varlen row's forward+backward time as a fraction of cuDNN's on the same sequences padded (the
    issue's goal: <= 2/3), do_bench and graph replay. cuDNN's row is found by name: with the C++ build the rows are
    Triton's varlen, the C++ varlen, then cuDNN's, and taking rows[1] for cuDNN's (run199-234) compared the Triton
    row with the C++ one."""
    cudnn = next((r for r in rows if r["impl"] == "sdpa cudnn (padded)"), None)
    if cudnn is None or cudnn.get("status") != "ok":
        return
    for ours in rows:
        if not ours["impl"].endswith("varlen (packed)") or ours.get("status") != "ok":
            continue
        frac = (ours["fwd_ms"] + ours["bwd_ms"]) / (cudnn["fwd_ms"] + cudnn["bwd_ms"])
        ours["time_vs_cudnn_padded"] = round(frac, 3)
        ours["goal_le_0.667"] = "met" if frac <= 2 / 3 else "not met"
        if all(r.get(k) for r in (ours, cudnn) for k in ("graph_fwd_ms", "graph_bwd_ms")):
            # the same ratio in GPU time (CUDA-graph replay): the do_bench one includes host time
            g = ((ours["graph_fwd_ms"] + ours["graph_bwd_ms"])
                 / (cudnn["graph_fwd_ms"] + cudnn["graph_bwd_ms"]))
            ours["graph_time_vs_cudnn_padded"] = round(g, 3)
            ours["graph_goal_le_0.667"] = "met" if g <= 2 / 3 else "not met"


def reference_fp32_fwd(mask, q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def report_step(groups: list[list[dict]], new: list[dict], budget: Budget):
    """Print the step's outcome; rewrite the CSV with every row so far (not in --smoke)."""
    print(f"[{budget.used():.0f}s] {new[0].get('shape')}: " + ", ".join(
        f"{r['impl']} {r.get('status')}" for r in new), flush=True)
    if not SMOKE:
        return common.write_rows("attention_matrix" if MATRIX_MODE else "attention", [r for g in groups for r in g])
    return None


COLS = ["shape", "impl", "status", "fwd_TFLOPs", "bwd_TFLOPs", "graph_fwd_TFLOPs", "graph_bwd_TFLOPs",
        "graph_note", "fwd_vs_best_peer", "bwd_vs_best_peer", "graph_fwd_vs_best_peer", "graph_bwd_vs_best_peer",
        "fwd_pct_matmul_peak", "err_out", "err_dq", "peak_extra_MiB", "scratch_MiB", "fp32_BHS_MiB", "configs"]
MATMUL_PEAK: float | None = None  # the card's measured bf16 matmul TFLOP/s (common.ceilings), None in --smoke


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="only the BERT and GPT-2 shapes and the varlen batch")
    ap.add_argument("--budget-s", type=float, default=170.0,
                    help="wall-clock budget in seconds: nothing new (case or FlexAttention compile) starts past 80%% of it")
    ap.add_argument("--matrix", action="store_true",
                    help="the shapes beyond the anchors (MATRIX: head dims 80 / 96 / 256, GQA, short sequences) "
                         "against SDPA flash and cuDNN; written to attention_matrix_<card>_<date>.csv")
    ap.add_argument("--only", default="",
                    help="with --matrix: only the MATRIX cases of these comma-separated names (d256_causal,d192_bidir)")
    ap.add_argument("--smoke", action="store_true",
                    help="check the script's logic on CPU: tiny fp32 shapes, Triton interpreter, no timing, no CSV")
    args = ap.parse_args(argv)
    budget = Budget(args.budget_s)
    global DEVICE, SMOKE, DTYPE, CASES, VARLEN, MATMUL_PEAK, MATRIX, MATRIX_MODE
    MATRIX_MODE = args.matrix
    if args.smoke:
        import os
        os.environ.setdefault("TRITON_INTERPRET", "1")
        DEVICE, SMOKE, DTYPE = "cpu", True, torch.float32
        CASES = [Case("bert", 2, 2, 24, 16, quick=True, eager=True),
                 Case("bert_keypad", 2, 2, 24, 16, key_padding=True, quick=True, eager=True),
                 Case("gpt2", 2, 2, 40, 16, causal=True, quick=True)]
        VARLEN = dict(B=3, H=2, D=16, S=20, lo=5, hi=20)
        MATRIX = [Case("d80", 2, 2, 24, 80), Case("gqa", 2, 4, 20, 16, causal=True, Hkv=2)]
        rows: list[dict] = []
    elif not torch.cuda.is_available():
        print("attention benchmark: no CUDA device present; nothing to time (run it on the GPU machine)")
        return 0
    else:
        ceil = common.ceilings()
        print(f"{torch.cuda.get_device_name()}: copy {ceil['copy_TBps']} TB/s, bf16 matmul "
              f"{ceil['matmul_bf16_TFLOPs']} TFLOP/s", flush=True)
        rows = [{"case": "ceilings", "impl": "card", "status": "ok", **ceil}]
        MATMUL_PEAK = ceil["matmul_bf16_TFLOPs"]
    if MATRIX_MODE:  # every case its own step, no varlen batch, no FlexAttention
        groups: list[list[dict]] = [rows]
        path = "(not written: --smoke)"
        names = [n for n in args.only.split(",") if n]
        unknown = sorted(set(names) - {c.name for c in MATRIX})
        if unknown:
            have = ", ".join(c.name for c in MATRIX)
            raise SystemExit(f"--only: no MATRIX case named {', '.join(unknown)} (have {have})")
        for case in [c for c in MATRIX if not names or c.name in names]:
            groups.append(run_case(case, budget))
            path = report_step(groups, groups[-1], budget) or path
        rows = [r for g in groups for r in g]
        common.print_table([r for r in rows if r["case"] != "ceilings"], COLS)
        print("x_vs_best_peer = fastest peer's time (SDPA flash, cuDNN) / this row's time")
        print(f"wrote {path} in {budget.used():.0f}s")
        return 0
    cases = [c for c in CASES if c.quick or not args.quick]
    # BERT cases, then the varlen batch (same lengths as bert_keypad), then the rest; FlexAttention
    # last, case by case while the budget lasts (each case compiles its own kernels). The CSV is
    # rewritten after every step, so a run cut short by an outer timeout still leaves its rows.
    path = "(not written: --smoke)"
    groups: list[list[dict]] = [rows]
    jobs = [lambda c=c: run_case(c, budget) for c in cases[:2]] + [lambda: run_varlen(budget)] + \
        [lambda c=c: run_case(c, budget) for c in cases[2:]]
    for job in jobs:
        groups.append(job())
        path = report_step(groups, groups[-1], budget) or path
    for case, group in zip(cases[:2] + [None] + cases[2:], groups[1:]):
        if case is not None and run_flex(case, group, budget):
            path = report_step(groups, group[-1:], budget) or path
    rows = [r for g in groups for r in g]
    common.print_table([r for r in rows if r["case"] != "ceilings"], COLS)
    print("x_vs_best_peer = fastest peer's time / this row's time (> 1: faster than every peer); "
          "fwd_pct_matmul_peak = forward TFLOP/s as % of this card's bf16 matmul rate; errors are max abs vs "
          "fp32 SDPA")
    for r in rows:
        if "time_vs_cudnn_padded" in r:
            print(f"{r['impl']}: varlen fwd+bwd time / cuDNN padded = {r['time_vs_cudnn_padded']} do_bench, "
                  f"{r.get('graph_time_vs_cudnn_padded', '?')} graph replay (goal <= 0.667)")
    print(f"wrote {path} in {budget.used():.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
