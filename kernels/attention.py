"""Fused scaled-dot-product attention: FlashAttention-2 forward and backward in Triton.

Design note
-----------
Algorithm (Dao, "FlashAttention-2", 2023). Forward: one program per (query block of BLOCK_M rows,
batch*query-head). It streams key/value blocks of BLOCK_N rows through on-chip memory and keeps an
online softmax in fp32: running row max ``m``, running denominator ``l`` and the fp32 output
accumulator. Scores are computed in base 2: ``log2(e) * scale`` is folded into one multiplier so the
exponentials are ``exp2`` (one MUFU op); an additive float mask is multiplied by ``log2(e)`` once on
load. The forward saves ``lse = m + log(l)`` (natural log, fp32, one per query row) and never
materialises the Sq x Sk matrix.

Backward (recomputation, no atomics, deterministic by construction; on Hopper the fused Gluon kernel of
``attention_sm90_bwd`` adds dQ by TMA reductions where the caller allows a non-deterministic backward):
  1. ``_attention_bwd_dq_kernel`` (below) runs first and forms ``delta = rowsum(dO * O)`` in fp32 for its
     query rows, storing it for step 2 (``COMPUTE_DELTA``; ``_attention_bwd_preprocess_kernel`` does only
     that, for the fused sm_90 kernel, which has no separate dQ kernel).
  2. ``_attention_bwd_dkdv_kernel``: one program per (key block, batch*kv-head). For GQA it loops over
     the query heads of its group *inside* the program, so dK/dV of a kv head are summed in registers
     without atomics or partial buffers. For each query block it recomputes ``P = exp2(S - lse)``,
     then ``dV += P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - delta)``, ``dK += dS^T Q``.
  3. ``_attention_bwd_dq_kernel``: one program per (query block, batch*query-head), looping over key
     blocks: ``dQ += dS K``. Computing dQ separately costs one extra QK^T and dO V^T product (the
     backward does 5 instead of 4 matmuls) but removes the atomic dQ accumulation, so the result is
     bitwise reproducible.

Causal masking is top-left aligned like ``torch.nn.functional.scaled_dot_product_attention``:
query i sees keys j <= i. Key blocks entirely above the diagonal are never visited, and the key loop
is split in two ("causal loop split"): the blocks strictly below the diagonal run without the causal
compare, only the BLOCK_M-wide diagonal band applies it (BLOCK_M is a multiple of BLOCK_N so the split
falls on a block boundary; in the dK/dV kernel BLOCK_N is a multiple of BLOCK_M).

Masks: a boolean (True = take part) or additive float mask is read in-kernel through its four strides
(batch, head, query, key), any of which may be 0, so a broadcast mask is never expanded in memory.
A key-padding mask (strides 0 over head and query) is read as one vector per key block (MASK_KIND
3/4) and additionally gets a per-batch valid-key range ``[kv_lo, kv_hi)`` (and whether every key in it
is valid, which the sm_90 forward uses) computed on the device by the caller in one launch
(``pykernels.attention._key_padding_range``, ``key_padding_range``; no host sync, saved for the
backward); the kernels skip the key blocks outside it (the dK/dV kernel writes zeros for them at once).

Fully masked rows (by a mask, Sk = 0, or an empty varlen sequence) output 0 with lse = -inf; the
final ``1/l`` is guarded and the backward replaces lse = -inf by +inf so P = 0 there, so the gradient
is 0 and never NaN.

Dropout: one Philox-4x32-7 call (``tl.randint4x``) per 8 keys of a query row, at the int64 counter
``((b * H + h) * Sq + i) * ceil(Sk / 8) + j // 8`` (query head h; for varlen Sq/Sk are max_seqlen_q/k and
i, j are positions inside the sequence); key j takes 16 of its 128 bits and is kept where they are
``>= p * 65536``, p rounded to a multiple of 2^-16 on the host (``_dropout_keep``). The backward regenerates
the same mask from the seed; the forward never stores it. Within the backward, at head dims up to 64, the dQ kernel
stores its draws' keep bits (``keep_buffer``, B H Sq Sk / 8 bytes, freed with the backward) and the dK/dV kernel loads
them instead of drawing again. ``attention_dropout_mask`` in ``pykernels.attention``
reproduces it in eager PyTorch, and the CUDA C++ kernels draw the same bits. On the GPU every kernel draws them
by inline PTX instead (``PTX_DROPOUT``: fp16 / bf16, D <= 128): one call a lane, shared by the lanes that hold its
8 elements through xor shuffles (the dK/dV kernel: the Gluon dK/dV kernel's octet draws, three shuffles; the forward
and the dQ kernel, whose tiles are queries x keys: their quad form, two), with no reshape of the tile.

Varlen: the same kernels with ``IS_VARLEN``: q/k/v are packed (total, H, D) tensors, the program reads
its sequence's start and length from ``cu_seqlens`` and works inside it; lse is (H, total_q). Output
and gradient rows that no program writes (past ``cu_seqlens[-1]``, or past ``max_seqlen`` into a
sequence) are zeroed by ``_varlen_zero_uncovered_kernel`` (a binary search per row; blocks without
such rows store nothing) instead of zero-filling whole buffers first.

Cost. Forward FLOPs 4*B*H*Sq*Sk*D (2 matmuls; half when causal), backward 2.5x that (5 matmuls here).
Bytes: forward reads Q, K, V once per program row of the grid (K/V re-read Sq/BLOCK_M times, mostly
from L2) and writes O and lse; backward reads Q, K, V, O, dO, lse, delta and writes dQ, dK, dV.

Bounds checks: only the tail key block (k >= Sk) and tail query block pay for bounds masks (each loop
range is split at the last full block); with a power-of-two head dim (EVEN_D) the interior loads are
unmasked. The dK/dV kernel works on the transposed (keys x queries) tile so dV += P^T dO and
dK += dS^T Q need no register transposes, and its short causal diagonal loop is not pipelined.

Offsets: program ids are cast to int64 before any stride multiplication, and batch/head/sequence
starts are added to the base pointers in int64. Row/column offsets *inside* one (batch, head) slice
are int32 (cheaper pointer tiles, fewer registers) unless a slice can reach 2**31 elements
(``IDX64``, chosen by the launcher from the strides). Grid = (blocks, heads, batch): heads and batch
are each limited to 65535 (CUDA grid y/z); larger calls fall back to the reference.

Tuning: per-kernel tables of (BLOCK_M, BLOCK_N, warps, stages) keyed on the padded head dim (64 /
128 / 256), a coarse sequence bucket, causal, mask kind and dropout; the first entry is the default
(``PYKERNELS_AUTOTUNE=0`` via kernels/_tuning), the benchmarks autotune over the (at most four) entries.
Entries were picked by compiling every variant for sm_90 on a CPU-only machine (Triton's bundled ptxas)
with the specialisation the JIT applies at run time (16-byte aligned pointers, strides and lengths
divisible by 16, GROUP == 1): without it the loads do not vectorise, are not turned into cp.async
pipelines, and register/spill counts are misleading. Every bf16 backward entry for D = 64/128 was
spill-free for the plain, causal and key-padding variants, and dropout has its own spill-free lists (the D = 64
entries that run190 added by measured time, dK/dV 32x64/w4/s4 and 64x64/w4/s3 and dQ 64x32/w4/s4, were not
compiled for this check; they were the fastest of their kernel's candidates on the H100).
Exceptions (8 to 80 bytes of stack): forward 128x128 at D = 128 with causal/masks, varlen D = 64
forward 128x64/4 warps, varlen D = 128 dK/dV 32x64/4 warps; the autotuner can avoid them. D = 256's
larger entries spill a little and were chosen by time (run471: the small spill-free tiles were 1.5-3.8x slower),
the entries pruned by their shared memory on smaller cards (``_SMEM_256``). Rules the tables follow: the TTGIR of
the dK/dV kernel gives its (BLOCK_N x BLOCK_M) S^T/dP^T wgmma tiles warps [8, 1] along BLOCK_N at 8 warps, so a
64-row tile there is replicated over both warpgroups (those two products computed twice): BLOCK_N = 128 at 8
warps, BLOCK_N = 64 only at 4 warps (D = 256 excepted: there 64x64 at 8 warps halves each thread's dK/dV
accumulators and was the fastest). Loops that run at most a few iterations (key / query tail, causal diagonal
band) of the backward are not software-pipelined, which frees registers for the main loop.
The D = 64 backward's entries are ordered by H100 timings (run190); the benchmark records the configs the
autotuner picks.

Limits: head dims up to 256 (padded to the next power of two >= 16 with masked loads; D > 128 takes
the D = 256 tiles), Dv may differ from D. fp16/bf16 use tensor-core dots with fp32
accumulation; fp32 inputs use IEEE fp32 dots (no TF32) for accuracy, on small tiles (FMA units, slow).
The last dim of every tensor must have stride 1 (the caller makes it so when needed). No tensor
descriptors (TMA), warp specialisation or persistent scheduling yet: expect plain-Triton FA2 speed.

References: Dao et al., FlashAttention (2022) and FlashAttention-2 (2023); the Triton fused-attention
tutorial (06-fused-attention.py) for the exp2 and causal-split structure (its non-causal backward is
known to be wrong; ours is tested on the full matrix); flash-attn's varlen interface.
"""
from __future__ import annotations

import os
import threading

import torch
import triton
import triton.language as tl

from pykernels._alloc import empty, empty_like_layout

from . import _launch
from . import _tuning
from ._dropout import dropout_keep as _dropout_keep
from ._dropout import load_seed, seed_arg
from ._dropout import dropout_rate as _dropout_rate
from ._dropout import APPLY_KEEP_CONSTRAINTS as _APPLY_KEEP_CONSTRAINTS
from ._dropout import APPLY_KEEP_PTX as _APPLY_KEEP_PTX
from ._dropout import KEEP_OCTET_CARRY_PTX as _KEEP_OCTET_PTX
from ._dropout import KEEP_OCTET_CONSTRAINTS as _KEEP_OCTET_CONSTRAINTS
from ._dropout import KEEP_QUAD_CARRY_PTX as _KEEP_QUAD_PTX
from ._dropout import KEEP_BUFFER_CONSTRAINTS as _KEEP_BUFFER_CONSTRAINTS
from ._dropout import KEEP_OCTET_LOAD_PTX as _KEEP_OCTET_LOAD_PTX
from ._dropout import KEEP_QUAD_LOAD_PTX as _KEEP_QUAD_LOAD_PTX
from ._dropout import KEEP_QUAD_STORE_PTX as _KEEP_QUAD_STORE_PTX

LOG2E = 1.4426950408889634
# The dK/dV kernel's dropout keep bits by inline PTX on the GPU (fp16 / bf16: its S^T tile in an MMA accumulator
# layout), the Gluon dK/dV kernel's octet draws (``_dropout._keep_octet_ptx``): one Philox call a lane for 8 elements,
# the keep bits moved by three xor shuffles, instead of ``dropout_keep``'s call per 8 columns of each row and the
# reshapes that give every element its bits (which went through shared memory: the kernel's LDS 115 -> 61 at D = 64).
# ``PYKERNELS_TRITON_PTX_DROPOUT=0`` turns it off; never under the interpreter (no inline asm there). H200 run456 (the
# whole Triton backward with dropout 0.1, graph replay, ``benchmarks/dev/attention_bwd_triton_dropout_ab.py``, the same
# gradients bitwise): 1.084x at BERT-base (432.0 against 468.1 us), 1.123x at GPT-2, 1.121x at 4 x 16 x 2048 D64
# causal, 1.187x at 4 x 16 x 2048 D128 causal, 1.080x at 8 x 16 x 1024 D128 (ptxas at D = 128: 140 bytes of spill
# against 192). Since the seventy-fifth session the forward and the dQ kernel too, by the quad form
# (``_keep_octet_ptx(quad=True)``: ``_ptx_keep_bits``), each kernel with its own dropout config table for the PTX
# draws (``dq_dropout_ptx``, ``dkdv_dropout_ptx``): the whole backward 1.42x at BERT-base (470.8 -> 330.7 us), 1.48x
# at GPT-2, 1.47x at 4 x 16 x 2048 D64 causal, 1.60x / 1.58x at the D = 128 shapes, the forward 1.21-1.28x (H200
# run459-460, against ``dropout_keep``'s draws in the same call)
PTX_DROPOUT = os.environ.get("PYKERNELS_TRITON_PTX_DROPOUT", "1") not in ("", "0")


