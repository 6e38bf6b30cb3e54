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

The same bits for an MMA accumulator tile of (keys, queries), as inline PTX (``_keep_octet_ptx``, ``_apply_keep_ptx``):
the Gluon dK/dV kernel's (``attention_sm90_bwd``) and the Triton dK/dV kernel's on the GPU (``attention.PTX_DROPOUT``);
and for a (queries, keys) tile, its quad form (``quad=True``): the Triton forward's and dQ kernel's.
``tests/test_attention_sm90_dropout_ptx.py`` runs them on the CPU.
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


def _call_coordinates(quad: bool, rot: bool) -> list[str]:
    """The PTX that puts the Philox row and key group of this lane's call in pkr / pkk (and its index in the octet
    or quad in pkg), from the pack's element 0 ($2 its Philox row, $10 its key): ``_keep_octet_ptx``'s."""
    if quad:  # (queries, keys) tile: t4 = (key >> 1) & 3 (keys 2 t4, 2 t4 + 1 of a group of 8); call t4: query
        # row $2 + 8 (t4 & 1), key group ($10 >> 3) + (t4 >> 1)
        return ["bfe.u32 pkg, $10, 1, 2;", "and.b32 pkt, pkg, 1;", "shl.b32 pkt, pkt, 3;", "add.u32 pkr, pkt, $2;",
                "shr.b32 pkk, $10, 3;", "shr.b32 pkt, pkg, 1;", "add.u32 pkk, pkk, pkt;"]
    # (keys, queries) tile: the call of element c = g: query row $2 + 8 (g >> 2) + (g & 1), key group ($10 >> 3) +
    # ((g >> 1) & 1)
    return [*(["and.b32 pkg, $10, 7;"] if rot else ["mov.u32 pkg, %laneid;", "shr.b32 pkg, pkg, 2;"]),
            "shr.b32 pkt, pkg, 2;", "shl.b32 pkt, pkt, 3;", "and.b32 pkr, pkg, 1;", "add.u32 pkr, pkr, pkt;",
            "add.u32 pkr, pkr, $2;", "shr.b32 pkk, $10, 3;", "bfe.u32 pkt, pkg, 1, 1;", "add.u32 pkk, pkk, pkt;"]


def _keep_buffer_address() -> list[str]:
    """The PTX that puts in pka the byte of the keep buffer (``attention.keep_buffer``) that holds this lane's call
    (Philox row pkr, key group pkk): $42 (the head's buffer, a u64 address) + ((q >> 4) $58 + pkk) 16 + (q & 15), q =
    pkr - $50 the call's query in its head ($50 the head's Philox row 0, $58 the buffer's groups a row). A warp's
    calls of one pack are 16 queries (a multiple of 16 first) x 2 key groups (an even one first): one 32-byte sector."""
    return ["sub.u32 pkq, pkr, $50;", "shr.u32 pkt, pkq, 4;", "mad.lo.u32 pkt, pkt, $58, pkk;", "shl.b32 pkt, pkt, 4;",
            "and.b32 pkq, pkq, 15;", "or.b32 pkt, pkt, pkq;", "cvt.u64.u32 pka, pkt;", "add.u64 pka, pka, $42;"]


