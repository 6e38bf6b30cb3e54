"""The CUDA C++ sources compile for sm_90a (setup.py's default arch list) against the installed torch's headers, on
any machine with nvcc (CPU-only CI included): API drift in torch's C++ headers or a syntax slip shows here, before a
GPU run. ptxas's resource report is checked too: no kernel may spill more than 64 bytes (the LayerNorm backward at
32 elements per thread spills at its 128-register cap: 36 bytes in the 2026-11-27 compile; its forward with fp32
parameters beside fp16 / bf16 rows at 2 packs a thread keeps 8 bytes on the stack, at 48 registers, 2026-11-28; the attention's mma.sync
dK/dV kernel at D = 64 with an arbitrary mask, capped at 168 registers for 3 blocks an SM, 36-48 (20 since its dropout
shares Philox calls, 2026-11-28; the dQ kernels 8), and its sm_90a backward at D = 64 without a mask, whose dQ blocks
hold the last block's dS across the next products, 48-56 (12 with cp.async loads and 4 with TMA since its dropout
draws run inline, 2026-11-28); the cross-entropy, masked-LM and other kernels 0-16; one exception, capped at 256: the
fused sm_90a backward with a mask, and its cp.async twin, _FUSED_MASKED_BWD below), and no warpgroup MMA chain may be serialized by ptxas
(C7515 and its kin);
the attention's wgmma kernels draw their dropout bits inline (read from the SASS; checked by mutation). The host-only sources
(``*.cpp``: attention's checks, autograd and registration) get a g++ syntax check against the same headers."""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sysconfig

import pytest
import torch.utils.cpp_extension as cpp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = sorted(glob.glob(os.path.join(ROOT, "csrc", "*.cu")))
HOST_SOURCES = sorted(glob.glob(os.path.join(ROOT, "csrc", "*.cpp")))


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for home in [os.environ.get("CUDA_HOME"), cpp.CUDA_HOME] + sorted(glob.glob("/usr/local/cuda*"), reverse=True):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return None


NVCC = _nvcc()
PY_INCLUDE = sysconfig.get_paths()["include"]


def _includes(tmp_path) -> list[str]:
    """-I flags for torch's C++ headers (with a stub for the header CMake generates for CUDA builds, which CPU
    wheels of torch lack), Python's and csrc's."""
    stub = tmp_path / "stub" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    includes = [str(tmp_path / "stub")] + cpp.include_paths() + [PY_INCLUDE, os.path.join(ROOT, "csrc")]
    return [f"-I{i}" for i in includes]


DEFINES = ["-DTORCH_EXTENSION_NAME=_C", "-DTORCH_API_INCLUDE_EXTENSION_H", "-D_GLIBCXX_USE_CXX11_ABI=1"]
# setup.py's sm_90a code generation (also benchmarks/dev/cuda_sass.py's)
SM90A_FLAGS = ["-std=c++17", "-O3", "--use_fast_math", "-gencode", "arch=compute_90a,code=sm_90a", "-DPYKERNELS_SM90A",
               "-diag-suppress", "3306"]


@pytest.mark.skipif(NVCC is None, reason="needs nvcc (CUDA toolkit)")
@pytest.mark.skipif(not os.path.exists(os.path.join(PY_INCLUDE, "Python.h")), reason="needs Python headers")
@pytest.mark.parametrize("source", SOURCES, ids=[os.path.basename(s) for s in SOURCES])
def test_cuda_source_compiles_for_sm90a(source, tmp_path):
    cmd = [NVCC, "-c", source, "-o", str(tmp_path / "out.o"), "-Xptxas", "-v"] + SM90A_FLAGS
    cmd += DEFINES + _includes(tmp_path)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    report = res.stdout + res.stderr
    kernels = re.findall(r"Compiling entry function '(\w+)'", report)
    assert kernels, "ptxas reported no kernels"
    # one report a kernel, and one a non-inlined device function (attention.cuh's mask read and Philox draw)
    spills = _spills_by_function(report)
    assert len(spills) >= len(kernels)
    over = {name: n for name, n in spills.items() if n > _spill_cap(name)}
    assert not over, f"spills past the cap: {over}"
    # ptxas keeps the attention's wgmma chains asynchronous (it serializes them, with a C75xx note, when registers
    # an MMA in flight owns are written by other instructions or run short)
    serialized = [line for line in report.splitlines() if "wgmma.mma_async instructions are serialized" in line]
    assert not serialized, serialized[:3]
    if os.path.basename(source) in ("attention_fwd_bf16.cu", "attention_bwd_bf16.cu"):
        _check_dropout_draws_inline(str(tmp_path / "out.o"))
    if os.path.basename(source) == "attention_fwd_bf16.cu":
        _check_fwd_stores_o_by_tma(str(tmp_path / "out.o"))