# ---------------------------------------------------------------------------------------------
# Autotune spaces: small, keyed on (padded head dim, sequence bucket, causal, mask kind, dropout)
# and pruned by head dim so shared memory fits. Under the CPU interpreter: one small config.
# ---------------------------------------------------------------------------------------------
# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and padded-head-dim tier, best guess first.
# Forward/dQ: BLOCK_M % BLOCK_N == 0; dK/dV: BLOCK_N % BLOCK_M == 0 (the causal split needs it).
# D = 256 (the tier of 128 < D <= 256): H200 run471 (``benchmarks/dev/attention_bwd_configs.py``, each kernel's
# candidates timed by its autotuner, bf16, us at 4 x 8 x 4096 causal / 4 x 8 x 2048 bidirectional): forward 128x32/w8/s3
# 769 / 321, 64x32/w4/s2 785 / 356, 64x64/w8/s2 1162 / 588, 64x32/w8/s2 1717 / 906 (the old pair: 64x64/w8/s2
# first); dK/dV 64x64/w8/s2 2142 / 962, 32x32/w4/s2 3171 / 1602, 32x64/w8/s2 3555 / 1308, 16x32/w4/s2 4680 / 2344,
# 16x64/w8/s2 5782 / 2065 (the old pair); dQ 128x32/w8/s2 1122 / 531, 128x16/w8/s2 1710 / 811, 64x32/w8/s2 2380 /
# 1225, 32x16/w4/s2 4299 / 2140, 32x16/w8/s2 8372 / 4247 (the old pair): the whole call 1.5x forward and 2.2-3.8x
# backward kernels. run472 (the bidirectional shape, more candidates): forward 128x64/w8/s2 292, 128x32/w8/s3 320,
# 128x32/w8/s4 324; dQ 128x32/w8/s3 403, 128x64/w8/s1 460, 128x32/w8/s2 532, 128x16/w8/s3 554; dK/dV 64x64/w8/s2 960,
# 32x64/w8/s3 1127, 32x64/w8/s2 1298, 64x64/w8/s1 1407. The larger tiles spill a little (sm_90 ptxas: dK/dV 64x64/w8
# 1368 B, dQ 128x32/w8 156 B; the small ones none) and beat the small ones by far; their shared memory
# (``_SMEM_256``) prunes them on smaller cards.
_TABLE = {
    "fwd": {64: [(128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2)],
            128: [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2)],
            256: [(128, 64, 8, 2), (128, 32, 8, 3), (64, 32, 4, 2), (64, 32, 8, 2)]},
    "fwd_short": {64: [(64, 64, 4, 3), (64, 32, 4, 3)],
                  128: [(64, 64, 4, 3), (64, 32, 4, 3)],
                  256: [(64, 32, 8, 2)]},
    # dK/dV: with 8 warps (two warpgroups) BLOCK_N must be >= 128, else the (BLOCK_N x BLOCK_M) S^T and
    # dP^T wgmma tiles (warps [8, 1] along BLOCK_N) are computed twice, once per warpgroup.
    # D = 64 (dK/dV and dQ): ordered by the H100's timings at BERT-base, BERT key padding and GPT-2 causal (run190,
    # benchmarks/dev/attention_bwd_configs.py: each kernel's candidates timed by its autotuner); the first entry, the
    # default without autotuning, was the slowest one before (dK/dV 32x128/w8/s3 185 us against 135 at BERT-base).
    "dkdv": {64: [(32, 64, 4, 4), (64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 8, 3)],
             128: [(32, 128, 8, 2), (32, 128, 8, 3), (16, 128, 8, 3), (32, 64, 4, 3)],
             256: [(64, 64, 8, 2), (32, 64, 8, 3), (32, 64, 8, 2), (16, 32, 4, 2)]},
    "dq": {64: [(64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 4), (128, 32, 8, 3)],
           128: [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3)],
           256: [(128, 32, 8, 3), (128, 32, 8, 2), (64, 32, 8, 2), (32, 16, 4, 2)]},
    # Dropout (in-kernel Philox per score) needs registers: the entries above that spill with it are
    # left out (sm_90 AOT: D=128 dK/dV 32x128 spills 184 B, dQ 128x64 456 B; these spill <= 24 B).
    "dkdv_dropout": {64: [(32, 128, 8, 3), (32, 64, 4, 3)], 128: [(16, 128, 8, 3)]},
    "dq_dropout": {64: [(128, 32, 8, 3)], 128: [(128, 32, 8, 3)]},
    # ... and with the keep bits by PTX (PTX_DROPOUT), which hold fewer registers (sm_90 AOT, D = 64 dQ 128x32/8 warps
    # 151 -> 100, 64x64/4 207 -> 154; every entry here spill-free at D = 64 and 128): H200 run458 (BERT-base / GPT-2,
    # each config pinned, the whole backward's graph replay, us): dQ 64x64/w4/s3 333.6 / 216.6, 64x32/w4/s4 336.8 /
    # 218.7, 128x32/w8/s3 339.9 / 235.5, 128x64/w8/s3 364.8 / 235.1; dK/dV 64x64/w4/s3 337.4 / 235.7, 32x64/w4/s3
    # 339.0 / 235.6, 32x64/w4/s4 340.6 / 234.9, 32x128/w8/s3 382.3 / 277.8. D = 128 run459 (4 x 16 x 2048 causal /
    # 8 x 16 x 1024): dQ 128x64/w8/s3 831.9 / 644.0, 128x32/w8/s3 871.3 / 680.5, 128x64/w8/s2 865.2 / 684.7, 64x64/w4/s3
    # 869.5 / 704.6; dK/dV 32x64/w4/s3 864.6 / 687.0, 32x128/w8/s3 969.3 / 731.1, 16x128/w8/s3 1015.8 / 846.1
    "dkdv_dropout_ptx": {64: [(32, 64, 4, 3), (64, 64, 4, 3), (32, 64, 4, 4)],
                         128: [(32, 64, 4, 3), (32, 128, 8, 3), (16, 128, 8, 3)]},
    "dq_dropout_ptx": {64: [(64, 64, 4, 3), (64, 32, 4, 4)], 128: [(128, 64, 8, 3), (128, 32, 8, 3), (128, 64, 8, 2)]},
    # fp32 inputs: IEEE fp32 dots run on FMA units (no tensor cores), so small tiles limit spills.
    "fp32_fwd": {64: [(64, 32, 4, 2)], 128: [(32, 32, 4, 2)], 256: [(16, 16, 4, 2)]},
    "fp32_dkdv": {64: [(16, 32, 4, 2)], 128: [(16, 32, 4, 2)], 256: [(16, 16, 4, 2)]},
    "fp32_dq": {64: [(32, 16, 4, 2)], 128: [(32, 16, 4, 2)], 256: [(16, 16, 4, 2)]},
}


# Shared memory (bytes) of the D = 256 entries as the JIT compiles them for sm_90 (``benchmarks/dev/
# attention_triton_bwd_codegen.py --cases d256_causal [--p 0.1] [--mask additive|bool]``): (no mask and no dropout,
# the most over masks and dropout: an additive mask's tiles are pipelined too). At D = 256 the pruner keeps the
# entries that fit the device's opt-in limit (an H100 / H200's 227 KiB drops dQ 128x32/w8/s3 with a mask or dropout,
# an A100's 163 KiB the 192 KiB tiles, a 99 KiB card all but the last), so that ``PYKERNELS_AUTOTUNE=0``'s first
# entry launches there too.
_SMEM_256 = {
    "fwd": {(128, 64, 8, 2): (196608, 221184), (128, 32, 8, 3): (163840, 184320), (64, 32, 4, 2): (98304, 104448),
            (64, 32, 8, 2): (98304, 104448)},
    "dkdv": {(64, 64, 8, 2): (197120, 209408), (32, 64, 8, 3): (164352, 176640), (32, 64, 8, 2): (131328, 139520),
             (16, 32, 4, 2): (57344, 58496)},
    "dq": {(128, 32, 8, 3): (229376, 249856), (128, 32, 8, 2): (196608, 208896), (64, 32, 8, 2): (131072, 139264),
           (32, 16, 4, 2): (53248, 58368)},
}


def _tier(d: int) -> int:
    """The tables' head-dim tier of a padded head dim: 64, 128 or 256."""
    return 64 if d <= 64 else (128 if d <= 128 else 256)


def _smem_limit(args) -> int | None:
    """The opt-in shared memory per block of the CUDA device the launch's tensors are on (None: none found)."""
    for v in args.values():
        dev = getattr(v, "device", None)
        if dev is not None and getattr(dev, "type", "") == "cuda":
            return getattr(_tuning.device_properties(dev), "shared_memory_per_block_optin", None)
    return None


def _fitting(kind: str, table: list, limit: int | None, plain: bool) -> list:
    """The D = 256 table's entries whose sm_90 shared memory (``_SMEM_256``: ``plain`` a call without mask and
    dropout) fits ``limit``, in table order; the last (smallest) entry when none does, the whole table when the
    limit is unknown."""
    if limit is None:
        return table
    sizes = _SMEM_256[kind]
    return [t for t in table if sizes[t][0 if plain else 1] <= limit] or table[-1:]


def _configs(*kinds):
    """Every config the tables name for these kernels (one small config under the interpreter)."""
    if _tuning.interpret():
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    seen = []
    for kind in kinds:
        for tier in _TABLE[kind].values():
            for c in tier:
                if c not in seen:
                    seen.append(c)
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st) for bm, bn, w, st in seen]


def _pruner(kind):
    """early_config_prune for one kernel: the table's configs for the head-dim tier (and, for the
    forward, the sequence bucket). Autotuning goes through kernels/_tuning (PYKERNELS_AUTOTUNE=0)."""
    def prune(configs, nargs, **kw):
        if len(configs) == 1:
            return configs
        args = {**nargs, **kw}  # seq_bucket is positional (nargs); the constexprs come as keywords
        tier = _tier(max(args["BLOCK_D"], args["BLOCK_DV"]))
        if args.get("PRECISION") == "ieee":
            table = _TABLE["fp32_" + kind][tier]
        elif kind == "fwd" and args.get("HAS_DROPOUT") and tier <= 128:
            # In-kernel Philox needs registers: 128-row tiles spilled (sm_90 AOT check, when a score drew its own call).
            table = _TABLE["fwd_short"][tier]
        elif kind in ("dkdv", "dq") and args.get("HAS_DROPOUT") and tier <= 128:
            # entries of the main table (in the configs list)
            table = _TABLE[kind + ("_dropout_ptx" if args.get("PTX_DROPOUT") else "_dropout")][tier]
        else:
            table = _TABLE["fwd_short" if kind == "fwd" and args["seq_bucket"] <= 128 else kind][tier]
        if tier == 256 and args.get("PRECISION") != "ieee":
            table = _fitting(kind, table, _smem_limit(args), not args.get("HAS_DROPOUT") and not args.get("MASK_KIND"))
        # In table order (best guess first): with PYKERNELS_AUTOTUNE=0, kernels/_tuning keeps the first.
        by_key = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages): c for c in configs}
        keep = [by_key[t] for t in table if t in by_key]
        return keep or configs[:1]
    return prune


_KEYS = ["BLOCK_D", "BLOCK_DV", "seq_bucket", "IS_CAUSAL", "MASK_KIND", "HAS_DROPOUT", "IS_VARLEN", "PTX_DROPOUT",
         "KEEP_BUF"]


# ---------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------
@triton.jit
def _seq_bounds(CuQ, CuK, b, Sq, Sk, IS_VARLEN: tl.constexpr):
    """Start (int64) and length (int32) of this program's query and key sequence."""
    if IS_VARLEN:
        q_start = tl.load(CuQ + b).to(tl.int64)
        q_len = (tl.load(CuQ + b + 1) - tl.load(CuQ + b)).to(tl.int32)
        k_start = tl.load(CuK + b).to(tl.int64)
        k_len = (tl.load(CuK + b + 1) - tl.load(CuK + b)).to(tl.int32)
    else:
        # Always tensors (never constexprs, which Sq == 1 would make), like the varlen branch.
        zero = b * 0
        q_start = zero
        q_len = zero.to(tl.int32) + Sq
        k_start = zero
        k_len = zero.to(tl.int32) + Sk
    return q_start, q_len, k_start, k_len