def _keep_octet_ptx(carry: bool = False, rot: bool = False, quad: bool = False, buffer: str = "") -> str:
    """The PTX of ``attention_sm90_bwd._dropout_keep_flags`` (and of the Triton kernels' ``_ptx_keep_bits``: the
    dK/dV kernel's S^T tile has the same register and lane order): one asm block a pack of 8 accumulator registers
    (``pack=8``). Operands:
    $0, $1 out (the pack's 8 keep bits in $0, bit c element c's; $1 zero: the int8 "flags" tensor is only their
    carrier, ``_apply_keep`` reads its first register a pack), then 8
    registers each of: the element's Philox row ((b H + h) Sq + query), its key, the seed's low word, the calls a row
    (ceil(Sk / 8)) and the threshold (p 2^16); of each only the pack's first element is read. The pack's element c is
    (query q0 + 8 (c >> 2) + (c & 1), key k0 + 8 ((c >> 1) & 1)), k0 = kb + g for lane 4 g + t4 (the NVMMA
    accumulator's register and lane order, row = key: ``to_linear_layout`` of ``s_layout``). The 8 lanes g of one t4
    (an octet) need the 8 calls (query, key group) of their pack: lane g draws call c = g (Philox-4x32-7,
    csrc/philox.cuh's philox4x32), forms its 8 keep bits (bit v: key v of the call; keep_byte), and three xor-shuffle
    stages transpose the octet's bit matrix (transpose_stage, F = 1), after which bit c is this lane's key in call c:
    csrc/attention.cuh's key_keep_bits, in Gluon's registers. ``tests/test_attention_sm90_dropout_ptx.py`` runs it on
    the CPU against ``attention_dropout_mask``. ``carry``: the keep bits by an add.cc / addc chain (csrc/attention.cuh's
    keep_byte_carry: a half is >= the threshold iff it, moved to the top, plus (2^16 - thr) 2^16 carries out; two
    instructions a bit) instead of a compare, select and or a bit. ``rot``: g read from the key (k0 & 7: kb is a
    multiple of 8) rather than %laneid, and each transpose stage a shuffle, a rotate and a lop3 with lane values (two
    mads) instead of both candidates' masks and shifts and a select. ``quad``: the same bits for a (queries, keys)
    tile (the Triton dQ kernel's S and dP, ``attention.PTX_DROPOUT``), whose pack's element c is (query q0 + 8
    ((c >> 1) & 1), key k0 + (c & 1) + 8 (c >> 2)), q0 = qb + g, k0 = kb + 2 t4 for lane 4 g + t4: the 4 lanes t4 of
    one g (a quad) need 4 calls, (query q0 + 8 (t4 & 1), key group (k0 >> 3) + (t4 >> 1)) drawn by lane t4, whose
    keep bits two xor-shuffle stages transpose as 2-bit fields (csrc/attention.cuh's group_keep_bits<2>), so that
    bit c is element c's here too (``_apply_keep_ptx`` applies either); with ``carry`` only (no ``rot``).
    ``buffer``: the keep bits shared through a buffer of the backward (``attention.keep_buffer``), three more operands
    ($42 the head's buffer address, "l"; $50 the head's Philox row 0; $58 the buffer's groups a row: 16 more "r";
    ``KEEP_BUFFER_CONSTRAINTS``): "store" draws the call as above and also stores its 8 keep bits (before the
    transposes: bit v key v of the call) at the call's byte (``_keep_buffer_address``); "load" loads them from there
    instead of drawing (no Philox: the seed, groups and threshold operands are not read)."""
    if quad and rot:
        raise ValueError("rot: the octet's transposes only (quad takes carry or the compare)")
    if buffer not in ("", "store", "load"):
        raise ValueError(f"buffer: '', 'store' or 'load', got {buffer!r}")
    lines = ["{", ".reg .pred pkp;",
             ".reg .b32 pkg, pkt, pkr, pkk, pkc0, pkc1, pkc2, pkc3, pkk0, pkk1, pkhb, pklb, pkha, pkla, pkn, pkx, pky, "
             "pku, pkv, pkhi;", ".reg .b64 pkctr, pkw;",
             *([".reg .b32 pkq;", ".reg .b64 pka;"] if buffer else []), *_call_coordinates(quad, rot)]
    if buffer == "load":  # (the bits another kernel's "store" left: a u8 load zero-extends into the 32-bit register)
        lines += [*_keep_buffer_address(), "ld.global.nc.u8 pkx, [pka];"]
    else:
        lines += _philox_keep_bits(carry)
    if buffer == "store":
        lines += [*_keep_buffer_address(), "st.global.u8 [pka], pkx;"]
    lines += _transposes(quad, rot)
    return "\n".join(lines + ["}"])


