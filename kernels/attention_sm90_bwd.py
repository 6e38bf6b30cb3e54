"""Attention backward for Hopper (sm_90) in Gluon: the dK/dV and dQ kernels that ``attention.attention_bwd``
takes on sm_90 where ``attention_sm90`` covers the case (fp16/bf16, D = 64 or 128, no mask, not varlen; with
dropout the dK/dV kernel only, ``HAS_DROPOUT`` below), at D = 128 with at least one CTA per SM (``kernels``),
and the tensors are seen through host descriptors. The Gluon dQ kernel runs first and forms delta =
rowsum(dO * O) itself (``_row_delta``) for the dK/dV kernel too; where it does not run, the Triton preprocess
does, as for the Triton kernels.
Either Gluon kernel can run with the other's Triton one. At D = 256 a third kernel, the D = 256 dK/dV kernel
(``_attention_bwd_dkdv_d256_sm90_kernel``, ``DKDV_D256_CONFIGS``: one consumer warpgroup holds dV, the other dK),
runs beside Triton's dQ kernel (``PYKERNELS_ATTN_SM90_D256=0`` turns it off, ``DKDV_D256_AUTO``).

Why. The Triton dK/dV and dQ kernels wait for every wgmma right after issuing it and cannot split a
producer from the consumers (``attention_sm90``'s docstring): at D = 128 the whole Triton backward reaches
288-393 TFLOP/s on an H100 against cuDNN's 437-502 (run36).

``_attention_bwd_dkdv_sm90_kernel``: one CTA takes 2 x BLOCK_N keys of one (batch, kv head). A 1-warp TMA
producer loads each consumer warpgroup's K and V once, then Q_j and dO_j (a STAGES-deep ring, both
consumers release a stage) for every query head of the GQA group and every query block the keys can
see, and with them the block's lse_j * log2 e and delta_j into shared memory (loaded by the consumers
themselves, those global loads stalled the issue of the dP^T GEMM, run67's profile; 1.05-1.16x the kernel,
run73). Each of the two consumer warpgroups (``setmaxnreg`` 240) holds its BLOCK_N keys' dK and dV in
registers (fp32) and, per query block, on transposed tiles so that no operand needs a register transpose
(FlashAttention-2/3's dK/dV loop):

    S^T = K Q_j^T, dP^T = V dO_j^T       (asynchronous wgmma, both in flight)
    P^T = exp2(S^T * scale * log2 e - lse_j * log2 e)      (0 above the causal diagonal)
    dV += P^T dO_j                        (P^T from registers; in flight while dS^T is formed)
    dS^T = P^T (dP^T - delta_j);  dK += dS^T Q_j

then dK * scale and dV leave through the K and V buffers by TMA (stores clip keys >= Sk). GQA heads sum
in registers: no atomics, so the kernel is deterministic.

``_attention_bwd_dq_sm90_kernel``: the forward's structure (a tile of 2 x 64 query rows of one (batch,
head), a producer streaming K and V through the forward's ring, ``_fill_kv_ring``); per key block each
consumer runs S = Q K_j^T and dP = dO V_j^T, P = exp2(S * scale * log2 e - lse * log2 e) (masked as the
forward masks), dS = P (dP - delta) and dQ += dS K_j. S_j, dP_j and dQ_{j-1} are issued together on the
consumer's ping-pong turn (two mbarriers, as in the forward), and dS_j forms while dQ_{j-1} runs.

Queries past a head's Sq in a Q/dO tile are the next head's rows (or TMA's zero fill): their lse reads as
+inf, so P = 0 there. Keys past Sk in the dQ kernel are masked; in the dK/dV kernel they are computed and
never stored.

Causal: both kernels' CTAs run longest first (``CAUSAL_LPT``) across the (batch, head)s of a group that fits L2
(``_lpt_order``, ``LPT_L2_BYTES``; all heads at once streamed every head's operands from DRAM, run87), the last
``LPT_TAIL_GROUPS`` groups as one so that the grid ends on short CTAs (run437).

Dropout (``HAS_DROPOUT``, D = 128; ``DROPOUT_KERNELS``): the dK/dV kernel's consumers draw the forward's keep mask
themselves, Philox-4x32-7 at the counter every pykernels kernel uses (``kernels/_dropout.py``), in inline PTX
(``_keep_octet_ptx``): one call per 8 elements, its keep bits moved to the lanes that hold them by three xor
shuffles (csrc/attention.cuh's octet transpose), the 8 bits of a pack left in one register until ``_apply_keep``
zeroes P^T with them; the draws are issued while the block's S^T and dP^T GEMMs run (``DROPOUT_EARLY``), and the
keep bits come from an add.cc / addc chain (``DROPOUT_CARRY``). dV += (P^T Z) dO_j and dS^T = P^T (dP^T Z / (1 - p) -
delta_j), dV scaled by 1 / (1 - p) once at the end; dP^T's Z is read from P^T Z's 16-bit values in the dV GEMM's
operand registers (``_apply_keep16``), so the keep bits are dead once P^T Z is formed. The dQ kernel has no dropout:
beside the dK/dV kernel Triton's dQ kernel runs (``sm90_backward``). H200 run447 (whole backward, graph replay, p =
0.1): 1.09-1.19x the C++ op's backward and 2.0-2.4x the Triton kernels', 1.27-1.40x its own time without dropout;
against cuDNN's backward with dropout 1.007x at 4 x 16 x 4096 full, 0.995x at 8 x 16 x 1024 full, 0.89-0.90x causal;
the carry chain 1.008-1.029x on that (run451). The consumer's time follows its registers, not its instruction count
(ptxas's spills; the loop's SASS counted by ``benchmarks/dev/attention_bwd_sass_loops.py``): reading dP^T's Z from
P^T Z instead of keeping the int8 flags (two registers a pack) across the dP^T wait, H200 run453: 1.082x / 1.039x /
1.078x / 1.089x faster at 4 x 16 x 2048 causal / 4 x 16 x 4096 full / 4 x 16 x 4096 causal / 1 x 16 x 8192 causal
(536.3 / 3215.6 / 1841.9 / 1769.0 us, the dropout's cost 1.22-1.25x its time without); run452's try, P^T Z held in
fp32 for dS^T = (P^T Z) dP^T - P^T delta_j (1 - p) with 75 fewer instructions a block a thread, was 1.01-1.10x
slower (more spills).

Set-up: the dK/dV kernel's K, V, dK and dV come through host descriptors where Sk is a multiple of its 128 keys
(``HOST_KV``; else made on the device per CTA, which cost 3.6-3.9 us of a CTA's 6.1 us before its first query
block, run438-439). ``benchmarks/dev/attention_bwd_trace.py`` (``TRACE``) times a CTA's marks.

Measured (H100 80GB HBM3, triton 3.6, bf16, ``benchmarks/dev/attention_bwd_sm90_gluon.py``, do_bench,
2026-11-26, run49): B2 H16 S8192 D128 full / causal, dK/dV 3.30 / 1.92 ms (667 / 572 TFLOP/s of its 4
GEMMs), dQ 2.27 / 1.24 ms (727 / 664 of its 3); the whole backward 5.56 / 3.19 ms against 6.86 / 4.13 with
the Triton kernels. Graph replay in the attention benchmark (run49): 506 / 427 TFLOP/s, cuDNN 528 / 473.
With lse / delta through shared memory (run74 probe): dK/dV 3.19 / 1.89 ms (689 / 581), 0.97 ms (568) at
B4 H16 S4096 causal; the whole backward 5.60 / 3.12 / 1.66 ms (491 / 441 / 413 TFLOP/s).

FUSED_DQ (opt-in "fused"): dQ_j's columns are split between the warpgroups, each staging its (BLOCK_M, D / 2)
fp32 tile in shared memory for an asynchronous bulk TMA reduction waited one block later. run54-55: 5.72-5.75 /
3.28-3.63 ms at S8192 full / causal, next to 5.68-5.89 / 3.22-3.26 for the pair (within the noise at full,
slower causal; 2.02 vs 1.76-1.87 ms at S4096 causal). Each warpgroup's block is serial (S^T, dP^T -> P^T -> dV,
dS^T -> dK, both dS^T -> dQ -> its epilogue), and ptxas spills 632-756 bytes of loop invariants (300-368 with
lse / delta in shared memory; run74: 5.19 vs 5.60 ms for the pair at S8192 full, 3.31 vs 3.12 causal, 2.48 vs
1.66 at S4096 causal). Most of that causal loss was L2: with the head-grouped causal order it ties the pair at
S4096 causal and is the default where the backward need not be deterministic (``kernels``, run87-91).
"""
from __future__ import annotations

import functools
import os

import torch
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from ._dropout import _apply_keep_ptx, _keep_octet_ptx, dropout_rate, seed_arg  # noqa: F401  (the PTX: also the tests')
from ._dropout import APPLY_KEEP_CONSTRAINTS as _APPLY_KEEP_CONSTRAINTS
from ._dropout import APPLY_KEEP_PTX as _APPLY_KEEP_PTX
from ._dropout import KEEP_OCTET_CARRY_PTX as _KEEP_OCTET_CARRY_PTX
from ._dropout import KEEP_OCTET_CONSTRAINTS as _KEEP_OCTET_CONSTRAINTS

from . import _launch, _tuning
from .attention_sm90 import (D192, LOG2E, MAX_REGS, SPLIT, TILE_D, _alloc_kv_ring, _descriptor, _descriptor_fields,
                             _fill_kv_ring, _flat_coords, _flat_descriptor, _flat_geometry, _mask_scores, _mma_nt_cols,
                             _needs_mask, _num_sms, _slice_desc, _store_rows, _tile_coords, _tma_ok, smem_layouts,
                             zero_fill_on)

