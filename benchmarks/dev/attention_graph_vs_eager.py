"""Why a backward's time differs between eager calls and CUDA-graph replay: the whole attention backward
(``attention.attention_bwd``) of one case timed five ways in one process, and its kernels' device time per
call under torch.profiler, eager and replayed.

run109's benchmark had the S8192 causal backward (the fused kernel) at 2.79 ms with do_bench on eager calls
and 3.15 ms replayed from a graph (cuDNN 2.88 / 2.92 ms); run107 had 3.12 / 3.08 ms. This probe separates
the timing method (L2 flushed or not, one call per replay or many) from the kernels' own time, and moves
the buffers' placement (a pad allocated first) to see whether the kernels depend on where their buffers lie.

``--forward``: the forward instead, next to cuDNN's and FlashAttention-2's through torch's SDPA, the op
(``pykernels.scaled_dot_product_attention``) and the launcher (``attention.attention_fwd``) both: the
benchmark's one-call graph with the L2 flushed (``benchmarks/attention.py``'s ``graph_*`` columns) against 20
calls in one graph (``attention_ncu.py --ab-fwd``'s), and each kernel's device time cold (after a flush) and
back to back. run121's benchmark had the BERT-base forward at 80.4 us against cuDNN's 72.8; run124's A/B
harness had the same kernel at 73.4 us.

Usage (GPU): ``python benchmarks/dev/attention_graph_vs_eager.py [--cases s8192c,s8192,s4096c]``;
``--forward [--cases bert,gpt2,s8192]``;
``--placement s8192c [--rounds 3]``: interleaved rounds of buffer placements with the GPU's clock and power.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_ncu import CASES  # noqa: E402
from attention_sm90_gluon_ws import capture, graph_ms  # noqa: E402

from pykernels._kernels import attention as katt  # noqa: E402


def kernel_us(fn, calls: int = 5, flush: bool = False) -> dict:
    """Device microseconds per call of each kernel ``fn`` launches (torch.profiler, CUDA activity). ``flush``:
    each call after an L2 flush (a 256 MiB fill, as ``triton.testing.do_bench`` does), the fill's own kernel
    (the largest elementwise or fill kernel) left out."""
    from torch.profiler import ProfilerActivity, profile
    cache = torch.empty(256 << 20, dtype=torch.int8, device="cuda") if flush else None
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            if cache is not None:
                cache.zero_()
            fn()
        torch.cuda.synchronize()
    out = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name[:60]] += e.device_time / calls
    fills = [n for n in out if "fill" in n.lower() or "elementwise" in n]
    if cache is not None and fills:
        out.pop(max(fills, key=out.get))
    return dict(out)


def back_to_back_ms(fn, calls: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(calls):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / calls


def gpu_state() -> str:
    """SM clock, temperature and power now (nvidia-smi), to tell clock drift from placement."""
    import subprocess
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,temperature.gpu,power.draw",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception as e:  # noqa: BLE001
        return f"? ({e})"


def placement(name: str, rounds: int) -> None:
    """The fused backward's time against where its fp32 dQ buffer lies (pads allocated first), in
    interleaved rounds with the GPU's clock, temperature and power after each measurement."""
    from pykernels._kernels import attention_sm90_bwd as kb
    b, h, s, d, causal = CASES[name]
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = d ** -0.5
    o, lse = katt.attention_fwd(q, k, v, None, causal=causal, scale=scale, dropout_p=0.0, seed=0)
    seen = []
    orig = kb._dq_acc_descriptor

    def spy(dq_acc, bm, dd):
        seen.append(dq_acc.data_ptr())
        return orig(dq_acc, bm, dd)
    kb._dq_acc_descriptor = spy

    def fn():
        return katt.attention_bwd(do, q, k, v, o, lse, None, causal=causal, scale=scale, dropout_p=0.0, seed=0)
    try:
        for r in range(rounds):
            for pad_mib in (0, 1, 2, 3, 34):
                pad = torch.empty(pad_mib << 20, dtype=torch.uint8, device="cuda") if pad_mib else None
                seen.clear()
                ms = back_to_back_ms(fn)
                ptr = seen[-1] if seen else 0
                print(f"{name} round {r} pad {pad_mib:2d} MiB: {ms:.3f} ms; dq_acc at {ptr:#x} (mod 2 MiB "
                      f"{ptr % (2 << 20):#x}); {gpu_state()}", flush=True)
                del pad
    finally:
        kb._dq_acc_descriptor = orig