@triton.jit
def _idx(offs, IDX64: tl.constexpr):
    """Row/column indices for pointer arithmetic inside one (batch, head) slice: int32 unless a
    slice spans 2**31 elements or more (IDX64), which keeps pointer tiles cheap in registers.
    Batch/head/sequence-start offsets are always int64 (added to the base pointers)."""
    if IDX64:
        return offs.to(tl.int64)
    else:
        return offs


@triton.jit
def _apply_masks(s, rows, cols, k_len, mask_ptrs, row_ok, MASK_KIND: tl.constexpr, APPLY_CAUSAL: tl.constexpr,
                 CHECK_N: tl.constexpr):
    """Mask log2-scaled scores ``s``. ``rows``/``cols`` are the query/key indices already broadcast to
    the tile's layout ((M,1)/(1,N), or (1,M)/(N,1) for the transposed tile of the dK/dV kernel).
    Masked lanes become -inf after every transform, so reductions never see garbage."""
    # MASK_KIND 1/2: boolean/additive mask read per (row, col); 3/4: the same when the mask does not
    # depend on the query row (key padding): one vector per key block, broadcast over the rows.
    if MASK_KIND >= 3:
        ld = cols < k_len
    else:
        ld = row_ok & (cols < k_len)
    if MASK_KIND == 1 or MASK_KIND == 3:  # boolean, True = take part (read as uint8)
        keep = tl.load(mask_ptrs, mask=ld, other=0)
        s = tl.where(keep != 0, s, float("-inf"))
    if MASK_KIND == 2 or MASK_KIND == 4:  # additive, natural-log units -> log2 units
        add = tl.load(mask_ptrs, mask=ld, other=0.0).to(tl.float32)
        s = s + add * 1.4426950408889634
    if APPLY_CAUSAL:  # top-left: query i sees keys j <= i
        s = tl.where(rows >= cols, s, float("-inf"))
    if CHECK_N:  # key tail past the sequence
        s = tl.where(cols < k_len, s, float("-inf"))
    return s


@triton.jit
def _block_offsets(start, length, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   IDX64: tl.constexpr):
    """A program's block of sequence rows [start, start + BLOCK) out of ``length``: the row offsets, the
    head-dim offsets (D, Dv), which rows are in bounds, and the row offsets for pointers (:func:`_idx`)."""
    offs = start + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    return offs, offs_d, offs_dv, offs < length, _idx(offs, IDX64)


@triton.jit
def _load_tile(X, idx, ok, offs_d, stride, N: tl.constexpr):
    """The (rows x head dim) tile ``X[idx, offs_d]`` (row stride ``stride``) of a program's own block;
    rows not ``ok`` and columns past N read 0."""
    return tl.load(X + idx[:, None] * stride + offs_d[None, :], mask=ok[:, None] & (offs_d[None, :] < N), other=0.0)


@triton.jit
def _store_tile(X, idx, ok, offs_d, stride, N: tl.constexpr, value):
    """Store ``value`` (rows x head dim, fp32) as X's dtype at ``X[idx, offs_d]``, rows ``ok`` and
    columns below N only."""
    tl.store(X + idx[:, None] * stride + offs_d[None, :], value.to(X.dtype.element_ty),
             mask=ok[:, None] & (offs_d[None, :] < N))


@triton.jit
def _mask_row_ptrs(Mask, b, h, rows, stride_mb, stride_mh, stride_mm, MASK_KIND: tl.constexpr):
    """Mask pointers of a query block's rows (batch b, query head h); a key block adds ``cols * stride_mn``.
    A row-broadcast mask (MASK_KIND 3/4) gets a (1, 1) base, so its key-block tiles are (1, BLOCK_N)."""
    if MASK_KIND >= 3:
        ptrs = Mask + b * stride_mb + h * stride_mh + tl.zeros([1, 1], dtype=tl.int32)
    else:
        ptrs = Mask + b * stride_mb + h * stride_mh + rows[:, None] * stride_mm
    return ptrs


@triton.jit
def _key_ranges(KvRange, b, start_m, k_len, IS_CAUSAL: tl.constexpr, HAS_KV_RANGE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key loop split of a query block [start_m, start_m + BLOCK_M) (forward and dQ kernels):
    [lo, split) full blocks without checks, [split, mid) the key tail (bounds check), and when causal
    [max(lo, start_m), hi) the diagonal band (causal compare). Returns (lo, split, mid, hi)."""
    lo = 0
    hi = k_len
    if HAS_KV_RANGE:  # key padding: only this batch's valid key range
        lo = (tl.load(KvRange + 3 * b) // BLOCK_N) * BLOCK_N
        hi = tl.minimum(hi, tl.load(KvRange + 3 * b + 1))
    full_end = (k_len // BLOCK_N) * BLOCK_N  # blocks before it need no key-bounds check
    if IS_CAUSAL:
        hi = tl.minimum(hi, start_m + BLOCK_M)  # blocks above the diagonal are never visited
        mid = tl.minimum(hi, start_m)  # off-diagonal blocks (every key j < start_m <= i): no causal compare
    else:
        mid = hi
    split = tl.maximum(lo, tl.minimum(mid, full_end))
    return lo, split, mid, hi


@triton.jit
def _lse_log2(lse):
    """The saved lse (natural log) in log2 units; fully masked rows saved -inf: +inf instead, so that
    P = exp2(S - lse) = 0 there."""
    return tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------
@triton.jit
def _fwd_inner(acc, l_i, m_i, q, K, V, start_lo, end_hi, offs_m, m_ok, offs_d, offs_dv, k_len,
               stride_kn, stride_vn, stride_mn, mask_row_ptrs, qk_scale, seed, rng_row0, rng_sk, dropout_p,
               D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr,
               APPLY_CAUSAL: tl.constexpr, CHECK_N: tl.constexpr, EVEN_D: tl.constexpr,
               HAS_DROPOUT: tl.constexpr, PRECISION: tl.constexpr, IDX64: tl.constexpr, PTX_DROPOUT: tl.constexpr,
               KEEP_BUF: tl.constexpr, keep_head, keep_groups):
    """Online-softmax update over key blocks [start_lo, end_hi). CHECK_N only for the tail block. ``rng_row0``: the
    Philox row of the program's query 0, (b H + h) Sq; PTX_DROPOUT: the keep bits by ``_ptx_keep_bits`` (KEEP_BUF 1:
    also stored in ``keep_buffer``, for the backward)."""
    # Unlike the backward loops, the short CHECK_N loops stay pipelined here: unpipelining them saved
    # no registers in the sm_90 AOT check (128x128/8 warps causal even gained a spill store).
    rng_base = rng_row0 * ((rng_sk + 7) // 8)  # (``dropout_keep``'s counter of the program's query 0)
    for start_n in range(start_lo, end_hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        cols = _idx(offs_n, IDX64)
        # K^T tile (BLOCK_D, BLOCK_N) loaded directly transposed through its strides.
        kt_ptrs = K + cols[None, :] * stride_kn + offs_d[:, None]
        v_ptrs = V + cols[:, None] * stride_vn + offs_dv[None, :]
        if CHECK_N or not EVEN_D:
            kt = tl.load(kt_ptrs, mask=(offs_n[None, :] < k_len) & (offs_d[:, None] < D), other=0.0)
            v = tl.load(v_ptrs, mask=(offs_n[:, None] < k_len) & (offs_dv[None, :] < DV), other=0.0)
        else:
            kt = tl.load(kt_ptrs)
            v = tl.load(v_ptrs)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        s = _apply_masks(s, offs_m[:, None], offs_n[None, :], k_len, mask_row_ptrs + cols[None, :] * stride_mn,
                         m_ok[:, None], MASK_KIND, APPLY_CAUSAL, CHECK_N)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row fully masked so far has m = -inf: subtract 0 instead (never -inf - -inf = NaN).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)  # the denominator counts dropped entries too
        if HAS_DROPOUT:
            if PTX_DROPOUT:
                p = tl.inline_asm_elementwise(
                    _APPLY_KEEP_PTX, _APPLY_KEEP_CONSTRAINTS,
                    [p, _ptx_keep_bits(seed, rng_row0.to(tl.int32), offs_m, offs_n, rng_sk, dropout_p, True, KEEP_BUF,
                                       keep_head, keep_groups)],
                    dtype=tl.float32, is_pure=True, pack=8)
            else:
                p = tl.where(_dropout_keep(seed, rng_base, offs_m, offs_n, rng_sk, dropout_p), p, 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@_tuning.autotune(configs=_configs("fwd", "fwd_short", "fp32_fwd"), key=_KEYS,
                 prune_configs_by={"early_config_prune": _pruner("fwd")})
@triton.jit
def _attention_fwd_kernel(
    Q, K, V, O, LSE, Mask, KvRange, CuQ, CuK,  # tensors (Mask/KvRange/Cu* are dummies when unused)
    stride_qb, stride_qh, stride_qm,  # query strides (batch, head, row); last dim has stride 1
    stride_kb, stride_kh, stride_kn,  # key strides
    stride_vb, stride_vh, stride_vn,  # value strides
    stride_ob, stride_oh, stride_om,  # output strides
    stride_lb, stride_lh,  # lse strides (batch, head); rows are contiguous
    stride_mb, stride_mh, stride_mm, stride_mn,  # mask strides (0 where broadcast)
    H, GROUP, Sq, Sk,  # query heads, query heads per kv head, (max) sequence lengths
    qk_scale, dropout_p, Seed, seq_bucket,  # scale*log2(e); dropout prob; Philox seed; autotune key
    KeepBuf, keep_stride, keep_groups,  # keep_buffer (KEEP_BUF 1: the keep bits stored there for the backward)
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_KV_RANGE: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr, IDX64: tl.constexpr,
    PTX_DROPOUT: tl.constexpr, KEEP_BUF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    seed = load_seed(Seed, HAS_DROPOUT)  # (the seed lives in device memory: graph-safe)
    pid_m = tl.program_id(0)
    # Grid (blocks, heads, batch): heads and batch in y/z (<= 65535 each), so B*H may exceed 65535.
    h = tl.program_id(1).to(tl.int64)  # int64 before any stride multiplication
    b = tl.program_id(2).to(tl.int64)
    hk = h // GROUP
    q_start, q_len, k_start, k_len = _seq_bounds(CuQ, CuK, b, Sq, Sk, IS_VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= q_len:  # varlen: this block lies past its sequence
        return
    offs_m, offs_d, offs_dv, m_ok, rows = _block_offsets(start_m, q_len, BLOCK_M, BLOCK_D, BLOCK_DV, IDX64)

    Q += b * stride_qb + h * stride_qh + q_start * stride_qm
    K += b * stride_kb + hk * stride_kh + k_start * stride_kn
    V += b * stride_vb + hk * stride_vh + k_start * stride_vn
    O += b * stride_ob + h * stride_oh + q_start * stride_om
    LSE += b * stride_lb + h * stride_lh + q_start
    mask_row_ptrs = _mask_row_ptrs(Mask, b, h, rows, stride_mb, stride_mh, stride_mm, MASK_KIND)

    q = _load_tile(Q, rows, m_ok, offs_d, stride_qm, D)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    lo, split, mid, hi = _key_ranges(KvRange, b, start_m, k_len, IS_CAUSAL, HAS_KV_RANGE, BLOCK_M, BLOCK_N)
    rng_row0 = (b * H + h) * Sq
    keep_head = _keep_head(KeepBuf, b * H + h, keep_stride, KEEP_BUF, BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, lo, split, offs_m, m_ok, offs_d, offs_dv, k_len,
                               stride_kn, stride_vn, stride_mn, mask_row_ptrs, qk_scale, seed, rng_row0, Sk,
                               dropout_p, D, DV, BLOCK_N, MASK_KIND, False, False, EVEN_D, HAS_DROPOUT, PRECISION, IDX64,
                               PTX_DROPOUT, KEEP_BUF, keep_head, keep_groups)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, split, mid, offs_m, m_ok, offs_d, offs_dv, k_len,
                               stride_kn, stride_vn, stride_mn, mask_row_ptrs, qk_scale, seed, rng_row0, Sk,
                               dropout_p, D, DV, BLOCK_N, MASK_KIND, False, True, EVEN_D, HAS_DROPOUT, PRECISION, IDX64,
                               PTX_DROPOUT, KEEP_BUF, keep_head, keep_groups)
    if IS_CAUSAL:  # the diagonal band [start_m, start_m + BLOCK_M): causal compare
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, tl.maximum(lo, start_m), hi, offs_m, m_ok, offs_d,
                                   offs_dv, k_len, stride_kn, stride_vn, stride_mn, mask_row_ptrs, qk_scale, seed,
                                   rng_row0, Sk, dropout_p, D, DV, BLOCK_N, MASK_KIND, True, True, EVEN_D,
                                   HAS_DROPOUT, PRECISION, IDX64, PTX_DROPOUT, KEEP_BUF, keep_head, keep_groups)

    # Fully masked rows have l = 0: output 0 and lse = -inf (never 0/0).
    row_ok = l_i > 0.0
    l_safe = tl.where(row_ok, l_i, 1.0)
    inv_l = tl.where(row_ok, 1.0 / l_safe, 0.0)
    if HAS_DROPOUT:
        inv_l = inv_l / (1.0 - dropout_p)
    acc = acc * inv_l[:, None]
    lse = tl.where(row_ok, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(LSE + offs_m, lse, mask=m_ok)
    _store_tile(O, rows, m_ok, offs_dv, stride_om, DV, acc)


@triton.jit
def _varlen_zero_uncovered_kernel(X0, X1, Cu, B, T, max_len, ROW: tl.constexpr, TWO: tl.constexpr,
                                  N_SEARCH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr):
    """Zero the rows of packed (T, ROW) buffers that the varlen kernels do not write: rows past
    ``cu[B]`` and rows more than ``max_len`` into their sequence (a ``max_seqlen`` below a real length).
    Each row finds its sequence by a binary search in ``cu`` (N_SEARCH >= log2(B + 1) + 1 steps); blocks
    with no such row store nothing, so this costs a few microseconds where zero-filling the buffers
    costs a full write of them."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_t = rows < T
    lo = tl.zeros([BLOCK_R], dtype=tl.int32)   # invariant: cu[lo] <= row (cu[0] = 0)
    hi = tl.zeros([BLOCK_R], dtype=tl.int32) + B + 1
    for _ in tl.static_range(N_SEARCH):
        mid = (lo + hi) // 2
        go = (hi - lo > 1) & (tl.load(Cu + mid, mask=mid <= B, other=0) <= rows)
        lo = tl.where(go, mid, lo)
        hi = tl.where((hi - lo > 1) & ~go, mid, hi)
    start = tl.load(Cu + lo)
    uncovered = in_t & ((lo == B) | (rows - start >= max_len))
    if tl.sum(uncovered.to(tl.int32), 0) > 0:
        base = rows.to(tl.int64)[:, None] * ROW
        for e in tl.static_range(0, ROW, BLOCK_E):
            cols = e + tl.arange(0, BLOCK_E)
            m = uncovered[:, None] & (cols[None, :] < ROW)
            tl.store(X0 + base + cols[None, :], tl.zeros([BLOCK_R, BLOCK_E], X0.dtype.element_ty), mask=m)
            if TWO:
                tl.store(X1 + base + cols[None, :], tl.zeros([BLOCK_R, BLOCK_E], X1.dtype.element_ty), mask=m)


