"""Experiment and harness around the sm_90 Gluon attention forwards (GPU runs: session 6,
``benchmarks/results/attention_sm90_gluon_{ws,pp}_*_run27.txt``, ``..._pp_*_run28.txt``).

Two warp-specialised kernels over one consumer body (``_consume``, in ``kernels/attention_sm90.py``):
* ``_attention_fwd_sm90_ws_kernel`` (here): FlashAttention-3's producer/consumer split alone (Shah et al.
  2024, section 3.1): a 1-warp TMA load partition (24 registers) fills the K/V ring; the compute
  partition (``num_warps`` warps) runs the intra-warpgroup overlap and releases stages by mbarrier.
  H100, run27: no faster than the non-specialised ``attention_sm90_gluon.py`` kernel (D128 S8192 full
  456 vs 454 TFLOP/s; cuDNN 603).
* the ping-pong kernel, now the package's (``kernels/attention_sm90.py``; section 3.2 added: two 64-row
  consumer warpgroups take turns at the tensor cores). Run27 (K and V released together): 513 / 472
  TFLOP/s full / causal at B2 H16 S8192 D128. Run28 (K released after its QK^T, V after its P V, K
  loaded a block ahead): 603 / 559, cuDNN 616 / 557, Triton 488 / 434; at D = 64 and S <= 1024 it
  stays at 150-185 against Triton's 205-300 (the per-CTA prologue dominates 4-8 key blocks).
Both are checked by the non-specialised experiment's correctness sweep (every case ok in both runs).

Usage on the GPU: ``python benchmarks/dev/attention_sm90_gluon_ws.py [--kernel ws,pp] [--quick] [--plain]``;
on any machine: ``--compile-only`` (Triton's ptxas: registers, spills, shared memory per config).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

_spec = importlib.util.spec_from_file_location(
    "attention_sm90_gluon", os.path.join(os.path.dirname(os.path.abspath(__file__)), "attention_sm90_gluon.py"))
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)
from pykernels._kernels import attention_sm90 as pkg  # noqa: E402
from pykernels._kernels.attention_sm90 import _consume, _epilogue, _fill_kv_ring, _head_descriptors  # noqa: E402


@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, k_empty, v_empty,
                    start_m, n_blocks, STAGES: gl.constexpr, BLOCK_N: gl.constexpr):
    """The producer warp: Q, then K and V of every block, each stage once the consumers released it."""
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [start_m, 0], q_bar, q_smem)
    _fill_kv_ring(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, k_empty, v_empty, n_blocks, 0, 0, 0, 0, 0, STAGES,
                  BLOCK_N)


@gluon.jit
def _compute_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, k_empty, v_empty,
                       start_m, n_blocks, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
                       O, LSE, o_off, l_off, stride_om, Sq, Sk, qk_scale,
                       HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, IS_CAUSAL: gl.constexpr,
                       q_layout: gl.constexpr, num_warps: gl.constexpr):
    acc, m_i, l_i, _ = _consume(q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, k_empty, v_empty, k_empty, 0, Sk,
                                qk_scale, start_m, n_blocks, HEAD_D, BLOCK_M, BLOCK_N, STAGES, IS_CAUSAL, num_warps,
                                False, 0, 0)
    _epilogue(acc, m_i, l_i, q_smem, O, LSE, o_off, l_off, stride_om, Sq, start_m, q_smem, HEAD_D, BLOCK_M, BLOCK_N,
              num_warps, False, q_layout)


@gluon.jit
def _attention_fwd_sm90_ws_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, stride_lb, stride_lh,
    GROUP, Sq, Sk, qk_scale,
    HEAD_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr, q_layout: gl.constexpr, kv_layout: gl.constexpr, num_warps: gl.constexpr,
):
    dtype: gl.constexpr = Q.dtype.element_ty
    start_m = gl.program_id(0) * BLOCK_M
    h64 = gl.program_id(1).to(gl.int64)
    b = gl.program_id(2).to(gl.int64)
    q_desc, k_desc, v_desc = _head_descriptors(
        Q, K, V, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
        b, h64, (gl.program_id(1) // GROUP).to(gl.int64), Sq, Sk, HEAD_D, BLOCK_M, BLOCK_N, q_layout, kv_layout)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_D], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_D], kv_layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=1)

    if IS_CAUSAL:
        hi = gl.minimum(Sk, start_m + BLOCK_M)
    else:
        hi = Sk
    n_blocks = gl.cdiv(hi, BLOCK_N)

    o_off = b * stride_ob + h64 * stride_oh
    l_off = b * stride_lb + h64 * stride_lh
    gl.warp_specialize([
        (_compute_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, k_empty, v_empty,
                              start_m, n_blocks, STAGES, BLOCK_N, O, LSE, o_off, l_off, stride_om, Sq, Sk, qk_scale,
                              HEAD_D, BLOCK_M, IS_CAUSAL, q_layout, num_warps)),
        (_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, k_empty, v_empty,
                           start_m, n_blocks, STAGES, BLOCK_N)),
    ], [1], [24])


def tri_forward(q, k, v, causal, scale):
    """The Triton forward kernel itself (the package's dense forward without its sm_90 dispatch)."""
    saved = os.environ.get("PYKERNELS_ATTN_SM90")
    os.environ["PYKERNELS_ATTN_SM90"] = "0"
    try:
        return base.tri.attention_fwd(q, k, v, None, causal=causal, scale=scale, dropout_p=0.0, seed=0)
    finally:
        if saved is None:
            os.environ.pop("PYKERNELS_ATTN_SM90")
        else:
            os.environ["PYKERNELS_ATTN_SM90"] = saved


def hd_main() -> None:
    """The sm_90 forward with host-built descriptors against the same kernel making them on the device
    (same math: outputs compared), the Triton forward and cuDNN, with do_bench and in CUDA-graph replay."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench
    print(torch.cuda.get_device_name(), torch.__version__)
    for b, h, s_, d, causal, layout in [
            (32, 12, 512, 64, False, "bhsd"), (32, 12, 512, 64, False, "bshd"), (8, 12, 1024, 64, True, "bhsd"),
            (32, 16, 512, 128, False, "bhsd"), (16, 16, 1024, 128, True, "bshd"), (4, 16, 4096, 128, True, "bhsd"),
            (2, 16, 8192, 128, False, "bhsd"), (2, 16, 8192, 128, True, "bhsd"), (4, 8, 1000, 128, True, "bshd")]:
        def make():
            if layout == "bshd":
                return torch.randn(b, s_, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
            return torch.randn(b, h, s_, d, device="cuda", dtype=torch.bfloat16)
        q, k, v = make(), make(), make()
        flops = 4 * b * h * s_ * s_ * d / (2 if causal else 1)
        o1, l1 = pkg.attention_fwd_sm90(q, k, v, causal=causal, scale=d ** -0.5, host_descriptors=False)
        o2, l2 = pkg.attention_fwd_sm90(q, k, v, causal=causal, scale=d ** -0.5)
        same = torch.equal(o1, o2) and torch.equal(l1, l2)
        rows = [("device-desc", lambda: pkg.attention_fwd_sm90(q, k, v, causal=causal, scale=d ** -0.5,
                                                               host_descriptors=False)),
                ("host-desc", lambda: pkg.attention_fwd_sm90(q, k, v, causal=causal, scale=d ** -0.5)),
                ("triton", lambda: tri_forward(q, k, v, causal, d ** -0.5))]

        def cudnn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        rows.append(("cudnn", cudnn))
        res = " | ".join(f"{n} {flops / do_bench(fn, warmup=25, rep=100) / 1e9:4.0f} / {flops / graph_ms(fn) / 1e9:4.0f}"
                         for n, fn in rows)
        print(f"B{b} H{h} S{s_} D{d} {'causal' if causal else 'full'} {layout}: host == device bitwise {same}; "
              f"TFLOP/s do_bench / graph: {res}", flush=True)


def capture(fn, calls: int = 1):
    """A CUDA graph of ``calls`` calls of ``fn`` (after one warm-up call on a side stream), replayed once."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    return g


def graph_ms(fn, calls: int = 20, replays: int = 10) -> float:
    """Milliseconds per call, ``calls`` calls captured in one CUDA graph and replayed (GPU time)."""
    g = capture(fn, calls)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (calls * replays)


# ping-pong: (BLOCK_M per warpgroup, BLOCK_N, STAGES); a CTA takes 2 * BLOCK_M rows
PP_CONFIGS = {64: [(64, 128, 2), (64, 128, 3), (64, 64, 4)], 128: [(64, 128, 2), (64, 64, 3)]}


CONFIGS = base.CONFIGS
WARPS_TOTAL_REGS = 65536


def _run(kernel, q, k, v, causal, scale, bm, bn, stages, rows_per_cta, warps, regs):
    """Allocate o (laid out like q where TMA allows) and lse, and launch ``kernel`` over (query tiles of
    ``rows_per_cta`` rows, heads, batch)."""
    batch, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    o = base.empty_like_layout(q)
    if any(s % 8 for s in o.stride()[:3]):
        o = base.empty(batch, hq, sq, d, dtype=q.dtype, device=q.device)
    lse = base.empty(batch, hq, sq, dtype=torch.float32, device=q.device)
    base._tuning.ensure_allocator()
    ql, kl = base.smem_layouts(bm, bn, d, q.dtype)
    kernel[(base._tuning.cdiv(sq, rows_per_cta), hq, batch)](
        q, k, v, o, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *lse.stride()[:2],
        hq // hkv, sq, sk, scale * base.LOG2E,
        HEAD_D=d, BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, IS_CAUSAL=bool(causal), q_layout=ql, kv_layout=kl,
        num_warps=warps, maxnreg=regs)
    return o, lse


def attention_fwd_sm90_ws(q, k, v, *, causal: bool, scale: float, config=None):
    """Same contract as ``attention_sm90_gluon.attention_fwd_sm90``."""
    bm, bn, stages, warps = config or CONFIGS[q.shape[-1]][0]
    return _run(_attention_fwd_sm90_ws_kernel, q, k, v, causal, scale, bm, bn, stages, bm, warps, max_regs(warps))


def attention_fwd_sm90_pp(q, k, v, *, causal: bool, scale: float, config=None):
    """The ping-pong kernel; same contract as ``attention_fwd_sm90_ws``. ``config`` = (BLOCK_M per warpgroup,
    BLOCK_N, STAGES), or a 4-tuple of the other experiments (its BLOCK_N and STAGES, 64 rows a warpgroup)."""
    cfg = config or PP_CONFIGS[q.shape[-1]][0]
    cfg = (64, cfg[1], cfg[2]) if len(cfg) == 4 else cfg  # wgmma: 64 rows per warpgroup
    return pkg.attention_fwd_sm90(q, k, v, causal=causal, scale=scale, config=cfg)


def max_regs(warps: int) -> int:
    """The launch's register cap: the compute warps plus one warpgroup for the loader share the SM's
    64K registers (one CTA per SM), in multiples of 8; the loader gives its share back (24 registers)."""
    return WARPS_TOTAL_REGS // ((warps + 4) * 32) // 8 * 8


def _ptxas_report(ptx: str) -> str:
    """Registers and spills of the kernel as Triton's own ptxas reports them for sm_90a (the ptxas Triton
    itself would run: ``TRITON_PTXAS_PATH`` or the bundled one). Tried twice: on the GPU machine, with the
    test suite's eight workers compiling at once, a ptxas run has come back without its report (run78,
    run94); a failure says what ptxas printed."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(90).path
    out = ""
    for _ in range(2):
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "k.ptx")
            with open(src, "w") as f:
                f.write(ptx)
            res = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.o")],
                                 capture_output=True, text=True, timeout=600)
        out = res.stdout + res.stderr
        regs = re.findall(r"Used (\d+) registers", out)
        spills = re.findall(r"(\d+) bytes spill stores", out)
        if regs and spills:
            return f"ptxas: {regs[0]} registers, {spills[0]} bytes spilled"
    return f"ptxas: ? registers, ? bytes spilled (ptxas rc {res.returncode}: {out.strip()[-300:]!r})"


def compile_report(fn, sig: dict, consts: dict, opts: dict) -> str:
    """Compile a Gluon kernel for sm_90 without a GPU (Triton's own ptxas) and say what came out: "compiled;"
    with shared memory, the setmaxnreg values, whether a wgmma group stays in flight, registers and spills,
    or "ERROR ..." (reported, not raised: this is a probe)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    try:
        kern = triton.compile(GluonASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32), options=opts)
    except Exception as e:  # noqa: BLE001
        return f"ERROR {type(e).__name__}: {str(e)[:400]}"
    ptx = kern.asm["ptx"]
    regs = sorted(set(ln.split()[-1] for ln in ptx.splitlines() if "setmaxnreg" in ln))
    return (f"compiled; shared {kern.metadata.shared} B, setmaxnreg {regs}, "
            f"wgmma.wait_group 1: {'wgmma.wait_group.sync.aligned 1' in ptx}"
            f"{'; wgmma.wait_group 2: True' if 'wgmma.wait_group.sync.aligned 2' in ptx else ''}; {_ptxas_report(ptx)}; "
            f"{_mbarrier_report(kern.asm['cubin'])}; wgmma {_wgmma_shapes(ptx)}")


def _wgmma_shapes(ptx: str) -> str:
    """The distinct wgmma shapes in ``ptx`` ("m64n64k16 m64n128k16"), sorted by N."""
    import re
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))
    return " ".join(sorted(shapes, key=lambda t: int(t.split("n")[1].split("k")[0]))) or "none"


