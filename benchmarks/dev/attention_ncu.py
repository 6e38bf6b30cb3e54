"""Where the sm_90 attention kernels spend their time: one case's forward and backward through
``pykernels.scaled_dot_product_attention``, run a few times so that Nsight Compute (``ncu``) can pick one
launch of one kernel; and a forward length sweep (same tokens, growing S) of the C++ forward next to cuDNN, which
separates the per-tile cost from the per-block cost.

Usage (GPU):
``python benchmarks/dev/attention_ncu.py --case bert [--peer cudnn]`` (what ncu wraps: see ``--help`` for cases;
``--peer`` runs the case through torch's SDPA with that backend, for the same profile of a peer's kernel);
``python benchmarks/dev/attention_ncu.py --sweep [--d 64]`` (the C++ backend and cuDNN, kernel time);
``python benchmarks/dev/attention_ncu.py --ab LPT_L2_BYTES=0/12582912`` (A/B of a backward setting;
``--ab MODULE=new/old.py`` of two versions of the module; ``MODULE=new,path/to/old.py`` where a path has "/").
The ncu call this was written for (SASS lines with their stall samples, then the sections)::

    ncu --clock-control none -k regex:dkdv -s 2 -c 1 --section WarpStateStats --section SourceCounters \
        --section SpeedOfLight -o rep python3 benchmarks/dev/attention_ncu.py --case s4096c
    ncu -i rep.ncu-rep --page source --csv --print-source sass > src.csv
"""
from __future__ import annotations

import argparse

import torch

import pykernels

CASES = {  # name -> (B, H, S, D, causal)
    "bert": (32, 12, 512, 64, False),
    "bertpad": (32, 12, 512, 64, False),  # key padding, lengths 256..512 (the benchmark's), forward A/B only
    "gpt2": (8, 12, 1024, 64, True),
    "s1024c": (16, 16, 1024, 128, True),
    "s2048c": (8, 16, 2048, 128, True),
    "s4096c": (4, 16, 4096, 128, True),
    "s4096": (4, 16, 4096, 128, False),
    "s8192": (2, 16, 8192, 128, False),
    "s8192c": (2, 16, 8192, 128, True),
}


