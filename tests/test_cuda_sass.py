"""benchmarks/dev/cuda_sass.py (ptxas resources and SASS of the C++ kernels on a machine without a GPU) on a tiny
kernel with an out-of-line function: the resources parse, a saved build diffs against a changed one, and the SASS
listing finds the kernel's CALL target with its body up to RET."""
from __future__ import annotations

import json

import pytest
from utils import load_benchmark


@pytest.fixture(scope="module")
def cuda_sass():
    yield from load_benchmark("dev/cuda_sass")


SOURCE = """#include <cstdint>
__device__ __noinline__ uint32_t mix(uint32_t a, uint32_t b) { return __umulhi(a, b) ^ (a * b); }
__global__ void tiny(const uint32_t* in, uint32_t* out) { out[threadIdx.x] = mix(in[threadIdx.x], 0xD2511F53u); }
"""


def test_cuda_sass_resources_diff_and_calls(cuda_sass, tmp_path, capsys):
    if cuda_sass.test_csrc.NVCC is None:
        pytest.skip("needs nvcc (CUDA toolkit)")
    try:
        cuda_sass.cuobjdump()
    except SystemExit:
        pytest.skip("needs cuobjdump (the CUDA toolkit's or triton's)")
    src = tmp_path / "tiny.cu"
    src.write_text(SOURCE)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    cuda_sass.main(["resources", str(src), "--save", str(a)])
    res = json.loads(a.read_text())
    (name,) = res
    assert "tiny" in name and res[name]["regs"] > 0 and res[name]["spill"] == 0 and res[name]["stack"] >= 0
    res[name]["spill"] = 8
    b.write_text(json.dumps(res))
    capsys.readouterr()
    cuda_sass.main(["diff", str(a), str(b)])
    out = capsys.readouterr().out
    assert "1 of 1 kernels differ" in out and "'spill': 8" in out
    cuda_sass.main(["sass", str(src), "--match", "tiny"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(name) and "CALL:1" in lines[0] and "NOP" not in lines[0]
    call = [ln for ln in lines if ln.strip().startswith("CALL 0x")]
    assert len(call) == 1 and "IMAD" in call[0] and "RET:1" in call[0]
    assert 3 <= int(call[0].split(": ")[1].split()[0]) < 20  # the body up to RET, not the rest of the kernel


def test_cuda_sass_diff_pairs_kernels_of_anonymous_namespaces(cuda_sass, tmp_path, capsys):
    """Two compiles of one source in different directories name its anonymous namespace differently (a hash of
    the path): ``diff`` pairs the kernels by their names with that part set aside."""
    def name(tag: str, kernel: str) -> str:
        anon = f"_GLOBAL__N__{tag}_16_cross_entropy_cu_528cafa4_18491"
        return f"_ZN9pykernels{len(anon)}{anon}{kernel}"

    k1, k2 = "13ce_bwd_kernelIfiLb0EEEvPKT_", "13ce_fwd_kernelIfiLb0EEEvPKT_"
    assert cuda_sass.stable_name(name("291fbbf5", k1)) == cuda_sass.stable_name(name("62b9eba3", k1))
    assert cuda_sass.stable_name(name("291fbbf5", k1)).endswith(k1)  # the length prefix decides where the name goes on
    assert cuda_sass.stable_name("_Z4tinyPKjPj") == "_Z4tinyPKjPj"
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({name("291fbbf5", k1): {"regs": 48, "spill": 2}, name("291fbbf5", k2): {"regs": 40}}))
    b.write_text(json.dumps({name("62b9eba3", k1): {"regs": 48, "spill": 0}, name("62b9eba3", k2): {"regs": 40}}))
    capsys.readouterr()
    cuda_sass.main(["diff", str(a), str(b)])
    out = capsys.readouterr().out
    assert "1 of 2 kernels differ" in out and "ce_bwd_kernel" in out and "ce_fwd_kernel" not in out