def _zero_uncovered(x0: torch.Tensor, x1: torch.Tensor | None, cu: torch.Tensor, max_len: int) -> None:
    """Zero the rows of the packed (T, H, D) buffers ``x0`` (and ``x1``, same shape) that no varlen
    program writes (see ``_varlen_zero_uncovered_kernel``)."""
    t = x0.shape[0]
    row = x0[0].numel() if t else 0
    if t == 0 or row == 0:
        return
    batch = cu.numel() - 1
    block_r = 16 if _tuning.interpret() else 128
    block_e = min(_tuning.next_pow2(row), 16 if _tuning.interpret() else 256)
    _launch.fast(_varlen_zero_uncovered_kernel)[(_tuning.cdiv(t, block_r),)](
        x0, x1 if x1 is not None else x0, cu, batch, t, int(max_len),
        ROW=row, TWO=x1 is not None, N_SEARCH=(batch + 1).bit_length() + 1, BLOCK_R=block_r, BLOCK_E=block_e)


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------
@triton.jit
def _attention_bwd_preprocess_kernel(
    O, DO, Delta, CuQ,
    stride_ob, stride_oh, stride_om, stride_dob, stride_doh, stride_dom, stride_lb, stride_lh,
    H, Sq, DV: tl.constexpr, BLOCK_DV: tl.constexpr, IS_VARLEN: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """delta[b, h, i] = sum_d dO[b, h, i, d] * O[b, h, i, d] in fp32."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    q_start, q_len, k_start, k_len = _seq_bounds(CuQ, CuQ, b, Sq, Sq, IS_VARLEN)
    if pid_m * BLOCK_M >= q_len:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < q_len
    mk = m_ok[:, None] & (offs_d[None, :] < DV)
    rows = (q_start + offs_m.to(tl.int64))[:, None]
    o = tl.load(O + b * stride_ob + h * stride_oh + rows * stride_om + offs_d[None, :], mask=mk, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows * stride_dom + offs_d[None, :], mask=mk, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + b * stride_lb + h * stride_lh + q_start + offs_m, delta, mask=m_ok)


@triton.jit
def _dkdv_inner(dk, dv, k, v, Q, DO, LSE, Delta, mask_col_ptrs, start_lo, end_hi, offs_n, offs_d, offs_dv,
                q_len, k_len, stride_qm, stride_dom, stride_mm, qk_scale, seed, rng_base, rng_sk, dropout_p,
                D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, MASK_KIND: tl.constexpr,
                APPLY_CAUSAL: tl.constexpr, CHECK_M: tl.constexpr, EVEN_D: tl.constexpr,
                HAS_DROPOUT: tl.constexpr, PRECISION: tl.constexpr, IDX64: tl.constexpr, PTX_DROPOUT: tl.constexpr,
                KEEP_BUF: tl.constexpr, keep_head, keep_groups):
    """Accumulate dK, dV of one key block over query blocks [start_lo, end_hi). Works on the
    transposed tile (BLOCK_N keys x BLOCK_M queries) so that dV += P^T dO and dK += dS^T Q need no
    register transposes. Key columns past k_len only touch their own (unstored) dK/dV rows. PTX_DROPOUT: the keep
    bits by ``_ptx_keep_bits`` (the tile in an MMA accumulator layout)."""
    row0 = 0
    if PTX_DROPOUT:
        row0 = (rng_base // ((rng_sk + 7) // 8)).to(tl.int32)  # ((b H + h) Sq: the launcher keeps it below 2^32)
    # The short loops are not software-pipelined: the causal diagonal band (APPLY_CAUSAL) runs 1-4
    # times and the row tail (CHECK_M) at most once; pipelining them buys nothing and costs registers
    # that the long loop needs (sm_90 AOT, D=128 causal 32x128/8 warps: 244 -> 241 registers).
    for start_m in tl.range(start_lo, end_hi, BLOCK_M, num_stages=1 if (APPLY_CAUSAL or CHECK_M) else None):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        rows = _idx(offs_m, IDX64)
        qt_ptrs = Q + rows[None, :] * stride_qm + offs_d[:, None]
        do_ptrs = DO + rows[:, None] * stride_dom + offs_dv[None, :]
        if CHECK_M or not EVEN_D:
            qt = tl.load(qt_ptrs, mask=(offs_m[None, :] < q_len) & (offs_d[:, None] < D), other=0.0)
            do = tl.load(do_ptrs, mask=(offs_m[:, None] < q_len) & (offs_dv[None, :] < DV), other=0.0)
        else:
            qt = tl.load(qt_ptrs)
            do = tl.load(do_ptrs)
        if CHECK_M:
            lse = tl.load(LSE + offs_m, mask=offs_m < q_len, other=float("inf"))
            delta = tl.load(Delta + offs_m, mask=offs_m < q_len, other=0.0)
        else:
            lse = tl.load(LSE + offs_m)
            delta = tl.load(Delta + offs_m)
        lse2 = _lse_log2(lse)
        st = tl.dot(k, qt, input_precision=PRECISION) * qk_scale  # (BLOCK_N, BLOCK_M)
        if MASK_KIND >= 3:
            mask_ptrs = mask_col_ptrs  # (BLOCK_N, 1): the mask does not depend on the query row
        else:
            mask_ptrs = mask_col_ptrs + rows[None, :] * stride_mm
        st = _apply_masks(st, offs_m[None, :], offs_n[:, None], k_len, mask_ptrs,
                          (offs_m < q_len)[None, :], MASK_KIND, APPLY_CAUSAL, False)
        pt = tl.math.exp2(st - lse2[None, :])
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # (BLOCK_N, BLOCK_M)
        if HAS_DROPOUT:
            inv_keep = 1.0 / (1.0 - dropout_p)
            if PTX_DROPOUT:
                keep = _ptx_keep_bits(seed, row0, offs_m, offs_n, rng_sk, dropout_p, False, KEEP_BUF, keep_head,
                                      keep_groups)
                pt_drop = tl.inline_asm_elementwise(_APPLY_KEEP_PTX, _APPLY_KEEP_CONSTRAINTS, [pt * inv_keep, keep],
                                                    dtype=tl.float32, is_pure=True, pack=8)
                dpt = tl.inline_asm_elementwise(_APPLY_KEEP_PTX, _APPLY_KEEP_CONSTRAINTS, [dpt * inv_keep, keep],
                                                dtype=tl.float32, is_pure=True, pack=8)
            else:
                keep = _dropout_keep(seed, rng_base, offs_m, offs_n, rng_sk, dropout_p, True)
                pt_drop = tl.where(keep, pt * inv_keep, 0.0)
                dpt = tl.where(keep, dpt * inv_keep, 0.0)
        else:
            pt_drop = pt
        dv += tl.dot(pt_drop.to(do.dtype), do, input_precision=PRECISION)
        dst = pt * (dpt - delta[None, :])
        dk += tl.dot(dst.to(qt.dtype), tl.trans(qt), input_precision=PRECISION)
    return dk, dv


@triton.jit
def _keep_head(KeepBuf, bh, keep_stride, KEEP_BUF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Head ``bh``'s part of ``keep_buffer`` (``keep_stride`` bytes a head) as an int64 address, 0 without KEEP_BUF.
    Its heads are padded to 128 rows and keys: no tile may reach past them."""
    head = 0
    if KEEP_BUF != 0:
        tl.static_assert(BLOCK_M <= 128 and BLOCK_N <= 128, "keep_buffer pads its heads to 128 rows and keys")
        head = (KeepBuf + bh * keep_stride).to(tl.int64)
    return head


@triton.jit
def _ptx_keep_bits(seed, row0, offs_m, offs_n, Sk, dropout_p, QUAD: tl.constexpr, KEEP_BUF: tl.constexpr = 0,
                   keep_head=0, keep_groups=0):
    """The keep bits of a tile in an MMA accumulator layout, Philox row ``row0`` + query: (keys ``offs_n``, queries
    ``offs_m``) by ``_keep_octet_ptx`` (the dK/dV kernel's S^T), or with QUAD (queries, keys) by its quad form (the
    forward's and the dQ kernel's S). An int8 tensor that carries them (a pack of 8 registers' bits in its first
    byte), read only by ``_APPLY_KEEP_PTX`` in the same layout. KEEP_BUF (``keep_buffer``; ``keep_head`` the head's
    buffer as an int64 address, ``keep_groups`` its groups a row): 1, the quad's draws also stored there (the dQ
    kernel, or the forward with ``attention_fwd``'s ``keep``); 2, the bits loaded from there instead of drawn (the
    dK/dV kernel's octets after the dQ kernel; both backward kernels after such a forward)."""
    rows = row0 + offs_m.to(tl.int32)
    keys = offs_n.to(tl.int32)
    if QUAD:
        zero = tl.zeros([offs_m.shape[0], offs_n.shape[0]], dtype=tl.int32)
        d_row = rows[:, None] + zero
        d_key = keys[None, :] + zero
    else:
        zero = tl.zeros([offs_n.shape[0], offs_m.shape[0]], dtype=tl.int32)
        d_row = rows[None, :] + zero
        d_key = keys[:, None] + zero
    d_seed = zero + seed.to(tl.int32)
    d_groups = zero + ((Sk + 7) // 8)
    d_thr = zero + (dropout_p * 65536.0).to(tl.int32)  # (p is a multiple of 2^-16)
    # (all pure, the store too: it writes the byte of its inputs' call at that call's address, whatever the layout, so
    # a copy more or less changes nothing, and its result is read. Marked impure, the compiler kept the copies of it
    # that layout propagation leaves dead: three draws a tile, two in blocked layouts, sm_90 probe)
    if KEEP_BUF != 0:
        tl.static_assert(QUAD or KEEP_BUF == 2, "the keep buffer: the quad stores or loads, the octet loads")
        bits = tl.inline_asm_elementwise(
            _KEEP_QUAD_STORE_PTX if KEEP_BUF == 1 else (_KEEP_QUAD_LOAD_PTX if QUAD else _KEEP_OCTET_LOAD_PTX),
            _KEEP_BUFFER_CONSTRAINTS,
            [d_row, d_key, d_seed, d_groups, d_thr, zero.to(tl.int64) + keep_head, zero + row0, zero + keep_groups],
            dtype=tl.int8, is_pure=True, pack=8)
    else:
        bits = tl.inline_asm_elementwise(_KEEP_QUAD_PTX if QUAD else _KEEP_OCTET_PTX, _KEEP_OCTET_CONSTRAINTS,
                                         [d_row, d_key, d_seed, d_groups, d_thr], dtype=tl.int8, is_pure=True, pack=8)
    return bits


@triton.jit
def _dkdv_rows(dk, dv, k, v, Qh, DOh, LSEh, Deltah, mask_col_ptrs, lo, hi, offs_n, offs_d, offs_dv, q_len, k_len,
               stride_qm, stride_dom, stride_mm, qk_scale, seed, rng_base, Sk, dropout_p,
               D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, MASK_KIND: tl.constexpr,
               EVEN_D: tl.constexpr, HAS_DROPOUT: tl.constexpr, PRECISION: tl.constexpr, IDX64: tl.constexpr,
               PTX_DROPOUT: tl.constexpr, KEEP_BUF: tl.constexpr, keep_head, keep_groups):
    """Query blocks [lo, hi) without causal compare: full blocks unchecked, then the row tail."""
    full_end = tl.maximum(lo, (q_len // BLOCK_M) * BLOCK_M)
    split = tl.minimum(hi, full_end)
    dk, dv = _dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, Deltah, mask_col_ptrs, lo, split, offs_n, offs_d, offs_dv,
                         q_len, k_len, stride_qm, stride_dom, stride_mm, qk_scale, seed, rng_base, Sk, dropout_p,
                         D, DV, BLOCK_M, MASK_KIND, False, False, EVEN_D, HAS_DROPOUT, PRECISION, IDX64, PTX_DROPOUT,
                         KEEP_BUF, keep_head, keep_groups)
    dk, dv = _dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, Deltah, mask_col_ptrs, split, hi, offs_n, offs_d, offs_dv,
                         q_len, k_len, stride_qm, stride_dom, stride_mm, qk_scale, seed, rng_base, Sk, dropout_p,
                         D, DV, BLOCK_M, MASK_KIND, False, True, EVEN_D, HAS_DROPOUT, PRECISION, IDX64, PTX_DROPOUT,
                         KEEP_BUF, keep_head, keep_groups)
    return dk, dv


@_tuning.autotune(configs=_configs("dkdv", "fp32_dkdv"), key=_KEYS, prune_configs_by={"early_config_prune": _pruner("dkdv")})
@triton.jit
def _attention_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV_, LSE, Delta, Mask, KvRange, CuQ, CuK,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,  # dO strides
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,  # dK, dV strides
    stride_lb, stride_lh,  # lse/delta strides (batch, head)
    stride_mb, stride_mh, stride_mm, stride_mn,
    H, HKV, GROUP, Sq, Sk, qk_scale, sm_scale, dropout_p, Seed, seq_bucket, KeepBuf, keep_stride, keep_groups,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_KV_RANGE: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr, IDX64: tl.constexpr,
    PTX_DROPOUT: tl.constexpr, KEEP_BUF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """KEEP_BUF (2): the keep bits loaded from ``keep_buffer`` (``KeepBuf``, a head's ``keep_stride`` bytes of
    ``keep_groups`` groups a row), where the dQ kernel, run before this one, stored them."""
    seed = load_seed(Seed, HAS_DROPOUT)  # (the seed lives in device memory: graph-safe)
    pid_n = tl.program_id(0)
    hk = tl.program_id(1).to(tl.int64)  # int64 before any stride multiplication
    b = tl.program_id(2).to(tl.int64)
    q_start, q_len, k_start, k_len = _seq_bounds(CuQ, CuK, b, Sq, Sk, IS_VARLEN)
    start_n = pid_n * BLOCK_N
    if start_n >= k_len:  # varlen: block past this sequence (its rows were zero-filled)
        return
    offs_n, offs_d, offs_dv, n_ok, cols = _block_offsets(start_n, k_len, BLOCK_N, BLOCK_D, BLOCK_DV, IDX64)
    K += b * stride_kb + hk * stride_kh + k_start * stride_kn
    V += b * stride_vb + hk * stride_vh + k_start * stride_vn
    DK += b * stride_dkb + hk * stride_dkh + k_start * stride_dkn
    DV_ += b * stride_dvb + hk * stride_dvh + k_start * stride_dvn

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    in_range = True
    if HAS_KV_RANGE:  # key padding: a block outside the batch's valid keys has zero gradient
        in_range = (start_n + BLOCK_N > tl.load(KvRange + 3 * b)) & (start_n < tl.load(KvRange + 3 * b + 1))
    if in_range:
        k = _load_tile(K, cols, n_ok, offs_d, stride_kn, D)
        v = _load_tile(V, cols, n_ok, offs_dv, stride_vn, DV)
        # GQA: sum the group's query heads here, in registers, without atomics.
        for g in range(0, GROUP):
            h = hk * GROUP + g
            Qh = Q + b * stride_qb + h * stride_qh + q_start * stride_qm
            DOh = DO + b * stride_dob + h * stride_doh + q_start * stride_dom
            LSEh = LSE + b * stride_lb + h * stride_lh + q_start
            Deltah = Delta + b * stride_lb + h * stride_lh + q_start
            mask_col_ptrs = Mask + b * stride_mb + h * stride_mh + cols[:, None] * stride_mn
            rng_base = ((b * H + h) * Sq) * ((Sk + 7) // 8)
            keep_head = _keep_head(KeepBuf, b * H + h, keep_stride, KEEP_BUF, BLOCK_M, BLOCK_N)
            if IS_CAUSAL:
                # Rows i < start_n never see this block; rows in [start_n, start_n + BLOCK_N) form the
                # diagonal band (BLOCK_N is a multiple of BLOCK_M); later rows see all of it.
                lo = tl.minimum(start_n, q_len)
                mid = tl.minimum(start_n + BLOCK_N, q_len)
                dk, dv = _dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, Deltah, mask_col_ptrs, lo, mid, offs_n, offs_d,
                                     offs_dv, q_len, k_len, stride_qm, stride_dom, stride_mm, qk_scale, seed,
                                     rng_base, Sk, dropout_p, D, DV, BLOCK_M, MASK_KIND, True, True, EVEN_D,
                                     HAS_DROPOUT, PRECISION, IDX64, PTX_DROPOUT, KEEP_BUF, keep_head,
                                     keep_groups)
                dk, dv = _dkdv_rows(dk, dv, k, v, Qh, DOh, LSEh, Deltah, mask_col_ptrs, mid, q_len, offs_n, offs_d,
                                    offs_dv, q_len, k_len, stride_qm, stride_dom, stride_mm, qk_scale, seed,
                                    rng_base, Sk, dropout_p, D, DV, BLOCK_M, MASK_KIND, EVEN_D, HAS_DROPOUT,
                                    PRECISION, IDX64, PTX_DROPOUT, KEEP_BUF, keep_head, keep_groups)
            else:
                dk, dv = _dkdv_rows(dk, dv, k, v, Qh, DOh, LSEh, Deltah, mask_col_ptrs, 0, q_len, offs_n, offs_d,
                                    offs_dv, q_len, k_len, stride_qm, stride_dom, stride_mm, qk_scale, seed,
                                    rng_base, Sk, dropout_p, D, DV, BLOCK_M, MASK_KIND, EVEN_D, HAS_DROPOUT,
                                    PRECISION, IDX64, PTX_DROPOUT, KEEP_BUF, keep_head, keep_groups)
    _store_tile(DK, cols, n_ok, offs_d, stride_dkn, D, dk * sm_scale)
    _store_tile(DV_, cols, n_ok, offs_dv, stride_dvn, DV, dv)


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, K, V, mask_row_ptrs, start_lo, end_hi, offs_m, m_ok, offs_d, offs_dv, k_len,
              stride_kn, stride_vn, stride_mn, qk_scale, seed, rng_row0, rng_sk, dropout_p,
              D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, MASK_KIND: tl.constexpr,
              APPLY_CAUSAL: tl.constexpr, CHECK_N: tl.constexpr, EVEN_D: tl.constexpr,
              HAS_DROPOUT: tl.constexpr, PRECISION: tl.constexpr, IDX64: tl.constexpr, PTX_DROPOUT: tl.constexpr,
              KEEP_BUF: tl.constexpr, keep_head, keep_groups, dq_b, q_b, do_b, offs_d_b, D_A: tl.constexpr):
    """dQ += dS K over key blocks [start_lo, end_hi). CHECK_N loops (key tail, causal band) are short:
    not pipelined (sm_90 AOT, D=128 causal 128x64/8 warps: 236 -> 215 registers). ``rng_row0``: the Philox row of
    the program's query 0, (b H + h) Sq. PTX_DROPOUT: the keep bits by ``_ptx_keep_bits`` (the tile in an MMA
    accumulator layout). D_A > 0 (``DQ_SPLIT_D``; D = Dv, not a power of two): the head dim as two column blocks of
    powers of two, [0, D_A) in ``q`` / ``do`` / ``dq`` (``offs_d``) and the rest in ``q_b`` / ``do_b`` / ``dq_b``
    (``offs_d_b``), so that no product runs over the padded columns; else ``dq_b`` is returned as it came.
    Returns (dq, dq_b)."""
    rng_base = rng_row0 * ((rng_sk + 7) // 8)  # (``dropout_keep``'s counter of the program's query 0)
    for start_n in tl.range(start_lo, end_hi, BLOCK_N, num_stages=1 if CHECK_N else None):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        cols = _idx(offs_n, IDX64)
        kt_ptrs = K + cols[None, :] * stride_kn + offs_d[:, None]
        vt_ptrs = V + cols[None, :] * stride_vn + offs_dv[:, None]
        if D_A > 0:  # (both blocks lie within D: only the key tail is masked)
            ktb_ptrs = K + cols[None, :] * stride_kn + offs_d_b[:, None]
            vtb_ptrs = V + cols[None, :] * stride_vn + offs_d_b[:, None]
            if CHECK_N:
                kt = tl.load(kt_ptrs, mask=offs_n[None, :] < k_len, other=0.0)
                vt = tl.load(vt_ptrs, mask=offs_n[None, :] < k_len, other=0.0)
                kt_b = tl.load(ktb_ptrs, mask=offs_n[None, :] < k_len, other=0.0)
                vt_b = tl.load(vtb_ptrs, mask=offs_n[None, :] < k_len, other=0.0)
            else:
                kt = tl.load(kt_ptrs)
                vt = tl.load(vt_ptrs)
                kt_b = tl.load(ktb_ptrs)
                vt_b = tl.load(vtb_ptrs)
            s = tl.dot(q_b, kt_b, tl.dot(q, kt, input_precision=PRECISION), input_precision=PRECISION) * qk_scale
        else:
            if CHECK_N or not EVEN_D:
                kt = tl.load(kt_ptrs, mask=(offs_n[None, :] < k_len) & (offs_d[:, None] < D), other=0.0)
                vt = tl.load(vt_ptrs, mask=(offs_n[None, :] < k_len) & (offs_dv[:, None] < DV), other=0.0)
            else:
                kt = tl.load(kt_ptrs)
                vt = tl.load(vt_ptrs)
            s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        s = _apply_masks(s, offs_m[:, None], offs_n[None, :], k_len, mask_row_ptrs + cols[None, :] * stride_mn,
                         m_ok[:, None], MASK_KIND, APPLY_CAUSAL, CHECK_N)
        p = tl.math.exp2(s - lse2[:, None])
        if D_A > 0:
            dp = tl.dot(do_b, vt_b, tl.dot(do, vt, input_precision=PRECISION), input_precision=PRECISION)
        else:
            dp = tl.dot(do, vt, input_precision=PRECISION)
        if HAS_DROPOUT:
            if PTX_DROPOUT:
                keep = _ptx_keep_bits(seed, rng_row0.to(tl.int32), offs_m, offs_n, rng_sk, dropout_p, True, KEEP_BUF,
                                      keep_head, keep_groups)
                dp = tl.inline_asm_elementwise(_APPLY_KEEP_PTX, _APPLY_KEEP_CONSTRAINTS,
                                               [dp * (1.0 / (1.0 - dropout_p)), keep], dtype=tl.float32, is_pure=True,
                                               pack=8)
            else:
                keep = _dropout_keep(seed, rng_base, offs_m, offs_n, rng_sk, dropout_p)
                dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=PRECISION)
        if D_A > 0:
            dq_b += tl.dot(ds.to(kt.dtype), tl.trans(kt_b), input_precision=PRECISION)
    return dq, dq_b


@_tuning.autotune(configs=_configs("dq", "fp32_dq"), key=_KEYS, prune_configs_by={"early_config_prune": _pruner("dq")})
@triton.jit
def _attention_bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, Delta, O, Mask, KvRange, CuQ, CuK,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom, stride_dqb, stride_dqh, stride_dqm, stride_ob, stride_oh, stride_om,
    stride_lb, stride_lh, stride_mb, stride_mh, stride_mm, stride_mn,
    H, GROUP, Sq, Sk, qk_scale, sm_scale, dropout_p, Seed, seq_bucket, KeepBuf, keep_stride, keep_groups,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_KV_RANGE: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr, IDX64: tl.constexpr,
    COMPUTE_DELTA: tl.constexpr, PTX_DROPOUT: tl.constexpr, KEEP_BUF: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, D_A: tl.constexpr = 0,
):
    """COMPUTE_DELTA: delta = rowsum(dO * O) of the program's rows is formed here (dO is loaded anyway, O
    once) and stored to ``Delta`` for the dK/dV kernel, which then runs after this one (no preprocess).
    KEEP_BUF (1): the keep bits also stored in ``keep_buffer`` (``KeepBuf``, a head's ``keep_stride`` bytes of
    ``keep_groups`` groups a row), for the dK/dV kernel. D_A > 0 (``DQ_SPLIT_D``, D = Dv): the head dim as the
    column blocks [0, D_A) and [D_A, D) (``_dq_inner``)."""
    seed = load_seed(Seed, HAS_DROPOUT)  # (the seed lives in device memory: graph-safe)
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)  # int64 before any stride multiplication
    b = tl.program_id(2).to(tl.int64)
    hk = h // GROUP
    q_start, q_len, k_start, k_len = _seq_bounds(CuQ, CuK, b, Sq, Sk, IS_VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= q_len:
        return
    offs_m, offs_d, offs_dv, m_ok, rows = _block_offsets(start_m, q_len, BLOCK_M, BLOCK_D, BLOCK_DV, IDX64)
    Q += b * stride_qb + h * stride_qh + q_start * stride_qm
    DO += b * stride_dob + h * stride_doh + q_start * stride_dom
    DQ += b * stride_dqb + h * stride_dqh + q_start * stride_dqm
    K += b * stride_kb + hk * stride_kh + k_start * stride_kn
    V += b * stride_vb + hk * stride_vh + k_start * stride_vn
    LSE += b * stride_lb + h * stride_lh + q_start
    Delta += b * stride_lb + h * stride_lh + q_start
    mask_row_ptrs = _mask_row_ptrs(Mask, b, h, rows, stride_mb, stride_mh, stride_mm, MASK_KIND)

    if D_A > 0:  # (D = Dv: the column blocks [0, D_A) and [D_A, D), each a power of two)
        offs_d = tl.arange(0, D_A)
        offs_dv = offs_d
        offs_d_b = D_A + tl.arange(0, D - D_A)
        q = _load_tile(Q, rows, m_ok, offs_d, stride_qm, D)
        q_b = _load_tile(Q, rows, m_ok, offs_d_b, stride_qm, D)
        do = _load_tile(DO, rows, m_ok, offs_d, stride_dom, DV)
        do_b = _load_tile(DO, rows, m_ok, offs_d_b, stride_dom, DV)
    else:
        offs_d_b = offs_d
        q = _load_tile(Q, rows, m_ok, offs_d, stride_qm, D)
        q_b = q
        do = _load_tile(DO, rows, m_ok, offs_dv, stride_dom, DV)
        do_b = do
    lse = tl.load(LSE + offs_m, mask=m_ok, other=float("inf"))
    if COMPUTE_DELTA:
        o_rows = O + b * stride_ob + h * stride_oh + q_start * stride_om
        if D_A > 0:
            delta = tl.sum(_load_tile(o_rows, rows, m_ok, offs_d, stride_om, DV).to(tl.float32) * do.to(tl.float32), 1)
            delta += tl.sum(_load_tile(o_rows, rows, m_ok, offs_d_b, stride_om, DV).to(tl.float32)
                            * do_b.to(tl.float32), 1)
        else:
            o = _load_tile(o_rows, rows, m_ok, offs_dv, stride_om, DV)
            delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(Delta + offs_m, delta, mask=m_ok)
    else:
        delta = tl.load(Delta + offs_m, mask=m_ok, other=0.0)
    lse2 = _lse_log2(lse)
    if D_A > 0:
        dq = tl.zeros([BLOCK_M, D_A], dtype=tl.float32)
        dq_b = tl.zeros([BLOCK_M, D - D_A], dtype=tl.float32)
    else:
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        dq_b = dq

    lo, split, mid, hi = _key_ranges(KvRange, b, start_m, k_len, IS_CAUSAL, HAS_KV_RANGE, BLOCK_M, BLOCK_N)
    rng_row0 = (b * H + h) * Sq
    keep_head = _keep_head(KeepBuf, b * H + h, keep_stride, KEEP_BUF, BLOCK_M, BLOCK_N)
    dq, dq_b = _dq_inner(dq, q, do, lse2, delta, K, V, mask_row_ptrs, lo, split, offs_m, m_ok, offs_d, offs_dv,
                         k_len, stride_kn, stride_vn, stride_mn, qk_scale, seed, rng_row0, Sk, dropout_p,
                         D, DV, BLOCK_N, MASK_KIND, False, False, EVEN_D, HAS_DROPOUT, PRECISION, IDX64, PTX_DROPOUT,
                         KEEP_BUF, keep_head, keep_groups, dq_b, q_b, do_b, offs_d_b, D_A)
    dq, dq_b = _dq_inner(dq, q, do, lse2, delta, K, V, mask_row_ptrs, split, mid, offs_m, m_ok, offs_d, offs_dv,
                         k_len, stride_kn, stride_vn, stride_mn, qk_scale, seed, rng_row0, Sk, dropout_p,
                         D, DV, BLOCK_N, MASK_KIND, False, True, EVEN_D, HAS_DROPOUT, PRECISION, IDX64, PTX_DROPOUT,
                         KEEP_BUF, keep_head, keep_groups, dq_b, q_b, do_b, offs_d_b, D_A)
    if IS_CAUSAL:
        dq, dq_b = _dq_inner(dq, q, do, lse2, delta, K, V, mask_row_ptrs, tl.maximum(lo, start_m), hi, offs_m, m_ok,
                             offs_d, offs_dv, k_len, stride_kn, stride_vn, stride_mn, qk_scale, seed, rng_row0, Sk,
                             dropout_p, D, DV, BLOCK_N, MASK_KIND, True, True, EVEN_D, HAS_DROPOUT, PRECISION, IDX64,
                             PTX_DROPOUT, KEEP_BUF, keep_head, keep_groups, dq_b, q_b, do_b, offs_d_b, D_A)
    _store_tile(DQ, rows, m_ok, offs_d, stride_dqm, D, dq * sm_scale)
    if D_A > 0:
        _store_tile(DQ, rows, m_ok, offs_d_b, stride_dqm, D, dq_b * sm_scale)


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------
def _pow2_dim(d: int) -> int:
    return max(16, _tuning.next_pow2(d))


def _seq_bucket(sq: int, sk: int) -> int:
    """Coarse autotune key for the sequence length (short / medium / long), so varying varlen
    max_seqlen or padded lengths do not retune every call."""
    s = max(sq, sk)
    return 128 if s <= 128 else (2048 if s <= 2048 else 16384)


def _mask_args(mask: torch.Tensor | None, dummy: torch.Tensor):
    """(tensor, MASK_KIND, 4 strides) for a mask already broadcast (as a view) to (B, H, Sq, Sk)."""
    if mask is None:
        return dummy, 0, (0, 0, 0, 0)
    row_bcast = 2 if (mask.shape[2] == 1 or mask.stride(2) == 0) else 0
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8), 1 + row_bcast, tuple(mask.stride())
    return mask, 2 + row_bcast, tuple(mask.stride())