# dK/dV: (keys per consumer warpgroup, BLOCK_M query rows per block, STAGES). At D = 128 with 64-query
# blocks ptxas spills 100 bytes (216 causal; 28 / 80 since lse / delta come through shared memory; dK, dV,
# S^T, dP^T near the 240 registers), yet it beats the spill-free 32-query blocks by 1.16-1.20x (run39: 3.41 vs
# 4.10 ms at S = 8192); three stages lose 2-9% (run50); 0.97-1.02x after the lse / delta change (run85).
DKDV_CONFIGS = {64: (64, 64, 2), 128: (64, 64, 2)}
# dQ: (query rows per consumer warpgroup, BLOCK_N keys per block, STAGES). STAGES >= 3 (the consumer releases
# K_{j-1} after V_j arrived); at D = 128 four stages beat three by 1.29-1.36x (run44: 2.33 vs 3.00 ms, S = 8192)
DQ_CONFIGS = {64: (64, 128, 3), 128: (64, 64, 4)}
# D = 256 (tried, not kept: H200 run478, ``attention_bwd_d256_gluon_dq_*_run478.txt``): this kernel compiles there at
# 64 x 32 x 3 (Q, dO and the ring fill 225 KiB; 36-48 bytes spilled) and is right (its GPU tests passed), but beside
# Triton's dK/dV kernel the whole backward ran at 0.87-0.98x the Triton pair's speed in graph replay (64 x 16 x 4:
# 0.87-1.00x) at B4 H8 S2048 / S4096 causal, B2 H8 S8192, B16 H16 S512 and B1 H8 S8192 causal
# causal: both kernels' CTAs longest first across (batch, head)s (the probe compares with by-head order)
CAUSAL_LPT = True
# ... in groups of heads whose reused operands fit this much of L2, yet of at least LPT_MIN_WAVES CTAs per SM
# (``lpt_group``; 0 = all heads at once), without GQA. Nsight Compute (run76, run87) had the causal kernels at an
# L2 hit rate of 35-39% at S4096 with every head's longest CTAs first at once. The whole backward at 12 MiB against
# all heads (H100 run88 / run89, do_bench): causal S1024 / 2048 / 4096 / 8192 1.20 / 1.18 / 1.02-1.07 /
# 1.00-1.04x, the fused kernel 1.44 / 1.62 / 1.62 / 1.05x; with 4 query heads per kv head (B4 H32/8 S4096)
# 0.93-0.97x, so GQA keeps all heads at once
LPT_L2_BYTES = 12 << 20
LPT_MIN_WAVES = 1
# ... with GQA too (``PYKERNELS_ATTN_SM90_LPT_GQA=1``, an experiment, off: the H100 measure above predates the host
# K / V descriptors, the tail groups and the H200's 50 MB of L2; H200 run491, matrix, graph replay, the same call:
# 4 x 32/8 x 4096 D128 causal backward 411 / 411 against 406 / 404 off (cuDNN 440 / 441), 8 x 32/8 x 2048 D64 causal
# 286 / 292 against 292 / 313: within the rows' noise, not adopted)
LPT_GQA = os.environ.get("PYKERNELS_ATTN_SM90_LPT_GQA", "0") not in ("", "0")
# ... except the last LPT_TAIL_GROUPS groups, which run as one (their heads' rank 0, then their rank 1, ...): with
# the groups one after another, the last group's long CTAs start near the end and run while the other SMs idle
# (run435's timeline: 4.0-4.6% of the SMs' time idle in the tail at 4 x 16 x 4096 and 2 x 16 x 8192 causal). With two
# merged, the grid's last CTAs are short ones (the dispatch modelled with run435's costs: 598 -> 580 against a
# balanced 574 at 4 x 16 x 4096, 1120 -> 1080 against 1071 at 2 x 16 x 8192; three or four merged gain no more:
# ``benchmarks/dev/attention_bwd_trace.py --model``), and L2 holds two groups' operands where they overlap. Moving
# every head's shortest CTAs to the grid's end, rank by rank across all heads, removed the tail too but read their
# Q / dO and dQ sums from DRAM (run436: its CTAs 3.3 us slower each at 4 x 16 x 4096, the kernel 1.01-1.05x)
LPT_TAIL_GROUPS = 2
# the fused kernel (dQ by TMA reductions, not bitwise reproducible) is the default where the backward need not be
# deterministic: full attention from FUSED_MIN_SK keys, causal without GQA from FUSED_CAUSAL_MIN_SK (``kernels``;
# H100 run88-89: it ties the pair at S1024 full and S4096 causal, loses 10-13% causal with 4 query heads per kv head;
# H200 run358, 4 x 16 x 4096 causal: 1.03-1.06x the pair in kernel time, 1.03x in graph replay, where 2048 keys tie).
# Since HOST_KV (the dK/dV kernel's set-up halved, the fused one's most), H200 run440 (``benchmarks/dev/
# attention_bwd_lpt_sweep.py --kernels``, graph replay of the whole backward, two rounds): 8 x 16 x 2048 causal
# 911.0 / 896.9 us against the pair's 953.2 / 942.4 (1.05x), 16 x 16 x 1024 full 829.5 / 832.6 against 885.3 /
# 881.9 (1.06x), 8 x 16 x 1024 full 397.3 / 398.1 against 426.4 / 431.3 (1.08x): the thresholds 2048 -> 1024 and
# 4096 -> 2048 (shorter ones not measured)
FUSED_MIN_SK = 1024
FUSED_CAUSAL_MIN_SK = 2048
# dK/dV without causal masking the consumers also read lse before issuing the block's first GEMMs (run77: 1.05x
# at S8192; causal 0.98-1.01x, so not there)
STATS_EARLY = True
# Dropout in the dK/dV kernel (HAS_DROPOUT: the consumers draw the forward's keep mask, ``_dropout_keep_flags``),
# fused with dQ or beside Triton's dQ kernel; ``PYKERNELS_ATTN_SM90_DROPOUT=0``: the Triton kernels take every call
# with dropout
DROPOUT_KERNELS = os.environ.get("PYKERNELS_ATTN_SM90_DROPOUT", "1") not in ("", "0")
# ... its draws issued between a block's S^T / dP^T GEMMs and their wait (DROP_EARLY), else after P^T
DROPOUT_EARLY = True
# ... its keep bits by a carry chain (``_keep_octet_ptx(carry=True)``) instead of compares: H200 run451 (the whole
# backward, graph replay, p = 0.1) 1.022x / 1.008x / 1.027x / 1.029x at 4 x 16 x 2048 causal / 4 x 16 x 4096 full /
# 4 x 16 x 4096 causal / 1 x 16 x 8192 causal (580.8 / 3375.8 / 1983.2 / 1918.7 us); ptxas 336 / 460 bytes of spill
# fused full / causal against 384 / 544
DROPOUT_CARRY = True
# ... (with the carry chain) g from the key and each transpose stage a rotate and one lop3
# (``_keep_octet_ptx(rot=True)``): 30-40 fewer instructions a block a thread, more registers held (ptxas: 516 / 392
# bytes of spill fused causal / full against 436 / 340); H200 run453 (the whole backward, graph replay, p = 0.1)
# 1.040x / 1.043x / 1.041x slower at 4 x 16 x 2048 causal / 4 x 16 x 4096 causal / 1 x 16 x 8192 causal, 1.005x
# faster at 4 x 16 x 4096 full: off
DROPOUT_ROT = False
# dK/dV: K, V, dK and dV through host descriptors over their (rows, row stride) views where Sk is a multiple of the
# CTA's 2 x BLOCK_N keys (no tile then reaches the next head's rows; else, or where a view has no such geometry,
# through descriptors of the CTA's head made on the device). run438's timeline: a CTA's four device-made
# descriptors were ready 3.6-3.9 us after its entry, of the 6.1 us before its first Q / dO landed. run439 (H200,
# ``benchmarks/dev/attention_bwd_trace.py --ab 5 --ab-knob host-kv``): set-up 6.1 -> 3.0 us a CTA, epilogue 2.8 ->
# 2.2; the fused call in graph replay 1.049x (median) at 4 x 16 x 4096 causal, 1.028x at 2 x 16 x 8192 causal,
# 1.086x at 8 x 16 x 2048 causal, 0.989x at 2 x 16 x 8192 full (its rounds 4690-5046 us: the card's power limit;
# the dK/dV kernel alone 1.016x there, 1.027-1.105x at the causal shapes)
HOST_KV = True
# D = 256 (``_attention_bwd_dkdv_d256_sm90_kernel``; ``kernels`` takes it as "dkdv", beside Triton's dQ kernel, which
# forms delta first). Here one warpgroup's dK and dV (2 x 64 x 256 fp32) do not fit its registers, so both consumer
# warpgroups work on one CTA's BLOCK_N keys and split the work by role: warpgroup 0 holds all of dV, warpgroup 1 all
# of dK (64 x 256 fp32, 128 registers a thread each). Per query block j (the producer warp streams Q_j, dO_j, lse_j
# and delta_j through a STAGES-deep ring, ``_dkdv_producer``):
#     warpgroup 0: S^T = K Q_j^T, P^T = exp2(S^T scale log2 e - lse_j log2 e) (causal: 0 above the diagonal), P^T in
#                  fp32 -> shared memory (one tile a ring stage, ``p_bar``); dV += P^T dO_j (P^T from registers);
#     warpgroup 1: dP^T = V dO_j^T; with P^T from shared memory dS^T = P^T (dP^T - delta_j); dK += dS^T Q_j.
# Two 64 x 64 x 256 GEMMs a warpgroup a block. A P^T tile is rewritten only once the producer refilled its stage,
# i.e. after both warpgroups released it. At the end dV and dK * scale go into the V and K buffers (once neither
# warpgroup reads them) and warpgroup 0 stores both by TMA. (BLOCK_N keys, BLOCK_M queries, STAGES): Q and dO 128 KiB,
# K and V 64 KiB, P^T 32 KiB (230864 B); ptxas 12-16 bytes spilled. dK's and dV's errors against float64 equal the
# Triton kernel's (one bf16 rounding of dS^T, P^T handed over in fp32). First written in
# ``benchmarks/dev/attention_bwd_d256_gluon.py``; H200 run481 (graph replay) against the column split of run480
# (both warpgroups on half of dK's and dV's columns, P^T and dS^T handed over in bf16: dK's error 1.0-2.6x Triton's;
# commit 7fc36f1): 0.926 / 0.425 / 3.340 / 0.267 / 0.852 ms against 1.009 / 0.450 / 3.677 / 0.286 / 0.920 at
# B4 H8 S4096 causal, B4 H8 S2048, B2 H8 S8192, B16 H16 S512, B1 H8 S8192 causal (594-658 TFLOP/s of its 4 GEMMs but
# 514 at S512), the Triton dK/dV kernel 2.225 / 1.011 / 7.987 / 0.574 / 2.061.
DKDV_D256_CONFIGS = {256: (64, 64, 2), 192: (64, 64, 2)}
# ``kernels``' default rule takes it (``PYKERNELS_ATTN_SM90_D256=0`` turns it off; read once, at import); a named
# ``PYKERNELS_ATTN_SM90_BWD`` with "dkdv" takes it at D = 256 either way
DKDV_D256_AUTO = os.environ.get("PYKERNELS_ATTN_SM90_D256", "1") not in ("", "0")
# D = 192 (default; ``PYKERNELS_ATTN_SM90_D192=0`` turns it off, a named "dkdv" takes it either way): the same kernel
# on its 256-wide tiles with every descriptor 192 columns wide (``D_COLS``), so that TMA loads read zeros in columns
# 192-255 (nothing added to S^T or dP^T) and stores clip there: no padded copies, a third more tensor-core work than
# the columns need. Q and dO come through the host's descriptors, so each of their (batch, head) slices must start at
# column 0 of its (rows, row stride) view (``_zero_fill_descriptor``: (B, H, S, D) rows, not the (B, S, H, D) views,
# whose heads sit side by side in a row); elsewhere the kernel declines and Triton's runs. H200 run485 (matrix,
# B4 H8 S2048 bidirectional, graph replay): the backward at 331 TFLOP/s against 194 with it off and cuDNN's 289
# (1.14x); ``test_gpu_sm90_gluon_backward_d192`` passed (the zero fill and its byte count on the barrier hold).
DKDV_D192_AUTO = D192  # (``PYKERNELS_ATTN_SM90_D192``: the forward's switch too, ``attention_sm90.TILE_D``)
# ... its GEMMs there on the columns' two blocks only (``attention_sm90.SPLIT``: 128 + 64), as the forward's
# (``attention_sm90.SPLIT_D``): S^T and dP^T over both blocks (two wgmma groups over K), dV and dK as 128- and 64-column
# accumulators, so a quarter of its tensor-core work less and 96 accumulator registers a thread instead of 128 (ptxas
# 12 / 24 bytes spilled full / causal, against 12 / 16). H200 run493 (matrix, graph replay, backward TFLOP/s; on, off,
# on again in one call): B4 H8 S2048 337 / 338 against 317 ("Triton" rows; ``auto`` 331 / 331 against 313), cuDNN
# 288-292; B4 H8 S4096 causal 284 / 283 against 268 (``auto`` 276 / 276 against 275), cuDNN 289-294: the whole
# backward (Triton's dQ kernel still pads to 256 columns) 1.06x full, 1.00-1.06x causal.
# ``PYKERNELS_ATTN_SM90_SPLIT_D_BWD=0`` pads.
SPLIT_D_BWD = os.environ.get("PYKERNELS_ATTN_SM90_SPLIT_D_BWD", "1") not in ("", "0")


# ------------------------------------------------------------------------------------------------
# dK / dV
# ------------------------------------------------------------------------------------------------
@builtin
def _tma_reduce_add_smem(desc, offsets, src, _semantic=None):
    """The tile in shared memory ``src`` added to the global tile of ``desc`` at ``offsets`` by an asynchronous
    bulk TMA reduction (``cp.reduce.async.bulk.tensor ... add``, one bulk group), FlashAttention-3's way of
    adding dQ: Gluon 3.6's builder has the op (``create_async_tma_reduce``) but no call for it (Triton's
    ``descriptor_reduce`` from registers, run53, waited for each reduction's read right away).
    ``tma.store_wait`` waits for it as for a TMA store."""
    offsets = _semantic._convert_to_ir_values(offsets, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, offsets, src.handle)


TRACE_SLOTS = gl.constexpr(16)  # int64 values a CTA in the development timeline (``_trace_put``)


