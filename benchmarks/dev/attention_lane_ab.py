"""The eager lane of ``pykernels.scaled_dot_product_attention`` (``pykernels.attention._lane``) on and off, next
to torch SDPA (its cuDNN backend; its own choice with a mask or dropout), in one process: host time of a forward and of a backward call with the GPU kept
busy (so that the host's own cost is what is timed, not a wait; the least of 100 calls), and
``triton.testing.do_bench`` of an eager forward (recording autograd, as the attention benchmark times it, and
without) and of an eager forward+backward (gradients reset to None each step), alternating rounds, best of them.

``--profile CASE``: then the host time and cProfile (100 calls, GPU kept busy; by own and cumulative time) of
the kernel-level backward that the lane's backward calls for that case, and cProfile of the lane's forward.

``--paired N``: instead, N calls each of the lane and the full path alternating call by call (host time of a
forward and of a forward+backward step, GPU busy): the A/B that host drift cannot bias.

Usage (GPU): ``python benchmarks/dev/attention_lane_ab.py [--rounds 3] [--cases bert,gpt2] [--profile bert]
[--paired 300]``."""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import pykernels
import pykernels.attention as patt

# B, H, S, D, causal, extra: BERT-base at 512 and 128 tokens (the sm_90 kernel and the Triton one), with a
# key-padding mask (lengths 256..512) and with attention dropout 0.1 (the Triton kernels), GPT-2, long D = 128
CASES = {"bert": (32, 12, 512, 64, False, None), "bert128": (128, 12, 128, 64, False, None),
         "bertpad": (32, 12, 512, 64, False, "keypad"), "bertdrop": (32, 12, 512, 64, False, "dropout"),
         "gpt2": (16, 12, 1024, 64, True, None), "s4096c": (4, 16, 4096, 128, True, None),
         "bertvarlen": (32, 12, 512, 64, False, "varlen")}  # (varlen_attention on the packed lengths 256..512)
SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU time queued before each timed call


def busy_host_us(setup, fn, n: int = 100) -> float:
    """Least host time of ``fn()`` over ``n`` calls with the GPU busy (a queued sleep), after an untimed
    ``setup()`` each (the least: these hosts' timings are noisy, and noise only adds)."""
    ts = []
    for _ in range(n):
        arg = setup()
        torch.cuda._sleep(SLEEP_CYCLES)
        t0 = time.perf_counter()
        fn(arg)
        ts.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    return min(ts) * 1e6


