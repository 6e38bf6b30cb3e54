"""The masked-LM loss's logit tiles as a warp-specialised Gluon kernel for sm_90 (Hopper).

Same job as ``masked_lm_loss._logits_tma_kernel`` (z = h_c W[v_off:v_off + VC]^T over the compacted rows, one
of two epilogues: the forward's per-tile row statistics, or the sized backward's dz), in the structure of
CUTLASS's "ping-pong" GEMMs, so that the softmax epilogue of one tile runs while the tensor cores work on the
next (Triton 3.6 does not warp-specialise on sm_90; the Triton kernel's epilogue and mainloop take turns on
the same warps). A persistent CTA (one per SM) walks the (row block, vocabulary tile) grid, row blocks
fastest, as the Triton kernel does, with three partitions:

* a 1-warp **loader** (24 registers) streams the H / BLOCK_K k-steps of each tile's hidden rows and weight
  rows by TMA into a STAGES-deep ring (one ``ready`` and one ``empty`` mbarrier per stage);
* two **consumer warpgroups** (240 registers each) take the CTA's tiles in turn (even / odd). A warpgroup
  runs its tile's mainloop (async wgmma, one group in flight, each stage released as soon as the wgmma
  reading it completed), passes the mainloop turn to the other warpgroup (``turn`` mbarriers, which also keep
  the two warpgroups' ring waits in order) and runs its epilogue while the other's GEMMs run:
  - forward: bias, then the tile's row max of the log2-scaled logits and sum of exp2 (and with label
    smoothing the row sum), stored as the (n_vtiles, N) partials ``_masked_lm_loss_combine_kernel`` merges
    (which computes the target logit itself, ``ZT_DOT``);
  - dz: g (softmax - (1 - eps) onehot - eps / V) from the saved lse, 0 at rows past the device count and
    columns past the chunk, NaN everywhere when the device count contradicts the host's; written as bf16/fp16
    into the warpgroup's own shared tile and stored by TMA (clipped to (n_rows, VC)) while the next tile's
    mainloop runs. Under a ``max_valid`` bound, tiles whose rows all lie past the device count take no k-steps
    (no loads, no GEMM; the loader and both warpgroups count the same ring steps) and store their zeros.

The three matrices come as host-built TMA descriptors (``_launch.host_descriptor``; the launcher encodes them),
not made on the device at each CTA's start as the Triton kernel's are: every vocabulary chunk is a launch (4 at
BERT-base, 22 at GPT-2), and the attention forward measured several microseconds a CTA for device-made ones.

The forward's arithmetic is the Triton kernel's (``_tile_stats``; the merged lse bitwise equal without a bias, within
2e-6 with one, as before: the bias add's order, run181-186): the columns
past V become -inf through the bias's masked load, or without a bias through a per-column 0 / -inf that the
log2 e FMA adds, rather than a select an element (bias with smoothing keeps the select); dz is the same
quantity as ``_dlogits_tile``'s, formed as g p - g ((1 - eps) onehot + eps / V) with one select and one FMA an
element (run177-179: a third fewer instructions in the latency-bound epilogue; its single rounding could differ
from the Triton kernel's two in the last fp32 bit, which bf16 hides: the dz compared in run178-179 over 19-63 M
elements was bitwise equal). Otherwise the two kernels' outputs can differ only by the wgmma instructions'
accumulation order. Gluon kernels do not run
under the interpreter: the CPU tests compile this one for sm_90 (``tests/test_gluon_sm90_compile.py``), the GPU
tests compare it with the Triton kernel and the reference.
"""
from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from . import _launch, _tuning
from .masked_lm_loss import _tile_launcher

LOG2E = gl.constexpr(1.4426950408889634)
# (BLOCK_M, BLOCK_N, BLOCK_K, STAGES) per epilogue; BLOCK_M x BLOCK_N is one warpgroup's tile (fp32
# accumulator: 128 registers a thread at 128 x 128)
FWD_CONFIG = (128, 128, 64, 4)
DZ_CONFIG = (128, 128, 64, 4)
MAX_REGS = 65536 // (12 * 32) // 8 * 8  # 4 + 4 consumer warps and the loader's warpgroup, one CTA per SM


