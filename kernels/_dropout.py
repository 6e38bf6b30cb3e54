"""The dropout keep-mask every pykernels kernel draws (attention and LayerNorm), as one Triton helper.

An element (row r, column j) of a logical (rows, cols) array is decided by 16 bits of Philox-4x32-7 (Triton's
``tl.randint4x`` at ``n_rounds=PHILOX_ROUNDS``, seven as FlashAttention-2) at the int64 counter
``base + r * ceil(cols / 8) + j // 8``: one call per 8 columns of a row, of whose 128 bits column j takes the half
``j % 2`` (low first) of word ``(j % 8) // 2``. It is kept where those bits are ``>= p * 65536``, p being a multiple
of 2^-16 (the host rounds it: ``pykernels.attention.dropout_rate``), and scaled by ``1 / (1 - p)``.
``pykernels.attention.dropout_bits`` computes the same bits in eager PyTorch and ``csrc/philox.cuh``
(``dropout_bits16``) in CUDA C++. Drawing a ``tl.rand`` per element, as before, cost one Philox call (ten rounds of
two 32-bit multiplies) an element: the BERT-base attention forward with dropout took 5.8x its dropout-free time
(run243).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# the rounds (seven; csrc/philox.cuh's kPhiloxRounds) and dropout_rate, the rate the kernels take for a requested p
# (p rounded to a multiple of 2^-16: every launcher passes it, never p itself), from the public package's definitions
from pykernels.attention import PHILOX_ROUNDS as _ROUNDS, dropout_rate  # noqa: F401  (dropout_rate: re-exported)

PHILOX_ROUNDS = tl.constexpr(_ROUNDS)  # (a constexpr global, as the jit functions read it)


@triton.jit
def dropout_keep(seed, base, rows, cols, n_cols, p, TRANS: tl.constexpr = False):
    """Keep-mask (len(rows), len(cols)), or its transpose with TRANS, for 1-D ``rows`` and ``cols``. With
    len(cols) a multiple of 8 the columns must come in runs of 8 that start at multiples of 8 (a tile's
    ``start + arange``): then a call serves 8 columns; otherwise (narrow tiles) each element makes its own call
    and picks its bits out of it, with the same result."""
    R: tl.constexpr = rows.shape[0]
    C: tl.constexpr = cols.shape[0]
    thr = (tl.full((), 65536.0, tl.float32) * p).to(tl.uint32)
    row_base = base + rows.to(tl.int64)[:, None] * ((n_cols + 7) // 8)
    if C % 8 == 0:
        groups = tl.max(tl.reshape(cols, (C // 8, 8)), axis=1) // 8
        r0, r1, r2, r3 = tl.randint4x(seed, row_base + groups.to(tl.int64)[None, :], PHILOX_ROUNDS)
        words = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (R, C // 2))  # word w of call g at 4 g + w
        bits = tl.reshape(tl.join(words & 0xFFFF, words >> 16), (R, C))  # column 8 g + 2 w + half
    else:
        c64 = cols.to(tl.int64)[None, :]
        r0, r1, r2, r3 = tl.randint4x(seed, row_base + c64 // 8, PHILOX_ROUNDS)
        q = (c64 % 8) // 2
        w = tl.where(q == 0, r0, tl.where(q == 1, r1, tl.where(q == 2, r2, r3)))
        bits = tl.where(c64 % 2 == 0, w & 0xFFFF, w >> 16)
    keep = bits >= thr
    if TRANS:
        keep = tl.trans(keep)
    return keep


def seed_arg(seed, device, has_dropout: bool) -> torch.Tensor:
    """A launcher's ``Seed`` argument: the (1,) int64 seed tensor on the kernel's ``device``. ``seed`` is the tensor an
    op drew (``pykernels._rng.op_seed``: already there, nothing is copied, so a CUDA-graph replay reads the value its
    generator drew for that replay) or an int (tests, ``dropout_mask_triton``), which is copied there. Without dropout
    the kernels never read it: any int64 tensor on the device stands in (``seed`` itself, the op's (0,) placeholder)."""
    if isinstance(seed, torch.Tensor):
        if not has_dropout:
            return seed
        if not isinstance(device, torch.device):
            device = torch.device(device)
        if seed.device == device and seed.dtype == torch.int64 and seed.numel():  # (an op's seed: every call)
            return seed
        return seed.reshape(-1)[:1].to(device=device, dtype=torch.int64)
    if not has_dropout:
        return torch.empty(0, dtype=torch.int64, device=device)
    return torch.tensor([int(seed)], dtype=torch.int64, device=device)


@triton.jit
def load_seed(Seed, HAS_DROPOUT: tl.constexpr):
    """The Philox seed a kernel draws its dropout mask with, read from device memory (``seed_arg``) once a program:
    a value that a CUDA graph replays from its generator's fresh draw, where a seed passed by value would be frozen
    into the captured launch. 0 (never used) without dropout."""
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(Seed)
    return seed