def forward(cases: list[str]) -> None:
    """The forward timed four ways per implementation (see the module's docstring)."""
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import pykernels
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}: forward, us per call; 'flush' = the "
          f"benchmark's one-call graph replayed under do_bench (L2 flushed, median), 'b2b' = 20 calls in one graph")
    for name in cases:
        b, h, s, d, causal = CASES[name]
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        scale = d ** -0.5

        def peer(backend):
            def fn():
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
            return fn
        impls = {
            "op": lambda: pykernels.scaled_dot_product_attention(q, k, v, is_causal=causal),
            "attention_fwd": lambda: katt.attention_fwd(q, k, v, None, causal=causal, scale=scale, dropout_p=0.0,
                                                        seed=0),
            "cudnn": peer(SDPBackend.CUDNN_ATTENTION),
            "flash": peer(SDPBackend.FLASH_ATTENTION),
        }
        flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
        with torch.no_grad():
            for impl, fn in impls.items():
                g = capture(fn)
                flush = triton.testing.do_bench(g.replay, warmup=25, rep=100, return_mode="median") * 1e3
                b2b = graph_ms(fn) * 1e3
                cold = kernel_us(g.replay, flush=True)
                warm = kernel_us(capture(fn, 20).replay, calls=1)
                print(f"{name} B{b} H{h} S{s} D{d} {'causal' if causal else 'full'} {impl:13s}: flush {flush:7.1f} us "
                      f"({flops / flush * 1e-6:5.1f} TFLOP/s), b2b {b2b:7.1f} us ({flops / b2b * 1e-6:5.1f}); "
                      f"{gpu_state()}", flush=True)
                for kname in sorted(set(cold) | set(warm), key=lambda x: -cold.get(x, 0)):
                    print(f"    {kname:60s} after a flush {cold.get(kname, 0):8.1f} us, back to back "
                          f"{warm.get(kname, 0) / 20:8.1f} us")
                del g


def main() -> None:
    import triton.testing
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="s8192c,s8192,s4096c")
    ap.add_argument("--placement", default="", help="a case: the fused kernel's time against its buffer placement")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--forward", action="store_true", help="the forward, with cuDNN and FlashAttention-2 beside it")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return
    if args.forward:
        forward(args.cases.split(",") if args.cases != "s8192c,s8192,s4096c" else ["bert", "gpt2", "s8192"])
        return
    if args.placement:
        placement(args.placement, args.rounds)
        return
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}: whole attention backward, ms per call")
    for name in args.cases.split(","):
        b, h, s, d, causal = CASES[name]
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        scale = d ** -0.5
        o, lse = katt.attention_fwd(q, k, v, None, causal=causal, scale=scale, dropout_p=0.0, seed=0)

        def fn():
            return katt.attention_bwd(do, q, k, v, o, lse, None, causal=causal, scale=scale, dropout_p=0.0, seed=0)
        for pad_mib in (0, 2, 34):
            pad = torch.empty(pad_mib << 20, dtype=torch.uint8, device="cuda") if pad_mib else None
            eager_flush = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
            eager_b2b = back_to_back_ms(fn)
            g = capture(fn)
            graph_flush = triton.testing.do_bench(g.replay, warmup=10, rep=50, return_mode="median")
            graph_b2b = graph_ms(fn)
            print(f"{name} B{b} H{h} S{s} D{d} {'causal' if causal else 'full'} pad {pad_mib:2d} MiB: eager do_bench "
                  f"{eager_flush:.3f}, eager back-to-back {eager_b2b:.3f}, one-call graph do_bench {graph_flush:.3f}, "
                  f"20-call graph {graph_b2b:.3f}", flush=True)
            del g, pad
        ke = kernel_us(fn)
        g = capture(fn)
        kg = kernel_us(g.replay)
        for kname in sorted(set(ke) | set(kg), key=lambda x: -ke.get(x, 0)):
            print(f"    {kname:60s} eager {ke.get(kname, 0):9.1f} us  graph {kg.get(kname, 0):9.1f} us")
        del g


if __name__ == "__main__":
    main()