def _spills_by_function(report: str) -> dict[str, int]:
    """ptxas -v's spill-store bytes of each compiled function (its "Compiling entry function" or "Function
    properties for" line names it; the spill line follows)."""
    spills, name = {}, None
    for line in report.splitlines():
        m = re.search(r"(?:Compiling entry function|Function properties for) '?(\w+)'?", line)
        if m:
            name = m.group(1)
        m = re.search(r"(\d+) bytes spill stores", line)
        if m and name is not None:
            spills[name] = max(spills.get(name, 0), int(m.group(1)))
    return spills


# The fused sm_90a attention backward (attn_bwd_sm90_kernel<T, 64, MODE, true, 1>) with a mask (MODE 1: key only, 2:
# any) holds S^T, dP^T, dK and dV (128 registers a thread at 64-query iterations) at the 168-register cap of three
# blocks an SM, and ptxas spills 7 values around the dropout draws (164-200 bytes of STL in its SASS across both
# causal-edge copies of the loop: 14 local accesses in an iteration of about 1400 instructions, 2026-11-29; 144-220
# bytes of spill stores since Philox runs seven rounds). Its cp.async twin without a mask (MODE 0, TMA false: packed
# varlen sequences, stride-0 K / V) holds the loads' addresses too: 164 bytes (144 without the varlen dq_acc offsets),
# 2026-11-29; and the fused kernel over packed sequences by TMA (MODE 0, TMA, FUSED 3): 84 bytes (21 STL / 23 LDL in its
# SASS against the dense kernel's 4 / 4), 2026-11-29. Every other function keeps the 64-byte cap.
_FUSED_MASKED_BWD = re.compile(r"attn_bwd_sm90_kernel.*Li64ELi(?:[12]ELb1ELi1E|0ELb0ELi1E|0ELb1ELi3E)")


def _spill_cap(name: str) -> int:
    return 256 if _FUSED_MASKED_BWD.search(name) else 64


def test_spill_cap_names_only_the_fused_masked_backward():
    mangled = "_ZN9pykernels4attn20attn_bwd_sm90_kernelI13__nv_bfloat16Li64ELi{}ELb1ELi{}EEEvNS0_6ParamsENS0_6BwdTmaE"
    assert _spill_cap(mangled.format(1, 1)) == 256 and _spill_cap(mangled.format(2, 1)) == 256
    assert _spill_cap(mangled.format(0, 1)) == 64 and _spill_cap(mangled.format(1, 0)) == 64
    cp_async = mangled.replace("ELb1E", "ELb0E")  # (the cp.async twin: TMA false)
    assert _spill_cap(cp_async.format(0, 1)) == 256 and _spill_cap(cp_async.format(1, 1)) == 64
    assert _spill_cap(cp_async.format(0, 0)) == 64
    assert _spill_cap(mangled.format(0, 3)) == 256 and _spill_cap(mangled.format(1, 3)) == 64
    report = ("ptxas info    : Compiling entry function 'k1' for 'sm_90a'\n"
              "    40 bytes stack frame, 164 bytes spill stores, 48 bytes spill loads\n"
              "ptxas info    : Function properties for f2\n    0 bytes stack frame, 8 bytes spill stores, 8 bytes\n")
    assert _spills_by_function(report) == {"k1": 164, "f2": 8}


def _check_dropout_draws_inline(obj: str) -> None:
    """The attention's dropout draws (Philox, then the lane group's transpose by shuffles) run inline in the wgmma
    kernels: out of line, a key block's draws ran one after another (1.4-1.5x slower with dropout, H200 run255).
    Read from the SASS (benchmarks/dev/cuda_sass.py): no function a wgmma kernel CALLs may shuffle; as a control,
    the mma.sync kernels, which keep the draws out of line, do CALL one that shuffles."""
    import contextlib

    from utils import load_benchmark
    with contextlib.contextmanager(load_benchmark)("dev/cuda_sass") as sass:
        functions = sass.sass_functions(obj)
        targets = {name: sass.call_targets(code) for name, code in functions.items()}
    wgmma, control = [], []
    for name, calls in targets.items():
        shuffling = [a for a, body in calls.items() if any("SHFL" in i for i in body)]
        if "_sm90_ws_kernel" in name or "_sm90_pipe_kernel" in name or "attn_bwd_sm90_kernel" in name:
            wgmma.append((name, shuffling))
        elif "attn_fwd_kernel" in name or "attn_bwd_dkdv_kernel" in name or "attn_bwd_dq_kernel" in name:
            control.append(bool(shuffling))
    assert wgmma and all(not calls for _, calls in wgmma), [n for n, calls in wgmma if calls][:3]
    assert control and all(control), "the mma.sync kernels' out-of-line draws were not found: the check is blind"