@gluon.jit
def _trace_put(Trace, slot, value, TRACE: gl.constexpr):
    """With TRACE (``benchmarks/dev/attention_bwd_trace.py``): ``value`` into ``Trace[cta * TRACE_SLOTS + slot]``,
    stored by every thread of the calling partition (one value). Nothing without TRACE. Slots: %globaltimer at
    the marks (``_trace_mark``) 0 entry, 8 K / V descriptors made, 9 consumer 0 started, 1 K / V landed, 10 the
    producer's first Q / dO issued, 11 its first lse / delta in shared memory, 2 the first Q / dO landed, 3 the
    last query block done, 12 dK / dV stores issued, 4 stored; 5 the SM, 6 the CTA's query blocks, 7 its (batch *
    kv heads + kv head) * 65536 + key rank."""
    if TRACE:
        cta = gl.program_id(0) + gl.num_programs(0) * (gl.program_id(1) + gl.num_programs(1) * gl.program_id(2))
        gl.store(Trace + cta * TRACE_SLOTS + slot, value)


@gluon.jit
def _trace_mark(Trace, slot, TRACE: gl.constexpr):
    """%globaltimer into ``slot`` (``_trace_put``); at slot 0 also the SM into slot 5."""
    if TRACE:
        pid = gl.program_id(0)
        now = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [pid], dtype=gl.int64, is_pure=False,
                                        pack=1)
        _trace_put(Trace, slot, now, TRACE)
        if slot == 0:
            sm = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [pid], dtype=gl.int32, is_pure=False, pack=1)
            _trace_put(Trace, 5, sm.to(gl.int64), TRACE)


_KEEP_OCTET_PTX = gl.constexpr(_keep_octet_ptx())
_KEEP_OCTET_ROT_PTX = gl.constexpr(_keep_octet_ptx(carry=True, rot=True))




def _apply_keep16_ptx() -> str:
    """The PTX of ``_apply_keep16``: 8 fp32 values ($8-$15) kept where P^T Z's bf16 value of the same element is not 0
    (element c in half c % 2, low first, of $16 + c // 2), else 0."""
    lines = ["{", ".reg .pred pkp;", ".reg .b32 pkt;"]
    for c in range(8):
        lines += [f"and.b32 pkt, ${16 + c // 2}, {0xFFFF << 16 * (c % 2)};", "setp.ne.u32 pkp, pkt, 0;",
                  f"selp.b32 ${c}, ${8 + c}, 0, pkp;"]
    return "\n".join(lines + ["}"])


_APPLY_KEEP16_PTX = gl.constexpr(_apply_keep16_ptx())
_APPLY_KEEP16_CONSTRAINTS = gl.constexpr(",".join(["=r"] * 8 + ["r"] * 12))


@gluon.jit
def _apply_keep16(vals, pz16):
    """``vals`` (fp32) where ``pz16`` (P^T Z in bf16 / fp16, the same shape and layout) is not 0, else 0: dP^T's
    dropout without the keep bits, which are dead once P^T Z is formed (their registers free while the dV GEMM reads
    P^T Z's). Where Z = 1 and P^T rounds to 0 the element's dS^T = P^T (..) is below the 16-bit format's least value
    times dP^T either way."""
    return gl.inline_asm_elementwise(_APPLY_KEEP16_PTX, _APPLY_KEEP16_CONSTRAINTS, [vals, pz16], dtype=gl.float32,
                                     is_pure=True, pack=8)


@gluon.jit
def _apply_keep(vals, keep):
    """``vals`` (fp32) where ``keep`` (``_dropout_keep_flags``'s keep bits, the same shape and layout) keeps the
    element, else 0."""
    return gl.inline_asm_elementwise(_APPLY_KEEP_PTX, _APPLY_KEEP_CONSTRAINTS, [vals, keep], dtype=gl.float32,
                                     is_pure=True, pack=8)


@gluon.jit
def _dropout_keep_flags(row, key, seed, groups, thr, CARRY: gl.constexpr, ROT: gl.constexpr = False):
    """The dropout keep bits of every element of a (keys, queries) tensor in the consumers' ``s_layout`` (NVMMA v3,
    4 x 1 warps), carried by an int8 tensor of that shape and layout whose values are not per element (a pack's 8
    bits in its first byte: only ``_apply_keep`` reads them, with the same layout), from int32 tensors: ``row`` the
    element's Philox row ((b H + h) Sq + query), ``key`` its key, and the seed's low word, the calls a row and the
    threshold (p 2^16) as int32 tensors: ``_keep_octet_ptx`` (``carry``: CARRY; ``rot``: ROT, with CARRY)."""
    if CARRY and ROT:
        flags = gl.inline_asm_elementwise(_KEEP_OCTET_ROT_PTX, _KEEP_OCTET_CONSTRAINTS,
                                          [row, key, seed, groups, thr], dtype=gl.int8, is_pure=True, pack=8)
    elif CARRY:
        flags = gl.inline_asm_elementwise(_KEEP_OCTET_CARRY_PTX, _KEEP_OCTET_CONSTRAINTS,
                                          [row, key, seed, groups, thr], dtype=gl.int8, is_pure=True, pack=8)
    else:
        flags = gl.inline_asm_elementwise(_KEEP_OCTET_PTX, _KEEP_OCTET_CONSTRAINTS, [row, key, seed, groups, thr],
                                          dtype=gl.int8, is_pure=True, pack=8)
    return flags