def _mbarrier_report(cubin: bytes) -> str:
    """"mbarriers clear" when no mbarrier's 8 bytes share a shared-memory address with a plain load or store
    at a constant address (the values warp-specialised partitions capture are passed that way), else
    "mbarriers OVERLAP <offsets>". The compiler reuses the bytes of an mbarrier that is dead after its init
    for those captures; under another process's GPU load a preempted CTA got the mbarrier's state written
    back over them (the dK/dV kernel's unused ds_bar, run98). From the SASS (Triton's nvdisasm)."""
    import re
    import tempfile

    import triton
    tool = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout
    width = {"": 4, ".64": 8, ".128": 16, ".U8": 1, ".S8": 1, ".U16": 2, ".S16": 2}
    bars = {int(m.group(1) or "0", 16) for m in re.finditer(r"SYNCS\.EXCH\.64 URZ, \[UR\d+(?:\+0x([0-9a-f]+))?\]", sass)}
    plain = [(int(m.group(3) or "0", 16), width.get(m.group(2) or "", 4))
             for m in re.finditer(r"\b(LDS|STS)(\.[A-Z0-9]+)? [^;]*?\[UR\d+(?:\+0x([0-9a-f]+))?\]", sass)]
    hits = sorted({b for b in bars for off, n in plain if off < b + 8 and b < off + n})
    return "mbarriers clear" if not hits else "mbarriers OVERLAP " + ",".join(hex(h) for h in hits)