def _needs_idx64(sq: int, sk: int, row_strides, mask_strides) -> bool:
    """Whether in-slice row/column offsets can reach 2**31 (then the kernels use int64 for them)."""
    rows = max(sq, sk) + 256  # blocks overhang the sequence by less than this
    big = rows * max([abs(int(x)) for x in row_strides] + [1])
    big = max(big, rows * (abs(int(mask_strides[2])) + abs(int(mask_strides[3]))))
    return big >= 2**31 - 1


@triton.jit
def _key_padding_range_kernel(Mask, Out, Sk, stride_mb, stride_mn, IS_BOOL: tl.constexpr, BLOCK: tl.constexpr):
    """One batch's key-padding row: the first valid key lo, one past the last hi (Sk and 0 when none) and
    whether every key in [lo, hi) is valid, into Out[b] (int32 (B, 3))."""
    b = tl.program_id(0).to(tl.int64)
    lo = Sk
    hi = Sk * 0
    cnt = Sk * 0
    for start in range(0, Sk, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inb = offs < Sk
        x = tl.load(Mask + b * stride_mb + offs.to(tl.int64) * stride_mn, mask=inb, other=0)
        if IS_BOOL:
            valid = (x != 0) & inb
        else:
            valid = (x != float("-inf")) & inb
        lo = tl.minimum(lo, tl.min(tl.where(valid, offs, Sk)))
        hi = tl.maximum(hi, tl.max(tl.where(valid, offs + 1, 0)))
        cnt += tl.sum(valid.to(tl.int32))
    tl.store(Out + 3 * b, lo)
    tl.store(Out + 3 * b + 1, hi)
    tl.store(Out + 3 * b + 2, (cnt == hi - lo).to(tl.int32))


def key_padding_range(row: torch.Tensor) -> torch.Tensor:
    """``pykernels.attention._key_padding_range`` for a (B, Sk) key-padding row (bool, or additive float:
    -inf = masked) on the GPU, in one launch."""
    batch, sk = row.shape
    out = empty(batch, 3, dtype=torch.int32, device=row.device)
    is_bool = row.dtype == torch.bool
    _launch.fast(_key_padding_range_kernel)[(batch,)](
        row.view(torch.uint8) if is_bool else row, out, sk, row.stride(0), row.stride(1),
        IS_BOOL=is_bool, BLOCK=min(2048, triton.next_power_of_2(max(sk, 16))))
    return out


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def sm90_forward(q, k, v, mask, *, dropout_p: float, scale: float, kv_range=None, causal: bool = False) -> bool:
    """Whether the dense forward runs the Gluon warp-specialised kernel of ``attention_sm90`` (Hopper;
    D = 80, 96, 128, 192 or 256, or D = 64 with long keys: ``attention_sm90.preferred``) instead of
    ``_attention_fwd_kernel``.
    Cheap checks first, so CPU tensors and masked (but key padding), dropout or other head-dim calls never
    import the Gluon module; ``unsupported`` checks the device (sm_90) and the rest, the mask's kind too."""
    if q.device.type != "cuda" or q.shape[-1] not in (64, 80, 96, 128, 192, 256) or dropout_p > 0 \
            or (mask is not None and kv_range is None):
        return False
    from . import attention_sm90
    return attention_sm90.preferred(q, k, causal) and attention_sm90.unsupported(
        q, k, v, mask, dropout_p=dropout_p, scale=scale, varlen=False, kv_range=kv_range, causal=causal) is None


def sm90_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                        dropout_p: float, scale: float, causal: bool) -> bool:
    """Whether the varlen forward runs the Gluon kernel (``attention_sm90.attention_fwd_sm90_varlen``; Hopper,
    causal or not, no dropout, every packed tensor through one host descriptor) instead of the Triton kernel: the
    speed rule is the head dim (``attention_sm90.VARLEN_HEAD_DIMS``: D = 128; the kernel covers D = 64 too,
    where the Triton kernel is faster), and the queries and keys must share one cu_seqlens (the same tensor or
    memory, and one max length: self-attention over packed sequences, what the GPU tests cover); otherwise the
    Triton kernel runs. ``PYKERNELS_ATTN_SM90=0`` turns it off with the dense path."""
    same = cu_seqlens_q is cu_seqlens_k or (cu_seqlens_q.data_ptr() == cu_seqlens_k.data_ptr()
                                             and cu_seqlens_q.shape == cu_seqlens_k.shape)
    if q.device.type != "cuda" or q.shape[-1] not in (64, 128) or dropout_p > 0 or q.shape[0] == 0 \
            or not same or max_seqlen_q != max_seqlen_k:
        return False
    from . import attention_sm90
    if not attention_sm90.enabled() or q.shape[-1] not in attention_sm90.VARLEN_HEAD_DIMS:
        return False
    return attention_sm90.varlen_unsupported(q, k, v, dropout_p=dropout_p, scale=scale, causal=causal) is None