def _check_fwd_stores_o_by_tma(obj: str) -> None:
    """The warp-specialised forward at D = 64 stores O by TMA (store_out_tma: one UTMASTG a warpgroup's tile, 7% of
    the BERT-base forward, H200 run330-332), with its register stores as the other path (packed sequences, the
    switch); at D = 128 (no shared memory for the tile) only the register stores. Read from the SASS."""
    import contextlib

    from utils import load_benchmark
    with contextlib.contextmanager(load_benchmark)("dev/cuda_sass") as sass:
        functions = sass.sass_functions(obj)
    stores = {name: sum(sass.opcode(i).startswith("UTMASTG") for _, i in code) for name, code in functions.items()
              if "attn_fwd_sm90_ws_kernel" in name}
    d64 = {n: c for n, c in stores.items() if "Li64E" in n}
    d128 = {n: c for n, c in stores.items() if "Li128E" in n}
    assert d64 and d128 and len(d64) + len(d128) == len(stores), sorted(stores)
    assert all(c == 1 for c in d64.values()), d64
    assert all(c == 0 for c in d128.values()), d128


def _cuda_include() -> str:
    """The toolkit's include directory (cuda_runtime_api.h): next to nvcc, or where CUDA_HOME / the usual installs
    put it."""
    homes = [os.path.dirname(os.path.dirname(os.path.realpath(NVCC))), os.environ.get("CUDA_HOME"), cpp.CUDA_HOME]
    homes += sorted(glob.glob("/usr/local/cuda*"), reverse=True)
    found = [h for h in homes if h and os.path.exists(os.path.join(h, "include", "cuda_runtime_api.h"))]
    assert found, f"nvcc at {NVCC} but no cuda_runtime_api.h in {homes}"
    return os.path.join(found[0], "include")


@pytest.mark.skipif(NVCC is None or shutil.which("g++") is None, reason="needs nvcc (CUDA toolkit) and g++")
@pytest.mark.skipif(not os.path.exists(os.path.join(PY_INCLUDE, "Python.h")), reason="needs Python headers")
@pytest.mark.parametrize("source", HOST_SOURCES, ids=[os.path.basename(s) for s in HOST_SOURCES])
def test_host_source_compiles(source, tmp_path):
    cmd = ["g++", "-fsyntax-only", "-std=c++17", source, f"-I{_cuda_include()}"] + DEFINES + _includes(tmp_path)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]