def _pkg_signature(fn) -> dict:
    """Signature types of an attention kernel's parameters for a bf16 compile (descriptor slots constexpr)."""
    sig = {}
    for p in fn.params:
        n = p.name
        sig[n] = ("*bf16" if n in "QKVO" else "*fp32" if n == "LSE" else "i64" if n.startswith("stride")
                  else "i32" if n in ("GROUP", "Sq", "Sk", "H", "n_m", "n_tiles") else "fp32" if n == "qk_scale" else "constexpr")
    return sig


def compile_only() -> None:
    """Compile every config for sm_90 without a GPU (Triton's ptxas) and print registers and shared memory."""
    runs = [(base._attention_fwd_sm90_kernel, "plain", d, cfg) for d, cfgs in CONFIGS.items() for cfg in cfgs[:1]]
    runs += [(_attention_fwd_sm90_ws_kernel, "ws", d, cfg) for d, cfgs in CONFIGS.items() for cfg in cfgs]
    runs += [(pkg._attention_fwd_sm90_kernel, "ping-pong", d, (cfg[0], cfg[1], cfg[2], 4))
             for d, cfgs in PP_CONFIGS.items() for cfg in cfgs]
    from triton.runtime.jit import mangle_type
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    # the package kernel with host descriptors (typed through a CPU stand-in); D = 256 (one Q tile a warpgroup,
    # ``q_bufs``), D = 192 on its 256-wide tiles and D = 96 on the D = 128 ones (``TILE_D``: D_COLS) without the varlen
    # variant, which their rule does not take (``VARLEN_HEAD_DIMS``); their device-made descriptors too (COLS)
    for d in (*PP_CONFIGS, 256, 192, 96):
        for causal in (False, True):
            bm, bn, stages = pkg.CONFIGS[d]
            td = pkg.TILE_D.get(d, d)
            ql, kl = base.smem_layouts(bm, bn, td, torch.bfloat16)
            t = torch.empty(4096, td, dtype=torch.bfloat16)
            qd, kd = (mangle_type(TensorDescriptor.from_tensor(t, [r, td], lay)) for r, lay in ((bm, ql), (bn, kl)))
            fn = pkg._attention_fwd_sm90_kernel
            sig = _pkg_signature(fn)
            sig.update(QD=qd, OD=qd, KD=kd, VD=kd)
            consts = dict(HEAD_D=td, BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, IS_CAUSAL=causal, HOST_DESC=True,
                          q_layout=ql, kv_layout=kl, num_warps=4, Mask=None, KvRange=None, KEY_PAD=False,
                          CuQ=None, CuK=None, VARLEN=False, Order=None, ORDER=False,
                          Q_BUFS=pkg.q_bufs(bm, bn, stages, td), D_COLS=d if td != d else 0, D_A=0, D_B=0)
            print(f"host-desc D{d} cfg{(bm, bn, stages, 4)} {'causal' if causal else 'full'}: "
                  f"{compile_report(fn, sig, consts, dict(num_warps=4, maxnreg=pkg.MAX_REGS))}")
            if d in pkg.SPLIT:  # staged (``SPLIT_D``): the GEMMs on the columns' two power-of-two blocks only
                sconsts = dict(consts, D_A=pkg.SPLIT[d][0], D_B=pkg.SPLIT[d][1])
                print(f"split D{d} cfg{(bm, bn, stages, 4)} {'causal' if causal else 'full'}: "
                      f"{compile_report(fn, sig, sconsts, dict(num_warps=4, maxnreg=pkg.MAX_REGS))}")
            if td != d:  # the CTAs' own descriptors (the (B, S, H, D) views: their heads do not start at column 0)
                dsig = {kk: vv for kk, vv in sig.items() if kk not in ("QD", "KD", "VD", "OD")}
                dconsts = dict(consts, QD=None, KD=None, VD=None, OD=None, HOST_DESC=False)
                print(f"device-desc D{d} cfg{(bm, bn, stages, 4)} {'causal' if causal else 'full'}: "
                      f"{compile_report(fn, dsig, dconsts, dict(num_warps=4, maxnreg=pkg.MAX_REGS))}")
            if causal:  # the causal persistent grid's tile table (``_causal_order``)
                osig = dict(sig, Order="*i32")
                oconsts = {kk: vv for kk, vv in consts.items() if kk != "Order"}
                oconsts["ORDER"] = True
                print(f"order D{d} cfg{(bm, bn, stages, 4)} causal: "
                      f"{compile_report(fn, osig, oconsts, dict(num_warps=4, maxnreg=pkg.MAX_REGS))}")
            if d in PP_CONFIGS:  # packed varlen sequences (the forward's VARLEN variant, cu_seqlens int32)
                vsig = dict(sig, CuQ="*i32", CuK="*i32")
                vconsts = {kk: vv for kk, vv in consts.items() if kk not in ("CuQ", "CuK")}
                vconsts["VARLEN"] = True
                print(f"varlen D{d} cfg{(bm, bn, stages, 4)} {'causal' if causal else 'full'}: "
                      f"{compile_report(fn, vsig, vconsts, dict(num_warps=4, maxnreg=pkg.MAX_REGS))}")
            if not causal:  # a boolean key-padding mask (the forward's KEY_PAD variant, its own tiles)
                bm, bn, stages = pkg.KEY_PAD_CONFIGS.get(d, pkg.CONFIGS[d])
                ql, kl = base.smem_layouts(bm, bn, td, torch.bfloat16)
                qd, kd = (mangle_type(TensorDescriptor.from_tensor(t, [r, td], lay))
                          for r, lay in ((bm, ql), (bn, kl)))
                sig.update(QD=qd, OD=qd, KD=kd, VD=kd, Mask="*u8", KvRange="*i32")
                consts.update(BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, q_layout=ql, kv_layout=kl, KEY_PAD=True,
                              Q_BUFS=pkg.q_bufs(bm, bn, stages, td))
                del consts["Mask"], consts["KvRange"]
                print(f"keypad D{d} cfg{(bm, bn, stages, 4)} full: "
                      f"{compile_report(fn, sig, consts, dict(num_warps=4, maxnreg=pkg.MAX_REGS))}")
    for fn, kind, d, cfg in runs:
            for causal in (False, True):
                bm, bn, stages, warps = cfg
                ql, kl = base.smem_layouts(bm, bn, d, torch.bfloat16)
                sig = _pkg_signature(fn)
                consts = dict(HEAD_D=d, BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, IS_CAUSAL=causal, q_layout=ql,
                              kv_layout=kl, num_warps=warps)
                if fn is pkg._attention_fwd_sm90_kernel:
                    consts.update(QD=None, KD=None, VD=None, OD=None, HOST_DESC=False, Mask=None, KvRange=None,
                                  KEY_PAD=False, CuQ=None, CuK=None, VARLEN=False, Order=None, ORDER=False,
                                  Q_BUFS=pkg.q_bufs(bm, bn, stages, d), D_COLS=0, D_A=0, D_B=0)
                opts = dict(num_warps=warps)
                if kind != "plain":
                    opts["maxnreg"] = max_regs(8 if kind == "ping-pong" else warps)
                print(f"{kind} D{d} cfg{cfg} {'causal' if causal else 'full'}: {compile_report(fn, sig, consts, opts)}")


