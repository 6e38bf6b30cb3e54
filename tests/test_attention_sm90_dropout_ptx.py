"""The Gluon dK/dV kernel's dropout PTX (``attention_sm90_bwd._keep_octet_ptx``) run on the CPU by a small
interpreter of the instructions it uses, for the 32 lanes of a warp at once (its shuffles too): every lane's 8 keep
flags of a pack must be ``pykernels.attention_dropout_mask``'s bits at the (query, key) that the NVMMA accumulator's
register and lane order put there (``to_linear_layout`` of the consumers' ``s_layout``: register bit 0 = query + 1,
bit 1 = key + 8, bit 2 = query + 8; lane bits 0-1 = query + 2, 4, bits 2-4 = key + 1, 2, 4). Whether the kernel
gives the right gradients with it is the GPU's to say (tests/test_attention.py's sm_90 dropout test)."""
from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from pykernels.attention import attention_dropout_mask, dropout_rate  # noqa: E402

M32, M64 = 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF


def _run_ptx(ptx: str, operands: list[list[int]], mem: dict | None = None,
             accesses: list | None = None) -> list[list[int]]:
    """Runs the asm block for 32 lanes; ``operands[lane]``: the values of $0.. (outputs first, their initial values
    ignored). Returns each lane's operands after the block. ``mem``: global memory, address -> byte, that the block's
    u8 loads read (an address it lacks fails the test) and its u8 stores write; ``accesses`` gets the 32 lanes'
    addresses of each load or store."""
    body = [ln.strip() for ln in ptx.strip().strip("{}").split("\n")
            if ln.strip() and not ln.strip().startswith(".reg")]
    regs = [dict() for _ in range(32)]
    carry = [0] * 32  # (add.cc sets it, addc reads it)
    ops = [list(o) for o in operands]

    def val(lane, tok):
        tok = tok.strip()
        if tok.startswith("$"):
            return ops[lane][int(tok[1:])]
        if tok == "%laneid":
            return lane
        if re.fullmatch(r"0x[0-9A-Fa-f]+|\d+", tok):
            return int(tok, 0)
        return regs[lane][tok]

    def put(lane, tok, x):
        tok = tok.strip()
        if tok.startswith("$"):
            ops[lane][int(tok[1:])] = x
        else:
            regs[lane][tok] = x

    for ln in body:
        ins, rest = ln.rstrip(";").split(None, 1)
        if ins == "mov.b64" and rest.startswith("{"):
            lo_hi, src = rest.split("}", 1)
            lo, hi = lo_hi.strip("{ ").split(",")
            for lane in range(32):
                x = val(lane, src.strip(", "))
                put(lane, lo, x & M32)
                put(lane, hi, x >> 32)
            continue
        if ins in ("ld.global.nc.u8", "st.global.u8"):  # ([address] operand: a register)
            assert mem is not None, ins
            dst, addr = ([a.strip() for a in rest.split(",")] if ins.startswith("ld") else
                         [a.strip() for a in rest.split(",")][::-1])
            addrs = [val(lane, addr.strip("[]")) for lane in range(32)]
            if accesses is not None:
                accesses.append(addrs)
            for lane, a in enumerate(addrs):
                if ins.startswith("ld"):
                    assert a in mem, (lane, hex(a))
                    put(lane, dst, mem[a])
                else:
                    mem[a] = val(lane, dst) & 0xFF
            continue
        args = [a.strip() for a in rest.split(",")]
        if ins.startswith("shfl.sync.bfly"):
            xs = [val(lane, args[1]) for lane in range(32)]
            for lane in range(32):
                put(lane, args[0], xs[lane ^ val(lane, args[2])])
            continue
        for lane in range(32):
            a = [val(lane, t) for t in args[1:]]
            if ins in ("mov.u32", "mov.b32"):
                r = a[0]
            elif ins == "shr.b32" or ins == "shr.u32":
                r = a[0] >> a[1]
            elif ins == "shl.b32":
                r = (a[0] << a[1]) & M32
            elif ins == "and.b32":
                r = a[0] & a[1]
            elif ins == "or.b32":
                r = a[0] | a[1]
            elif ins == "xor.b32":
                r = a[0] ^ a[1]
            elif ins == "add.u32":
                r = (a[0] + a[1]) & M32
            elif ins == "sub.u32":
                r = (a[0] - a[1]) & M32
            elif ins == "add.cc.u32":
                r, carry[lane] = (a[0] + a[1]) & M32, (a[0] + a[1]) >> 32
            elif ins == "addc.u32":
                r = (a[0] + a[1] + carry[lane]) & M32
            elif ins == "add.u64":
                r = (a[0] + a[1]) & M64
            elif ins == "bfe.u32":
                r = (a[0] >> a[1]) & ((1 << a[2]) - 1)
            elif ins == "mul.wide.u32":
                r = a[0] * a[1]
            elif ins == "cvt.u64.u32":
                r = a[0]
            elif ins == "mul.lo.u32":
                r = (a[0] * a[1]) & M32
            elif ins == "mul.hi.u32":
                r = (a[0] * a[1]) >> 32
            elif ins == "mad.lo.u32":
                r = (a[0] * a[1] + a[2]) & M32
            elif ins == "shf.l.wrap.b32":  # (funnel shift of a[1]:a[0] left by a[2] mod 32, the high word's bits)
                n = a[2] & 31
                r = (((a[1] << 32 | a[0]) << n) >> 32) & M32
            elif ins == "lop3.b32":  # (bit i of the result: bit (a b c) of the table, a 0xF0, b 0xCC, c 0xAA)
                r = 0
                for i in range(32):
                    r |= (a[3] >> ((a[0] >> i & 1) << 2 | (a[1] >> i & 1) << 1 | (a[2] >> i & 1)) & 1) << i
            elif ins == "setp.ge.u32":
                r = a[0] >= a[1]
            elif ins == "setp.ne.u32":
                r = a[0] != a[1]
            elif ins == "selp.b32":
                r = a[0] if a[2] else a[1]
            else:
                raise AssertionError(f"instruction {ins} not interpreted")
            put(lane, args[0], r)
    return ops


