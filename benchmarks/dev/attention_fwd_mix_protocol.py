"""A model of the C++ forward's barrier protocol on tiles that mix heads (csrc/attention.cuh, attn_fwd_sm90_ws_kernel's
kMix), for development: the producer (Q buffers, the K / V ring of S slots, a position's K then its V), three consumer
warpgroups (their turn chain, each freeing the other head's block unread: the one at g - 1 at its block at ring
position g, and the first head's warpgroups the second's last after their last P V) and the TMA loads landing in a
random order, stepped by random schedules. It checks that no schedule deadlocks, that each consumer finds its own head's
block in the slot it reads, and that no load lands in a slot a consumer still holds. A model, not the kernel: a
change to the kernel's protocol is to be made here too (the GPU tests run the kernel: test_attention.py's
mixed-head tests). Usage: ``python benchmarks/dev/attention_fwd_mix_protocol.py [--seeds 6]``.
"""
import argparse
import random
import sys

S, NW = 4, 3

def mix_rows(t, w, n_u, units):
    u, last = 3 * t + w, units - 1
    a, z, me = 3 * t // n_u, min(3 * t + 2, last) // n_u, min(u, last) // n_u
    return dict(head=me, step=2 if a != z else 1, second=int(me != a), a=a, z=z)

class Bar:
    def __init__(s, count): s.count, s.pending, s.n = count, count, 0
    def arrive(s):
        s.pending -= 1
        assert s.pending >= 0
        if s.pending == 0: s.n += 1; s.pending = s.count
    def done(s, parity): return (s.n & 1) != parity

def run(n_u, heads, nkb, grid, seed, keep_last=False):
    """One schedule; ``keep_last``: the first head's warpgroups leave the second head's last block unfreed (a broken
    protocol, which deadlocks: the check's own check)."""
    rng = random.Random(seed)
    units = n_u * heads; tiles = (units + 2) // 3
    kf = [Bar(1) for _ in range(S)]; ke = [Bar(NW) for _ in range(S)]
    vf = [Bar(1) for _ in range(S)]; ve = [Bar(NW) for _ in range(S)]
    qf = [Bar(1) for _ in range(2)]; qe = [Bar(NW) for _ in range(2)]
    inflight = []  # TMA loads: barriers to arrive on later
    # what each consumer reads at each position (for checking the data it uses is the right head's)
    slot_head = {}
    holds = {}
    def producer(blk):
        qi, g = 0, 0
        for t in range(blk, tiles, grid):
            qb = qi & 1
            yield lambda: qe[qb].done(((qi >> 1) & 1) ^ 1)
            inflight.append(qf[qb]); qi += 1
            r = mix_rows(t, 0, n_u, units); sh = r['step'] - 1
            n = nkb << sh
            def v(j, gj):
                yield lambda: ve[gj % S].done(((gj // S) & 1) ^ 1)
                assert not holds.get(('v', gj % S)), ('v overwritten in use', gj); inflight.append(vf[gj % S]); slot_head[('v', gj % S)] = (r['z'] if (j & sh) else r['a'], j >> sh)
            for j in range(n):
                st = g % S
                yield lambda: ke[st].done(((g // S) & 1) ^ 1)
                assert not holds.get(('k', st)), ('k overwritten in use', g); inflight.append(kf[st]); slot_head[('k', st)] = (r['z'] if (j & sh) else r['a'], j >> sh)
                yield from v(j, g)
                g += 1
    turn = [0] * NW
    def consumer(blk, cw):
        nxt = (cw + 1) % NW
        if cw == NW - 1: turn[0] += 1
        qi, g = 0, 0
        for t in range(blk, tiles, grid):
            r = mix_rows(t, cw, n_u, units); step, second = r['step'], r['second']
            qb = qi & 1
            yield lambda: qf[qb].done((qi >> 1) & 1)
            qi += 1
            g += second
            def free_k(gs):
                yield lambda: kf[gs % S].done((gs // S) & 1)
                ke[gs % S].arrive()
            def free_v(gs):
                yield lambda: vf[gs % S].done((gs // S) & 1)
                ve[gs % S].arrive()
            for nb in range(nkb):
                st, pst = g % S, (g + S - step) % S
                yield lambda: kf[st].done((g // S) & 1) and (nb == 0 or vf[pst].done(((g - step) // S) & 1))
                assert slot_head[('k', st)] == (r['head'], nb), (t, cw, nb)
                holds[('k', st)] = holds.get(('k', st), 0) + 1
                if nb > 0:
                    assert slot_head[('v', pst)] == (r['head'], nb - 1)
                    holds[('v', pst)] = holds.get(('v', pst), 0) + 1
                if step == 2 and (second or nb > 0):
                    yield from free_k(g - 1)
                    yield from free_v(g - 1)
                yield lambda: turn[cw] > 0
                turn[cw] -= 1
                turn[nxt] += 1
                holds[('k', st)] -= 1; ke[st].arrive()
                if nb == nkb - 1: qe[qb].arrive()
                yield lambda: True  # the softmax
                if nb > 0: holds[('v', pst)] -= 1; ve[pst].arrive()
                g += step
            if nkb > 0:
                pst = (g + S - step) % S
                yield lambda: vf[pst].done(((g - step) // S) & 1)
                assert slot_head[('v', pst)] == (r['head'], nkb - 1)
                holds[('v', pst)] = holds.get(('v', pst), 0) + 1
                yield lambda: turn[cw] > 0
                turn[cw] -= 1; turn[nxt] += 1
                yield lambda: True  # the P V
                holds[('v', pst)] -= 1; ve[pst].arrive()
                if step == 2 and second == 0 and not keep_last:
                    yield from free_k(g - 1)
                    yield from free_v(g - 1)
            else:
                qe[qb].arrive()
            g -= second
        if cw == 0:
            yield lambda: turn[0] > 0
            turn[0] -= 1
    for blk in range(grid):
        procs = [producer(blk)] + [consumer(blk, c) for c in range(NW)]
        # reset barriers per block (each block its own smem)
        kf[:] = [Bar(1) for _ in range(S)]; ke[:] = [Bar(NW) for _ in range(S)]
        vf[:] = [Bar(1) for _ in range(S)]; ve[:] = [Bar(NW) for _ in range(S)]
        qf[:] = [Bar(1) for _ in range(2)]; qe[:] = [Bar(NW) for _ in range(2)]
        turn[:] = [0] * NW; inflight.clear(); holds.clear()
        waits = [None] * len(procs)
        live = list(range(len(procs)))
        steps = 0
        while live or inflight:
            steps += 1
            assert steps < 10**6
            choices = [i for i in live if waits[i] is None or waits[i]()]
            if inflight and (not choices or rng.random() < 0.3):
                inflight.pop(rng.randrange(len(inflight))).arrive(); continue
            if not choices:
                raise RuntimeError(f"deadlock n_u={n_u} heads={heads} nkb={nkb} grid={grid} blk={blk}")
            i = rng.choice(choices)
            try:
                waits[i] = next(procs[i])
            except StopIteration:
                live.remove(i)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=6)
    args = ap.parse_args(argv)
    n = 0
    for n_u in (2, 3, 4, 5, 8):
        for heads in (1, 2, 3, 5):
            for nkb in (0, 1, 2, 3, 4, 5):
                for grid in (1, 2, 3):
                    for seed in range(args.seeds):
                        run(n_u, heads, nkb, grid, seed)
                        n += 1
    print(f"ok: {n} schedules, no deadlock")
    return 0


if __name__ == "__main__":
    sys.exit(main())
