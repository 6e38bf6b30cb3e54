"""Where the warp-specialised C++ forward's cycles go: its per-warp timeline (attention.cuh, FwdTrace).

Needs a development build with the timeline compiled in (it is not in the package's build)::

    PYKERNELS_NVCC_FLAGS=-DPYKERNELS_FWD_TRACE pip install --no-build-isolation --no-deps -e .
    python benchmarks/dev/attention_fwd_trace.py [--cases bert,gpt2,long] [--dump 2] [--by-mix] [--latency]

Each case runs the bf16 forward (backend="cuda") a few times, then once more with the timeline reset, and reads
what the first 16 blocks' warps recorded (clock64 at each event). Per consumer warpgroup (its first warp) it prints
the mean SM cycles of each phase of a key block (K/V landed, the turn taken, the products done, the marks inside
softmax_block: entered, each row's max, the exponentials, the dropout's zeros; the softmax done),
split by the block's place in its tile, and of each tile's end (the last P V, O's store, the next tile's Q); then the
tile period and the kernel's cycles against its time (the SM clock it implies). ``--dump N`` prints the first N
tiles' events of block 0, each consumer (two or three: PYKERNELS_CUDA_ATTN_FWD_WG), as cycles from the block's
start. ``--by-mix`` splits the three-consumer kernel's tiles into those of one head and of two (kMix); ``--latency``
(where no tile mixes heads) sets each ring position's K / V issue by the producer against each consumer's wait for it:
how far ahead the producer is, and how long the wait takes once the consumer arrives (run422: the kMix kernel's
producer 11-13k cycles ahead, the 192-row kernel's 7.5-9.7k, yet kMix's wait 462-538 cycles against 342-372).
"""
import argparse
import collections

import torch

import pykernels

CASES = {  # name: (batch, heads, seq, head dim, causal)
    "bert": (32, 12, 512, 64, False),
    "s256": (64, 12, 256, 64, False),
    "s384": (40, 12, 384, 64, False),
    "gpt2": (8, 12, 1024, 64, True),
    "long": (2, 12, 4096, 64, False),
    "d128": (8, 16, 2048, 128, True),
}
N_CTAS, N_WARPS = 16, 16  # attention.cuh's kTraceCtas, kTraceWarps (warps 12-15: a third consumer's)
# the marks inside softmax_block (attention.cuh): the phase that ends at each
SOFTMAX_MARKS = {13: "sm entered", 16: "sm row 0 max", 17: "sm row 1 max", 14: "sm exps", 15: "sm dropout"}
CLK = (1 << 48) - 1


def read_trace(reset=True):
    t = torch.ops.pykernels_cuda.attention_fwd_trace(reset)
    t = t.view(N_CTAS, N_WARPS, -1)
    out = []
    for c in range(N_CTAS):
        warps = []
        for w in range(N_WARPS):
            ev = [(int(v) >> 48, int(v) & CLK) for v in t[c, w].tolist() if v != 0]
            warps.append(ev)
        out.append(warps)
    return out


def phases(events):
    """One consumer warp's events -> {phase: [cycles]} and the tile periods."""
    ph = collections.defaultdict(list)
    periods = []
    prev = None          # the last event's clock
    blk = 0
    last_store = None
    tile_blocks = []     # (phase, cycles) of this tile's blocks, labelled after the tile ends
    for code, clk in events:
        if code == 0:
            prev = clk
            continue
        if code == 1:
            ph["q wait (after O stored)" if last_store is not None else "first q wait"].append(clk - prev)
            blk, tile_blocks = 0, []
        elif code == 11:
            tile_blocks.append(("kv landed", clk - prev))
        elif code == 2:
            tile_blocks.append(("turn taken", clk - prev))
        elif code == 3:
            tile_blocks.append(("products done", clk - prev))
        elif code in SOFTMAX_MARKS:
            tile_blocks.append((SOFTMAX_MARKS[code], clk - prev))
        elif code == 4:
            tile_blocks.append(("softmax done", clk - prev))
            blk += 1
        elif code == 12:
            ph["tile end: last V landed"].append(clk - prev)
        elif code == 5:
            ph["tile end: last P V's turn"].append(clk - prev)
        elif code == 6:
            ph["tile end: last P V done"].append(clk - prev)
        elif code == 7:
            ph["tile end: O stored"].append(clk - prev)
            if last_store is not None:
                periods.append(clk - last_store)
            last_store = clk
            n = blk
            i = 0
            for name, cyc in tile_blocks:
                place = "first" if i == 0 else ("last" if i == n - 1 else "mid")
                ph[f"block {place}: {name}"].append(cyc)
                if name == "softmax done":
                    i += 1
        prev = clk
    return ph, periods