@gluon.jit
def _dkdv_producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, dq_smem, ds_smem, lse_smem,
                   dlt_smem, kv_bar, q_bar, q_empty, ds_bar, stride_qb, stride_qh, stride_qm, stride_dob, stride_doh,
                   stride_dom, LSE,
                   DELTA, DQACC, stride_lb, stride_lh, H, GROUP, Sq, qk_scale, scale, b, hk, start_n, j_lo, n_qb,
                   dk_desc, dv_desc, Trace, HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                   STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, FUSED_DQ: gl.constexpr, TRACE: gl.constexpr):
    """Per query block Q_j and dO_j by TMA (host descriptors), and lse_j * log2 e and delta_j by loads into
    ``lse_smem`` / ``dlt_smem`` (the block's second ``q_bar`` arrival): read by the consumers there, no global
    load stands between their GEMM issues. (K and V are loaded by the default partition: see
    ``_attention_bwd_dkdv_sm90_kernel``.)"""
    stat_reg: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    it = 0
    for g in range(GROUP):
        h = hk * GROUP + g
        q_row0, q_col0 = _flat_coords(b * stride_qb + h * stride_qh, stride_qm)
        do_row0, do_col0 = _flat_coords(b * stride_dob + h * stride_doh, stride_dom)
        l_off = b * stride_lb + h * stride_lh
        for j in range(j_lo, n_qb):
            s = it % STAGES
            mbarrier.wait(q_empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(q_bar.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [q_row0 + j * BLOCK_M, q_col0], q_bar.index(s), q_smem.index(s))
            tma.async_copy_global_to_shared(do_desc, [do_row0 + j * BLOCK_M, do_col0], q_bar.index(s),
                                            do_smem.index(s))
            if TRACE:
                if it == 0:
                    _trace_mark(Trace, 10, TRACE)
            # (queries past Sq: lse +inf, so P = 0 there)
            rows = j * BLOCK_M + gl.arange(0, BLOCK_M, layout=stat_reg)
            lse = gl.load(LSE + l_off + rows, mask=rows < Sq, other=float("inf"))
            lse_smem.index(s).store(lse * 1.4426950408889634)
            dlt_smem.index(s).store(gl.load(DELTA + l_off + rows, mask=rows < Sq, other=0.0))
            if TRACE:
                if it == 0:
                    _trace_mark(Trace, 11, TRACE)
            mbarrier.arrive(q_bar.index(s), count=1)
            it += 1


@gluon.jit
def _dkdv_consumer(WG: gl.constexpr, q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, dq_smem,
                   ds_smem, lse_smem, dlt_smem, kv_bar, q_bar, q_empty, ds_bar, st_bar, stride_qb, stride_qh,
                   stride_qm, stride_dob, stride_doh,
                   stride_dom, LSE, DELTA, DQACC, stride_lb, stride_lh, H, GROUP, Sq, qk_scale, scale, b, hk, start_n,
                   j_lo, n_qb, dk_desc, dv_desc, dk_row, dk_col, dv_row, dv_col, Trace, seed, drop_groups, drop_thr,
                   drop_inv, HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr,
                   BLOCK_M: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, FUSED_DQ: gl.constexpr,
                   STATS_EARLY: gl.constexpr, TRACE: gl.constexpr, HAS_DROPOUT: gl.constexpr,
                   DROP_EARLY: gl.constexpr, DROP_CARRY: gl.constexpr,
                   DROP_ROT: gl.constexpr):
    """Consumer warpgroup WG: keys [start_n + WG * BLOCK_N, + BLOCK_N) against every visible query block.
    FUSED_DQ: also dQ_j's columns [WG * D / 2, + D / 2) over both warpgroups' keys, dQ_j = dS_j K, from
    both dS^T tiles in shared memory (``ds_bar``: both written), added (scaled) to the fp32 dQ buffer by a
    bulk TMA reduction through the descriptor DQACC (rows B * H * Sq, D columns; D / 2-column tiles).
    HAS_DROPOUT: the forward's keep mask regenerated (``_dropout_keep_flags``, Z 1 kept, 0 dropped): dV += (P^T Z)
    dO_j, scaled by 1 / (1 - p) at the end, and dS^T = P^T (dP^T Z / (1 - p) - delta_j), Z there read from P^T Z's
    bf16 operand registers (``_apply_keep16``); ``seed`` the seed's low word,
    ``drop_groups`` the Philox calls a query row (ceil(Sk / 8)), ``drop_thr`` p 2^16 and ``drop_inv`` 1 / (1 - p)."""
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_D, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HEAD_D // 2, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    n0 = start_n + WG * BLOCK_N
    k_tile = k_smem.index(WG)
    v_tile = v_smem.index(WG)
    dk = gl.zeros([BLOCK_N, HEAD_D], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N, HEAD_D], gl.float32, acc_layout)
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    keys = n0 + gl.arange(0, BLOCK_N, layout=row_s)
    if HAS_DROPOUT:  # (int32 tensors of s_layout: a broadcast is the same register, the asm reads one a pack)
        i_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.int32, s_layout)
        d_key = i_zero + gl.expand_dims(keys.to(gl.int32), 1)
        d_seed = i_zero + seed
        d_groups = i_zero + drop_groups
        d_thr = i_zero + drop_thr
    if WG == 0:
        _trace_mark(Trace, 9, TRACE)
    mbarrier.wait(kv_bar.index(WG), 0)
    if FUSED_DQ:
        mbarrier.wait(kv_bar.index(1 - WG), 0)  # the other warpgroup's K halves too
    if WG == 0:
        _trace_mark(Trace, 1, TRACE)
    it = 0
    for g in range(GROUP):
        for j in range(j_lo, n_qb):
            s = it % STAGES
            mbarrier.wait(q_bar.index(s), (it // STAGES) & 1)
            if TRACE and WG == 0:
                if it == 0:
                    _trace_mark(Trace, 2, TRACE)
            q_tile = q_smem.index(s)
            do_tile = do_smem.index(s)
            if STATS_EARLY:
                lse2 = lse_smem.index(s).load(col_s)
            st = warpgroup_mma(k_tile, q_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dpt = warpgroup_mma(v_tile, do_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            cols = j * BLOCK_M + gl.arange(0, BLOCK_M, layout=col_s)
            if HAS_DROPOUT:
                if DROP_EARLY:  # the draws while S^T and dP^T are on the tensor cores
                    d_row = gl.expand_dims(((b * H + hk * GROUP + g) * Sq).to(gl.int32) + cols, 0) + i_zero
                    zt = _dropout_keep_flags(d_row, d_key, d_seed, d_groups, d_thr, DROP_CARRY, DROP_ROT)
            if not STATS_EARLY:
                lse2 = lse_smem.index(s).load(col_s)
            st = warpgroup_mma_wait(num_outstanding=1, deps=(st, ))
            pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
            delta = dlt_smem.index(s).load(col_s)
            if IS_CAUSAL:
                if j * BLOCK_M < n0 + BLOCK_N:  # the block reaches the diagonal: query i sees keys <= i
                    pt = gl.where(gl.expand_dims(cols, 0) >= gl.expand_dims(keys, 1), pt, 0.0)
            if HAS_DROPOUT:
                if not DROP_EARLY:
                    d_row = gl.expand_dims(((b * H + hk * GROUP + g) * Sq).to(gl.int32) + cols, 0) + i_zero
                    zt = _dropout_keep_flags(d_row, d_key, d_seed, d_groups, d_thr, DROP_CARRY, DROP_ROT)
                # (1 / (1 - p) applied to dV once, at the end; the keep bits die here: dP^T's zeros come from
                # P^T Z's in the GEMM's operand registers, _apply_keep16)
                pz16 = _apply_keep(pt, zt).to(dtype)
                pt_op = gl.convert_layout(pz16, a_layout)
            else:
                pt_op = gl.convert_layout(pt.to(dtype), a_layout)
            dv = warpgroup_mma(pt_op, do_tile, dv, is_async=True)
            dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt, ))
            if HAS_DROPOUT:
                dst = (pt * (_apply_keep16(dpt, pz16) * drop_inv - gl.expand_dims(delta, 0))).to(dtype)
            else:
                dst = (pt * (dpt - gl.expand_dims(delta, 0))).to(dtype)
            if FUSED_DQ:
                # dS^T goes through shared memory: the A operand of dK += dS^T Q_j (no register copy held while
                # the GEMMs run) and, with the other warpgroup's, of dQ_j's columns
                buf = it % 2
                ds_tile = ds_smem.index(buf * 2 + WG)
                ds_tile.store(dst)
                fence_async_shared()
                mbarrier.arrive(ds_bar.index(buf), count=1)
                dk = warpgroup_mma(ds_tile, q_tile, dk, is_async=True)
                dv = warpgroup_mma_wait(num_outstanding=1, deps=(dv, ))  # P^T's registers are free
                mbarrier.wait(ds_bar.index(buf), (it // 2) & 1)  # both warpgroups' dS^T are in place
                dq = warpgroup_mma(ds_smem.index(buf * 2).permute((1, 0)),
                                   k_smem.index(0).slice(WG * (HEAD_D // 2), HEAD_D // 2, dim=1),
                                   gl.zeros([BLOCK_M, HEAD_D // 2], gl.float32, dq_layout), use_acc=False,
                                   is_async=True)
                dq = warpgroup_mma(ds_smem.index(buf * 2 + 1).permute((1, 0)),
                                   k_smem.index(1).slice(WG * (HEAD_D // 2), HEAD_D // 2, dim=1), dq, is_async=True)
                dk, dq = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dq))
                mbarrier.arrive(q_empty.index(s), count=1)
                # the previous block's reduction has read the staging tile by now (a block's GEMMs ago)
                tma.store_wait(pendings=0)
                dq_tile = dq_smem.index(WG)
                dq_tile.store(dq * scale)
                fence_async_shared()
                # an asynchronous bulk TMA reduction of the tile into DQACC's rows (B * H * Sq, D): query rows
                # past Sq add the zeros of P = 0 there (to the next head's rows, or clipped past the end)
                row = ((b * H + hk * GROUP + g) * Sq + j * BLOCK_M).to(gl.int32)
                _tma_reduce_add_smem(DQACC, [row, WG * (HEAD_D // 2)], dq_tile)
            else:
                dst_op = gl.convert_layout(dst, a_layout)
                dk = warpgroup_mma(dst_op, q_tile, dk, is_async=True)
                dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
                mbarrier.arrive(q_empty.index(s), count=1)
            it += 1
    if WG == 0:
        _trace_mark(Trace, 3, TRACE)
    if FUSED_DQ:  # the other warpgroup's dQ GEMMs read this one's K: both past their last block
        mbarrier.arrive(ds_bar.index(it % 2), count=1)
        mbarrier.wait(ds_bar.index(it % 2), (it // 2) & 1)
    # every wgmma that read this warpgroup's K and V is complete: their buffers stage dK and dV. Warpgroup 0's
    # partition (which made dk_desc and dv_desc where they are made on the device) issues every TMA through
    # them: it stores warpgroup 1's tiles too, once ``st_bar`` says they are in place
    k_tile.store((dk * scale).to(dtype))
    if HAS_DROPOUT:
        v_tile.store((dv * drop_inv).to(dtype))
    else:
        v_tile.store(dv.to(dtype))
    fence_async_shared()
    if WG == 0:
        tma.async_copy_shared_to_global(dk_desc, [dk_row + n0, dk_col], k_tile)
        tma.async_copy_shared_to_global(dv_desc, [dv_row + n0, dv_col], v_tile)
        mbarrier.wait(st_bar.index(0), 0)
        tma.async_copy_shared_to_global(dk_desc, [dk_row + n0 + BLOCK_N, dk_col], k_smem.index(1))
        tma.async_copy_shared_to_global(dv_desc, [dv_row + n0 + BLOCK_N, dv_col], v_smem.index(1))
        _trace_mark(Trace, 12, TRACE)
        tma.store_wait(pendings=0)
        _trace_mark(Trace, 4, TRACE)
        _trace_put(Trace, 6, (GROUP * (n_qb - j_lo)).to(gl.int64), TRACE)
    else:
        mbarrier.arrive(st_bar.index(0), count=1)


@gluon.jit
def _kv_slices(K, V, DK, DV, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_dkb, stride_dkh,
               stride_dkn, stride_dvb, stride_dvh, stride_dvn, b, hk, Sk, HEAD_D: gl.constexpr,
               BLOCK_N: gl.constexpr, kv_layout: gl.constexpr, HOST_KV: gl.constexpr, COLS: gl.constexpr = 0):
    """The dK/dV kernels' K, V, dK and dV descriptors of (batch ``b``, kv head ``hk``) and each one's (row, column)
    of the slice's first element: with HOST_KV the host descriptors K .. DV over (rows, row stride) views and the
    slice's place in them; else descriptors of the slices made here, at (0, 0) (COLS > 0: COLS columns in HEAD_D-wide
    tiles, ``_slice_desc``)."""
    if HOST_KV:
        k_desc = K
        v_desc = V
        dk_desc = DK
        dv_desc = DV
        k_row, k_col = _flat_coords(b * stride_kb + hk * stride_kh, stride_kn)
        v_row, v_col = _flat_coords(b * stride_vb + hk * stride_vh, stride_vn)
        dk_row, dk_col = _flat_coords(b * stride_dkb + hk * stride_dkh, stride_dkn)
        dv_row, dv_col = _flat_coords(b * stride_dvb + hk * stride_dvh, stride_dvn)
    else:
        k_desc = _slice_desc(K, b * stride_kb + hk * stride_kh, Sk, stride_kn, HEAD_D, BLOCK_N, kv_layout,
                              COLS)
        v_desc = _slice_desc(V, b * stride_vb + hk * stride_vh, Sk, stride_vn, HEAD_D, BLOCK_N, kv_layout,
                              COLS)
        dk_desc = _slice_desc(DK, b * stride_dkb + hk * stride_dkh, Sk, stride_dkn, HEAD_D, BLOCK_N, kv_layout,
                              COLS)
        dv_desc = _slice_desc(DV, b * stride_dvb + hk * stride_dvh, Sk, stride_dvn, HEAD_D, BLOCK_N, kv_layout,
                              COLS)
        k_row, k_col, v_row, v_col, dk_row, dk_col, dv_row, dv_col = 0, 0, 0, 0, 0, 0, 0, 0
    return k_desc, v_desc, dk_desc, dv_desc, k_row, k_col, v_row, v_col, dk_row, dk_col, dv_row, dv_col


@gluon.jit
def _attention_bwd_dkdv_sm90_kernel(
    q_desc, do_desc, K, V, DK, DV, LSE, DELTA, DQACC,
    stride_qb, stride_qh, stride_qm, stride_dob, stride_doh, stride_dom,
    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, stride_lb, stride_lh,
    H, GROUP, Sq, Sk, qk_scale, scale, lpt_heads, tail_from, Trace, Seed, drop_thr, drop_inv,
    HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr, FUSED_DQ: gl.constexpr, LPT: gl.constexpr, STATS_EARLY: gl.constexpr,
    kv_layout: gl.constexpr, ds_layout: gl.constexpr, num_warps: gl.constexpr, TRACE: gl.constexpr = False,
    HOST_KV: gl.constexpr = False, HAS_DROPOUT: gl.constexpr = False, DROP_EARLY: gl.constexpr = True,
    DROP_CARRY: gl.constexpr = False, DROP_ROT: gl.constexpr = False, D_COLS: gl.constexpr = 0,
):
    """Grid (cdiv(Sk, 2 * BLOCK_N), kv heads, batch), or with LPT (cdiv(Sk, 2 * BLOCK_N) * kv heads * batch,):
    causal, longest CTAs first across the (batch, kv head)s of a group of ``lpt_heads`` (``_lpt_order``).
    q_desc / do_desc: host descriptors over (rows, row stride) views of q and do
    (``attention_sm90._flat_descriptor``); K, V, dK, dV: the CTA's kv head's slice through descriptors made
    on the device; with HOST_KV host descriptors over their (rows, row stride) views, as q's (``HOST_KV``: Sk a
    multiple of 2 * BLOCK_N, so no tile reaches the next head's rows). LSE and DELTA (B, H, Sq) fp32 with strides
    (lb, lh, 1).
    FUSED_DQ: dQ * scale is added through DQACC, a host descriptor over a zeroed contiguous (B, H, Sq, D) fp32
    buffer seen as (B * H * Sq, D), (BLOCK_M, D / 2) tiles, by bulk TMA reductions.
    HAS_DROPOUT: Seed the (1,) int64 seed (below 2^31), drop_thr p 2^16, drop_inv 1 / (1 - p)
    (``_dkdv_consumer``). D_COLS > 0 (D = 80 / 96, ``attention_sm90.TILE_D``): the tensors are D_COLS < HEAD_D
    columns wide (the device-made K / V / dK / dV descriptors so too; the host's, q's and do's, come so), DQACC
    HEAD_D wide."""
    gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
    dtype: gl.constexpr = q_desc.dtype
    _trace_mark(Trace, 0, TRACE)
    if LPT:
        n_kb = gl.cdiv(Sk, 2 * BLOCK_N)
        rank, head = _lpt_order(gl.program_id(0), n_kb, gl.num_programs(0) // n_kb, lpt_heads, tail_from)
        start_n = rank * (2 * BLOCK_N)
        hk = (head % (H // GROUP)).to(gl.int64)
        b = (head // (H // GROUP)).to(gl.int64)
    else:
        start_n = gl.program_id(0) * (2 * BLOCK_N)
        hk = gl.program_id(1).to(gl.int64)
        b = gl.program_id(2).to(gl.int64)
    _trace_put(Trace, 7, (b * (H // GROUP) + hk) * 65536 + start_n // (2 * BLOCK_N), TRACE)  # as the order gave
    k_desc, v_desc, dk_desc, dv_desc, k_row, k_col, v_row, v_col, dk_row, dk_col, dv_row, dv_col = _kv_slices(
        K, V, DK, DV, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_dkb, stride_dkh,
        stride_dkn, stride_dvb, stride_dvh, stride_dvn, b, hk, Sk, HEAD_D, BLOCK_N, kv_layout, HOST_KV, D_COLS)
    _trace_mark(Trace, 8, TRACE)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD_D], kv_layout)
    if FUSED_DQ:
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_D // 2], DQACC.layout)  # per warpgroup
        ds_smem = gl.allocate_shared_memory(dtype, [4, BLOCK_N, BLOCK_M], ds_layout)  # (parity, warpgroup)
    else:
        dq_smem = k_smem
        ds_smem = k_smem
    stat_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stat_layout)
    dlt_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stat_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # Every mbarrier allocated here must stay in use until the partitions end. One that only FUSED_DQ uses
    # (ds_bar) was dead in the dK/dV-only kernel after its init, so the compiler gave its bytes to values the
    # partitions capture (causal: batch and head, stored to shared memory for the producer warp). Under another
    # process's GPU load (time-slicing preempts and resumes CTAs) the producer then read garbage there, most
    # likely the mbarriers' state restored over them: illegal addresses in 1 of 6 test runs beside other
    # workers and in every run beside a matmul loop, none with memory load alone (run93, run98-106).
    # ``tests/test_gluon_sm90_compile.py`` checks every Gluon kernel's SASS for such an overlap.
    if FUSED_DQ:
        ds_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    else:
        ds_bar = kv_bar  # (unused)
    st_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(kv_bar.index(i), count=1)
        if FUSED_DQ:
            mbarrier.init(ds_bar.index(i), count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_bar.index(i), count=2)  # (the TMA's expect, the stats' arrival)
        mbarrier.init(q_empty.index(i), count=2)
    mbarrier.init(st_bar.index(0), count=1)
    fence_async_shared()
    # K and V of both warpgroups, issued here by the partition that made their descriptors on the device (as
    # Triton's own one-partition kernels use such descriptors: the tensormap acquire fence is this partition's;
    # HOST_KV's come made), and the producer warp starts on Q / dO at once: with the stores below, 1.003-1.047x
    # the whole backward (run106, causal gained most)
    for wg in gl.static_range(2):
        mbarrier.expect(kv_bar.index(wg), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [k_row + start_n + wg * BLOCK_N, k_col], kv_bar.index(wg),
                                        k_smem.index(wg))
        tma.async_copy_global_to_shared(v_desc, [v_row + start_n + wg * BLOCK_N, v_col], kv_bar.index(wg),
                                        v_smem.index(wg))
    j_lo = 0
    if IS_CAUSAL:
        j_lo = start_n // BLOCK_M  # queries before the CTA's first key see none of its keys
    n_qb = gl.cdiv(Sq, BLOCK_M)
    if HAS_DROPOUT:
        seed = gl.load(Seed).to(gl.int32)
    else:
        seed = 0
    drop_groups = (Sk + 7) // 8
    gl.warp_specialize([
        (_dkdv_consumer, (0, q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, dq_smem,
                          ds_smem, lse_smem, dlt_smem, kv_bar, q_bar, q_empty, ds_bar, st_bar, stride_qb, stride_qh,
                          stride_qm, stride_dob,
                          stride_doh, stride_dom, LSE, DELTA, DQACC, stride_lb, stride_lh, H, GROUP, Sq, qk_scale,
                          scale, b, hk, start_n, j_lo, n_qb, dk_desc, dv_desc, dk_row, dk_col, dv_row, dv_col,
                          Trace, seed, drop_groups, drop_thr, drop_inv, HEAD_D, BLOCK_N, BLOCK_M, STAGES,
                          IS_CAUSAL, FUSED_DQ, STATS_EARLY, TRACE, HAS_DROPOUT, DROP_EARLY, DROP_CARRY, DROP_ROT)),
        (_dkdv_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, dq_smem,
                          ds_smem, lse_smem, dlt_smem, kv_bar, q_bar, q_empty, ds_bar, stride_qb, stride_qh,
                          stride_qm, stride_dob,
                          stride_doh, stride_dom, LSE, DELTA, DQACC, stride_lb, stride_lh, H, GROUP, Sq, qk_scale,
                          scale, b, hk, start_n, j_lo, n_qb, dk_desc, dv_desc, Trace, HEAD_D, BLOCK_N, BLOCK_M,
                          STAGES, IS_CAUSAL, FUSED_DQ, TRACE)),
        (_dkdv_consumer, (1, q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, dq_smem,
                          ds_smem, lse_smem, dlt_smem, kv_bar, q_bar, q_empty, ds_bar, st_bar, stride_qb, stride_qh,
                          stride_qm, stride_dob,
                          stride_doh, stride_dom, LSE, DELTA, DQACC, stride_lb, stride_lh, H, GROUP, Sq, qk_scale,
                          scale, b, hk, start_n, j_lo, n_qb, dk_desc, dv_desc, dk_row, dk_col, dv_row, dv_col,
                          Trace, seed, drop_groups, drop_thr, drop_inv, HEAD_D, BLOCK_N, BLOCK_M, STAGES,
                          IS_CAUSAL, FUSED_DQ, STATS_EARLY, TRACE, HAS_DROPOUT, DROP_EARLY, DROP_CARRY, DROP_ROT)),
    ], [1, 4], [24, 240])


@gluon.jit
def _mma_acc_cols(x, b_tile, acc, acc_b, a_layout: gl.constexpr, ab_layout: gl.constexpr, D_A: gl.constexpr,
                  D_B: gl.constexpr):
    """acc += x b_tile (x in registers, b_tile shared, the head dim the product's N), issued; with D_B > 0 as two
    accumulators, ``acc`` b_tile's columns [0, D_A) and ``acc_b`` [D_A, D_A + D_B) (x in each one's A-operand
    layout, ``a_layout`` / ``ab_layout``); else ``acc_b`` is returned as it came."""
    if D_B > 0:
        acc = warpgroup_mma(gl.convert_layout(x, a_layout), b_tile.slice(0, D_A, dim=1), acc, is_async=True)
        acc_b = warpgroup_mma(gl.convert_layout(x, ab_layout), b_tile.slice(D_A, D_B, dim=1), acc_b, is_async=True)
    else:
        acc = warpgroup_mma(gl.convert_layout(x, a_layout), b_tile, acc, is_async=True)
    return acc, acc_b


@gluon.jit
def _dkdv_d256_consumer(WG: gl.constexpr, q_smem, do_smem, k_smem, v_smem, pt_smem, lse_smem, dlt_smem, kv_bar,
                        q_bar, q_empty, p_bar, end_bar, st_bar, dk_desc, dv_desc, dk_row, dk_col, dv_row, dv_col,
                        GROUP, qk_scale, scale, start_n, j_lo, n_qb, HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr,
                        BLOCK_M: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
                        D_A: gl.constexpr = 0, D_B: gl.constexpr = 0):
    """Consumer warpgroup WG of the D = 256 dK/dV kernel: warpgroup 0 S^T, P^T and dV, warpgroup 1 dP^T, dS^T and dK
    (``DKDV_D256_CONFIGS``' comment has the algorithm). D_B > 0 (``SPLIT_D_BWD``): the GEMMs on the head dim's
    column blocks [0, D_A) and [D_A, D_A + D_B) only, as the forward's ``_consume`` splits them: S^T and dP^T over
    both (two wgmma groups over K), dV or dK as two accumulators, so the tiles' zero columns cost no tensor-core
    work."""
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    if D_B > 0:
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, D_A, 16])
        accb_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                              instr_shape=[16, D_B, 16])
        ab_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=accb_layout, k_width=2)
        acc = gl.zeros([BLOCK_N, D_A], gl.float32, acc_layout)  # dV (warpgroup 0) or dK (warpgroup 1): [0, D_A)
        acc_b = gl.zeros([BLOCK_N, D_B], gl.float32, accb_layout)  # ... and [D_A, D_A + D_B)
    else:
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, HEAD_D, 16])
        acc = gl.zeros([BLOCK_N, HEAD_D], gl.float32, acc_layout)  # dV (warpgroup 0) or dK (warpgroup 1)
        acc_b = acc
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    if D_B == 0:
        ab_layout: gl.constexpr = a_layout  # (unused: one accumulator)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    keys = start_n + gl.arange(0, BLOCK_N, layout=row_s)
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    mbarrier.wait(kv_bar.index(0), 0)
    it = 0
    for g in range(GROUP):
        for j in range(j_lo, n_qb):
            s = it % STAGES
            ph = (it // STAGES) & 1
            mbarrier.wait(q_bar.index(s), ph)
            q_tile = q_smem.index(s)
            do_tile = do_smem.index(s)
            pt_tile = pt_smem.index(s)
            if WG == 0:
                st = _mma_nt_cols(k_smem.index(0), q_tile, s_zero, D_A, D_B)  # S^T = K Q_j^T
                lse2 = lse_smem.index(s).load(col_s)
                st = warpgroup_mma_wait(num_outstanding=0, deps=(st, ))
                pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
                if IS_CAUSAL:
                    if j * BLOCK_M < start_n + BLOCK_N:  # the block reaches the diagonal: query i sees keys <= i
                        cols = j * BLOCK_M + gl.arange(0, BLOCK_M, layout=col_s)
                        pt = gl.where(gl.expand_dims(cols, 0) >= gl.expand_dims(keys, 1), pt, 0.0)
                pt_tile.store(pt)
                mbarrier.arrive(p_bar.index(s), count=1)
                acc, acc_b = _mma_acc_cols(pt.to(dtype), do_tile, acc, acc_b, a_layout, ab_layout, D_A, D_B)  # dV
            else:
                dpt = _mma_nt_cols(v_smem.index(0), do_tile, s_zero, D_A, D_B)  # dP^T = V dO_j^T
                delta = dlt_smem.index(s).load(col_s)
                dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt, ))
                mbarrier.wait(p_bar.index(s), ph)
                pt = pt_tile.load(s_layout)
                dst = (pt * (dpt - gl.expand_dims(delta, 0))).to(dtype)
                acc, acc_b = _mma_acc_cols(dst, q_tile, acc, acc_b, a_layout, ab_layout, D_A, D_B)  # dK
            if D_B > 0:
                acc, acc_b = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_b))
            else:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(q_empty.index(s), count=1)
            it += 1
    mbarrier.arrive(end_bar.index(0), count=1)
    mbarrier.wait(end_bar.index(0), 0)  # both warpgroups past their loops: no GEMM reads K or V any more
    if D_B > 0:  # (the tiles' columns past D_A + D_B keep K's / V's zeros; the stores clip them)
        if WG == 0:
            v_smem.index(0).slice(0, D_A, dim=1).store(acc.to(dtype))
            v_smem.index(0).slice(D_A, D_B, dim=1).store(acc_b.to(dtype))
        else:
            k_smem.index(0).slice(0, D_A, dim=1).store((acc * scale).to(dtype))
            k_smem.index(0).slice(D_A, D_B, dim=1).store((acc_b * scale).to(dtype))
    elif WG == 0:
        v_smem.index(0).store(acc.to(dtype))
    else:
        k_smem.index(0).store((acc * scale).to(dtype))
    fence_async_shared()
    if WG == 0:
        mbarrier.wait(st_bar.index(0), 0)  # warpgroup 1's dK is in place
        tma.async_copy_shared_to_global(dk_desc, [dk_row + start_n, dk_col], k_smem.index(0))
        tma.async_copy_shared_to_global(dv_desc, [dv_row + start_n, dv_col], v_smem.index(0))
        tma.store_wait(pendings=0)
    else:
        mbarrier.arrive(st_bar.index(0), count=1)


@gluon.jit
def _attention_bwd_dkdv_d256_sm90_kernel(
    q_desc, do_desc, K, V, DK, DV, LSE, DELTA,
    stride_qb, stride_qh, stride_qm, stride_dob, stride_doh, stride_dom,
    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, stride_lb, stride_lh,
    H, GROUP, Sq, Sk, qk_scale, scale,
    HEAD_D: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr, kv_layout: gl.constexpr, p_layout: gl.constexpr,
    num_warps: gl.constexpr, HOST_KV: gl.constexpr, D_COLS: gl.constexpr = 0, D_A: gl.constexpr = 0,
    D_B: gl.constexpr = 0,
):
    """Grid (cdiv(Sk, BLOCK_N), kv heads, batch). q_desc / do_desc: host descriptors over (rows, row stride) views
    (``_flat_descriptor``); K, V, dK, dV: host descriptors likewise where Sk is a multiple of BLOCK_N (HOST_KV),
    else the tensors, whose (batch, kv head) slices get descriptors made here (a store clips keys >= Sk). LSE and
    DELTA (B, H, Sq) fp32, unit last stride. ``p_layout``: the fp32 P^T tiles' shared layout (one a ring stage).
    D_COLS > 0 (D = 192 on the HEAD_D = 256 tiles): the tensors are D_COLS wide; every descriptor, the host's too,
    is D_COLS columns wide with HEAD_D-wide tiles, so loads read zeros past column D_COLS and stores clip there.
    D_B > 0: the consumers' GEMMs on column blocks [0, D_A) and [D_A, D_A + D_B) only (``_dkdv_d256_consumer``)."""
    gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
    dtype: gl.constexpr = q_desc.dtype
    start_n = gl.program_id(0) * BLOCK_N
    hk = gl.program_id(1).to(gl.int64)
    b = gl.program_id(2).to(gl.int64)
    k_desc, v_desc, dk_desc, dv_desc, k_row, k_col, v_row, v_col, dk_row, dk_col, dv_row, dv_col = _kv_slices(
        K, V, DK, DV, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_dkb, stride_dkh,
        stride_dkn, stride_dvb, stride_dvh, stride_dvn, b, hk, Sk, HEAD_D, BLOCK_N, kv_layout, HOST_KV, D_COLS)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_D], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, HEAD_D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, HEAD_D], kv_layout)
    pt_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N, BLOCK_M], p_layout)
    stat_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stat_layout)
    dlt_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stat_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    end_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    st_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar.index(0), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_bar.index(i), count=2)  # (the TMA's expect, the stats' arrival: _dkdv_producer)
        mbarrier.init(q_empty.index(i), count=2)
        mbarrier.init(p_bar.index(i), count=1)
    mbarrier.init(end_bar.index(0), count=2)
    mbarrier.init(st_bar.index(0), count=1)
    fence_async_shared()
    mbarrier.expect(kv_bar.index(0), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [k_row + start_n, k_col], kv_bar.index(0), k_smem.index(0))
    tma.async_copy_global_to_shared(v_desc, [v_row + start_n, v_col], kv_bar.index(0), v_smem.index(0))
    j_lo = 0
    if IS_CAUSAL:
        j_lo = start_n // BLOCK_M  # queries before the CTA's first key see none of its keys
    n_qb = gl.cdiv(Sq, BLOCK_M)
    gl.warp_specialize([
        (_dkdv_d256_consumer, (0, q_smem, do_smem, k_smem, v_smem, pt_smem, lse_smem, dlt_smem, kv_bar, q_bar,
                               q_empty, p_bar, end_bar, st_bar, dk_desc, dv_desc, dk_row, dk_col, dv_row, dv_col,
                               GROUP, qk_scale, scale, start_n, j_lo, n_qb, HEAD_D, BLOCK_N, BLOCK_M, STAGES,
                               IS_CAUSAL, D_A, D_B)),
        (_dkdv_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, k_smem, k_smem,
                          lse_smem, dlt_smem, kv_bar, q_bar, q_empty, kv_bar, stride_qb, stride_qh, stride_qm,
                          stride_dob, stride_doh, stride_dom, LSE, DELTA, None, stride_lb, stride_lh, H, GROUP, Sq,
                          qk_scale, scale, b, hk, start_n, j_lo, n_qb, dk_desc, dv_desc, None, HEAD_D, BLOCK_N,
                          BLOCK_M, STAGES, IS_CAUSAL, False, False)),
        (_dkdv_d256_consumer, (1, q_smem, do_smem, k_smem, v_smem, pt_smem, lse_smem, dlt_smem, kv_bar, q_bar,
                               q_empty, p_bar, end_bar, st_bar, dk_desc, dv_desc, dk_row, dk_col, dv_row, dv_col,
                               GROUP, qk_scale, scale, start_n, j_lo, n_qb, HEAD_D, BLOCK_N, BLOCK_M, STAGES,
                               IS_CAUSAL, D_A, D_B)),
    ], [1, 4], [24, 240])