def paired(name, fn, q, k, v, do, n: int) -> None:
    """Host time of a forward (no grad) and of a forward+backward step, lane and full path alternating call by
    call with the GPU busy (host drift and noise hit both alike): medians and least, microseconds."""
    times = {(lane, what): [] for lane in (True, False) for what in ("fwd", "step")}

    def step():
        for t in (q, k, v):
            t.grad = None
        fn().backward(do)
    for lane in (True, False):  # warm both
        patt._LANE_ON = lane
        for _ in range(3):
            step()
    for _ in range(n):
        for lane in (True, False):
            patt._LANE_ON = lane
            for what in ("fwd", "step"):
                torch.cuda._sleep(SLEEP_CYCLES)
                t0 = time.perf_counter()
                if what == "fwd":
                    with torch.no_grad():
                        fn()
                else:
                    step()
                times[(lane, what)].append(time.perf_counter() - t0)
                torch.cuda.synchronize()
    patt._LANE_ON = True
    for what in ("fwd", "step"):
        med = {lane: statistics.median(times[(lane, what)]) * 1e6 for lane in (True, False)}
        least = {lane: min(times[(lane, what)]) * 1e6 for lane in (True, False)}
        print(f"{name:8s} {what:4s} host us, lane / full, {n} pairs: median {med[True]:7.1f} / {med[False]:7.1f} "
              f"({med[False] / med[True]:.2f}x), least {least[True]:7.1f} / {least[False]:7.1f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--profile", default="", help="a case whose lane backward to profile")
    ap.add_argument("--paired", type=int, default=0,
                    help="instead: N calls of each, lane and full path alternating call by call (host time of a "
                         "forward and of a forward+backward step, GPU busy): medians and least")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}; bf16; host us "
          f"(least of 100, GPU busy) and do_bench us (eager calls); best of {args.rounds} alternating rounds")
    for name, (b, h, s, d, causal, extra) in CASES.items():
        if name not in args.cases.split(","):
            continue
        if extra == "varlen":  # packed (T, H, D): only the paired A/B takes it
            if args.paired:
                lens = torch.randint(s // 2, s + 1, (b,), generator=torch.Generator().manual_seed(0))
                cu = torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(torch.int32).cuda()
                t = int(cu[-1])
                q, k, v = (torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                           for _ in range(3))
                mx = int(lens.max())
                paired(name, lambda q=q, k=k, v=v, cu=cu, mx=mx: pykernels.varlen_attention(q, k, v, cu, cu, mx, mx),
                       q, k, v, torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16), args.paired)
            continue
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        do = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
        mask, p = None, 0.0
        if extra == "keypad":
            lens = torch.randint(s // 2, s + 1, (b,), device="cuda")
            mask = (torch.arange(s, device="cuda")[None, :] < lens[:, None])[:, None, None, :]
        elif extra == "dropout":
            p = 0.1

        def ours(q=q, k=k, v=v, causal=causal, mask=mask, p=p):
            return pykernels.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal)

        def peer(q=q, k=k, v=v, causal=causal, mask=mask, p=p):
            if mask is not None or p > 0:  # (torch picks its backend for masks and dropout)
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                                                        is_causal=causal)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

        variants = {"lane": (ours, True), "full": (ours, False), "torch" if extra else "cuDNN": (peer, None)}
        if args.paired:
            paired(name, ours, q, k, v, do, args.paired)
            continue
        best: dict = {}

        def step(fn):
            for t in (q, k, v):
                t.grad = None
            fn().backward(do)
        for _ in range(args.rounds):
            for label, (fn, lane) in variants.items():
                if lane is not None:
                    patt._LANE_ON = lane
                for _ in range(3):
                    step(fn)
                with torch.no_grad():
                    fwd_host = busy_host_us(lambda: None, lambda _: fn())
                bwd_host = busy_host_us(fn, lambda o: o.backward(do))
                fwd_db = triton.testing.do_bench(fn, warmup=25, rep=100) * 1e3  # (recording autograd)
                with torch.no_grad():
                    fwd_ng = triton.testing.do_bench(fn, warmup=25, rep=100) * 1e3
                step_db = triton.testing.do_bench(lambda: step(fn), warmup=25, rep=100) * 1e3
                row = (fwd_host, bwd_host, fwd_db, fwd_ng, step_db)
                best[label] = tuple(min(a, b) for a, b in zip(best.get(label, row), row))
        patt._LANE_ON = True
        for label, (fh, bh, fd, fn_, sd) in best.items():
            print(f"{name:8s} B{b} H{h} S{s} D{d}{' causal' if causal else ''}{' ' + extra if extra else ''} {label:6s}: "
                  f"host fwd {fh:6.1f} bwd {bh:6.1f} | do_bench fwd {fd:7.1f} (no grad {fn_:7.1f}) fwd+bwd {sd:7.1f}",
                  flush=True)
        if name == args.profile:
            # the kernel-level backward the lane's backward calls, in this thread (the autograd engine runs
            # CUDA backward nodes on its own thread, out of cProfile's sight): its host time, then its profile
            from pykernels._kernels import attention as katt
            if extra:
                continue
            with torch.no_grad():
                o, lse = katt.attention_fwd(q, k, v, None, causal=causal, scale=d ** -0.5, dropout_p=0.0, seed=0)

            def bwd(_):
                return katt.attention_bwd(do, q, k, v, o, lse, None, causal=causal, scale=d ** -0.5, dropout_p=0.0,
                                          seed=0, deterministic=False)
            print(f"kernel-level attention_bwd: host {busy_host_us(lambda: None, bwd):.1f} us (GPU busy)")
            for label, fn in (("kernel-level backward", lambda: bwd(None)), ("lane forward (no grad)", ours)):
                torch.cuda._sleep(SLEEP_CYCLES * 10)
                prof = cProfile.Profile()
                with torch.no_grad():
                    prof.enable()
                    for _ in range(100):
                        fn()
                    prof.disable()
                torch.cuda.synchronize()
                print(f"== cProfile: {label}, 100 calls")
                for key in ("tottime", "cumulative"):
                    pstats.Stats(prof).sort_stats(key).print_stats(25)


if __name__ == "__main__":
    main()