@gluon.jit
def _ksteps(pid, t, m_tiles, live_rows, ksteps, DZ: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
            BLOCK_M: gl.constexpr):
    """The k-steps of the CTA's t-th tile: all of them, or (dz) none for a tile whose rows all lie past the live
    rows (max_valid; its dz is all 0). A trip count rather than a branch: the accumulator's dataflow (and the
    epilogue's code) stays that of the plain loop. (The forward covers the device count: no tile to skip.)"""
    n = ksteps
    if DZ:
        n = gl.where(((pid + t * NUM_PROGRAMS) % m_tiles) * BLOCK_M < live_rows, ksteps, 0)
    return n


@gluon.jit
def _loader(a_desc, w_desc, a_smem, w_smem, ready_bar, empty_bar, n_rows, live_rows, VC, H, v_off,
            DZ: gl.constexpr, NUM_PROGRAMS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    m_tiles = gl.cdiv(n_rows, BLOCK_M)
    n_tiles = m_tiles * gl.cdiv(VC, BLOCK_N)
    ksteps = gl.cdiv(H, BLOCK_K)
    nbytes: gl.constexpr = a_desc.block_type.nbytes + w_desc.block_type.nbytes
    pid = gl.program_id(0)
    idx = 0
    for t in range(gl.cdiv(n_tiles - pid, NUM_PROGRAMS)):
        tile = pid + t * NUM_PROGRAMS
        off_m = (tile % m_tiles) * BLOCK_M
        off_n = v_off + (tile // m_tiles) * BLOCK_N
        for k in range(_ksteps(pid, t, m_tiles, live_rows, ksteps, DZ, NUM_PROGRAMS, BLOCK_M)):
            slot = idx % STAGES
            mbarrier.wait(empty_bar.index(slot), ((idx // STAGES) & 1) ^ 1)
            mbarrier.expect(ready_bar.index(slot), nbytes)
            tma.async_copy_global_to_shared(a_desc, [off_m, k * BLOCK_K], ready_bar.index(slot), a_smem.index(slot))
            tma.async_copy_global_to_shared(w_desc, [off_n, k * BLOCK_K], ready_bar.index(slot), w_smem.index(slot))
            idx += 1


@gluon.jit
def _dz_rows(rows_ptr, tgt_ptr, lse_ptr, gloss_ptr, offs_m, n_rows, count, mismatch, stride_g, t0,
             BLOCK_N: gl.constexpr):
    """Per row of a dz tile: lse * log2 e, the upstream gradient g and the target's column within the tile
    (t0: the tile's first vocabulary column; -1 outside it, in int32: an int64 compare widens every column index
    of the tile). Rows past the device count (or past n_rows: clipped on store) get lse = +inf and g = 0, so
    their p and dz are 0 with no select per element (their logits are finite: under a bound the gathered rows
    past the count are 0). A device count that contradicts the host's: g NaN in every row (a branch to a NaN
    tile would keep a second tile live: 660 bytes of spills)."""
    mask_m = offs_m < n_rows
    rows = gl.load(rows_ptr + offs_m, mask=mask_m, other=0).to(gl.int64)
    tgt = gl.load(tgt_ptr + rows, mask=mask_m, other=-1)
    lse2 = gl.load(lse_ptr + rows, mask=mask_m, other=0.0) * LOG2E
    g = gl.load(gloss_ptr + rows * stride_g, mask=mask_m, other=0.0)
    g = gl.where(mismatch != 0, float("nan"), g)
    row_ok = (offs_m < count) | (mismatch != 0)
    lse2 = gl.where(row_ok, lse2, float("inf"))
    g = gl.where(row_ok, g, 0.0)
    tcol = gl.where((tgt >= t0) & (tgt < t0 + BLOCK_N), tgt - t0, -1).to(gl.int32)
    return lse2, g, tcol


@gluon.jit
def _consumer(WG: gl.constexpr, a_smem, w_smem, o_smem, out_desc, ready_bar, empty_bar, turn_bar,
              b_ptr, tgt_ptr, rows_ptr, lse_ptr, gloss_ptr, part_m_ptr, part_s_ptr, part_zsum_ptr,
              N, V, H, v_off, VC, n_rows, live_rows, count, mismatch, stride_b, stride_g, smooth_eps,
              NUM_PROGRAMS: gl.constexpr, DZ: gl.constexpr, HAS_BIAS: gl.constexpr, SMOOTH: gl.constexpr,
              COL_MASK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
              STAGES: gl.constexpr):
    """Tiles WG, WG + 2, ... of this CTA (local order): mainloop on the turn, epilogue after passing it."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    row_l: gl.constexpr = gl.SliceLayout(1, acc_layout)
    col_l: gl.constexpr = gl.SliceLayout(0, acc_layout)
    m_tiles = gl.cdiv(n_rows, BLOCK_M)
    n_tiles = m_tiles * gl.cdiv(VC, BLOCK_N)
    ksteps = gl.cdiv(H, BLOCK_K)
    pid = gl.program_id(0)
    my_tiles = gl.cdiv(n_tiles - pid, NUM_PROGRAMS)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
    # ring steps of the CTA's tiles before this warpgroup's first (the loader's count: a skipped tile has none)
    base = 0
    if WG == 1:
        base = _ksteps(pid, 0, m_tiles, live_rows, ksteps, DZ, NUM_PROGRAMS, BLOCK_M)
    for t in range(WG, my_tiles, 2):
        tile = pid + t * NUM_PROGRAMS
        pid_m = tile % m_tiles
        pid_n = tile // m_tiles
        nk = _ksteps(pid, t, m_tiles, live_rows, ksteps, DZ, NUM_PROGRAMS, BLOCK_M)
        mbarrier.wait(turn_bar.index(WG), (t // 2) & 1)
        acc = zero
        for k in range(nk):
            idx = base + k
            slot = idx % STAGES
            mbarrier.wait(ready_bar.index(slot), (idx // STAGES) & 1)
            acc = warpgroup_mma(a_smem.index(slot), w_smem.index(slot).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            # the previous k-step's wgmma has completed: its stage goes back to the loader
            mbarrier.arrive(empty_bar.index((idx + STAGES - 1) % STAGES), count=1, pred=k > 0)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty_bar.index((base + nk - 1) % STAGES), count=1, pred=nk > 0)
        mbarrier.arrive(turn_bar.index(1 - WG), count=1)  # the other warpgroup's mainloop may start
        # past this tile and the other warpgroup's next one
        base += nk + _ksteps(pid, t + 1, m_tiles, live_rows, ksteps, DZ, NUM_PROGRAMS, BLOCK_M)

        off_m = pid_m * BLOCK_M
        off_c = pid_n * BLOCK_N
        offs_m = off_m + gl.arange(0, BLOCK_M, layout=row_l)
        mask_m = offs_m < n_rows
        offs_c = off_c + gl.arange(0, BLOCK_N, layout=col_l)
        offs_n = v_off + offs_c
        mask_n = (offs_c < VC) & (offs_n < V)  # (the sized backward may pad the last chunk past V)
        if DZ:
            # (loaded here, after the mainloop: loaded before it, in flight through the turn wait and the GEMM,
            # they made dz 1.12x slower, run178)
            lse2, g, tcol = _dz_rows(rows_ptr, tgt_ptr, lse_ptr, gloss_ptr, offs_m, n_rows, count, mismatch,
                                     stride_g, v_off + off_c, BLOCK_N)
            if HAS_BIAS:
                bias = gl.load(b_ptr + offs_n.to(gl.int64) * stride_b, mask=mask_n, other=0.0).to(gl.float32)
                acc = acc + gl.expand_dims(bias, 0)
            p = gl.exp2(acc * LOG2E - gl.expand_dims(lse2, 1))
            onehot = gl.expand_dims(gl.arange(0, BLOCK_N, layout=col_l), 0) == gl.expand_dims(tcol, 1)
            # dz = g p - g ((1 - eps) onehot + eps / V): per row the two values subtracted, then one select and
            # one FMA an element (the epilogue runs on one warp a scheduler, latency-bound: run177's profile)
            if SMOOTH:
                g_off = g * (smooth_eps / V)
                g_on = g * (1.0 - smooth_eps) + g_off
                sub = gl.where(onehot, gl.expand_dims(g_on, 1), gl.expand_dims(g_off, 1))
            else:
                sub = gl.where(onehot, gl.expand_dims(g, 1), 0.0)
            d = p * gl.expand_dims(g, 1) - sub
            if COL_MASK:  # the last chunk padded past V: its columns past V are 0 (past VC the store clips)
                d = gl.where(gl.expand_dims(mask_n, 0), d, 0.0)
            buf = o_smem.index(WG)
            tma.store_wait(pendings=0)  # this warpgroup's previous tile has left its buffer
            buf.store(d.to(o_smem.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(out_desc, [off_m, off_c], buf)
        else:
            # columns past V (the weight's rows past V read as 0 by TMA) are -inf in the row max and sum: through
            # the bias's masked load, or a per-column 0 / -inf added by the same FMA that scales by log2 e (not
            # a select an element)
            if HAS_BIAS and not SMOOTH:
                bias = gl.load(b_ptr + offs_n.to(gl.int64) * stride_b, mask=mask_n,
                               other=float("-inf")).to(gl.float32)
                z2 = (acc + gl.expand_dims(bias, 0)) * LOG2E
            elif HAS_BIAS:  # (smoothing's row sum needs the masked columns' 0; this way ptxas spills nothing)
                bias = gl.load(b_ptr + offs_n.to(gl.int64) * stride_b, mask=mask_n, other=0.0).to(gl.float32)
                acc = acc + gl.expand_dims(bias, 0)
                z2 = gl.where(gl.expand_dims(mask_n, 0), acc * LOG2E, float("-inf"))
            else:
                z2 = acc * LOG2E + gl.expand_dims(gl.where(mask_n, 0.0, float("-inf")), 0)
            m = gl.max(z2, axis=1)
            s = gl.sum(gl.exp2(z2 - gl.expand_dims(m, 1)), axis=1)
            out = pid_n.to(gl.int64) * N + offs_m
            gl.store(part_m_ptr + out, m, mask=mask_m)
            gl.store(part_s_ptr + out, s, mask=mask_m)
            if SMOOTH:
                zsum = gl.sum(gl.where(gl.expand_dims(mask_n, 0), acc, 0.0), axis=1)
                gl.store(part_zsum_ptr + out, zsum, mask=mask_m)
    if DZ:
        tma.store_wait(pendings=0)


@gluon.jit
def _logits_sm90_kernel(
    a_desc,         # host TMA descriptor over the (R, H) compacted hidden rows, block (BLOCK_M, BLOCK_K)
    w_desc,         # over the (V, H) weight, block (BLOCK_N, BLOCK_K) (rows past V read as 0)
    out_desc,       # DZ: over the chunk's (n_rows, VC) dlogits, block (BLOCK_M, BLOCK_N) (stores clipped); else
                    # a_desc again (unused)
    b_ptr, tgt_ptr, rows_ptr, count_ptr,
    lse_ptr, gloss_ptr,                     # DZ: saved lse and upstream grad, by position
    part_m_ptr, part_s_ptr, part_zsum_ptr,  # not DZ: (n_vtiles, N) per-tile partials
    N, V, H, R, v_off, VC,  # (R: the descriptor's; unused here)
    n_rows,         # rows to cover (-1: the device count)
    capacity,       # 1: n_rows is an upper bound (max_valid): only a device count above it poisons
    lda, stride_wv, ldo,  # (the descriptors carry these: unused here, the Triton kernel's positions)
    stride_b, stride_g, smooth_eps,
    NUM_PROGRAMS: gl.constexpr, DZ: gl.constexpr, HAS_BIAS: gl.constexpr, SMOOTH: gl.constexpr,
    COL_MASK: gl.constexpr,  # dz: the chunk reaches past V (the launcher sets it per chunk)
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """The arguments of ``_logits_tma_kernel`` (less the target-logit partials), with host-built descriptors in
    place of its three matrix pointers (a descriptor made on the device costs each CTA microseconds before its
    first load; every chunk is a launch); num_warps = 4 (the default partition is one consumer warpgroup)."""
    gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
    dtype: gl.constexpr = a_desc.dtype
    count = gl.load(count_ptr)
    # the forward covers the device count (n_rows = -1); the sized backward its host count (or bound), and if
    # the device contradicts it every dz is NaN (as in the Triton kernels)
    bad = gl.where(capacity != 0, count > n_rows, count != n_rows)
    mismatch = gl.where(n_rows < 0, 0, bad.to(gl.int32))
    n_rows = gl.where(n_rows < 0, count, n_rows)
    # under a bound (max_valid) the row tiles wholly past the device count are skipped (no loads, no GEMM: dz
    # 0); with a contradicting count (NaN everywhere) or without a bound every tile runs
    live_rows = gl.where((capacity != 0) & (mismatch == 0), gl.minimum(count, n_rows), n_rows)
    a_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    w_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    if DZ:
        o_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N], out_desc.layout)
    else:
        o_smem = a_smem  # (unused)
    ready_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bar.index(i), count=1)
        mbarrier.init(empty_bar.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn_bar.index(i), count=1)
    mbarrier.arrive(turn_bar.index(0), count=1)  # warpgroup 0 runs the first mainloop
    fence_async_shared()
    gl.warp_specialize([
        (_consumer, (0, a_smem, w_smem, o_smem, out_desc, ready_bar, empty_bar, turn_bar, b_ptr, tgt_ptr, rows_ptr, lse_ptr,
                      gloss_ptr, part_m_ptr, part_s_ptr, part_zsum_ptr, N, V, H, v_off, VC, n_rows, live_rows, count,
                      mismatch, stride_b, stride_g, smooth_eps, NUM_PROGRAMS, DZ, HAS_BIAS, SMOOTH, COL_MASK, BLOCK_M,
                      BLOCK_N, BLOCK_K, STAGES)),
        (_loader, (a_desc, w_desc, a_smem, w_smem, ready_bar, empty_bar, n_rows, live_rows, VC, H, v_off,
                   DZ, NUM_PROGRAMS, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)),
        (_consumer, (1, a_smem, w_smem, o_smem, out_desc, ready_bar, empty_bar, turn_bar, b_ptr, tgt_ptr, rows_ptr, lse_ptr,
                      gloss_ptr, part_m_ptr, part_s_ptr, part_zsum_ptr, N, V, H, v_off, VC, n_rows, live_rows, count,
                      mismatch, stride_b, stride_g, smooth_eps, NUM_PROGRAMS, DZ, HAS_BIAS, SMOOTH, COL_MASK, BLOCK_M,
                      BLOCK_N, BLOCK_K, STAGES)),
    ], [1, 4], [24, 240])


def _gl_dtype(dtype: torch.dtype):
    return gl.bfloat16 if dtype == torch.bfloat16 else gl.float16


@functools.lru_cache(maxsize=None)
def smem_layouts(cfg: tuple, dtype: torch.dtype) -> tuple:
    bm, bn, bk, _ = cfg
    gdt = _gl_dtype(dtype)
    return (gl.NVMMASharedLayout.get_default_for([bm, bk], gdt), gl.NVMMASharedLayout.get_default_for([bn, bk], gdt),
            gl.NVMMASharedLayout.get_default_for([bm, bn], gdt))


def logits(hc, weight, bias, target, rows, count, lse, grad_loss, partials, *, n, n_rows, label_smoothing, dz,
           capacity: bool = False, cfg: tuple | None = None):
    """``launch(out, v_off, vc)`` as ``masked_lm_loss._logits_tma`` returns it: dz into ``out`` (dz) or the
    statistics into ``partials`` (m, s, zsum; the combine kernel computes the target logit). ``n_rows`` (the
    host count or a ``max_valid`` bound) must be at most N: the epilogue reads ``rows[:n_rows]`` and indexes the
    targets, lse and upstream gradient with them (the op checks it; a bound past N read past the compacted
    rows and faulted on a garbage index, run173-174). ``hc``, ``weight`` and ``out`` take TMA descriptors: 16-byte
    aligned bases and row strides, unit column strides (``masked_lm_loss.tma_applies``)."""
    cfg = cfg or (DZ_CONFIG if dz else FWD_CONFIG)
    bm, bn, bk, stages = cfg
    parts = (partials[0], partials[1], partials[3]) if partials is not None else (lse,) * 3
    al, wl, ol = smem_layouts(cfg, hc.dtype)
    (r, h), v = hc.shape, weight.shape[0]
    a_desc = _launch.host_descriptor(hc, [r, h], [hc.stride(0), 1], [bm, bk], al)
    w_desc = _launch.host_descriptor(weight, [v, h], [weight.stride(0), 1], [bn, bk], wl)

    def out_desc(out, vc):
        """The chunk's dz, clipped to (n_rows, vc) on store (the forward's placeholder: a_desc, never read)."""
        return _launch.host_descriptor(out, [n_rows, vc], [out.stride(0), 1], [bm, bn], ol) if dz else a_desc

    flags = dict(DZ=dz, HAS_BIAS=bias is not None, SMOOTH=label_smoothing > 0.0, BLOCK_M=bm, BLOCK_N=bn,
                 BLOCK_K=bk, STAGES=stages, num_warps=4, maxnreg=MAX_REGS)
    # (``kernel[grid]`` costs 60-85 us of host time a launch there: the fast launcher, as for the Triton kernels)
    return _tile_launcher(_launch.fast(_logits_sm90_kernel), hc, weight, bias, target, rows, count, lse,
                          grad_loss, parts, n=n, n_rows=n_rows, label_smoothing=label_smoothing, dz=dz,
                          capacity=capacity, block_m=bm, block_n=bn,
                          programs=_tuning.device_properties(hc.device).multi_processor_count, flags=flags,
                          col_mask=True, descriptors=(a_desc, w_desc, out_desc))