def mean(x):
    return sum(x) / len(x) if x else float("nan")


def mixed_tiles(name, tile, grid):
    """``--by-mix``: each traced block's tiles split by whether they meet two heads (the three-consumer kernel's
    tiles of 64-row units, kMix: csrc/fwd_order.cuh's mix_rows), as consumer warp ``w``'s events show them: mean
    cycles of the tile (O stored to O stored), of its start (the Q wait), and its key blocks' waits for K / V and
    for the turn."""
    b, h, s, d, causal = CASES[name]
    n_u = (s + 63) // 64
    units = n_u * h * b
    out = collections.defaultdict(list)
    for c, cta in enumerate(tile):
        k, prev, last7, cls = 0, None, None, None
        for code, clk in cta:
            if code == 1:
                t = c + k * grid
                a, z = 3 * t // n_u, min(3 * t + 2, units - 1) // n_u
                cls = "two heads" if a != z else "one head"
                if last7 is not None:
                    out[cls, "q wait"].append(clk - last7)
            elif code == 11 and cls:
                out[cls, "kv wait"].append(clk - prev)
            elif code == 2 and cls:
                out[cls, "turn wait"].append(clk - prev)
            elif code == 7:
                if last7 is not None and cls:
                    out[cls, "period"].append(clk - last7)
                last7 = clk
                k += 1
            prev = clk
    for cls in ("one head", "two heads"):
        print(f"    {cls:9s}: " + "  ".join(f"{key} {mean(out[cls, key]):6.0f} (n {len(out[cls, key])})"
                                          for key in ("period", "q wait", "kv wait", "turn wait")))


def latency(tr, consumers):
    """Where no tile mixes heads (every consumer reads every ring position): per position n, the producer's K / V
    issue (codes 9 / 10, the n-th of each) against each consumer's pass of the wait for K_n and V_(n-1) (code 11, the
    n-th) and its arrival there (the event before it): issue -> arrival (the producer's lead), arrival -> pass (the
    wait) and issue -> pass, means over the first 16 blocks' positions 4 on (SM cycles)."""
    for wg, w in consumers:
        acc = collections.defaultdict(list)
        for cta in tr:
            prod = cta[0]
            k_iss = [clk for c, clk in prod if c == 9]
            v_iss = [clk for c, clk in prod if c == 10]
            ev = cta[w]
            n = 0
            for i, (c, clk) in enumerate(ev):
                if c != 11:
                    continue
                if 4 <= n < len(k_iss) and i > 0:
                    arr = ev[i - 1][1]
                    acc["K issue->arrival"].append(arr - k_iss[n])
                    acc["arrival->pass"].append(clk - arr)
                    acc["K issue->pass"].append(clk - k_iss[n])
                    acc["V(n-1) issue->pass"].append(clk - v_iss[n - 1])
                    acc["K(n) issue - V(n-1) issue"].append(k_iss[n] - v_iss[n - 1])
                n += 1
        print(f"  consumer {wg} latency: " + "  ".join(f"{k} {mean(v):6.0f}" for k, v in acc.items())
              + f"  (n {len(acc['arrival->pass'])})")


