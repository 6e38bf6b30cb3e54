"""The Gluon causal forward's tile table (``kernels/attention_sm90.py``, ``_causal_order``) against the alternating
rounds, finely interleaved in one process: the long causal rows run near the card's power limit, where the clock
moves by several percent within a call (run429: the same kernel 438-477 us at B4 H16 S4096 D128 in one call's
separate timings), so the two settings alternate graph by graph rather than case by case.

Each case and setting gets a CUDA graph of ``--launches`` forwards (``attention_fwd_sm90``, causal, bf16); the
rounds replay the settings' graphs in turn (the first setting alternating), each replay timed by CUDA events.
One line a case and setting: median, 10th and 90th percentile microseconds a forward, TFLOP/s at the median,
the grid, and the ratio of the medians to the first setting's. Settings are ``PYKERNELS_ATTN_SM90_ORDER`` values
(``0`` the rounds, ``1`` the table forced, ``auto`` the rule); ``1/MIB`` is ``1`` with ``ORDER_L2_BYTES`` set to MIB
MiB (fewer heads a group: at 4 MiB one head a group at S8192 D128); ``sms=N`` runs the rule as if the card had N SMs
(the persistent grid's size: e.g. 128 for 2048 equal tiles, the same 16 rounds as 132 with 4 SMs idle).

Usage (GPU): ``python benchmarks/dev/attention_fwd_order_ab.py [--cases c4k,c8k] [--settings 0,1]
[--rounds 40] [--launches 10]``
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

# (batch, heads, tokens, D[, causal]), causal unless given
CASES = {"cgpt2": (8, 12, 1024, 64), "c1k": (16, 16, 1024, 128), "c2k": (3, 12, 2048, 128),
         "c2k16": (8, 16, 2048, 128), "c4k": (4, 16, 4096, 128), "c8k": (2, 16, 8192, 128),
         "c16k": (1, 16, 16384, 128), "b8k": (2, 16, 8192, 128, False), "b4k": (4, 16, 4096, 128, False),
         "bert": (32, 12, 512, 64, False)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="c4k,c8k,c2k")
    ap.add_argument("--settings", default="0,1")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--launches", type=int, default=10)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 0
    from pykernels._kernels import attention_sm90 as ks
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}")
    settings = args.settings.split(",")
    for case in args.cases.split(","):
        b, h, s, d, *rest = CASES[case]
        causal = rest[0] if rest else True
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * b * h * s * s * d // (2 if causal else 1)
        idx = q.device.index if q.device.index is not None else torch.cuda.current_device()
        ks._num_sms(q.device)
        sms_default = ks._SMS[idx]
        graphs, grids = {}, {}
        l2_default = ks.ORDER_L2_BYTES
        for st in settings:
            ks._SMS[idx] = sms_default
            if st.startswith("sms="):
                ks._SMS[idx] = int(st[4:])
                mode, mib = "auto", ""
            else:
                mode, _, mib = st.partition("/")
            os.environ["PYKERNELS_ATTN_SM90_ORDER"] = mode
            ks.ORDER_L2_BYTES = int(float(mib) * 2**20) if mib else l2_default
            ks._FWD_PLANS.clear()
            ks.attention_fwd_sm90(q, k, v, causal=causal, scale=d ** -0.5)  # compile, plan, table
            plan = ks.forward_plan(q, k, v, causal=causal, scale=d ** -0.5)
            grids[st] = plan.order_spec[0] if plan.order is not None else plan.grid[0]
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(args.launches):
                    ks.attention_fwd_sm90(q, k, v, causal=causal, scale=d ** -0.5)
            graphs[st] = g
        os.environ.pop("PYKERNELS_ATTN_SM90_ORDER", None)
        ks.ORDER_L2_BYTES = l2_default
        ks._SMS[idx] = sms_default
        ks._FWD_PLANS.clear()
        for g in graphs.values():  # warm
            g.replay()
        torch.cuda.synchronize()
        times = {st: [] for st in settings}
        for rnd in range(args.rounds):
            order = settings if rnd % 2 == 0 else settings[::-1]
            for st in order:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                graphs[st].replay()
                e1.record()
                e1.synchronize()
                times[st].append(e0.elapsed_time(e1) * 1e3 / args.launches)
        base = statistics.median(times[settings[0]])
        for st in settings:
            t = sorted(times[st])
            med = statistics.median(t)
            p10, p90 = t[len(t) // 10], t[(len(t) * 9) // 10]
            print(f"{case} B{b} H{h} S{s} D{d} {'causal' if causal else 'full'} {st} grid {grids[st]}: median {med:.1f} us "
                  f"(p10 {p10:.1f}, p90 {p90:.1f}) {flops / med / 1e6:.1f} TFLOP/s, x{base / med:.4f} "
                  f"the first setting's speed", flush=True)
        del graphs
    return 0


if __name__ == "__main__":
    sys.exit(main())