def main() -> None:
    if "--compile-only" in sys.argv:
        compile_only()
        return
    if "--host-desc" in sys.argv:
        hd_main()
        return
    # The non-specialised experiment's correctness sweep and benchmark, with its kernel swapped for these
    # (``--kernel ws``, ``pp`` or both); then the non-specialised kernel again in the same run.
    kinds = {"ws": attention_fwd_sm90_ws, "pp": attention_fwd_sm90_pp}
    chosen = sys.argv[sys.argv.index("--kernel") + 1].split(",") if "--kernel" in sys.argv else list(kinds)
    plain = base.attention_fwd_sm90
    plain_configs = base.CONFIGS
    for kind in chosen:
        print(f"== {kind} kernel (correctness sweep, then TFLOP/s with Triton, cuDNN and flash)")
        base.attention_fwd_sm90 = kinds[kind]
        base.CONFIGS = PP_CONFIGS if kind == "pp" else plain_configs
        base.main()
    base.CONFIGS = plain_configs
    if "--plain" not in sys.argv:
        return
    print("== the non-specialised kernel, same shapes")
    from triton.testing import do_bench
    for b, h, s_, d, causal in [(32, 12, 512, 64, False), (2, 16, 8192, 128, False), (2, 16, 8192, 128, True)]:
        q, k, v = (torch.randn(b, h, s_, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * b * h * s_ * s_ * d / (2 if causal else 1)
        for cfg in CONFIGS[d]:
            ms = do_bench(lambda cfg=cfg: plain(q, k, v, causal=causal, scale=d ** -0.5, config=cfg), warmup=50, rep=200)
            print(f"B{b} H{h} S{s_} D{d} {'causal' if causal else 'full':<6} plain gluon {cfg} {ms:8.3f} "
                  f"{flops / ms / 1e9:8.1f}", flush=True)


if __name__ == "__main__":
    main()