def run_case(name, dump, by_mix=False, lat=False):
    b, h, s, d, causal = CASES[name]
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def f():
        return pykernels.scaled_dot_product_attention(q, k, v, is_causal=causal, backend="cuda")

    for _ in range(5):
        f()
    torch.cuda.synchronize()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    st.record()
    for _ in range(20):
        f()
    en.record()
    torch.cuda.synchronize()
    us = st.elapsed_time(en) / 20 * 1e3
    read_trace(True)
    f()
    torch.cuda.synchronize()
    tr = read_trace(True)
    starts = [min(clk for w in cta for _, clk in w) for cta in tr]
    ends = [max(clk for w in cta for _, clk in w) for cta in tr]
    span = mean([e - s0 for s0, e in zip(starts, ends)])
    print(f"\n== {name}: B {b} H {h} S {s} D {d} causal {causal}: {us:.1f} us a call (trace build), "
          f"blocks 0-{N_CTAS - 1} span {span:.0f} cycles, {span / us:.0f} MHz implied")
    consumers = [(c, 4 * c) for c in (1, 2, 3) if any(tr[0][4 * c])]  # (the third: FwdWsCfg<64, 3>)
    for wg, w in consumers:
        agg = collections.defaultdict(list)
        per = []
        for cta in tr:
            ph, periods = phases(cta[w])
            for key, vals in ph.items():
                agg[key].extend(vals)
            per.extend(periods)
        print(f"  consumer {wg} (warp {w}): tile period {mean(per):.0f} cycles (n {len(per)})")
        order = ["first", "mid", "last"]
        names = ["kv landed", "turn taken", "products done"]
        names += [n for n in SOFTMAX_MARKS.values() if agg[f"block mid: {n}"]] + ["softmax done"]
        for place in order:
            row = [f"{mean(agg[f'block {place}: {n}']):7.0f}" for n in names]
            cnt = len(agg[f"block {place}: softmax done"])
            print(f"    block {place:5s} (n {cnt:4d}): " + " ".join(f"{n} {r}" for n, r in zip(names, row)))
        for key in ("tile end: last V landed", "tile end: last P V's turn", "tile end: last P V done",
                    "tile end: O stored", "q wait (after O stored)", "first q wait"):
            print(f"    {key:28s} {mean(agg[key]):7.0f}  (n {len(agg[key])})")
    if by_mix:
        import os
        n_u = (CASES[name][2] + 63) // 64
        grid = min((n_u * CASES[name][1] * CASES[name][0] + 2) // 3,
                   torch.cuda.get_device_properties(0).multi_processor_count)
        if os.environ.get("PYKERNELS_CUDA_ATTN_FWD_MIX") != "0":
            for wg, w in consumers:
                print(f"  consumer {wg} by tile kind (grid {grid}):")
                mixed_tiles(name, [cta[w] for cta in tr], grid)
    if lat:
        latency(tr, consumers)
    if dump:
        base = starts[0]
        for wg, w in consumers:
            ev = tr[0][w]
            tiles, out = 0, []
            for code, clk in ev:
                out.append(f"{code}:{clk - base}")
                if code == 7:
                    tiles += 1
                    if tiles >= dump:
                        break
            print(f"  block 0 consumer {wg}: " + " ".join(out))
        prod = tr[0][0]
        print("  block 0 producer: " + " ".join(f"{c}:{clk - base}" for c, clk in prod[: 9 * dump + 1]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="bert,gpt2,long")
    ap.add_argument("--dump", type=int, default=2)
    ap.add_argument("--by-mix", action="store_true", help="the three-consumer kernel's tiles of one head and of two")
    ap.add_argument("--latency", action="store_true", help="K / V issue to the consumers' waits (no tile mixing)")
    a = ap.parse_args()
    import pykernels._C  # noqa: F401  (registers the ops; pykernels loads it lazily)
    if not hasattr(torch.ops.pykernels_cuda, "attention_fwd_trace"):
        raise SystemExit("this build has no timeline: PYKERNELS_NVCC_FLAGS=-DPYKERNELS_FWD_TRACE pip install -e .")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for name in a.cases.split(","):
        run_case(name, a.dump, a.by_mix, a.latency)


if __name__ == "__main__":
    main()