def sm90_backward(q, k, v, do, mask, *, dropout_p: float, scale: float, kv_range=None, causal: bool = False,
                  deterministic: bool = False) -> str:
    """Which Gluon backward kernels of ``attention_sm90_bwd`` ("dkdv", "dq", both, "fused" or "") the dense
    backward takes instead of the Triton ones: the forward's cover (``attention_sm90.unsupported``), a
    TMA-aligned ``do`` and the speed rule ``attention_sm90_bwd.kernels`` (never "fused" when
    ``deterministic``). Each kernel may still decline a layout (then
    its Triton kernel runs). With dropout only the dK/dV kernel (fused with dQ or not) draws the mask
    (``attention_sm90_bwd.DROPOUT_KERNELS``): "dkdv,dq" becomes "dkdv" (Triton's dQ kernel beside it), "dq" "". At
    D = 256 (and D = 192 on its zero-filled tiles) only the D = 256 dK/dV kernel exists ("dkdv", beside
    Triton's dQ kernel; no dropout). At D = 80 and 96 (on the D = 128 tiles: ``attention_sm90.TILE_D``)
    the dK/dV kernel, fused with dQ or beside Triton's dQ kernel (the Gluon dQ kernel reads O by pointer at its
    tile's width), without dropout."""
    d = q.shape[-1]
    if q.device.type != "cuda" or d not in (64, 80, 96, 128, 192, 256) or mask is not None or kv_range is not None:
        return ""
    from . import attention_sm90, attention_sm90_bwd
    if dropout_p > 0 and (not attention_sm90_bwd.DROPOUT_KERNELS or d not in (64, 128)):
        return ""
    which = attention_sm90_bwd.kernels(q, k, causal, attention_sm90._num_sms(q.device), deterministic)
    if d > 128 or (d in (80, 96) and which != "fused"):  # only the D = 256 dK/dV kernel (``attention_sm90_bwd.
        which = "dkdv" if "dkdv" in which.split(",") else ""  # DKDV_D256_CONFIGS``); at 80 / 96 no Gluon dQ
    if dropout_p > 0:
        which = "fused" if which == "fused" else "dkdv" if "dkdv" in which.split(",") else ""
    # (the kernels' cover apart from dropout, which the dK/dV kernel draws itself)
    if not which or not attention_sm90.enabled() or do.dtype != q.dtype or not attention_sm90._tma_ok(do) \
            or attention_sm90.unsupported(q, k, v, mask, dropout_p=0.0, scale=scale, varlen=False) is not None:
        return ""
    return which