def _check_draws(ptx: str, p: float, sk: int, rows: int, seed: int, element, buffer=(), mem=None, accesses=None,
                 draw: bool = True) -> None:
    """Runs a keep-bit asm block (``_keep_octet_ptx``'s operands) for 32 lanes and checks bit c of each lane's first
    output against ``attention_dropout_mask`` at ``element(lane, c)`` = (Philox row, key), element 0 of a pack
    being what the block is given; rows below ``rows``. ``buffer``: the keep buffer's three operands (address, the
    head's Philox row 0, groups a row), with ``mem`` and ``accesses`` as ``_run_ptx``'s; ``draw`` False: the seed,
    groups and threshold operands given wrong (a block that loads its bits must not read them)."""
    groups, thr = (sk + 7) // 8, round(dropout_rate(p) * 65536)
    ops = [seed, groups, thr] if draw else [seed ^ 0x5A5A5A5, groups + 3, 65536 - thr]
    operands = []
    for lane in range(32):
        q0, k0 = element(lane, 0)
        operands.append([0, 0] + [q0] * 8 + [k0] * 8 + [v for v in ops + list(buffer) for _ in range(8)])
    out = _run_ptx(ptx, operands, mem, accesses)
    keep = attention_dropout_mask(seed, 1, 1, rows, sk, p, "cpu")[0, 0]
    checked = 0
    for lane in range(32):
        for c in range(8):
            query, key = element(lane, c)
            if key < sk:
                assert (out[lane][0] >> c) & 1 == int(keep[query, key]), (lane, c, query, key)
                checked += 1
    assert checked >= 8 * 16
    assert all(out[lane][0] < 256 and out[lane][1] == 0 for lane in range(32))  # (no bit past the pack's 8)
    # a rate that keeps about 1 - p of them (not a constant answer)
    flags = [(out[lane][0] >> c) & 1 for lane in range(32) for c in range(8)]
    assert 0 < sum(flags) < len(flags)


@pytest.mark.parametrize("p,sk,kb,nt,row0", [(0.1, 200, 16, 2, 0), (0.5, 64, 48, 0, 3 * 57),
                                              (0.37, 1031, 1008, 6, 5 * 1000)])
