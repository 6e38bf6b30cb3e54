"""What Triton 3.6 generates for sm_90 (compiled here, no GPU needed): evidence for two limits the
README names.

1. wgmma overlap: a FlashAttention-2 inner loop written plainly, and rotated so that the next block's
   QK^T is issued before the current block's softmax. The printed sequence of wgmma issues (MMA),
   waits (WAITn) and exp2 (EX2) shows whether a wgmma stays in flight across the softmax.
2. Automatic warp specialisation (``tl.range(..., warp_specialize=True)``) on a persistent descriptor
   matmul and a one-tile one: PTX size with it on and off (the same size: nothing changed), or the
   pass's compile error.

Usage: ``python benchmarks/dev/sm90_codegen.py`` (any machine with triton 3.6)."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)


@triton.jit
def _softmax_pv(s, m_i, l_i, acc, V, on, od, D: tl.constexpr):
    """One online-softmax step on the score tile ``s`` and its P @ V update."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(tl.bfloat16), tl.load(V + on[:, None] * D + od[None, :]), acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _start(Q, BM: tl.constexpr, D: tl.constexpr):
    """The program's query rows, head-dim offsets, Q tile and empty softmax state."""
    om = tl.program_id(0) * BM + tl.arange(0, BM)
    od = tl.arange(0, D)
    q = tl.load(Q + om[:, None] * D + od[None, :])
    return om, od, q, tl.full((BM,), float("-inf"), tl.float32), tl.zeros((BM,), tl.float32), \
        tl.zeros((BM, D), tl.float32)


@triton.jit
def fa_plain(Q, K, V, O, S, qk_scale, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
    om, od, q, m_i, l_i, acc = _start(Q, BM, D)
    for n0 in range(0, S, BN):
        on = n0 + tl.arange(0, BN)
        s = tl.dot(q, tl.load(K + on[None, :] * D + od[:, None])) * qk_scale
        m_i, l_i, acc = _softmax_pv(s, m_i, l_i, acc, V, on, od, D)
    tl.store(O + om[:, None] * D + od[None, :], (acc / l_i[:, None]).to(tl.bfloat16))


@triton.jit
def fa_rotated(Q, K, V, O, S, qk_scale, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
    om, od, q, m_i, l_i, acc = _start(Q, BM, D)
    s = tl.dot(q, tl.load(K + tl.arange(0, BN)[None, :] * D + od[:, None])) * qk_scale
    for n0 in range(0, S - BN, BN):
        on = n0 + tl.arange(0, BN)
        s_next = tl.dot(q, tl.load(K + (on + BN)[None, :] * D + od[:, None])) * qk_scale  # issued first
        m_i, l_i, acc = _softmax_pv(s, m_i, l_i, acc, V, on, od, D)
        s = s_next
    tl.store(O + om[:, None] * D + od[None, :], (acc / l_i[:, None]).to(tl.bfloat16))


@triton.jit
def mm_persistent(a_desc, b_desc, c_desc, M, N, K, WS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr):
    m_tiles = tl.cdiv(M, BM)
    for t in tl.range(tl.program_id(0), m_tiles * tl.cdiv(N, BN), 132, flatten=True, warp_specialize=WS):
        pm = t % m_tiles
        pn = t // m_tiles
        acc = tl.zeros((BM, BN), tl.float32)
        for k in range(0, tl.cdiv(K, BK)):
            acc = tl.dot(a_desc.load([pm * BM, k * BK]), b_desc.load([pn * BN, k * BK]).T, acc)
        c_desc.store([pm * BM, pn * BN], acc.to(tl.bfloat16))


@triton.jit
def mm_tile(a_desc, b_desc, c_desc, M, N, K, WS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
            BK: tl.constexpr):
    acc = tl.zeros((BM, BN), tl.float32)
    for k in tl.range(0, tl.cdiv(K, BK), warp_specialize=WS):
        acc = tl.dot(a_desc.load([tl.program_id(0) * BM, k * BK]), b_desc.load([tl.program_id(1) * BN, k * BK]).T,
                     acc)
    c_desc.store([tl.program_id(0) * BM, tl.program_id(1) * BN], acc.to(tl.bfloat16))


def _compile(fn, sig, const, warps, stages=3):
    names = fn.arg_names
    src = ASTSource(fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=TARGET, options=dict(num_warps=warps, num_stages=stages))


def _sequence(ptx: str) -> str:
    seq = []
    for line in ptx.split("\n"):
        t = line.strip()
        tag = ("MMA" if t.startswith("wgmma.mma_async") else
               "WAIT" + t.split()[1].rstrip(";") if t.startswith("wgmma.wait_group") else
               "EX2" if t.startswith("ex2.approx") else None)
        if tag:
            if seq and seq[-1][0] == tag:
                seq[-1][1] += 1
            else:
                seq.append([tag, 1])
    return " ".join(f"{t}x{n}" if n > 1 else t for t, n in seq)


def main() -> None:
    print("triton", triton.__version__, "target sm_90")
    sig = dict(Q="*bf16", K="*bf16", V="*bf16", O="*bf16", S="i32", qk_scale="fp32",
               BM="constexpr", BN="constexpr", D="constexpr")
    for fn in (fa_plain, fa_rotated):
        ck = _compile(fn, sig, dict(BM=128, BN=64, D=128), warps=8)
        print(f"{fn.__name__:<11} {_sequence(ck.asm['ptx'])}")
    sig = dict(a_desc="tensordesc<bf16[128, 64]>", b_desc="tensordesc<bf16[128, 64]>",
               c_desc="tensordesc<bf16[128, 128]>", M="i32", N="i32", K="i32",
               WS="constexpr", BM="constexpr", BN="constexpr", BK="constexpr")
    for fn, label in ((mm_persistent, "persistent descriptor matmul"), (mm_tile, "one-tile descriptor matmul")):
        for warps in (4, 8):
            sizes = []
            for ws in (False, True):
                try:
                    ck = _compile(fn, sig, dict(WS=ws, BM=128, BN=128, BK=64), warps=warps)
                    sizes.append(f"{ck.asm['ptx'].count(chr(10))} PTX lines")
                except Exception as e:  # noqa: BLE001 (the pass's failure is the finding)
                    sizes.append(f"compile error ({type(e).__name__})")
            print(f"{label}, {warps} warps: warp_specialize off {sizes[0]}, on {sizes[1]}")


if __name__ == "__main__":
    main()