def run_case(name: str, reps: int, peer: str = "pykernels", backend: str | None = None, dropout: float = 0.0) -> None:
    """``reps`` forward+backward calls of one case through ``pykernels`` (``backend``: which of its backends; "cuda"
    profiles the C++ kernels, ``-k regex:attn_fwd_kernel``) or (``peer`` "cudnn" / "flash") torch's SDPA with that
    backend alone, for a profile of the peer's kernels beside ours. "bertpad" takes the benchmark's key-padding mask
    (lengths 256..512 of 512, ``benchmarks/attention.py``). ``dropout``: the calls' dropout_p (the C++ op's fused
    backward: ``--backend cuda --dropout 0.1``, ``-k regex:attn_bwd_sm90_kernel``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    b, h, s, d, causal = CASES[name]
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
    mask = None
    if name == "bertpad":
        g = torch.Generator().manual_seed(1234)  # the benchmark's lengths (bert_lengths)
        lengths = torch.randint(s // 2, s + 1, (b,), generator=g).cuda()
        mask = (torch.arange(s, device="cuda")[None, :] < lengths[:, None])[:, None, None, :]
    sdpa_backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}.get(peer)
    for _ in range(reps):
        if sdpa_backend is None:
            o = pykernels.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, backend=backend,
                                                       dropout_p=dropout)
        else:
            with sdpa_kernel(sdpa_backend):
                o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                                     dropout_p=dropout)
        o.backward(do)
    torch.cuda.synchronize()
    via = peer if sdpa_backend is not None else f"pykernels (backend {backend or 'default'})"
    print(f"{name}: B{b} H{h} S{s} D{d} causal={causal}: {reps} forward+backward calls through {via}")


def sweep(d: int) -> None:
    """The forward at a fixed token count (16384, 12 heads of ``d``) over lengths 256..8192, full and causal, the
    C++ backend against cuDNN, in kernel time (the profiler's kernel records, benchmarks/common.py's gpu_kernel_ms;
    eager do_bench timed the host at the short lengths: run322's sweep had the C++ op at 0.38x cuDNN at S = 256)."""
    import os
    import sys

    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from common import gpu_kernel_ms  # benchmarks/common.py
    tokens, iters = 16384, 10
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}; "
          f"forward, H12 D{d}, {tokens} tokens, kernel time a call")
    for s in (256, 512, 1024, 2048, 4096, 8192):
        b = tokens // s
        for causal in (False, True):
            q, k, v = (torch.randn(b, 12, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            flops = 4 * b * 12 * s * s * d * (0.5 if causal else 1.0)

            def ours():
                for _ in range(iters):
                    pykernels.scaled_dot_product_attention(q, k, v, is_causal=causal, backend="cuda")

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    for _ in range(iters):
                        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

            ours()
            cudnn()
            torch.cuda.synchronize()
            t_ours, t_cud = gpu_kernel_ms(ours) / iters, gpu_kernel_ms(cudnn) / iters
            print(f"S{s:5d} B{b:3d} {'causal' if causal else 'full  '}: C++ {flops / t_ours * 1e-9:6.1f} "
                  f"cuDNN {flops / t_cud * 1e-9:6.1f} TFLOP/s (ratio {t_cud / t_ours:.3f}; {t_ours * 1e3:.1f} / "
                  f"{t_cud * 1e3:.1f} us)")


def ab(spec: str, cases: list[str] | None = None, rounds: int = 3, forward: bool = False) -> None:
    """``--ab KEY=A/B``: the whole backward (``attention.attention_bwd`` on the forward's o / lse, what the
    op's backward runs) per case with KEY set to A, then B, alternating ``rounds`` times; GPU time by CUDA-graph
    replay (best of the rounds), gradients compared. KEY is an ``attention_sm90_bwd`` module setting
    (``LPT_L2_BYTES=0/12582912``, ``STATS_EARLY=False/True``, ``"DQ_CONFIGS={128: (64, 64, 4)}/{128: (64, 64, 5)}"``;
    Python literals) or an environment variable
    (``PYKERNELS_ATTN_SM90_BWD=dkdv,dq/fused``). run73 / run77 / run82 / run90 compared kernel variants so.
    ``forward``: the forward (``attention.attention_fwd``) instead, KEY an ``attention_sm90`` setting
    (``"CONFIGS={64: (64, 128, 2), 128: (64, 128, 2)}/{64: (128, 64, 2), 128: (64, 128, 2)}"``); outputs compared.
    KEY ``MODULE`` compares whole versions of the module: ``MODULE=new/old.py`` ("new" the installed one, else
    a file loaded as a module of the package, e.g. ``git show HEAD:kernels/attention_sm90_bwd.py > old.py``;
    run106 compared the ds_bar fix so)."""
    import ast
    import os

    import triton
    from attention_sm90_gluon_ws import graph_ms

    from pykernels._kernels import attention as katt
    from pykernels._kernels import attention_sm90 as kf
    from pykernels._kernels import attention_sm90_bwd as kb
    from pykernels.attention import _key_padding_range
    mod = kf if forward else kb
    key, values = spec.split("=", 1)
    # (MODULE's variants may be separated by "," instead, for a module file named by a path with "/")
    variants = values.split("," if key == "MODULE" and "," in values else "/")
    versions = None
    if key == "MODULE":  # whole module versions, swapped as the package's attribute that attention.py imports
        import importlib.util

        import pykernels._kernels as pkg
        versions = {"new": mod}
        for path in variants:
            if path != "new":
                spec_ = importlib.util.spec_from_file_location(f"{mod.__package__}._ab_{len(versions)}", path)
                versions[path] = importlib.util.module_from_spec(spec_)
                spec_.loader.exec_module(versions[path])
        mod_name = mod.__name__.rsplit(".", 1)[1]
    env = versions is None and not hasattr(mod, key)
    before = os.environ.get(key) if env else getattr(mod, key, None)

    def put(value):
        if versions is not None:
            setattr(pkg, mod_name, versions[value])
        elif env:
            os.environ[key] = value
        else:
            setattr(mod, key, ast.literal_eval(value))
    what = "forward" if forward else "whole backward"
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}: {what}, "
          f"{key} = {' / '.join(variants)}, graph replay, best of {rounds} rounds alternating; TFLOP/s "
          f"({'2' if forward else '5'}-GEMM count, padded keys counted)")
    try:
        for name, (b, h, s, d, causal) in CASES.items():
            if (name not in cases) if cases else (d != 128 or name == "bertpad"):  # (default: the D = 128 cases)
                continue
            torch.manual_seed(0)
            q, k, v, do = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            scale = d ** -0.5
            mask, kv_range = None, None
            if name == "bertpad":
                lengths = torch.randint(s // 2, s + 1, (b,), device="cuda")
                keep = torch.arange(s, device="cuda")[None, :] < lengths[:, None]
                mask = keep[:, None, None, :].expand(b, h, s, s)
                kv_range = _key_padding_range(mask)
            o, lse = katt.attention_fwd(q, k, v, mask, causal=causal, scale=scale, dropout_p=0.0, seed=0,
                                        kv_range=kv_range)
            flops = (1 if forward else 2.5) * 4 * b * h * s * s * d * (0.5 if causal else 1.0)
            grads, best = {}, {}

            def fn():
                if forward:
                    return katt.attention_fwd(q, k, v, mask, causal=causal, scale=scale, dropout_p=0.0, seed=0,
                                              kv_range=kv_range)
                return katt.attention_bwd(do, q, k, v, o, lse, mask, causal=causal, scale=scale, dropout_p=0.0,
                                          seed=0, kv_range=kv_range)
            for _ in range(rounds):
                for val in variants:
                    put(val)
                    grads[val] = fn()
                    best[val] = min(best.get(val, 1e9), graph_ms(fn))
            ref = grads[variants[0]]
            line = [f"{name:8s} B{b} H{h} S{s} D{d} {'causal' if causal else 'full'}:"]
            for val in variants:
                err = max((x.float() - y.float()).abs().max().item() for x, y in zip(grads[val], ref))
                line.append(f"{val} {best[val] * 1e3:8.1f} us ({flops / best[val] * 1e-9:5.1f}, "
                            f"{best[variants[0]] / best[val]:.3f}x, max diff {err:.1e})")
            print(" ".join(line), flush=True)
    finally:
        if versions is not None:
            setattr(pkg, mod_name, mod)
        elif not env:
            setattr(mod, key, before)
        elif before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=sorted(CASES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dropout", type=float, default=0.0, help="the case's dropout_p (--case only)")
    ap.add_argument("--peer", choices=("pykernels", "cudnn", "flash"), default="pykernels",
                    help="--case through torch's SDPA with this backend instead (a peer's kernels for ncu)")
    ap.add_argument("--backend", choices=("auto", "triton", "cuda"),
                    help="--case through this pykernels backend (cuda: the C++ kernels)")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--ab", metavar="KEY=A/B", help="the whole backward with a setting at A, then B (see ab())")
    ap.add_argument("--ab-fwd", metavar="KEY=A/B", help="the forward with an attention_sm90 setting at A, then B")
    ap.add_argument("--cases", help="--ab's cases, comma-separated (default: the D = 128 ones)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to profile")
        return
    if args.ab:
        ab(args.ab, args.cases.split(",") if args.cases else None)
    if args.ab_fwd:
        ab(args.ab_fwd, args.cases.split(",") if args.cases else None, forward=True)
    if args.sweep:
        sweep(args.d)
    if args.case:
        run_case(args.case, args.reps, args.peer, args.backend, args.dropout)


if __name__ == "__main__":
    main()