_PLACEHOLDERS: dict = {}


def _placeholder(device) -> torch.Tensor:
    """An int32 (2,) tensor the kernels take for pointer arguments they never read (mask, cu_seqlens, key
    range), one per device (an allocation per call costs host time). The cached one is allocated on a
    helper thread: torch.compile's CUDA-graph trees route every allocation of the calling thread to the
    graph's pool while they warm a graph up (not capturing yet), and a tensor kept from there is a live
    allocation in the pool that they refuse ("not tracked as outputs"; a first pykernels call under
    mode="reduce-overhead" hit it, GPU run97; with this fix the graph tests pass in a fresh process, run98).
    During a capture itself (where another thread may not allocate) the call gets a fresh one from the
    graph's pool, not cached; if the helper's allocation fails, this call allocates its own, uncached (the
    behaviour before the cache)."""
    t = _PLACEHOLDERS.get(device)
    if t is None:
        if _tuning.capturing(device):
            return torch.empty(2, dtype=torch.int32, device=device)
        made = []

        def alloc():
            try:
                made.append(torch.empty(2, dtype=torch.int32, device=device))
            except Exception:  # noqa: BLE001 - then this call's own tensor, uncached, as before the cache
                pass
        helper = threading.Thread(target=alloc)
        helper.start()
        helper.join()
        if not made:
            return torch.empty(2, dtype=torch.int32, device=device)
        t = _PLACEHOLDERS[device] = made[0]
    return t


def attention_fwd(q, k, v, mask, *, causal: bool, scale: float, dropout_p: float, seed,
                  kv_range: torch.Tensor | None = None, cu_seqlens_q=None, cu_seqlens_k=None,
                  max_seqlen_q: int = 0, max_seqlen_k: int = 0, keep=None):
    """Dense: q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv), mask None or a (B, Hq, Sq, Sk)
    view (bool or float). Varlen (cu_seqlens given): q (Tq, Hq, D), k/v (Tk, Hkv, D/Dv), no mask.
    Returns o (like q with Dv) and lse (fp32: (B, Hq, Sq) dense, (Hq, Tq) varlen). ``keep``: a ``keep_buffer`` of
    the shape, in which the forward stores its dropout keep bits for ``attention_bwd``'s ``keep`` (where it draws
    them by PTX, else a ValueError; not the sm_90 forward, which has no dropout)."""
    varlen = cu_seqlens_q is not None
    if varlen:
        tq, hq, d = q.shape
        hkv, dv = k.shape[1], v.shape[-1]
        batch, sq, sk = cu_seqlens_q.numel() - 1, max_seqlen_q, max_seqlen_k
        if sm90_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, sq, sk, dropout_p=dropout_p, scale=scale,
                               causal=causal):
            from . import attention_sm90
            o, lse = attention_sm90.attention_fwd_sm90_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, sq, sk,
                                                              scale=scale, causal=causal)
            _zero_uncovered(o, None, cu_seqlens_q, sq)
            return o, lse
        # rows no program writes (past cu_seqlens[-1], or past max_seqlen_q into a sequence) are zeroed by
        # _zero_uncovered below, not by a full fill; lse is small and keeps -inf there
        o = empty(tq, hq, dv, dtype=q.dtype, device=q.device)
        lse = torch.full((hq, tq), float("-inf"), dtype=torch.float32, device=q.device)
        qs = (0, q.stride(1), q.stride(0))
        ks = (0, k.stride(1), k.stride(0))
        vs = (0, v.stride(1), v.stride(0))
        os_ = (0, o.stride(1), o.stride(0))
        ls = (0, lse.stride(0))
    else:
        if sm90_forward(q, k, v, mask, dropout_p=dropout_p, scale=scale, kv_range=kv_range, causal=causal):
            from . import attention_sm90
            return attention_sm90.attention_fwd_sm90(q, k, v, causal=causal, scale=scale, mask=mask,
                                                     kv_range=kv_range)
        batch, hq, sq, d = q.shape
        hkv, sk, dv = k.shape[1], k.shape[2], v.shape[-1]
        # laid out like q when it can be (transformers' transposed views: reshaping o back is free)
        o = empty_like_layout(q) if dv == d else empty(batch, hq, sq, dv, dtype=q.dtype, device=q.device)
        lse = empty(batch, hq, sq, dtype=torch.float32, device=q.device)
        qs, ks, vs, os_ = q.stride()[:3], k.stride()[:3], v.stride()[:3], o.stride()[:3]
        ls = lse.stride()[:2]
    if o.numel() == 0 or batch == 0 or sq == 0:
        return o.zero_(), lse.fill_(float("-inf"))  # (varlen: no row is covered by any program)
    dummy = _placeholder(q.device)
    mask_t, mask_kind, ms = _mask_args(mask, dummy)
    idx64 = _needs_idx64(sq, sk, (qs[2], ks[2], vs[2], os_[2]), ms)
    ptx_dropout = _ptx_dropout(q, v, batch * hq * sq, dropout_p, seed)
    if keep is not None and not ptx_dropout:
        raise ValueError("keep: the forward stores keep bits only where it draws them by PTX (_ptx_dropout)")
    grid = lambda meta: (_tuning.cdiv(sq, meta["BLOCK_M"]), hq, batch)  # noqa: E731
    _launch.fast(_attention_fwd_kernel)[grid](
        q, k, v, o, lse, mask_t, kv_range if kv_range is not None else dummy,
        cu_seqlens_q if varlen else dummy, cu_seqlens_k if varlen else dummy,
        *qs, *ks, *vs, *os_, *ls, *ms,
        hq, hq // hkv, sq, sk,
        scale * LOG2E, _dropout_rate(dropout_p), seed_arg(seed, q.device, dropout_p > 0), _seq_bucket(sq, sk),
        *(keep if keep is not None else (dummy, 0, 0)),
        D=d, DV=dv, BLOCK_D=_pow2_dim(d), BLOCK_DV=_pow2_dim(dv), EVEN_D=_pow2_dim(d) == d and _pow2_dim(dv) == dv,
        IS_CAUSAL=bool(causal), MASK_KIND=mask_kind, HAS_KV_RANGE=kv_range is not None,
        HAS_DROPOUT=dropout_p > 0, IS_VARLEN=varlen, PRECISION=_precision(q.dtype), IDX64=idx64,
        PTX_DROPOUT=ptx_dropout, KEEP_BUF=1 if keep is not None else 0,
    )
    if varlen:
        _zero_uncovered(o, None, cu_seqlens_q, sq)
    return o, lse


def _ptx_dropout(q, v, rows: int, dropout_p: float, seed) -> bool:
    """Whether the kernels draw their keep bits by PTX (``PTX_DROPOUT``): dropout, fp16 / bf16 on a CUDA device of
    compute capability 8.0 or later (an MMA tile), head dims up to 128 (the dropout configs' tiles, every warp 16 rows
    x 16 or more columns; D = 256's smaller tiles are not assumed to be), not the interpreter, and the draws' 32-bit
    registers enough: fewer than 2^32 Philox rows (``rows``, B H Sq) and a seed below 2^31 (the ops draw them so; an
    int seed outside that takes ``dropout_keep``)."""
    return (dropout_p > 0 and PTX_DROPOUT and not _tuning.interpret() and q.is_cuda
            and q.dtype in (torch.float16, torch.bfloat16) and max(q.shape[-1], v.shape[-1]) <= 128
            and rows < 2**32 and not (isinstance(seed, int) and not 0 <= seed < 2**31)
            and _tuning.device_properties(q.device).major >= 8)  # (mma.sync m16n8k16 / wgmma accumulators)


# The Triton backward's keep buffer: its dQ kernel (run first) stores each Philox call's 8 keep bits, its dK/dV kernel
# loads them instead of drawing the mask again. B H Sq Sk / 8 bytes (heads padded to 128 queries and keys), held for
# the backward only; ``PYKERNELS_TRITON_KEEP_BUFFER_MB`` caps it (MiB, default 1024: above it both kernels draw; 0: never)
def _keep_buffer_mb(value: str) -> float:
    """``PYKERNELS_TRITON_KEEP_BUFFER_MB``'s value: MiB, a number >= 0 ("" is 0)."""
    try:
        mb = float(value or 0)
    except ValueError:
        mb = -1.0
    if not mb >= 0:
        raise ValueError(f"PYKERNELS_TRITON_KEEP_BUFFER_MB: expected a number of MiB >= 0, got {value!r}")
    return mb


