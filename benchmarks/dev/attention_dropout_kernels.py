"""GPU time of the attention with dropout (transformers' 0.1), forward and backward, by the profiler's kernel records:
each kernel's own time (the wall clock of an eager call measures the host). The shapes are the training steps' (benchmarks/train_step.py): BERT-base 32 x 512
bidirectional and GPT-2 8 x 1024 causal, 12 heads of 64; BERT-base with a key-padding mask (a (B, 1, 1, S) boolean
mask, lengths uniform in 256..512: transformers' padded batches); and a D = 128 causal one (the pipelined wgmma
forward).

Usage (GPU): ``python benchmarks/dev/attention_dropout_kernels.py LABEL [--peers] [--triton] [--auto] [--kernels]
[--busy] [--graph] [--iters 10] [--dtype bf16|fp16] [--p 0.1] [--cases bert,gpt2,...]`` (``--p``: the dropout
probability, 0 for the same rows without dropout, the peers' too; ``--cases`` also takes the long D = 128 shapes
s4096_d128, s8192c_d128 and causal_4k_d128 (the attention benchmark's S4096 causal), bert_s128 and bert_s256
(128 x 12 x 128 and 64 x 12 x 256 tokens), bert_varlen: bert_pad's
sequences packed, through ``varlen_attention``, and d128_pad / d128_varlen, the same at D = 128, 8 x 16 x 1024). One
line a shape and implementation: ``NAME case fwd_us bwd_us fwd_TFLOPs bwd_TFLOPs`` (a call's kernels; the backward
is the forward+backward's time less the forward's; FLOPs as benchmarks/attention.py counts them, the padded case's as
if unpadded), then with ``--busy`` the forward and backward us as the union of the kernels' intervals (a kernel that
overlaps another counted once) and with ``--graph`` as one call's CUDA-graph replay (benchmarks/attention.py's
graph_time; nan where the capture failed). NAME is LABEL for
the C++ backend's rows (the build under test in an A/B, benchmarks/dev/attention_cuda_ab_builds.sh), else the peer's
name: ``--triton`` adds the same calls through the Triton backend, ``--auto`` through ``auto``; ``--peers`` the C++
backend without dropout (the dropout's cost) and torch's SDPA flash, memory-efficient and cuDNN backends with dropout
(those that take it).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from attention import graph_time  # noqa: E402  (benchmarks/attention.py)
from common import gpu_busy_ms, gpu_kernel_ms, gpu_kernels_us  # noqa: E402  (benchmarks/common.py)

import pykernels  # noqa: E402

CASES = (("bert", 32, 12, 512, 64, False), ("gpt2", 8, 12, 1024, 64, True), ("bert_pad", 32, 12, 512, 64, False),
         ("causal_2k_d128", 4, 16, 2048, 128, True),
         # (named by --cases only: bert_pad's batch packed, its lengths, through varlen_attention; SDPA's rows there
         # are not run: bert_pad's are the peers' padded time for the same sequences)
         ("bert_varlen", 32, 12, 512, 64, False),
         # (named by --cases only: the same at D = 128, 8 x 16 heads x 1024, padded and packed: the deferred fused
         # backward over packed sequences, branch next/varlen-bwd-tma-d128)
         ("d128_pad", 8, 16, 1024, 128, False), ("d128_varlen", 8, 16, 1024, 128, False),
         # (named by --cases only: the ANCHORS long D = 128 shapes)
         ("s4096_d128", 4, 16, 4096, 128, False), ("s8192c_d128", 1, 16, 8192, 128, True),
         ("causal_4k_d128", 4, 16, 4096, 128, True),
         # (named by --cases only: short sequences, 128 and 256 tokens, where the C++ forward takes two consumers:
         # fwd_three_pad_ok)
         ("bert_s128", 128, 12, 128, 64, False), ("bert_s256", 64, 12, 256, 64, False))
DEFAULT_CASES = "bert,gpt2,bert_pad,causal_2k_d128"


def flops(b: int, h: int, s: int, d: int, causal: bool) -> float:
    f = 4.0 * b * h * s * s * d
    return f / 2 if causal else f


def impls(peers: bool, triton: bool, p_drop: float = 0.1, auto: bool = False):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def ours(backend, p):
        def run(q, k, v, causal, mask, cu=None, max_len=0):
            if cu is not None:  # packed (T, H, D) sequences
                return pykernels.varlen_attention(q, k, v, cu, cu, max_len, max_len, causal=causal, dropout_p=p,
                                                  backend=backend)
            return pykernels.scaled_dot_product_attention(q, k, v, mask, dropout_p=p, is_causal=causal,
                                                          backend=backend)
        return run

    def sdpa(kind):
        def run(q, k, v, causal, mask, cu=None, max_len=0):
            if cu is not None:
                raise RuntimeError("SDPA takes no packed sequences (bert_pad: the padded batch)")
            with sdpa_kernel(kind):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, mask, dropout_p=p_drop,
                                                                        is_causal=causal)
        return run

    yield "cuda", ours("cuda", p_drop)
    if triton:
        yield "triton", ours("triton", p_drop)
    if auto:
        yield "auto", ours("auto", p_drop)
    if peers:
        if p_drop > 0:
            yield "cuda-nodrop", ours("cuda", 0.0)
        yield "sdpa-flash", sdpa(SDPBackend.FLASH_ATTENTION)
        yield "sdpa-efficient", sdpa(SDPBackend.EFFICIENT_ATTENTION)
        yield "sdpa-cudnn", sdpa(SDPBackend.CUDNN_ATTENTION)


def time_case(fn, b: int, h: int, s: int, d: int, causal: bool, iters: int,
              kernels: bool = False, dtype: torch.dtype = torch.bfloat16, padded: bool = False,
              varlen: bool = False, busy: bool = False, graph: bool = False,
              hkv: int = 0) -> tuple[float, float, list[float]]:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, hh, s, d, device="cuda", dtype=dtype, generator=g).requires_grad_()
               for hh in (h, hkv or h, hkv or h))  # (hkv < h: GQA, the fn's to pass enable_gqa)
    do = torch.randn(b, h, s, d, device="cuda", dtype=dtype, generator=g)
    mask, cu, max_len = None, None, 0
    if padded or varlen:  # a key-padding mask, lengths uniform in s / 2 .. s
        lens = torch.randint(s // 2, s + 1, (b,), device="cuda", generator=g)
        mask = (torch.arange(s, device="cuda") < lens[:, None]).view(b, 1, 1, s)
    if varlen:  # the same sequences packed: (T, H, D), int32 cu_seqlens
        valid = mask.view(b, s)
        q, k, v = (t.detach().transpose(1, 2)[valid].requires_grad_() for t in (q, k, v))
        do = do.transpose(1, 2)[valid]
        cu = torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0)).to(torch.int32)
        mask, max_len = None, s

    def fwd():
        with torch.no_grad():
            for _ in range(iters):
                fn(q, k, v, causal, mask, cu, max_len)

    def fwd_bwd():  # (autograd.grad: no accumulation into .grad, whose add kernels were counted until run278)
        for _ in range(iters):
            torch.autograd.grad([fn(q, k, v, causal, mask, cu, max_len)], [q, k, v], [do])

    fwd_bwd()  # compiles / warms up outside the profile
    torch.cuda.synchronize()
    f = gpu_kernel_ms(fwd) / iters
    fb = gpu_kernel_ms(fwd_bwd) / iters
    if kernels:  # each kernel of a forward+backward (the seed's draw, the delta pass, the forward, the backward)
        for us, name in gpu_kernels_us(fwd_bwd, iters):
            print(f"    {us:8.1f} us  {name[:110]}")
    extra = []
    if busy:  # the union of the kernels' intervals (kernels that overlap counted once)
        bf, bfb = gpu_busy_ms(fwd) / iters, gpu_busy_ms(fwd_bwd) / iters
        extra += [bf * 1e3, (bfb - bf) * 1e3]
    if graph:  # one call captured in a CUDA graph and replayed, as the attention benchmark does (no host time)
        g = graph_time(lambda q_, k_, v_: fn(q_, k_, v_, causal, mask, cu, max_len), q, k, v, do)
        extra += [g.get("graph_fwd_ms", float("nan")) * 1e3, g.get("graph_bwd_ms", float("nan")) * 1e3]
    return f * 1e3, (fb - f) * 1e3, extra


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("label", nargs="?", default="build")
    ap.add_argument("--peers", action="store_true")
    ap.add_argument("--triton", action="store_true")
    ap.add_argument("--auto", action="store_true", help="the same calls through backend auto (what a user gets)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--p", type=float, default=0.1, help="the dropout probability (0: the peers without dropout too)")
    ap.add_argument("--kernels", action="store_true", help="print the C++ (and auto) rows' kernels, each's time a call")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--busy", action="store_true",
                    help="also the union of the kernels' intervals, forward and backward us (overlapping kernels)")
    ap.add_argument("--graph", action="store_true",
                    help="also one call captured in a CUDA graph and replayed, forward and backward us")
    ap.add_argument("--cases", default=DEFAULT_CASES,
                    help=f"comma-separated, of {', '.join(c[0] for c in CASES)} (default: {DEFAULT_CASES})")
    args = ap.parse_args()
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    print("#", torch.cuda.get_device_name(), "torch", torch.__version__, args.dtype, "dropout", args.p)
    for name, fn in impls(args.peers, args.triton, args.p, args.auto):
        label = args.label if name == "cuda" else name
        for case, b, h, s, d, causal in CASES:
            if case not in args.cases.split(","):
                continue
            try:
                show = args.kernels and name in ("cuda", "auto")
                f_us, b_us, extra = time_case(fn, b, h, s, d, causal, args.iters, show, dtype,
                                              padded=case.endswith("_pad"), varlen=case.endswith("_varlen"),
                                              busy=args.busy, graph=args.graph)
            except RuntimeError as e:  # an SDPA backend that does not take the case
                print(f"{label} {case} not run: {str(e).splitlines()[0][:120]}")
                continue
            fl = flops(b, h, s, d, causal)
            print(f"{label} {case} {f_us:.1f} {b_us:.1f} {fl / f_us / 1e6:.1f} {2.5 * fl / b_us / 1e6:.1f}"
                  + "".join(f" {x:.1f}" for x in extra), flush=True)


if __name__ == "__main__":
    main()