@pytest.mark.skipif(NVCC is None or shutil.which("g++") is None, reason="needs nvcc (CUDA toolkit) and g++")
@pytest.mark.skipif(not os.path.exists(os.path.join(PY_INCLUDE, "Python.h")), reason="needs Python headers")
def test_forward_timeline_build_compiles(tmp_path):
    """The development build with the warp-specialised forward's timeline (-DPYKERNELS_FWD_TRACE through setup.py's
    PYKERNELS_NVCC_FLAGS; benchmarks/dev/attention_fwd_trace.sh) compiles: the bf16 forward unit with its buffer
    (kTraceCtas x kTraceWarps x kTraceN 8-byte values in global memory, as ptxas reports) and attention.cpp with the op
    that reads it. (The package's build has no buffer: test_cuda_source_compiles_for_sm90a keeps its wgmma chains and
    spills as they are.)"""
    src = os.path.join(ROOT, "csrc", "attention_fwd_bf16.cu")
    cmd = [NVCC, "-c", src, "-o", str(tmp_path / "out.o"), "-Xptxas", "-v", "-DPYKERNELS_FWD_TRACE"] + SM90A_FLAGS
    res = subprocess.run(cmd + DEFINES + _includes(tmp_path), capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    gmem = [int(n) for n in re.findall(r"(\d+) bytes gmem", res.stdout + res.stderr)]
    assert gmem and max(gmem) >= 16 * 12 * 1024 * 8, gmem
    host = os.path.join(ROOT, "csrc", "attention.cpp")
    cmd = ["g++", "-fsyntax-only", "-std=c++17", "-DPYKERNELS_FWD_TRACE", host, f"-I{_cuda_include()}"]
    res = subprocess.run(cmd + DEFINES + _includes(tmp_path / "host"), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]


def _host_exe(main):
    """``main`` (a .cpp that includes csrc headers) compiled for the host with g++: the executable's path."""
    exe = main.with_suffix("")
    res = subprocess.run(["g++", "-O2", "-std=c++17", f"-I{os.path.join(ROOT, 'csrc')}", str(main), "-o", str(exe)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return exe


def _walk_exe(tmp_path, names, body):
    """A host program over csrc/fwd_order.cuh's walks: int ``names`` read from argv[1], argv[2], ..., then ``body``
    (the rest of main, printing its rows), compiled by _host_exe."""
    args = ", ".join(f"{n} = atoi(argv[{i}])" for i, n in enumerate(names, 1))
    main = tmp_path / "main.cpp"
    main.write_text('#include <cstdio>\n#include <cstdlib>\n#include "fwd_order.cuh"\n'
                    f"using namespace pykernels::attn;\nint main(int argc, char** argv) {{\n  const int {args};\n"
                    + body + "}\n")
    return _host_exe(main)


def _int_rows(exe, *args) -> list[tuple[int, ...]]:
    """The lines the executable prints for ``args``, each a tuple of its integers."""
    out = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True, check=True).stdout
    return [tuple(int(v) for v in line.split()) for line in out.splitlines() if line]


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_philox_port_matches_triton_stream(tmp_path):
    """csrc/philox.cuh's philox4x32, compiled for the host, gives bit for bit pykernels.attention.philox4x32, the
    eager twin of Triton's tl.randint4x (itself checked against Triton in test_attention.py), for counters and
    seeds past 2^32: the CUDA kernels' dropout masks are the Triton kernels' masks."""
    import torch
    from pykernels.attention import philox4x32
    main = tmp_path / "main.cpp"
    main.write_text('#include <cstdio>\n#include <cstdlib>\n#include "philox.cuh"\n'
                    "int main(int argc, char** argv) {\n"
                    "  unsigned long long seed = strtoull(argv[1], nullptr, 10);\n"
                    "  for (int i = 2; i < argc; ++i) {\n"
                    "    uint32_t c0, c1, c2, c3;\n"
                    "    pykernels::philox4x32(seed, strtoull(argv[i], nullptr, 10), c0, c1, c2, c3);\n"
                    "    printf(\"%08x %08x %08x %08x\\n\", c0, c1, c2, c3);\n"
                    "  }\n}\n")
    exe = _host_exe(main)
    g = torch.Generator().manual_seed(0)
    offsets = [0, 1, 2, 767, 2**31 - 1, 2**31, 2**32 - 1, 2**32 + 5, 2**40 + 3]
    offsets += torch.randint(0, 2**62, (200,), generator=g).tolist()
    for seed in [0, 1, 1234567, 2**32 - 1, 2**40 + 17, 2**63 - 5] + torch.randint(0, 2**62, (5,), generator=g).tolist():
        out = subprocess.run([str(exe), str(seed)] + [str(o) for o in offsets], capture_output=True, text=True,
                             check=True).stdout.split()
        words = torch.stack(philox4x32(seed, torch.tensor(offsets, dtype=torch.int64)), dim=-1).reshape(-1).tolist()
        assert out == [f"{v:08x}" for v in words], seed


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_attention_dropout_bits_port_matches_reference(tmp_path):
    """csrc/philox.cuh's dropout_bits16 (the C++ attention's dropout, compiled for the host) gives bit for bit
    pykernels.attention.dropout_bits (the Triton kernels' mask, checked against them in test_attention.py), for
    rows whose counters pass 2^32 and odd key counts."""
    import torch
    from pykernels.attention import dropout_bits
    main = tmp_path / "main.cpp"
    main.write_text('#include <cstdio>\n#include <cstdlib>\n#include "philox.cuh"\n'
                    "int main(int argc, char** argv) {\n"
                    "  unsigned long long seed = strtoull(argv[1], nullptr, 10);\n"
                    "  unsigned long long sk = strtoull(argv[2], nullptr, 10), sk8 = (sk + 7) / 8;\n"
                    "  for (int i = 3; i < argc; ++i) {\n"
                    "    unsigned long long row = strtoull(argv[i], nullptr, 10);\n"
                    "    for (unsigned j = 0; j < sk; ++j) printf(\"%u\\n\", pykernels::dropout_bits16(seed, row * sk8, j));\n"
                    "  }\n}\n")
    exe = _host_exe(main)
    rows = [0, 1, 5, 2**29 + 3, 2**33 + 1]
    for seed, sk in [(0, 8), (1234567, 17), (2**40 + 17, 3), (987654321, 64)]:
        out = subprocess.run([str(exe), str(seed), str(sk)] + [str(r) for r in rows], capture_output=True, text=True,
                             check=True).stdout.split()
        ref = dropout_bits(seed, torch.tensor(rows), sk).reshape(-1).tolist()
        assert [int(v) for v in out] == ref, (seed, sk)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_attention_lane_exchange_gives_every_lane_its_bits(tmp_path):
    """csrc/philox.cuh's quad and octet exchanges (the C++ attention's dropout: each lane of a group draws one Philox
    call, turns it into 8 keep bits, and the group transposes those bits in xor-shuffle stages), run on the host with
    the shuffles simulated: every lane ends
    with the keep bits dropout_bits16 gives its elements (quad: lane t4's columns 2 t4, 2 t4 + 1 of each call; octet:
    lane g's key g of each call), for counters past 2^32. The kernels' use (which call a lane draws) is checked by the
    GPU tests of the C++ attention's mask against pykernels.attention_dropout_mask."""
    main = tmp_path / "main.cpp"
    main.write_text('#include <cstdio>\n#include <cstdlib>\n#include "philox.cuh"\nusing namespace pykernels;\n'
                    "int main(int argc, char** argv) {\n"
                    "  unsigned long long seed = strtoull(argv[1], nullptr, 10), base = strtoull(argv[3], nullptr, 10);\n"
                    "  uint32_t thr = strtoul(argv[2], nullptr, 10);\n"
                    "  long bad = 0, kept = 0, total = 0;\n"
                    "  for (int trial = 0; trial < 64; ++trial) {\n"
                    "    unsigned long long ctr[8]; uint32_t w[8][4];\n"
                    "    for (int c = 0; c < 8; ++c) {\n"
                    "      ctr[c] = base + trial * 977ull + c * 131ull;\n"
                    "      philox4x32(seed, ctr[c], w[c][0], w[c][1], w[c][2], w[c][3]);\n"
                    "    }\n"
                    "    uint32_t x[8], y[8];\n"
                    "    for (int me = 0; me < 4; ++me)\n"
                    "      x[me] = keep_byte(w[me][0], w[me][1], w[me][2], w[me][3], thr);\n"
                    "    for (int s = 2; s >= 1; s >>= 1) {\n"
                    "      for (int me = 0; me < 4; ++me) y[me] = x[me ^ s];\n"
                    "      for (int me = 0; me < 4; ++me) x[me] = transpose_stage<2>(x[me], y[me], s, me & s);\n"
                    "    }\n"
                    "    for (int me = 0; me < 4; ++me) {\n"
                    "      uint32_t bits = x[me];\n"
                    "      for (int c = 0; c < 4; ++c) for (int q = 0; q < 2; ++q) {\n"
                    "        uint32_t want = dropout_bits16(seed, ctr[c], 2 * me + q) >= thr, got = (bits >> (2 * c + q)) & 1u;\n"
                    "        bad += want != got; kept += got; ++total;\n"
                    "      }\n"
                    "    }\n"
                    "    for (int me = 0; me < 8; ++me)\n"
                    "      x[me] = keep_byte(w[me][0], w[me][1], w[me][2], w[me][3], thr);\n"
                    "    for (int s = 4; s >= 1; s >>= 1) {\n"
                    "      for (int me = 0; me < 8; ++me) y[me] = x[me ^ s];\n"
                    "      for (int me = 0; me < 8; ++me) x[me] = transpose_stage<1>(x[me], y[me], s, me & s);\n"
                    "    }\n"
                    "    for (int me = 0; me < 8; ++me) {\n"
                    "      uint32_t bits = x[me];\n"
                    "      for (int c = 0; c < 8; ++c) {\n"
                    "        uint32_t want = dropout_bits16(seed, ctr[c], me) >= thr, got = (bits >> c) & 1u;\n"
                    "        bad += want != got; kept += got; ++total;\n"
                    "      }\n"
                    "    }\n"
                    "  }\n"
                    '  printf("%ld %ld %ld\\n", bad, kept, total);\n'
                    "}\n")
    exe = _host_exe(main)
    for seed, thr, base in [(5, 6554, 0), (2**40 + 17, 32768, 2**32 - 300), (123456789, 60000, 2**45 + 11)]:
        bad, kept, total = map(int, subprocess.run([str(exe), str(seed), str(thr), str(base)], capture_output=True,
                                                   text=True, check=True).stdout.split())
        assert total == 64 * (4 * 8 + 8 * 8) and bad == 0, (seed, bad)
        assert abs(kept / total - (1 - thr / 65536)) < 0.05, (seed, kept, total)  # the bits are live, not constant


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_layer_norm_keep_pack_bits_port_matches_reference(tmp_path):
    """csrc/philox.cuh's keep_pack_bits (the C++ LayerNorm's dropout, one Philox call for a pack of 8 bf16 / fp16
    or 4 fp32 elements) gives pykernels.layer_norm.layer_norm_dropout_mask's bits, for 8- and 4-element packs."""
    from pykernels.attention import dropout_rate
    from pykernels.layer_norm import layer_norm_dropout_mask
    main = tmp_path / "main.cpp"
    main.write_text('#include <cstdio>\n#include <cstdlib>\n#include "philox.cuh"\n'
                    "int main(int argc, char** argv) {\n"
                    "  unsigned long long seed = strtoull(argv[1], nullptr, 10);\n"
                    "  int rows = atoi(argv[2]), n = atoi(argv[3]), pack = atoi(argv[4]);\n"
                    "  float p = strtof(argv[5], nullptr);\n"
                    "  for (int r = 0; r < rows; ++r)\n"
                    "    for (int c = 0; c < n; c += pack) {\n"
                    "      unsigned long long counter = (unsigned long long)r * ((n + 7) / 8) + c / 8;\n"
                    "      unsigned bits = pack == 8 ? pykernels::keep_pack_bits<8>(seed, counter, c & 7, p)\n"
                    "                                : pykernels::keep_pack_bits<4>(seed, counter, c & 7, p);\n"
                    "      for (int j = 0; j < pack; ++j) printf(\"%u\\n\", (bits >> j) & 1u);\n"
                    "    }\n}\n")
    exe = _host_exe(main)
    for seed, rows, n, pack, p in [(5, 3, 64, 8, 0.1), (123456789, 4, 36, 4, 0.3), (2**40 + 1, 2, 8, 8, 0.5)]:
        out = subprocess.run([str(exe), str(seed), str(rows), str(n), str(pack), repr(dropout_rate(p))],
                             capture_output=True, text=True, check=True).stdout.split()
        want = layer_norm_dropout_mask(seed, (rows, n), p).reshape(-1).int().tolist()
        assert [int(v) for v in out] == want, (seed, n, pack)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("batch,hq,g,causal", [(32, 12, 132, False), (7, 3, 5, True), (1, 1, 132, False),
                                               (300, 4, 132, True), (5, 2, 1, False)])
def test_attention_forward_order_walk_covers_every_tile_once(tmp_path, batch, hq, g, causal):
    """csrc/fwd_order.cuh's order_tile (the warp-specialised forward's ordered walk over packed sequences), compiled
    for the host over ranks sorted as attn_fwd_order_kernel sorts them (by key blocks, most first): the walk's tiles
    are every (sequence, head, query tile) once, empty sequences none; within each round of g blocks the ranks run
    forward on even rounds and backward on odd ones (so each block alternates long and short tiles), the last,
    partial round over its own tiles; in the ranks' order a head's query tiles run first to last, last to first where
    causal."""
    import torch
    main = tmp_path / "main.cpp"
    main.write_text('#include <cstdio>\n#include <cstdlib>\n#include <vector>\n#include "fwd_order.cuh"\n'
                    "using namespace pykernels::attn;\n"
                    "int main(int argc, char** argv) {\n"
                    "  const int batch = atoi(argv[1]), hq = atoi(argv[2]), g = atoi(argv[3]), causal = atoi(argv[4]);\n"
                    "  std::vector<int> seq(batch), pre(batch + 1), m_of(batch);\n"
                    "  for (int r = 0; r < batch; ++r) seq[r] = atoi(argv[5 + r]);\n"
                    "  for (int b = 0; b < batch; ++b) m_of[b] = atoi(argv[5 + batch + b]);\n"
                    "  pre[0] = 0;\n"
                    "  for (int r = 0; r < batch; ++r) pre[r + 1] = pre[r] + hq * m_of[seq[r]];\n"
                    "  for (int t = 0; t < pre[batch]; ++t) {\n"
                    "    const OrderTile x = order_tile(t, g, batch, causal, seq.data(), pre.data(), m_of.data());\n"
                    "    printf(\"%d %d %d\\n\", x.b, x.h, x.m);\n"
                    "  }\n}\n")
    exe = _host_exe(main)
    gen = torch.Generator().manual_seed(batch * 7 + g)
    lengths = torch.randint(0, 1500, (batch,), generator=gen).tolist()
    lengths[0] = 0
    m_of = [-(-n // 128) for n in lengths]
    keys = [min(-(-n // 128), 63) for n in lengths]  # (the order kernel's classes: key blocks)
    seq = sorted(range(batch), key=lambda b: (-keys[b], b))
    out = subprocess.run([str(exe), str(batch), str(hq), str(g), str(int(causal))] + [str(b) for b in seq] +
                         [str(m) for m in m_of], capture_output=True, text=True, check=True).stdout.split()
    walk = [tuple(int(v) for v in out[i:i + 3]) for i in range(0, len(out), 3)]
    expected = [(b, h, m) for b in range(batch) for h in range(hq) for m in range(m_of[b])]
    assert sorted(walk) == sorted(expected) and len(walk) == len(expected)
    rank = {b: r for r, b in enumerate(seq)}
    for r0 in range(0, len(walk), g):
        ranks = [rank[b] for b, _, _ in walk[r0:r0 + g]]
        assert ranks == sorted(ranks, reverse=(r0 // g) % 2 == 1), r0
    n = len(walk)
    by_u = [None] * n  # the walk in the ranks' order (undoing the rounds' directions)
    for t, x in enumerate(walk):
        base = t // g * g
        k, width = t - base, min(g, n - base)
        by_u[base + (width - 1 - k if (t // g) % 2 else k)] = x
    assert [rank[b] for b, _, _ in by_u] == sorted(rank[b] for b, _, _ in by_u)
    for b in range(batch):  # a head's tiles first to last, or last to first where causal
        for h in range(hq):
            ms = [m for bb, hh, m in by_u if (bb, hh) == (b, h)]
            assert ms == sorted(ms, reverse=causal), (b, h)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("n_u,hq,batch,g", [(8, 12, 32, 132), (2, 12, 128, 132), (4, 12, 64, 132), (5, 3, 7, 4),
                                            (16, 16, 4, 132), (2, 1, 1, 1), (3, 2, 5, 7), (7, 5, 3, 2), (2, 3, 1, 50)])
def test_attention_forward_mixed_head_tiles(tmp_path, n_u, hq, batch, g):
    """csrc/fwd_order.cuh's mix_rows (the three-consumer forward's tiles of three 64-row units that may mix heads,
    kMix: the producer's divisions) and MixWalk (the consumers' sums), compiled for the host: equal, block by block
    and tile by tile; the tiles cover every (batch, head, query block) once, warpgroup w of tile t taking unit 3 t + w
    (units past the last: the last head's blocks past its n_u, in the walk's last tile only); a tile meets one head
    or two, ``step`` 2 exactly where it meets two, and ``second`` marks the warpgroups of the second (the ring's odd
    positions: the producer's order)."""
    exe = _walk_exe(tmp_path, ("n_u", "hq", "batch", "g"),
                    "  const int units = n_u * hq * batch, tiles = (units + 2) / 3;\n"
                    "  for (int blk = 0; blk < g && blk < tiles; ++blk) {\n"
                    "    MixWalk w(g, blk, n_u, hq);\n"
                    "    for (int t = blk; t < tiles; t += g, w.next(n_u, hq))\n"
                    "      for (int k = 0; k < 3; ++k) {\n"
                    "        const MixRows a = w.rows(k, 3, n_u, hq, batch), e = mix_rows(t, k, n_u, hq, units);\n"
                    "        printf(\"%d %d %d %d %d %d %d %d %d %d %d %d\\n\", t, k, a.m, a.h, a.b, a.step, a.second,\n"
                    "               e.m, e.h, e.b, e.step, e.second);\n"
                    "      }\n"
                    "  }\n")
    rows = _int_rows(exe, n_u, hq, batch, g)
    units = n_u * hq * batch
    tiles = -(-units // 3)
    assert len(rows) == 3 * tiles
    got = {}
    for t, k, *x in rows:
        assert x[:5] == x[5:], (t, k, x)
        got[t, k] = x[:5]
    seen = []
    for t in range(tiles):
        heads = set()
        for k in range(3):
            m, h, b, step, second = got[t, k]
            u = 3 * t + k
            if u < units:
                assert (b * hq + h) * n_u + m == u and 0 <= m < n_u, (t, k, got[t, k])
                seen.append((b, h, m))
                heads.add((b, h))
            else:  # past the last unit: the last head's rows past its end, in the last tile
                assert t == tiles - 1 and (b, h) == (batch - 1, hq - 1) and m == n_u + u - units, (t, k)
        assert len(heads) in (1, 2)
        first = (got[t, 0][2], got[t, 0][1])
        for k in range(3):
            m, h, b, step, second = got[t, k]
            assert step == len(heads) and second == int((b, h) != first), (t, k, got[t, k])
    assert sorted(seen) == [(b, h, m) for b in range(batch) for h in range(hq) for m in range(n_u)]


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("n_m,hq,batch,g", [(4, 12, 32, 132), (16, 16, 4, 128), (8, 12, 8, 132), (1, 1, 1, 1),
                                            (3, 5, 7, 2), (7, 3, 11, 50), (2, 40, 3, 132), (5, 1, 300, 17)])
def test_attention_forward_tile_walk_is_tile_of(tmp_path, n_m, hq, batch, g):
    """csrc/fwd_order.cuh's TileWalk (the warp-specialised forward's consumers step their tiles by additions) gives,
    block by block and round by round, the tile tile_of computes with its divisions (the producer's walk), causal
    flips included; and the walk covers every (query tile, head, batch) once."""
    exe = _walk_exe(tmp_path, ("n_m", "hq", "batch", "g"),
                    "  const long long n = static_cast<long long>(n_m) * hq * batch;\n"
                    "  for (int flip = 0; flip < 2; ++flip)\n"
                    "    for (int blk = 0; blk < g && blk < n; ++blk) {\n"
                    "      TileWalk w(g, blk, n_m, hq);\n"
                    "      for (long long t = blk; t < n; t += g, w.next(n_m, hq)) {\n"
                    "        const Tile a = w.tile(n_m, g, flip), e = tile_of(t, n_m, hq, g, flip);\n"
                    "        printf(\"%d %lld %d %d %d %d %d %d\\n\", flip, t, a.m, a.h, a.b, e.m, e.h, e.b);\n"
                    "      }\n"
                    "    }\n")
    rows = _int_rows(exe, n_m, hq, batch, g)
    n = n_m * hq * batch
    assert len(rows) == 2 * n
    for flip, t, *got in rows:
        assert got[:3] == got[3:], (flip, t, got)
        bh, m = divmod(t, n_m)
        rev = flip and (g % n_m != 0 or (t // g) % 2 == 0)
        assert got[:3] == [n_m - 1 - m if rev else m, bh % hq, bh // hq], (flip, t, got)
    for flip in (0, 1):
        tiles = sorted(tuple(r[2:5]) for r in rows if r[0] == flip)
        assert tiles == sorted((m, h, b) for b in range(batch) for h in range(hq) for m in range(n_m))


def _kernels_and_plain_launches(text: str) -> tuple[dict[str, str], set[str]]:
    """The __global__ functions of a source (name -> the body's text from its opening brace) and the names its
    ``<<<`` launches name."""
    kernels = {}
    for m in re.finditer(r"__global__\s+void\s+(?:__launch_bounds__\((?:[^()]|\([^()]*\))*\)\s*)?(\w+)\s*\(", text):
        kernels[m.group(1)] = text[text.index("{", m.end()):]
    plain = set(re.findall(r"(\w+)(?:<[^;{}]*?>)?<<<", text))
    return kernels, plain


def test_programmatic_launches_wait_first():
    """csrc/pdl.cuh's rule: a kernel launched with programmatic stream serialization (launch_pdl, or attention.cuh's
    launch helpers over it) may run beside the kernel ahead of it, so it must wait (pdl_enter) before it touches
    global memory. Every kernel of csrc is launched either by ``<<<`` (plainly) or through launch_pdl, so every
    kernel no ``<<<`` names must open with pdl_enter(); checked on the sources, and the check on a kernel that
    does not."""
    sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "*.cu")) + glob.glob(os.path.join(ROOT, "csrc", "*.cuh")))
    found = {os.path.basename(s): _kernels_and_plain_launches(open(s).read()) for s in sources
             if os.path.basename(s) != "pdl.cuh"}
    plain = set().union(*(p for _, p in found.values()))
    assert not any("__launch_bounds__" in k for k, _ in found.values()), "a __launch_bounds__ the regex does not parse"
    checked = []
    for src, (kernels, _) in found.items():
        for name, body in kernels.items():
            if name in plain:
                continue
            assert body[1:].lstrip().startswith("pdl_enter();"), f"{src}: {name} does not open with pdl_enter()"
            checked.append(name)
    assert {"ln_fwd_kernel", "ln_bwd_kernel", "attn_fwd_sm90_ws_kernel", "attn_bwd_sm90_kernel",
            "attn_dq_convert_kernel", "attn_bwd_pre_kernel"} <= set(checked), checked
    # the check itself: a kernel launched through launch_pdl without the wait is found, one launched plainly is not
    bad = ("__global__ void __launch_bounds__(256, (f<a, 2>)) k1(int* p) {\n  p[0] = 1;\n}\n"
           "__global__ void k2(int* p) { p[0] = 2; }\nvoid go() { launch_pdl(k1, 1, 1, 0, s, p); k2<<<1, 1>>>(p); }\n")
    kernels, plain = _kernels_and_plain_launches(bad)
    assert set(kernels) == {"k1", "k2"} and plain == {"k2"}
    assert not kernels["k1"][1:].lstrip().startswith("pdl_enter();")


def test_attention_forward_mixed_head_protocol_model():
    """benchmarks/dev/attention_fwd_mix_protocol.py, the model of the kMix forward's barrier protocol (its producer's
    order, the consumers' turns and their frees of the other head's blocks): no deadlock, every consumer reading its
    own head's blocks and no load landing in a held slot, over random schedules of tiles of one and two heads."""
    import contextlib

    from utils import load_benchmark
    with contextlib.contextmanager(load_benchmark)("dev/attention_fwd_mix_protocol") as model:
        assert model.main(["--seeds", "2"]) == 0
        for n_u, heads, nkb in ((2, 3, 4), (5, 2, 3), (8, 1, 1)):
            assert model.run(n_u, heads, nkb, 2, seed=7)
        with pytest.raises(RuntimeError, match="deadlock"):  # (a block left unfreed: the model sees it)
            model.run(2, 2, 4, 1, seed=0, keep_last=True)


def test_attention_forward_trace_latency(capsys):
    """benchmarks/dev/attention_fwd_trace.py's ``latency``: on a synthetic timeline whose producer issues ring
    position n's K at 1000 n and V at 1000 n + 400, and whose consumer arrives at its wait 5000 cycles after the K's
    issue and passes it 300 later, it prints those spans (the lead 5000, the wait 300, K issue to pass 5300, the
    previous V's issue to pass 5900, a K 600 after the previous V)."""
    import contextlib

    from utils import load_benchmark
    with contextlib.contextmanager(load_benchmark)("dev/attention_fwd_trace") as trace:
        n = 12
        prod = [e for i in range(n) for e in ((9, 1000 * i), (10, 1000 * i + 400))]
        cons = [(0, 0)] + [e for i in range(n) for e in ((4, 1000 * i + 5000), (11, 1000 * i + 5300))]
        cta = [prod, [], [], [], cons] + [[] for _ in range(11)]
        trace.latency([cta, cta], [(1, 4)])
        out = capsys.readouterr().out
        assert "consumer 1 latency:" in out and "(n 16)" in out, out
        for key, val in (("K issue->arrival", 5000), ("arrival->pass", 300), ("K issue->pass", 5300),
                         ("V(n-1) issue->pass", 5900), ("K(n) issue - V(n-1) issue", 600)):
            assert f"{key} {val:6d}" in out, (key, out)