def _philox_keep_bits(carry: bool) -> list[str]:
    """The PTX that draws this lane's call (Philox row pkr, key group pkk) and puts its 8 keep bits in pkx (bit v: key
    v of the call): ``_keep_octet_ptx``'s draw."""
    lines = ["mul.wide.u32 pkctr, pkr, $26;", "cvt.u64.u32 pkw, pkk;", "add.u64 pkctr, pkctr, pkw;",
             "mov.b64 {pkc0, pkc1}, pkctr;", "mov.b32 pkc2, 0;", "mov.b32 pkc3, 0;", "mov.b32 pkk0, $18;",
             "mov.b32 pkk1, 0;"]  # (seeds are drawn below 2^31: the key's high word is 0)
    for _ in range(_ROUNDS):
        lines += ["mul.hi.u32 pkhb, pkc2, 0xCD9E8D57;", "mul.lo.u32 pklb, pkc2, 0xCD9E8D57;",
                  "mul.hi.u32 pkha, pkc0, 0xD2511F53;", "mul.lo.u32 pkla, pkc0, 0xD2511F53;",
                  "xor.b32 pkn, pkhb, pkc1;", "xor.b32 pkc0, pkn, pkk0;", "xor.b32 pkn, pkha, pkc3;",
                  "xor.b32 pkc2, pkn, pkk1;", "mov.b32 pkc1, pklb;", "mov.b32 pkc3, pkla;",
                  "add.u32 pkk0, pkk0, 0x9E3779B9;", "add.u32 pkk1, pkk1, 0xBB67AE85;"]
    # keep bits: bit 2 w (low half of word w) and 2 w + 1 (high half), kept where the half is >= the threshold
    if carry:  # bit 7 (word 3's high half) first: each addc doubles the bits and adds the carry
        lines += ["sub.u32 pkhi, 65536, $34;", "shl.b32 pkhi, pkhi, 16;", "add.cc.u32 pkt, pkc3, pkhi;",
                  "addc.u32 pkx, 0, 0;", "shl.b32 pku, pkc3, 16;", "add.cc.u32 pkt, pku, pkhi;",
                  "addc.u32 pkx, pkx, pkx;"]
        for w in (2, 1, 0):
            lines += [f"add.cc.u32 pkt, pkc{w}, pkhi;", "addc.u32 pkx, pkx, pkx;", f"shl.b32 pku, pkc{w}, 16;",
                      "add.cc.u32 pkt, pku, pkhi;", "addc.u32 pkx, pkx, pkx;"]
    else:
        lines += ["shl.b32 pkhi, $34, 16;", "mov.b32 pkx, 0;"]
        for w in range(4):
            lines += [f"shl.b32 pku, pkc{w}, 16;", "setp.ge.u32 pkp, pku, pkhi;",
                      f"selp.b32 pkv, {1 << 2 * w}, 0, pkp;", "or.b32 pkx, pkx, pkv;",
                      f"setp.ge.u32 pkp, pkc{w}, pkhi;",
                      f"selp.b32 pkv, {1 << 2 * w + 1}, 0, pkp;", "or.b32 pkx, pkx, pkv;"]
    return lines