# ------------------------------------------------------------------------------------------------
# dQ
# ------------------------------------------------------------------------------------------------
@gluon.jit
def _lpt_order(pid, n_units, n_heads, lpt_heads, tail_from):
    """CTA ``pid`` of a grid of ``n_heads * n_units`` -> (rank, head): heads in groups of ``lpt_heads``, one
    group after the other, and within a group every head's rank 0 (its longest unit), then every head's rank
    1, and so on. A group's Q / dO / K / V stay in L2 (longest first across all the heads at once streamed
    every head from DRAM: L2 hit rate 35-39%, run76); ``lpt_heads = n_heads`` is that order. The heads from
    ``tail_from`` (a multiple of ``lpt_heads``) on are one last group (``lpt_tail_from``: LPT_TAIL_GROUPS groups
    merged), so that the grid ends on short CTAs."""
    n_first = tail_from * n_units
    if pid < n_first:
        g_size = lpt_heads
        group = pid // (lpt_heads * n_units)
        r = pid - group * (lpt_heads * n_units)
        head0 = group * lpt_heads
    else:
        g_size = n_heads - tail_from
        r = pid - n_first
        head0 = tail_from
    rank = r // g_size
    return rank, head0 + (r - rank * g_size)


@gluon.jit
def _dq_tile(n_m, lpt_heads, tail_from, H, GROUP, Sk, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             IS_CAUSAL: gl.constexpr, LPT: gl.constexpr):
    """The CTA's tile as ``_tile_coords`` gives it; LPT (causal): tiles ordered longest first across the
    heads of a group of ``lpt_heads`` (``_lpt_order``), so that the grid's last CTAs are short ones (by
    head, the last head's longest tiles would start near the end and run alone)."""
    if LPT:
        rank, hb = _lpt_order(gl.program_id(0), n_m, gl.num_programs(0) // n_m, lpt_heads, tail_from)
        start_m = (n_m - 1 - rank) * (2 * BLOCK_M)
        h = hb % H
        hi = gl.minimum(Sk, start_m + 2 * BLOCK_M)
        return start_m, (hb // H).to(gl.int64), h.to(gl.int64), (h // GROUP).to(gl.int64), gl.cdiv(hi, BLOCK_N)
    else:
        return _tile_coords(gl.program_id(0), n_m, H, GROUP, Sk, BLOCK_M, BLOCK_N, IS_CAUSAL, False)


@gluon.jit
def _load_o_rows(O, o_off, stride_om, Sq, my_m, HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr):
    """Rows [my_m, + BLOCK_M) of one (batch, head) of O (``O + o_off``, row stride ``stride_om``, unit column
    stride; 0 past Sq), for ``_row_delta``: issued before the consumer waits for its dO tile, so the load's
    latency hides behind that wait (run67's profile: ~5% of the dQ consumers' samples waited on it)."""
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = my_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, blk))
    cols = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, blk))
    return gl.load(O + o_off + gl.expand_dims(rows.to(gl.int64) * stride_om, 1) + gl.expand_dims(cols, 0),
                   mask=gl.expand_dims(rows < Sq, 1), other=0.0)


