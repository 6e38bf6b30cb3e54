"""Where the fused Gluon backward's time goes, CTA by CTA (``kernels/attention_sm90_bwd.py``, its dK/dV kernel with
dQ fused, as ``auto`` runs it for D = 128 from 1024 keys, causal from 2048): a development timeline.

With ``TRACE`` the kernel's default partition (consumer warpgroup 0) writes %globaltimer at five marks of each CTA
(``_trace_mark``): 0 the kernel's entry, 1 its K / V landed, 2 its first Q / dO block landed, 3 its last query block
done, 4 its dK / dV stored; and the CTA's SM and query-block count. From those this prints, per case:
- the kernel time with and without the marks (CUDA events, median), so that the marks' own cost shows;
- a CTA's set-up (entry -> first Q / dO), its loop and its epilogue (last block -> dK / dV stored), and the loop's
  least-squares fit against its query blocks: the time a block and the loop's fixed part;
- per SM, the gap between one CTA's end and the next one's entry (launch and exit), and the tail: how long each SM
  sits idle after its last CTA while others still run;
- the SMs' time split into set-up, loop, epilogue, gaps and tail, against SMs x span.
So a persistent kernel's possible gain (set-up, epilogue and gaps overlapped with work) is measured, not guessed.
Each case also prints one call's kernels with their device times (torch.profiler) and checks the grid's causal
order against the host's copy (``lpt_order``); ``--ab N`` times the fused call (zeros, kernel, dQ copy) in CUDA-graph
replay with the last two head groups merged (``LPT_TAIL_GROUPS`` 2) and not (1), alternating, N rounds, then
traces both; ``--ab-knob host-kv`` alternates ``HOST_KV`` instead (K / V / dK / dV through host descriptors or
through descriptors made on the device), timing the dK/dV kernel alone too. ``--model`` (no GPU) prints the causal grid's span as the in-order dispatch gives it with run435's
costs (a CTA: 4 query blocks' time beside its blocks) for 1-4 merged groups, against a perfect balance.

Usage (GPU): ``python benchmarks/dev/attention_bwd_trace.py [--cases c4k,c8k,b8k,c2k] [--ab 3 [--ab-knob host-kv]]
[--model]``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import _device_us  # noqa: E402

from pykernels._kernels import attention as tri
from pykernels._kernels import attention_sm90_bwd as kb

CASES = {  # name: (batch, heads, seq, causal), D = 128
    "c4k": (4, 16, 4096, True),
    "c8k": (2, 16, 8192, True),
    "b8k": (2, 16, 8192, False),
    "c2k": (8, 16, 2048, True),
}


def _events_ms(fn, reps: int = 20) -> float:
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _fit(xs, ys):
    """Least squares y = a + b x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def _graph_us(fn, reps: int = 10) -> float:
    """Mean time of ``fn`` replayed from one CUDA graph, us (3 replays of warm-up, ``reps`` timed)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / reps


AB_KNOBS = {  # --ab-knob: the module constant of kernels/attention_sm90_bwd.py alternated, (off, on)
    "tail": ("LPT_TAIL_GROUPS", (1, 2)),
    "host-kv": ("HOST_KV", (False, True)),
}


def run_case(name: str, batch: int, heads: int, seq: int, causal: bool, ab: int = 0, knob: str = "tail") -> None:
    d = 128
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(batch, heads, seq, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    sc = d ** -0.5
    o, lse = tri.attention_fwd(q, k, v, None, causal=causal, scale=sc, dropout_p=0.0, seed=0)
    delta = (o.float() * do.float()).sum(-1).contiguous()
    dk, dv, dq = torch.empty_like(k), torch.empty_like(v), torch.empty_like(q)
    n_ctas = -(-seq // (2 * kb.DKDV_CONFIGS[d][0])) * heads * batch
    trace = torch.zeros(n_ctas, int(kb.TRACE_SLOTS), dtype=torch.int64, device="cuda")

    def plain():
        assert kb.attention_bwd_dkdv_sm90(do, q, k, v, lse, delta, dk, dv, causal=causal, scale=sc, dq=dq)

    def traced():
        assert kb.attention_bwd_dkdv_sm90(do, q, k, v, lse, delta, dk, dv, causal=causal, scale=sc, dq=dq,
                                          trace=trace)

    def dkdv_only():
        assert kb.attention_bwd_dkdv_sm90(do, q, k, v, lse, delta, dk, dv, causal=causal, scale=sc)

    plain()
    if ab:
        n_kb = -(-seq // 128)
        g = kb.lpt_group(batch * heads, 2 * seq * d * 2, n_kb, q.device)
        print(f"{name}: heads in groups of {g}, the last two from head {kb.lpt_tail_from(batch * heads, g)} on",
              flush=True)
        attr, vals = AB_KNOBS[knob]
        keep = getattr(kb, attr)
        calls = {"fused call (zeros, kernel, dQ copy)": plain}
        if knob == "host-kv":
            calls["dK/dV kernel alone"] = dkdv_only
        for what, fn in calls.items():
            res = {m: [] for m in vals}
            for _ in range(ab):
                for m in vals:
                    setattr(kb, attr, m)
                    res[m].append(_graph_us(fn))
            setattr(kb, attr, keep)
            off, on = vals
            print(f"  graph replay of the {what}, us: {attr} {off} {' '.join(f'{x:.1f}' for x in res[off])}; "
                  f"{on} {' '.join(f'{x:.1f}' for x in res[on])}; {on} / {off} {min(res[off]) / min(res[on]):.4f}x "
                  f"(best), {statistics.median(res[off]) / statistics.median(res[on]):.4f}x (median)", flush=True)
    print("  one call's device time, us: " + ", ".join(f"{k_[:60]} {v_:.1f}" for k_, v_ in _device_us(plain).items()),
          flush=True)
    plain()
    ref = (dk.clone(), dv.clone())
    traced()
    dkv_same = torch.equal(dk, ref[0]) and torch.equal(dv, ref[1])
    t_plain, t_trace = _events_ms(plain), _events_ms(traced)
    t_plain = min(t_plain, _events_ms(plain))
    torch.cuda.synchronize()
    tr = trace.cpu().tolist()
    t0 = min(r[0] for r in tr)
    rows = [dict(e=r[0] - t0, kv=r[1] - t0, q=r[2] - t0, last=r[3] - t0, end=r[4] - t0, sm=r[5], n=r[6], hr=r[7],
                 desc=r[8] - t0, c0=r[9] - t0, p_issue=r[10] - t0, p_stats=r[11] - t0, st_issue=r[12] - t0)
            for r in tr]
    if causal:  # the grid's (rank, head) against the host's copy of the order (``lpt_order``)
        n_kb = -(-seq // 128)
        g = kb.lpt_group(batch * heads, 2 * seq * d * 2, n_kb, q.device)
        tail_from = kb.lpt_tail_from(batch * heads, g)
        got = [(r["hr"] & 0xFFFF, r["hr"] >> 16) for r in rows]
        print(f"  grid order (groups of {g}, last group from head {tail_from}) as lpt_order gives it: "
              f"{got == kb.lpt_order(n_kb, batch * heads, g, tail_from)}", flush=True)
    span = max(r["end"] for r in rows)
    n_sm = len({r["sm"] for r in rows})
    setup = [r["q"] - r["e"] for r in rows]
    kv = [r["kv"] - r["e"] for r in rows]
    loop = [r["last"] - r["q"] for r in rows]
    epi = [r["end"] - r["last"] for r in rows]
    a, b = _fit([r["n"] for r in rows], loop)

    def mean_us(key, frm="e"):
        return statistics.mean(r[key] - r[frm] for r in rows) / 1e3
    print(f"  set-up marks from entry (us, mean): descriptors made {mean_us('desc'):.2f}, consumer 0 started "
          f"{mean_us('c0'):.2f}, producer's first Q / dO issued {mean_us('p_issue'):.2f}, its lse / delta in shared "
          f"memory {mean_us('p_stats'):.2f}, K / V landed {mean_us('kv'):.2f}, first Q / dO landed {mean_us('q'):.2f}; "
          f"epilogue: dK / dV stores issued {mean_us('st_issue', 'last'):.2f} after the last block, stored "
          f"{mean_us('end', 'st_issue'):.2f} later", flush=True)
    by_sm = {}
    for r in rows:
        by_sm.setdefault(r["sm"], []).append(r)
    gaps, tails, heads_ = [], [], []
    for lst in by_sm.values():
        lst.sort(key=lambda r: r["e"])
        heads_.append(lst[0]["e"])
        gaps += [y["e"] - x["end"] for x, y in zip(lst, lst[1:])]
        tails.append(span - lst[-1]["end"])
    total = n_sm * span
    parts = dict(setup=sum(setup), loop=sum(loop), epilogue=sum(epi), gaps=sum(gaps), tail=sum(tails),
                 start=sum(heads_))
    print(f"{name}: B{batch} H{heads} S{seq} D{d} {'causal' if causal else 'full'}: {n_ctas} CTAs on {n_sm} SMs; "
          f"kernel {t_plain * 1e3:.1f} us plain, {t_trace * 1e3:.1f} us traced; traced span {span / 1e3:.1f} us; "
          f"dK/dV bitwise as plain: {dkv_same}", flush=True)
    print(f"  per CTA (us, mean / median / max): set-up {statistics.mean(setup) / 1e3:.2f} / "
          f"{statistics.median(setup) / 1e3:.2f} / {max(setup) / 1e3:.2f} (K/V landed "
          f"{statistics.mean(kv) / 1e3:.2f}); epilogue {statistics.mean(epi) / 1e3:.2f} / "
          f"{statistics.median(epi) / 1e3:.2f} / {max(epi) / 1e3:.2f}; gap between CTAs on an SM "
          f"{statistics.mean(gaps) / 1e3 if gaps else 0:.2f} / {statistics.median(gaps) / 1e3 if gaps else 0:.2f}",
          flush=True)
    print(f"  loop = {a / 1e3:.2f} us + {b / 1e3:.3f} us x query blocks (blocks a CTA {min(r['n'] for r in rows)}.."
          f"{max(r['n'] for r in rows)}, mean {statistics.mean(r['n'] for r in rows):.1f})", flush=True)
    print("  SM time: " + ", ".join(f"{k_} {100 * v_ / total:.1f}%" for k_, v_ in parts.items())
          + f" (sum {100 * sum(parts.values()) / total:.1f}%); tail per SM mean {statistics.mean(tails) / 1e3:.1f} "
          f"max {max(tails) / 1e3:.1f} us", flush=True)
    blocks = sum(r["n"] for r in rows)
    print(f"  if every SM ran only loop blocks at {b / 1e3:.3f} us: {blocks * b / n_sm / 1e3:.1f} us "
          f"({100 * blocks * b / n_sm / span:.1f}% of the span)", flush=True)


def model(sms: int = 132, fixed: float = 4.0) -> None:
    """The causal dK/dV grid's span in query blocks' time, CTAs dispatched in grid order to the first free SM."""
    import heapq
    kb._num_sms = lambda device: sms  # (no GPU needed)
    for batch, heads, seq in ((4, 16, 4096), (2, 16, 8192), (8, 16, 2048), (3, 12, 2048), (8, 16, 4096),
                              (1, 16, 16384)):
        n_kb, n_qb, nh = seq // 128, seq // 64, batch * heads
        g = kb.lpt_group(nh, 2 * seq * 128 * 2, n_kb, None)
        spans = []
        for m in (1, 2, 3, 4):
            kb.LPT_TAIL_GROUPS = m
            free, end = [0.0] * sms, 0.0
            for r, _ in kb.lpt_order(n_kb, nh, g, kb.lpt_tail_from(nh, g)):
                t = free[0] + n_qb - 2 * r + fixed
                heapq.heapreplace(free, t)
                end = max(end, t)
            spans.append(end)
        kb.LPT_TAIL_GROUPS = 2
        ideal = nh * sum(n_qb - 2 * r + fixed for r in range(n_kb)) / sms
        print(f"B{batch} H{heads} S{seq}: groups of {g}; span with 1-4 groups merged last "
              f"{' '.join(f'{x:.0f}' for x in spans)}, balanced {ideal:.0f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="c4k,c8k,b8k,c2k")
    ap.add_argument("--ab", type=int, default=0, help="rounds of the knob's A/B (the tail's: causal cases only)")
    ap.add_argument("--ab-knob", default="tail", choices=sorted(AB_KNOBS))
    ap.add_argument("--model", action="store_true", help="the modelled spans only (no GPU)")
    args = ap.parse_args()
    if args.model:
        model()
        return
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for name in args.cases.split(","):
        batch, heads, seq, causal = CASES[name]
        if args.ab and (causal or args.ab_knob != "tail"):
            attr, (off, on) = AB_KNOBS[args.ab_knob]
            run_case(name, batch, heads, seq, causal, ab=args.ab, knob=args.ab_knob)
            setattr(kb, attr, off)
            print(f"{name}: traced with {attr} {off}", flush=True)
            run_case(name, batch, heads, seq, causal)
            setattr(kb, attr, on)
            print(f"{name}: traced with {attr} {on}", flush=True)
        run_case(name, batch, heads, seq, causal)


if __name__ == "__main__":
    main()