@pytest.mark.parametrize("carry,rot", [(False, False), (True, False), (True, True)])
def test_keep_octet_ptx_draws_the_kernels_mask(p, sk, kb, nt, row0, carry, rot):
    from pykernels._kernels.attention_sm90_bwd import _keep_octet_ptx

    def element(lane, c):  # (query of its column, key of its row)
        g, t4 = lane >> 2, lane & 3
        return row0 + nt * 8 + 2 * t4 + 8 * (c >> 2) + (c & 1), kb + g + 8 * ((c >> 1) & 1)
    _check_draws(_keep_octet_ptx(carry, rot), p, sk, row0 + nt * 8 + 16, 987654321, element)


def test_apply_keep_ptx_zeroes_the_dropped_elements():
    """``_apply_keep_ptx`` keeps value c of a pack where bit c of the keep register is set, else writes 0 (as fp32
    bit patterns), reading nothing of the pack's second keep register."""
    import struct

    from pykernels._kernels.attention_sm90_bwd import _apply_keep_ptx
    gen = torch.Generator().manual_seed(5)
    vals = [[struct.unpack("<I", struct.pack("<f", float(x)))[0] for x in torch.randn(8, generator=gen) + 3.0]
            for _ in range(32)]
    bits = [int(b) for b in torch.randint(0, 256, (32,), generator=gen)]
    out = _run_ptx(_apply_keep_ptx(), [[0] * 8 + vals[lane] + [bits[lane], 0xFFFFFFFF] for lane in range(32)])
    for lane in range(32):
        for c in range(8):
            assert out[lane][c] == (vals[lane][c] if bits[lane] >> c & 1 else 0), (lane, c)
    assert 0 < sum(bin(b).count("1") for b in bits) < 256


def test_apply_keep16_ptx_zeroes_where_p_z_is_zero():
    """``_apply_keep16_ptx`` keeps value c where element c's 16-bit P^T Z (half c % 2, low first, of register c // 2)
    is not 0, else writes 0: dP^T's dropout read from the dV GEMM's operand registers. The halves that stand for kept
    elements are nonzero bf16 values with a zero low or high byte too (a test of the whole half, not of one byte)."""
    import struct

    from pykernels._kernels.attention_sm90_bwd import _apply_keep16_ptx
    gen = torch.Generator().manual_seed(11)
    vals = [[struct.unpack("<I", struct.pack("<f", float(x)))[0] for x in torch.randn(8, generator=gen) - 2.0]
            for _ in range(32)]
    kept = torch.rand(32, 8, generator=gen) > 0.3
    halves = [0x3F80, 0x0100, 0x0001, 0x8000, 0x4049]  # (bf16 1, 2^-125, the least denormal, -0 as bits, 3.14)
    pz = [[(halves[(lane + c) % len(halves)] if kept[lane, c] else 0) for c in range(8)] for lane in range(32)]
    regs = [[pz[lane][2 * r] | pz[lane][2 * r + 1] << 16 for r in range(4)] for lane in range(32)]
    out = _run_ptx(_apply_keep16_ptx(), [[0] * 8 + vals[lane] + regs[lane] for lane in range(32)])
    for lane in range(32):
        for c in range(8):
            assert out[lane][c] == (vals[lane][c] if kept[lane, c] else 0), (lane, c)


@pytest.mark.parametrize("p,sk,kb,mt,row0", [(0.1, 200, 16, 2, 0), (0.5, 64, 48, 0, 3 * 57),
                                              (0.37, 1031, 1008, 5, 5 * 1000)])
@pytest.mark.parametrize("carry", [False, True])
def test_keep_quad_ptx_draws_the_kernels_mask(p, sk, kb, mt, row0, carry):
    """The quad form (``quad=True``: the Triton dQ kernel's and forward's (queries, keys) tile, register bit 0 = key
    + 1, bit 1 = query + 8, bit 2 = key + 8; lane bits 0-1 = key + 2, 4, bits 2-4 = query + 1, 2, 4): bit c of every
    lane's first output is its element c's keep flag of ``attention_dropout_mask``."""
    from pykernels._kernels._dropout import _keep_octet_ptx

    def element(lane, c):  # (its query's Philox row, its key)
        g, t4 = lane >> 2, lane & 3
        return row0 + mt * 16 + g + 8 * ((c >> 1) & 1), kb + 2 * t4 + (c & 1) + 8 * (c >> 2)
    _check_draws(_keep_octet_ptx(carry, quad=True), p, sk, row0 + mt * 16 + 16, 1234567, element)