def _transposes(quad: bool, rot: bool) -> list[str]:
    """The PTX that moves the calls' keep bits (pkx) to the lanes that hold their elements, then writes the outputs:
    ``_keep_octet_ptx``'s transposes."""
    lines = []
    # the transposes: the octet's lanes are 4 apart, stages of bits; the quad's 1 apart, stages of 2-bit fields (a 4 x 4
    # transpose over the quad's lanes: field j of lane t4 is then call j's keys 2 t4, 2 t4 + 1, i.e. bit c element c's,
    # its call c >> 1, its key's half c & 1)
    stages = [(st, 2 * st, lo) for st, lo in ((2, 0x0F), (1, 0x33))] if quad else \
        [(st, st, lo) for st, lo in ((4, 0x0F), (2, 0x33), (1, 0x55))]
    for st, sh, lo in stages:  # (st: the stage's bit of g, sh: its shift; lo: the positions whose bit st is clear)
        lanes = st if quad else st << 2
        if rot:  # the partner's word rotated left by st (this lane's g bit st clear) or right (set), then one lop3
            # keeps this lane's half (mask lo, or lo << st) and the byte's rest from the rotated word: x's bits past
            # the byte are 0, so the mask takes them from x; both lane values are two mads of the g bit
            lines += [f"bfe.u32 pkt, pkg, {st.bit_length() - 1}, 1;", f"mad.lo.u32 pkn, pkt, {32 - 2 * st}, {st};",
                      f"mad.lo.u32 pkv, pkt, {(lo << st) - lo}, {lo | 0xFFFFFF00};",
                      f"shfl.sync.bfly.b32 pky, pkx, {lanes}, 0x1f, 0xffffffff;",
                      "shf.l.wrap.b32 pky, pky, pky, pkn;", "lop3.b32 pkx, pkx, pky, pkv, 0xE4;"]
            continue
        lines += [f"shfl.sync.bfly.b32 pky, pkx, {lanes}, 0x1f, 0xffffffff;", f"and.b32 pkt, pkg, {st};",
                  "setp.ne.u32 pkp, pkt, 0;",
                  f"and.b32 pku, pkx, {lo << sh};", f"shr.b32 pkv, pky, {sh};", f"and.b32 pkv, pkv, {lo};",
                  "or.b32 pku, pku, pkv;",
                  f"and.b32 pkn, pkx, {lo};", f"and.b32 pkv, pky, {lo};", f"shl.b32 pkv, pkv, {sh};",
                  "or.b32 pkn, pkn, pkv;", "selp.b32 pkx, pku, pkn, pkp;"]
    # out: the 8 keep bits as they are (bit c: element c) in $0, $1 zero (``_apply_keep`` reads bits of $0 only)
    lines += ["mov.b32 $0, pkx;", "mov.b32 $1, 0;"]
    return lines


def _apply_keep_ptx() -> str:
    """The PTX of ``attention_sm90_bwd._apply_keep`` (and the Triton dK/dV kernel's ``_APPLY_KEEP_PTX``): 8 fp32 values
    ($8-$15) kept or zeroed by the keep bits of ``_keep_octet_ptx``,
    which come as that asm left them: bit c of $16 element c's ($17 unused), one register a pack between the two asm
    blocks (through run451 the flags were bytes, two registers a pack and a multiply-and-mask each to make them)."""
    lines = ["{", ".reg .pred pkp;", ".reg .b32 pkt;"]
    for c in range(8):
        lines += [f"and.b32 pkt, $16, {1 << c};", "setp.ne.u32 pkp, pkt, 0;", f"selp.b32 ${c}, ${8 + c}, 0, pkp;"]
    return "\n".join(lines + ["}"])


# The constants both dK/dV kernels pass to ``inline_asm_elementwise`` (``gl.constexpr`` is ``tl.constexpr``): the keep
# bits with the carry chain (the kernels' default), and the select that applies them, with their operand constraints
KEEP_OCTET_CARRY_PTX = tl.constexpr(_keep_octet_ptx(carry=True))
KEEP_QUAD_CARRY_PTX = tl.constexpr(_keep_octet_ptx(carry=True, quad=True))  # (the Triton dQ kernel's)
KEEP_OCTET_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 2 + ["r"] * 40))  # (the quad's too)
# ... the Triton backward's keep buffer (``attention.keep_buffer``): the dQ kernel's quad draws store, the dK/dV
# kernel's octet loads
KEEP_QUAD_STORE_PTX = tl.constexpr(_keep_octet_ptx(carry=True, quad=True, buffer="store"))
KEEP_OCTET_LOAD_PTX = tl.constexpr(_keep_octet_ptx(carry=True, buffer="load"))
KEEP_QUAD_LOAD_PTX = tl.constexpr(_keep_octet_ptx(carry=True, quad=True, buffer="load"))
KEEP_BUFFER_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 2 + ["r"] * 40 + ["l"] * 8 + ["r"] * 16))
APPLY_KEEP_PTX = tl.constexpr(_apply_keep_ptx())
APPLY_KEEP_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 8 + ["r"] * 10))