KEEP_BUFFER_MB = _keep_buffer_mb(os.environ.get("PYKERNELS_TRITON_KEEP_BUFFER_MB", "1024"))
# ... at head dims up to 64. H200 run464 (the whole Triton backward, p = 0.1, graph replay, against both kernels
# drawing, in the same call): BERT-base 328.5 against 335.7 us (1.022x), GPT-2 1.008x, 4 x 16 x 2048 D64 causal
# 1.014x (run462: 1.013x, 1.001x, 1.016x); at D = 128 slower: 8 x 16 x 1024 0.955x, 4 x 16 x 2048 causal 0.996x
KEEP_BUFFER_MAX_D = 64
# The dQ kernel at D = Dv = 192 on the head dim's two power-of-two column blocks, 128 + 64 (``_dq_inner``'s D_A), not on
# a 256-wide tile whose last 64 columns are zeros: a quarter of its tensor-core work less. On Hopper it runs beside the
# D = 192 Gluon dK/dV kernel. sm_90 compile at the D = 256 tier's 128 x 32 / 8 warps: 1828 bytes spilled against
# 3016, 120 KiB shared against 160. H200 run494 (matrix, graph replay, the whole backward, on and off in one call):
# B4 H8 S2048 368 / 364 TFLOP/s ("Triton" / ``auto`` rows) against 336 / 334 (cuDNN 286-287), B4 H8 S4096 causal
# 311 / 302 against 279 / 274 (cuDNN 293-294). ``PYKERNELS_TRITON_DQ_SPLIT_D=0`` pads (read once, at import).
DQ_SPLIT_D = {192: 128}
DQ_SPLIT = os.environ.get("PYKERNELS_TRITON_DQ_SPLIT_D", "1") not in ("", "0")


def keep_buffer(batch: int, heads: int, sq: int, sk: int, device) -> tuple[torch.Tensor, int, int] | None:
    """The keep buffer of a Triton backward with PTX dropout draws: (buffer, a head's bytes, groups a row), a head
    being ceil(sq / 128) 128 queries x ceil(sk / 128) 16 key groups of 8, stored by 16-query blocks (byte ((q >> 4)
    groups + group) 16 + (q & 15): ``_dropout._keep_buffer_address``, a warp's calls one 32-byte sector). None where
    it is over ``KEEP_BUFFER_MB`` or a head's bytes reach 2^31 (the PTX's 32-bit offsets)."""
    groups = _tuning.cdiv(sk, 128) * 16
    head = _tuning.cdiv(sq, 128) * 128 * groups
    if head >= 2**31 or batch * heads * head > KEEP_BUFFER_MB * 2**20:
        return None
    return empty(batch * heads * head, dtype=torch.uint8, device=device), head, groups


def attention_bwd(do, q, k, v, o, lse, mask, *, causal: bool, scale: float, dropout_p: float, seed,
                  kv_range: torch.Tensor | None = None, cu_seqlens_q=None, cu_seqlens_k=None,
                  max_seqlen_q: int = 0, max_seqlen_k: int = 0, deterministic: bool = False, keep=None):
    """Gradients (dq, dk, dv) with the shapes and dtypes of q, k, v (see ``attention_fwd``). Bitwise
    reproducible where ``deterministic``, and wherever the sm_90 fused kernel does not run (every other
    kernel writes each gradient element once, in a fixed order). ``keep``: the ``keep_buffer`` in which
    ``attention_fwd`` stored its keep bits: the Triton kernels load them instead of drawing (the Gluon ones draw)."""
    varlen = cu_seqlens_q is not None
    if varlen:
        tq, hq, d = q.shape
        hkv, dv_dim = k.shape[1], v.shape[-1]
        batch, sq, sk = cu_seqlens_q.numel() - 1, max_seqlen_q, max_seqlen_k
        # Rows no program writes (past cu_seqlens[-1], or past max_seqlen into a sequence) get a defined
        # zero gradient from _zero_uncovered at the end (no full fills of the three gradients).
        dq = empty(*q.shape, dtype=q.dtype, device=q.device)
        dk = empty(*k.shape, dtype=k.dtype, device=k.device)
        dv = empty(*v.shape, dtype=v.dtype, device=v.device)
        delta = torch.zeros(hq, tq, dtype=torch.float32, device=q.device)
        seq3 = lambda t: (0, t.stride(1), t.stride(0))  # noqa: E731
        ls = (0, lse.stride(0))
    else:
        batch, hq, sq, d = q.shape
        hkv, sk, dv_dim = k.shape[1], k.shape[2], v.shape[-1]
        # gradients laid out like their inputs when those are dense (no copy when autograd views them back)
        dq, dk, dv = empty_like_layout(q), empty_like_layout(k), empty_like_layout(v)
        delta = empty(batch, hq, sq, dtype=torch.float32, device=q.device)
        seq3 = lambda t: tuple(t.stride()[:3])  # noqa: E731
        ls = tuple(lse.stride()[:2])
    if batch == 0 or sq == 0 or sk == 0 or dq.numel() == 0 or dk.numel() == 0:
        # nothing to compute: every gradient row is 0 (varlen: no row is covered by any program)
        for t in (dq, dk, dv):
            t.zero_()
        return dq, dk, dv
    # (batch, head, row) strides of each tensor, once (each launch below takes six of them)
    s_q, s_k, s_v, s_do, s_dq, s_dk, s_dv, s_o = (seq3(t) for t in (q, k, v, do, dq, dk, dv, o))
    dummy = _placeholder(q.device)
    mask_t, mask_kind, ms = _mask_args(mask, dummy)
    cu_q = cu_seqlens_q if varlen else dummy
    cu_k = cu_seqlens_k if varlen else dummy
    kvr = kv_range if kv_range is not None else dummy
    bd, bdv = _pow2_dim(d), _pow2_dim(dv_dim)
    bucket = _seq_bucket(sq, sk)
    gluon = "" if varlen else sm90_backward(q, k, v, do, mask, dropout_p=dropout_p, scale=scale, kv_range=kv_range,
                                            causal=causal, deterministic=deterministic)
    if gluon:
        from . import attention_sm90_bwd as kb
    # each Gluon kernel may decline the layout (False, nothing launched): its Triton kernel runs instead. A dQ
    # kernel (Gluon's or Triton's) runs first and forms delta itself (for the dK/dV kernel too); only the
    # fused kernel, which computes dQ inside the dK/dV kernel, needs the preprocess (and, if it declines,
    # Triton's dQ kernel runs last on that delta)
    common = dict(D=d, DV=dv_dim, BLOCK_D=bd, BLOCK_DV=bdv, EVEN_D=bd == d and bdv == dv_dim, IS_CAUSAL=bool(causal), MASK_KIND=mask_kind,
                  HAS_KV_RANGE=kv_range is not None, HAS_DROPOUT=dropout_p > 0, IS_VARLEN=varlen,
                  PRECISION=_precision(q.dtype),
                  IDX64=_needs_idx64(sq, sk, [t[2] for t in (s_q, s_k, s_v, s_do, s_dq, s_dk, s_dv, s_o)], ms))

    ptx_dropout = _ptx_dropout(q, v, batch * hq * sq, dropout_p, seed)
    # the keep buffer where the Triton dQ kernel runs first and the Triton dK/dV kernel after it (not where a Gluon
    # dK/dV kernel is to run: it draws its own), at head dims up to 64 (KEEP_BUFFER_MAX_D)
    stored = keep is not None
    if stored and not ptx_dropout:
        raise ValueError("keep: stored keep bits are loaded only where the kernels draw them by PTX (_ptx_dropout)")
    if ptx_dropout and not gluon and not stored and max(d, dv_dim) <= KEEP_BUFFER_MAX_D:
        keep = keep_buffer(batch, hq, sq, sk, q.device)
    keep_args = (keep[0], keep[1], keep[2]) if keep else (dummy, 0, 0)

    def triton_dq(compute_delta: bool):
        _launch.fast(_attention_bwd_dq_kernel)[lambda meta: (_tuning.cdiv(sq, meta["BLOCK_M"]), hq, batch)](
            q, k, v, do, dq, lse, delta, o, mask_t, kvr, cu_q, cu_k,
            *s_q, *s_k, *s_v, *s_do, *s_dq, *s_o, *ls, *ms,
            hq, hq // hkv, sq, sk, scale * LOG2E, scale, _dropout_rate(dropout_p), seed_arg(seed, q.device, dropout_p > 0), bucket,
            *keep_args, **common, COMPUTE_DELTA=compute_delta, PTX_DROPOUT=ptx_dropout,
            KEEP_BUF=2 if stored else 1 if keep and compute_delta else 0,
            D_A=DQ_SPLIT_D.get(d, 0) if DQ_SPLIT and d == dv_dim else 0)

    dq_done = "dq" in gluon and kb.attention_bwd_dq_sm90(do, q, k, v, lse, delta, dq, causal=causal, scale=scale,
                                                         o=o)
    if not dq_done and gluon != "fused":
        triton_dq(True)
        dq_done = True
    if not dq_done:
        pre_bm = 16 if _tuning.interpret() else 64
        _launch.fast(_attention_bwd_preprocess_kernel)[(_tuning.cdiv(sq, pre_bm), hq, batch)](
            o, do, delta, cu_q, *s_o, *s_do, *ls, hq, sq,
            DV=dv_dim, BLOCK_DV=bdv, IS_VARLEN=varlen, BLOCK_M=pre_bm)
    fused = gluon == "fused" and kb.attention_bwd_dkdv_sm90(do, q, k, v, lse, delta, dk, dv, causal=causal,
                                                            scale=scale, dq=dq, dropout_p=dropout_p, seed=seed)
    if not fused and not ("dkdv" in gluon and kb.attention_bwd_dkdv_sm90(do, q, k, v, lse, delta, dk, dv,
                                                                         causal=causal, scale=scale,
                                                                         dropout_p=dropout_p, seed=seed)):
        _launch.fast(_attention_bwd_dkdv_kernel)[lambda meta: (_tuning.cdiv(sk, meta["BLOCK_N"]), hkv, batch)](
            q, k, v, do, dk, dv, lse, delta, mask_t, kvr, cu_q, cu_k,
            *s_q, *s_k, *s_v, *s_do, *s_dk, *s_dv, *ls, *ms,
            hq, hkv, hq // hkv, sq, sk, scale * LOG2E, scale, _dropout_rate(dropout_p), seed_arg(seed, q.device, dropout_p > 0), bucket,
            *keep_args, **common, PTX_DROPOUT=ptx_dropout, KEEP_BUF=2 if keep and (dq_done or stored) else 0)
    if not fused and not dq_done:
        triton_dq(False)
    if varlen:
        _zero_uncovered(dq, None, cu_seqlens_q, sq)
        _zero_uncovered(dk, dv if dv.shape == dk.shape else None, cu_seqlens_k, sk)
        if dv.shape != dk.shape:
            _zero_uncovered(dv, None, cu_seqlens_k, sk)
    return dq, dk, dv


@triton.jit
def _dropout_mask_kernel(Out, Seed, Sk, dropout_p, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Writes the keep-mask the attention kernels use, (rows, Sk) over flat rows (b * heads + h) * Sq + i (tests)."""
    seed = load_seed(Seed, True)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    keep = _dropout_keep(seed, 0, rows, cols, Sk, dropout_p)
    tl.store(Out + rows[:, None] * Sk + cols[None, :], keep.to(tl.int8), mask=cols[None, :] < Sk)


def dropout_mask_triton(seed, batch: int, heads: int, sq: int, sk: int, p: float, device) -> torch.Tensor:
    """The in-kernel keep-mask as a bool (batch, heads, sq, sk) tensor, generated by Triton itself."""
    rows = batch * heads * sq
    out = torch.empty(_tuning.cdiv(rows, 16) * 16 * sk, dtype=torch.int8, device=device)
    if rows and sk:
        _launch.fast(_dropout_mask_kernel)[(_tuning.cdiv(rows, 16), _tuning.cdiv(sk, 32))](
            out, seed_arg(seed, device, True), sk, _dropout_rate(p), BLOCK_R=16, BLOCK_C=32)
    return out[:rows * sk].view(batch, heads, sq, sk).bool()


__all__ = ["attention_fwd", "attention_bwd", "dropout_mask_triton", "LOG2E"]