def test_keep_quad_ptx_refuses_rot():
    from pykernels._kernels._dropout import _keep_octet_ptx
    with pytest.raises(ValueError, match="rot"):
        _keep_octet_ptx(True, rot=True, quad=True)


@pytest.mark.parametrize("p,sq,sk,head", [(0.1, 40, 200, 0), (0.37, 20, 75, 5)])
def test_keep_buffer_quad_stores_octet_loads(p, sq, sk, head):
    """The Triton backward's keep buffer (``attention.keep_buffer``): the dQ kernel's quad draws with ``buffer="store"``
    over every 16 x 16 (queries, keys) block of a head leave each call's keep byte (bit v: key v of the group) at
    ``_keep_buffer_address``'s byte, and the quad (a forward's stores, then the dQ kernel's loads) and the dK/dV
    kernel's octet with ``buffer="load"`` over every block then give the mask's bits, with the seed, groups and
    threshold operands wrong (they draw nothing).
    Each warp-wide store and load is one 32-byte sector."""
    from pykernels._kernels._dropout import _keep_octet_ptx
    seed, base = 1357911, 1 << 36
    row0, gp = head * sq, -(-sk // 128) * 16  # (the head's Philox row 0; the buffer's groups a row)
    rows = row0 + -(-sq // 16) * 16
    mem, accesses = {}, []
    for mt in range(-(-sq // 16)):
        for kb in range(0, -(-sk // 16) * 16, 16):
            def element(lane, c, mt=mt, kb=kb):  # (quad: query of its row, key of its column)
                g, t4 = lane >> 2, lane & 3
                return row0 + mt * 16 + g + 8 * ((c >> 1) & 1), kb + 2 * t4 + (c & 1) + 8 * (c >> 2)
            _check_draws(_keep_octet_ptx(True, quad=True, buffer="store"), p, sk, rows, seed, element,
                         (base, row0, gp), mem, accesses)
    keep = attention_dropout_mask(seed, 1, 1, rows, sk, p, "cpu")[0, 0]
    assert len(mem) == -(-sq // 16) * 16 * -(-sk // 16) * 2  # (a byte for each call of the blocks, none twice)
    for q in range(-(-sq // 16) * 16):
        for grp in range(-(-sk // 8)):
            byte = mem[base + ((q >> 4) * gp + grp) * 16 + (q & 15)]
            for v in range(min(8, sk - 8 * grp)):
                assert byte >> v & 1 == int(keep[row0 + q, 8 * grp + v]), (q, grp, v)
    n_stores = len(accesses)
    for mt in range(-(-sq // 16)):  # (the quad's loads: the backward's dQ kernel after a forward that stored)
        for kb in range(0, -(-sk // 16) * 16, 16):
            def element(lane, c, mt=mt, kb=kb):
                g, t4 = lane >> 2, lane & 3
                return row0 + mt * 16 + g + 8 * ((c >> 1) & 1), kb + 2 * t4 + (c & 1) + 8 * (c >> 2)
            _check_draws(_keep_octet_ptx(True, quad=True, buffer="load"), p, sk, rows, seed, element,
                         (base, row0, gp), mem, accesses, draw=False)
    for nt in range(0, -(-sq // 16) * 2, 2):
        for kb in range(0, -(-sk // 16) * 16, 16):
            def element(lane, c, nt=nt, kb=kb):  # (octet: query of its column, key of its row)
                g, t4 = lane >> 2, lane & 3
                return row0 + nt * 8 + 2 * t4 + 8 * (c >> 2) + (c & 1), kb + g + 8 * ((c >> 1) & 1)
            _check_draws(_keep_octet_ptx(True, buffer="load"), p, sk, rows, seed, element, (base, row0, gp), mem,
                         accesses, draw=False)
    assert len(accesses) == 3 * n_stores
    for addrs in accesses:
        assert len({a // 32 for a in addrs}) == 1, addrs


def test_keep_octet_ptx_refuses_an_unknown_buffer():
    from pykernels._kernels._dropout import _keep_octet_ptx
    with pytest.raises(ValueError, match="buffer"):
        _keep_octet_ptx(True, buffer="keep")