@gluon.jit
def _row_delta(do_tile, o, Sq, my_m, DELTA, l_off, BLOCK_M: gl.constexpr, out_layout: gl.constexpr):
    """delta = rowsum(dO * O) in fp32 for rows [my_m, + BLOCK_M) of one (batch, head) (0 past Sq), dO from
    the shared ``do_tile``, O the rows ``_load_o_rows`` gave; stored to ``DELTA + l_off`` (rows < Sq) and
    returned in ``out_layout``."""
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = my_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, blk))
    d = gl.sum(do_tile.load(blk).to(gl.float32) * o.to(gl.float32), axis=1)
    gl.store(DELTA + l_off + rows, d, mask=rows < Sq)
    return gl.convert_layout(d, out_layout)


@gluon.jit
def _dq_producer(q_desc, do_desc, k_desc, v_desc, dq_desc, q_smem, do_smem, k_smem, v_smem, q_bar, k_bar, v_bar,
                 k_empty, v_empty, turn_bar, DQ, LSE, DELTA, O, stride_ob, stride_oh, stride_om, stride_qb, stride_qh,
                 stride_qm, stride_dob, stride_doh, stride_dom,
                 stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_dqb, stride_dqh, stride_dqm,
                 stride_lb, stride_lh, H, GROUP, Sq, Sk, qk_scale, scale, n_m, lpt_heads, tail_from,
                 HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 IS_CAUSAL: gl.constexpr, LPT: gl.constexpr, COMPUTE_DELTA: gl.constexpr, q_layout: gl.constexpr):
    start_m, b, h, hk, n_blocks = _dq_tile(n_m, lpt_heads, tail_from, H, GROUP, Sk, BLOCK_M, BLOCK_N, IS_CAUSAL, LPT)
    q_row0, q_col0 = _flat_coords(b * stride_qb + h * stride_qh, stride_qm)
    do_row0, do_col0 = _flat_coords(b * stride_dob + h * stride_doh, stride_dom)
    k_row0, k_col0 = _flat_coords(b * stride_kb + hk * stride_kh, stride_kn)
    v_row0, v_col0 = _flat_coords(b * stride_vb + hk * stride_vh, stride_vn)
    for wg in gl.static_range(2):
        mbarrier.expect(q_bar.index(wg), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row0 + start_m + wg * BLOCK_M, q_col0], q_bar.index(wg),
                                        q_smem.index(wg))
        tma.async_copy_global_to_shared(do_desc, [do_row0 + start_m + wg * BLOCK_M, do_col0], q_bar.index(wg),
                                        do_smem.index(wg))
    _fill_kv_ring(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, k_empty, v_empty, n_blocks, 0, k_row0, k_col0,
                  v_row0, v_col0, STAGES, BLOCK_N)


@gluon.jit
def _dq_consumer(WG: gl.constexpr, q_desc, do_desc, k_desc, v_desc, dq_desc, q_smem, do_smem, k_smem, v_smem, q_bar,
                 k_bar, v_bar, k_empty, v_empty, turn_bar, DQ, LSE, DELTA, O, stride_ob, stride_oh, stride_om,
                 stride_qb, stride_qh, stride_qm, stride_dob, stride_doh, stride_dom, stride_kb, stride_kh, stride_kn,
                 stride_vb, stride_vh, stride_vn, stride_dqb, stride_dqh, stride_dqm, stride_lb, stride_lh, H, GROUP,
                 Sq, Sk, qk_scale, scale, n_m, lpt_heads, tail_from,
                 HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 IS_CAUSAL: gl.constexpr, LPT: gl.constexpr, COMPUTE_DELTA: gl.constexpr, q_layout: gl.constexpr):
    """Consumer warpgroup WG: query rows [start_m + WG * BLOCK_M, + BLOCK_M) of the CTA's tile. Per key
    block j, on this warpgroup's turn (ping-pong with the other, through ``turn_bar`` as in the forward):
    issue S_j = Q K_j^T, dP_j = dO V_j^T and dQ += dS_{j-1} K_{j-1}; wait for S_j and dP_j only (V_j is
    released), form dS_j while dQ_{j-1} runs, then wait for it (K_{j-1} is released). K_{j-1} is released
    in iteration j and the producer loads K_{j+1} ahead of V_j: STAGES >= 3 keeps that from deadlocking.
    COMPUTE_DELTA: delta = rowsum(dO * O) of the warpgroup's rows is formed here (dO from its shared tile, O
    read once) and written to DELTA for the dK/dV kernel, which runs after this one (no preprocess)."""
    gl.static_assert(STAGES >= 3, "K_{j+1} must not wait for K_{j-1}'s stage")
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    start_m, b, h, hk, n_blocks = _dq_tile(n_m, lpt_heads, tail_from, H, GROUP, Sk, BLOCK_M, BLOCK_N, IS_CAUSAL, LPT)
    my_m = start_m + WG * BLOCK_M
    rows = my_m + gl.arange(0, BLOCK_M, layout=row_s)
    l_off = b * stride_lb + h * stride_lh
    lse2 = gl.load(LSE + l_off + rows, mask=rows < Sq, other=float("inf")) * 1.4426950408889634
    q_tile = q_smem.index(WG)
    do_tile = do_smem.index(WG)
    if COMPUTE_DELTA:
        o_rows = _load_o_rows(O, b * stride_ob + h * stride_oh, stride_om, Sq, my_m, HEAD_D, BLOCK_M)
        mbarrier.wait(q_bar.index(WG), 0)  # dO is in shared memory
        delta = _row_delta(do_tile, o_rows, Sq, my_m, DELTA, l_off, BLOCK_M, row_s)
    else:
        delta = gl.load(DELTA + l_off + rows, mask=rows < Sq, other=0.0)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    dq = gl.zeros([BLOCK_M, HEAD_D], gl.float32, acc_layout)
    mbarrier.wait(q_bar.index(WG), 0)
    mbarrier.wait(k_bar.index(0), 0)
    mbarrier.wait(v_bar.index(0), 0)
    mbarrier.wait(turn_bar.index(WG), 0)
    s = warpgroup_mma(q_tile, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    dp = warpgroup_mma(do_tile, v_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    mbarrier.arrive(turn_bar.index(1 - WG), count=1)
    s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))
    mbarrier.arrive(v_empty.index(0), count=1)
    if _needs_mask(0, my_m, Sk, BLOCK_N, IS_CAUSAL):
        s = _mask_scores(s, 0, my_m, Sk, BLOCK_M, BLOCK_N, IS_CAUSAL, s_layout)
    p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1))
    ds_op = gl.convert_layout((p * (dp - gl.expand_dims(delta, 1))).to(dtype), a_layout)
    for j in range(1, n_blocks):
        slot = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(k_bar.index(slot), (j // STAGES) & 1)
        mbarrier.wait(v_bar.index(slot), (j // STAGES) & 1)
        mbarrier.wait(turn_bar.index(WG), j & 1)
        s = warpgroup_mma(q_tile, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_tile, v_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dq = warpgroup_mma(ds_op, k_smem.index(prev), dq, is_async=True)
        mbarrier.arrive(turn_bar.index(1 - WG), count=1)
        s, dp = warpgroup_mma_wait(num_outstanding=1, deps=(s, dp))  # (groups complete in order)
        mbarrier.arrive(v_empty.index(slot), count=1)
        if _needs_mask(j, my_m, Sk, BLOCK_N, IS_CAUSAL):
            s = _mask_scores(s, j, my_m, Sk, BLOCK_M, BLOCK_N, IS_CAUSAL, s_layout)
        p = gl.exp2(s * qk_scale - gl.expand_dims(lse2, 1))
        ds = (p * (dp - gl.expand_dims(delta, 1))).to(dtype)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
        mbarrier.arrive(k_empty.index(prev), count=1)
        ds_op = gl.convert_layout(ds, a_layout)
    last = (n_blocks - 1) % STAGES
    mbarrier.wait(turn_bar.index(WG), n_blocks & 1)
    dq = warpgroup_mma(ds_op, k_smem.index(last), dq, is_async=True)
    mbarrier.arrive(turn_bar.index(1 - WG), count=1)
    dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
    # every wgmma that read Q is complete: its buffer stages dQ
    q_tile.store((dq * scale).to(dtype))
    fence_async_shared()
    _store_rows(q_tile, DQ, b * stride_dqb + h * stride_dqh, stride_dqm, Sq, my_m, dq_desc, HEAD_D, BLOCK_M, True,
                q_layout)


@gluon.jit
def _attention_bwd_dq_sm90_kernel(
    q_desc, do_desc, k_desc, v_desc, dq_desc, DQ, LSE, DELTA, O, stride_ob, stride_oh, stride_om,
    stride_qb, stride_qh, stride_qm, stride_dob, stride_doh, stride_dom,
    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dqb, stride_dqh, stride_dqm, stride_lb, stride_lh,
    H, GROUP, Sq, Sk, qk_scale, scale, n_m, lpt_heads, tail_from,
    HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr, LPT: gl.constexpr, COMPUTE_DELTA: gl.constexpr, q_layout: gl.constexpr,
    kv_layout: gl.constexpr, num_warps: gl.constexpr,
):
    """Grid (n_m * H * B,): one tile of 2 * BLOCK_M query rows of one (batch, head) per CTA, in the forward's
    order (``_tile_coords``: causal, longest first). Every descriptor is the host's over a (rows, row stride)
    view; a query tail tile's dQ goes through a descriptor of its head made on the device."""
    gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
    dtype: gl.constexpr = DQ.dtype.element_ty
    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_D], q_layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_D], q_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=1)
    k_smem, v_smem, k_bar, v_bar, k_empty, v_empty, turn_bar = _alloc_kv_ring(dtype, STAGES, BLOCK_N, HEAD_D,
                                                                              kv_layout)
    gl.warp_specialize([
        (_dq_consumer, (0, q_desc, do_desc, k_desc, v_desc, dq_desc, q_smem, do_smem, k_smem, v_smem, q_bar, k_bar,
                        v_bar, k_empty, v_empty, turn_bar, DQ, LSE, DELTA, O, stride_ob, stride_oh, stride_om,
                        stride_qb, stride_qh, stride_qm, stride_dob,
                        stride_doh, stride_dom, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                        stride_dqb, stride_dqh, stride_dqm, stride_lb, stride_lh, H, GROUP, Sq, Sk, qk_scale, scale,
                        n_m, lpt_heads, tail_from, HEAD_D, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL, LPT, COMPUTE_DELTA,
                        q_layout)),
        (_dq_producer, (q_desc, do_desc, k_desc, v_desc, dq_desc, q_smem, do_smem, k_smem, v_smem, q_bar, k_bar,
                        v_bar, k_empty, v_empty, turn_bar, DQ, LSE, DELTA, O, stride_ob, stride_oh, stride_om,
                        stride_qb, stride_qh, stride_qm, stride_dob,
                        stride_doh, stride_dom, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                        stride_dqb, stride_dqh, stride_dqm, stride_lb, stride_lh, H, GROUP, Sq, Sk, qk_scale, scale,
                        n_m, lpt_heads, tail_from, HEAD_D, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL, LPT, COMPUTE_DELTA,
                        q_layout)),
        (_dq_consumer, (1, q_desc, do_desc, k_desc, v_desc, dq_desc, q_smem, do_smem, k_smem, v_smem, q_bar, k_bar,
                        v_bar, k_empty, v_empty, turn_bar, DQ, LSE, DELTA, O, stride_ob, stride_oh, stride_om,
                        stride_qb, stride_qh, stride_qm, stride_dob,
                        stride_doh, stride_dom, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                        stride_dqb, stride_dqh, stride_dqm, stride_lb, stride_lh, H, GROUP, Sq, Sk, qk_scale, scale,
                        n_m, lpt_heads, tail_from, HEAD_D, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL, LPT, COMPUTE_DELTA,
                        q_layout)),
    ], [1, 4], [24, 240])


# ------------------------------------------------------------------------------------------------
# host side
# ------------------------------------------------------------------------------------------------
def lpt_group(n_heads: int, reused_bytes: int, n_units: int, device, grouped: bool = True) -> int:
    """How many (batch, head)s one group of the causal longest-first order takes (``_lpt_order``): as many
    as ``LPT_L2_BYTES`` holds of what each one's CTAs read again and again (the dK/dV kernel: its query
    heads' Q and dO; the dQ kernel: its share of K and V), yet enough for ``LPT_MIN_WAVES`` CTAs per SM
    (``n_units`` CTAs a head), at most all (``LPT_L2_BYTES = 0`` or not ``grouped`` (GQA): all, the order
    before run88)."""
    if LPT_L2_BYTES <= 0 or not grouped:
        return n_heads
    floor = -(-LPT_MIN_WAVES * _num_sms(device) // n_units)
    return max(1, min(n_heads, max(floor, LPT_L2_BYTES // max(1, reused_bytes))))


def lpt_tail_from(n_heads: int, lpt_heads: int) -> int:
    """``_lpt_order``'s ``tail_from``: the first head of the last LPT_TAIL_GROUPS groups of ``lpt_heads``."""
    n_groups = -(-n_heads // lpt_heads)
    return (n_groups - min(n_groups, max(1, LPT_TAIL_GROUPS))) * lpt_heads


def lpt_order(n_units: int, n_heads: int, lpt_heads: int, tail_from: int) -> list:
    """``_lpt_order``'s (rank, head) for every CTA of the grid, in grid order (the host's copy, for tests and
    ``benchmarks/dev/attention_bwd_trace.py``'s model)."""
    groups = [range(g0, g0 + lpt_heads) for g0 in range(0, tail_from, lpt_heads)] + [range(tail_from, n_heads)]
    return [(r, h) for heads in groups for r in range(n_units) for h in heads]


def kernels(q, k, causal: bool, sms: int, deterministic: bool = False) -> str:
    """The Gluon backward kernels the auto path takes, as ``PYKERNELS_ATTN_SM90_BWD`` names them:
    "fused" (dK/dV/dQ in one kernel, dQ added by bulk TMA reductions into an fp32 buffer: not bitwise
    reproducible), "dkdv,dq" (both Gluon, no atomics), "dkdv" or "dq" (the other one Triton's), or ""
    (none; ``PYKERNELS_ATTN_SM90=0`` turns off every sm_90 kernel). A value set explicitly is taken wherever
    the kernels cover the case (D = 64 too), except "fused" where ``deterministic`` or torch's deterministic
    mode asks for a reproducible backward ("dkdv,dq" then).

    The speed rule: at D = 256 "dkdv" (``DKDV_D256_CONFIGS``' kernel) where ``DKDV_D256_AUTO`` (default), else "";
    at D = 192 the same kernel where ``DKDV_D192_AUTO`` (default); D = 80 and 96 as D = 128 where
    ``attention_sm90.zero_fill_on`` (``kernels.attention.sm90_backward`` then keeps "fused" or "dkdv").
    D = 128 with at least one CTA of 128 keys per SM (``sms``); with fewer, the Triton
    kernels' smaller blocks fill the card (B2 H8/2 S1000: 0.148 ms Triton, 0.266 ms Gluon; at D = 64 both
    lose, BERT-base shape 0.349 vs 0.245 ms; H100 run41-44). There, "fused" unless deterministic, from
    ``FUSED_MIN_SK`` keys (causal: from ``FUSED_CAUSAL_MIN_SK``, and without GQA); else "dkdv,dq". H100
    run88 / run89 (whole backward, do_bench, ``attention_bwd_sm90_gluon.py --fused-sweep``), fused against
    the pair (ms): full attention S1024 / 2048 / 4096 / 8192, and GQA 32/8 at S4096: 0.866-0.870 /
    1.473-1.485 / 2.616-2.656 / 4.935-4.949 / 5.158-5.176 against 0.857-0.882 / 1.506-1.536 / 2.834-2.880 /
    5.347-5.443 / 5.538-5.567 (cuDNN 0.82 / 1.42 / 2.65-2.67 / 5.07-5.17 / 5.26-5.37). Causal, both in the
    head-grouped order (``LPT_L2_BYTES``), S1024 / 2048 / 4096 / 8192: 0.707 / 1.03 / 1.674-1.680 /
    2.955-3.015 against 0.61 / 0.94 / 1.664-1.732 / 3.028-3.179 (cuDNN 0.60 / 0.89 / 1.55 / 2.79-2.82); GQA
    32/8 at S4096 3.36 against 2.98-3.08 (all heads at once). H200 run358 (``benchmarks/dev/
    attention_dropout_kernels.py --graph``, kernel time / graph replay, us): causal 4 x 16 x 4096 1478-1486 /
    1624-1636 against the pair's 1529-1567 / 1674-1686 (cuDNN 1398 / 1602), 4 x 16 x 2048 495-496 / 492-501
    against 493 / 495-500: the causal threshold 8192 -> 4096. H200 run440 (since ``HOST_KV``): the thresholds 1024
    and 2048 (``FUSED_MIN_SK``'s comment)."""
    deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
    named = os.environ.get("PYKERNELS_ATTN_SM90_BWD")
    if named is not None:
        if named == "fused" and deterministic:
            return "dkdv,dq"  # (the fused kernel's dQ reductions are not bitwise reproducible)
        return named
    if q.shape[-1] == 192:
        return "dkdv" if DKDV_D192_AUTO else ""  # (the D = 256 dK/dV kernel on zero-filled columns)
    if q.shape[-1] in DKDV_D256_CONFIGS:
        return "dkdv" if DKDV_D256_AUTO else ""  # (the D = 256 dK/dV kernel, beside Triton's dQ)
    d = 128 if q.shape[-1] in (80, 96) and zero_fill_on(q.shape[-1]) else q.shape[-1]  # (on the D = 128 tiles)
    if d != 128 or (k.shape[2] + 127) // 128 * k.shape[1] * k.shape[0] < sms:
        return ""
    if not deterministic and k.shape[2] >= (FUSED_CAUSAL_MIN_SK if causal else FUSED_MIN_SK) \
            and (not causal or q.shape[1] == k.shape[1]):
        return "fused"
    return "dkdv,dq"


def attention_bwd_dkdv_sm90(do, q, k, v, lse, delta, dk, dv, *, causal: bool, scale: float, config=None,
                            dq=None, trace=None, dropout_p: float = 0.0, seed=None) -> bool:
    """dK, dV into ``dk``, ``dv`` for (B, H, S, D) tensors covered per ``attention_sm90.unsupported`` and a
    TMA-aligned ``do``; lse and delta (B, H, Sq) fp32 with a unit last stride. With ``dq``: dQ too, in the
    same kernel (FUSED_DQ: bulk TMA reductions into a zeroed fp32 buffer, then one copy into ``dq``). False (nothing
    launched) where q or do cannot be seen through one host descriptor or dk / dv are not TMA-aligned: the
    caller runs the Triton kernel. ``trace``: an int64 (CTAs, TRACE_SLOTS) buffer for the development timeline
    (``benchmarks/dev/attention_bwd_trace.py``; ``_trace_put``'s slots). ``dropout_p`` > 0: the forward's dropout
    (its rate rounded as every kernel rounds it, ``dropout_rate``), regenerated from ``seed`` (the op's (1,)
    int64 seed tensor on the device, or an int)."""
    batch, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if d in DKDV_D256_CONFIGS:  # (no dQ, no dropout there: ``sm90_backward`` asks for neither)
        if dq is not None or dropout_p > 0 or trace is not None:
            return False
        return attention_bwd_dkdv_d256_sm90(do, q, k, v, lse, delta, dk, dv, causal=causal, scale=scale,
                                             config=config)
    tile_d = TILE_D.get(d, d)  # (D = 80 / 96 on the D = 128 tiles: zero-filled columns, ``_zero_fill_descriptor``)
    bn, bm, stages = config or DKDV_CONFIGS[tile_d]
    ql, kl = smem_layouts(bm, bn, tile_d, q.dtype)
    if tile_d != d:
        if dropout_p > 0 or trace is not None:
            return False
        qd, dod = _zero_fill_descriptor(q, bm, tile_d, ql), _zero_fill_descriptor(do, bm, tile_d, ql)
    else:
        qd, dod = _flat_descriptor(q, bm, ql), _flat_descriptor(do, bm, ql)
    if qd is None or dod is None or not (_tma_ok(dk) and _tma_ok(dv)) or (dq is not None and batch * hq * sq >= 2**31):
        return False
    rate = dropout_rate(dropout_p) if dropout_p > 0 else 0.0
    if rate > 0 and (batch * hq * sq >= 2**32 or (isinstance(seed, int) and not 0 <= seed < 2**31)):
        return False  # (the draws' Philox row and seed are 32-bit registers, the seed's high word 0: ops draw seeds
        # below 2^31, pykernels._rng.new_seed; an int seed outside that, or 2^32 query rows, go to the Triton kernels)
    fused = dq is not None
    dq_acc = dqd = None
    if fused:  # (tile_d wide: the reductions add the zero columns' zeros there too)
        dq_acc = torch.zeros(batch, hq, sq, tile_d, dtype=torch.float32, device=q.device)
        dqd = _dq_acc_descriptor(dq_acc, bm, tile_d)
    dsl = _ds_layout(bn, bm, q.dtype) if fused else kl
    host_kv = host_kv_descriptors(k, v, dk, dv, bn, kl, tile_d=tile_d if tile_d != d else 0)
    kv = host_kv or (k, v, dk, dv)
    _tuning.ensure_allocator()
    lpt = bool(causal) and CAUSAL_LPT
    n_kb = _tuning.cdiv(sk, 2 * bn)
    lpt_heads, tail_from = 1, 0
    if lpt:
        lpt_heads = lpt_group(batch * hkv, 2 * (hq // hkv) * sq * d * q.element_size(), n_kb, q.device,
                               hq == hkv or LPT_GQA)
        tail_from = lpt_tail_from(batch * hkv, lpt_heads)
    seed_t = seed_arg(seed if seed is not None else 0, q.device, rate > 0)
    drop_thr = round(rate * 65536)
    drop_inv = 1.0 / (1.0 - rate)
    _launch.fast(_attention_bwd_dkdv_sm90_kernel)[(n_kb * hkv * batch,) if lpt else (n_kb, hkv, batch)](
        qd, dod, *kv, lse, delta, dqd, *q.stride()[:3], *do.stride()[:3], *k.stride()[:3],
        *v.stride()[:3], *dk.stride()[:3], *dv.stride()[:3], *lse.stride()[:2],
        hq, hq // hkv, sq, sk, scale * LOG2E, scale, lpt_heads, tail_from, trace, seed_t, drop_thr, drop_inv,
        HEAD_D=tile_d, BLOCK_N=bn, BLOCK_M=bm, STAGES=stages, IS_CAUSAL=bool(causal), FUSED_DQ=fused, LPT=lpt,
        STATS_EARLY=STATS_EARLY and not causal, kv_layout=kl,
        ds_layout=dsl, num_warps=4, TRACE=trace is not None, HOST_KV=host_kv is not None, HAS_DROPOUT=rate > 0,
        DROP_EARLY=DROPOUT_EARLY, DROP_CARRY=DROPOUT_CARRY,
        DROP_ROT=DROPOUT_ROT and DROPOUT_CARRY, D_COLS=d if tile_d != d else 0, maxnreg=MAX_REGS)
    if fused:
        dq.copy_(dq_acc if tile_d == d else dq_acc[..., :d])
    return True


def attention_bwd_dkdv_d256_sm90(do, q, k, v, lse, delta, dk, dv, *, causal: bool, scale: float,
                                 config=None) -> bool:
    """dK, dV at D = 256 (``DKDV_D256_CONFIGS``' kernel) into ``dk``, ``dv``; inputs as ``attention_bwd_dkdv_sm90``
    takes them (delta = rowsum(dO O) already formed). False (nothing launched) where q or do cannot be seen through
    one host descriptor or dk / dv are not TMA-aligned. K / V / dK / dV through host descriptors where Sk is a
    multiple of BLOCK_N (``HOST_KV``), else descriptors made on the device. D = 192: the same kernel on zero-filled
    columns (``DKDV_D192_AUTO``' comment); q and do must then have every slice at column 0 of their views."""
    batch, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    bn, bm, stages = config or DKDV_D256_CONFIGS[d]
    tile_d = 256
    cols = d if d < tile_d else 0
    ql, kl = smem_layouts(bm, bn, tile_d, q.dtype)
    if cols:
        qd, dod = _zero_fill_descriptor(q, bm, tile_d, ql), _zero_fill_descriptor(do, bm, tile_d, ql)
    else:
        qd, dod = _flat_descriptor(q, bm, ql), _flat_descriptor(do, bm, ql)
    if qd is None or dod is None or not (_tma_ok(dk) and _tma_ok(dv)):
        return False
    host = host_kv_descriptors(k, v, dk, dv, bn, kl, cta_keys=bn, tile_d=tile_d if cols else 0)
    _tuning.ensure_allocator()  # (descriptors made on the device)
    d_a, d_b = SPLIT[d] if SPLIT_D_BWD and d in SPLIT else (0, 0)
    _launch.fast(_attention_bwd_dkdv_d256_sm90_kernel)[(_tuning.cdiv(sk, bn), hkv, batch)](
        qd, dod, *(host or (k, v, dk, dv)), lse, delta, *q.stride()[:3], *do.stride()[:3], *k.stride()[:3],
        *v.stride()[:3], *dk.stride()[:3], *dv.stride()[:3], *lse.stride()[:2], hq, hq // hkv, sq, sk,
        scale * LOG2E, scale, HEAD_D=tile_d, BLOCK_N=bn, BLOCK_M=bm, STAGES=stages, IS_CAUSAL=bool(causal),
        kv_layout=kl, p_layout=_pt_layout(bn, bm), num_warps=4, HOST_KV=host is not None, D_COLS=cols,
        D_A=d_a, D_B=d_b, maxnreg=MAX_REGS)
    return True


def _zero_fill_descriptor(t: torch.Tensor, block_rows: int, tile_d: int, layout):
    """A host descriptor over ``t`` (B, H, S, D), D < tile_d, as ``_flat_descriptor``'s (rows, row stride) view but
    D columns wide in (block_rows, tile_d) tiles (loads read zeros past column D, stores clip there); None where
    there is no such view or a (batch, head) slice would not start at column 0 of it (the tiles would then cover the
    next head's columns)."""
    geometry = _flat_geometry(t.shape, t.stride(), block_rows, zero_fill=True)
    if geometry is None:
        return None
    return _descriptor(t, _descriptor_fields(geometry, block_rows, t.shape[3], layout, tile_d))


def host_kv_descriptors(k, v, dk, dv, bn: int, layout, cta_keys: int = 0, tile_d: int = 0):
    """The dK/dV kernel's host descriptors over k, v, dk and dv (``HOST_KV``: (rows, row stride) views, BLOCK_N-row
    tiles), or None where it makes them on the device: HOST_KV off, Sk not a multiple of a CTA's keys (``cta_keys``,
    2 * bn by default; the D = 256 kernel's bn: a CTA's last tile would read, and store into, the next head's rows), or
    a tensor without such a view. ``tile_d`` > D: ``_zero_fill_descriptor``'s (D columns in tile_d-wide tiles)."""
    if not HOST_KV or k.shape[2] % (cta_keys or 2 * bn):
        return None
    if tile_d:
        descs = tuple(_zero_fill_descriptor(t, bn, tile_d, layout) for t in (k, v, dk, dv))
    else:
        descs = tuple(_flat_descriptor(t, bn, layout) for t in (k, v, dk, dv))
    return None if any(x is None for x in descs) else descs


def _dq_acc_descriptor(dq_acc: torch.Tensor, bm: int, d: int):
    """A host descriptor over the fused kernel's fp32 dQ buffer (B, H, Sq, D) as (B * H * Sq, D) rows, tiles
    of (bm, D / 2): one consumer's half of a query block's dQ."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    layout = gl.NVMMASharedLayout.get_default_for([bm, d // 2], gl.float32)
    return TensorDescriptor.from_tensor(dq_acc.view(-1, d), [bm, d // 2], layout)


@functools.lru_cache(maxsize=16)
def _pt_layout(bn: int, bm: int):
    """The shared layout of the D = 256 dK/dV kernel's fp32 P^T tiles."""
    return gl.NVMMASharedLayout.get_default_for([bn, bm], gl.float32)


@functools.lru_cache(maxsize=16)
def _ds_layout(bn: int, bm: int, dtype: torch.dtype):
    """The shared layout of the fused kernel's dS^T tiles."""
    return gl.NVMMASharedLayout.get_default_for([bn, bm], gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def attention_bwd_dq_sm90(do, q, k, v, lse, delta, dq, *, causal: bool, scale: float, config=None,
                          o=None) -> bool:
    """dQ into ``dq``, inputs as ``attention_bwd_dkdv_sm90`` takes them; False (nothing launched) where q,
    do, k, v or dq cannot be seen through one host descriptor each. With ``o`` (the forward's output, unit
    last stride, else False): delta = rowsum(dO * O) is computed in the kernel and written into ``delta``
    (no preprocess; the dK/dV kernel then reads it)."""
    batch, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    bm, bn, stages = config or DQ_CONFIGS[d]
    ql, kl = smem_layouts(bm, bn, d, q.dtype)
    descs = (_flat_descriptor(q, bm, ql), _flat_descriptor(do, bm, ql), _flat_descriptor(k, bn, kl),
             _flat_descriptor(v, bn, kl), _flat_descriptor(dq, bm, ql) if _tma_ok(dq) else None)
    if any(x is None for x in descs) or (o is not None and (o.stride(-1) != 1 or o.dtype != do.dtype)):
        return False
    _tuning.ensure_allocator()  # a query tail tile's store
    n_m = _tuning.cdiv(sq, 2 * bm)
    lpt_heads, tail_from = 1, 0
    if causal and CAUSAL_LPT:
        lpt_heads = lpt_group(batch * hq, 2 * sk * d * k.element_size() // (hq // hkv), n_m, q.device,
                               hq == hkv or LPT_GQA)
        tail_from = lpt_tail_from(batch * hq, lpt_heads)
    _launch.fast(_attention_bwd_dq_sm90_kernel)[(n_m * hq * batch,)](
        *descs, dq, lse, delta, o, *(o.stride()[:3] if o is not None else (0, 0, 0)), *q.stride()[:3],
        *do.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dq.stride()[:3], *lse.stride()[:2],
        hq, hq // hkv, sq, sk, scale * LOG2E, scale, n_m, lpt_heads, tail_from,
        HEAD_D=d, BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, IS_CAUSAL=bool(causal),
        LPT=bool(causal) and CAUSAL_LPT, COMPUTE_DELTA=o is not None, q_layout=ql, kv_layout=kl,
        num_warps=4, maxnreg=MAX_REGS)
    return True
