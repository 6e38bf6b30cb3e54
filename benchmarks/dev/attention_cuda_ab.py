"""The CUDA C++ attention's speed on the quick shapes, for an A/B of two builds in one device call (build one,
run this with its label, rebuild, run it again: ``attention_cuda_ab_builds.sh`` does both builds): CUDA-graph replay of the forward and of forward+backward
(``benchmarks/attention.py``'s ``graph_time``), TFLOP/s as that script counts them, bf16.

Usage (GPU): ``python benchmarks/dev/attention_cuda_ab.py LABEL [--fwd-kernels]``. One line a shape:
``LABEL case fwd_ms bwd_ms fwd_TFLOPs bwd_TFLOPs``. ``--fwd-kernels``: each shape three times in this process, with
the mma.sync kernels (``PYKERNELS_CUDA_ATTN_SM90=0``, labels ``LABEL-mma``), the wgmma kernels without the
warp-specialised forward (``=1``, ``LABEL-wgmma``) and the default (``LABEL-default``: on an sm_90a build and a 9.0
device, the warp-specialised forward where it covers the case). ``--peers``: after the C++ rows, the same shapes through the
Triton path (``backend="triton"``) and torch's cuDNN SDPA, labelled ``triton`` and ``cudnn``, as a yardstick."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import attention as bench  # noqa: E402  (benchmarks/attention.py)
from torch.nn.attention import SDPBackend  # noqa: E402

CASES = [c for c in bench.CASES if c.quick] + [bench.Case("causal_2k_d128", 4, 16, 2048, 128, causal=True)]


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    label = args[0] if args else "build"
    if "--fwd-kernels" not in sys.argv:
        run(label)
        if "--peers" in sys.argv:
            run("triton", lambda mask, causal: bench.pykernels_impl(mask, causal, "triton"))
            run("cudnn", lambda mask, causal: bench.sdpa_impl(mask, causal, SDPBackend.CUDNN_ATTENTION))
        return
    for kernel, env in (("mma", "0"), ("wgmma", "1"), ("default", None)):
        if env is None:
            os.environ.pop("PYKERNELS_CUDA_ATTN_SM90", None)
        else:
            os.environ["PYKERNELS_CUDA_ATTN_SM90"] = env
        run(f"{label}-{kernel}")


def run(label: str, impl=None) -> None:
    impl = impl or (lambda mask, causal: bench.pykernels_impl(mask, causal, "cuda"))
    for case in CASES:
        q, k, v, do, _, mask = bench.case_inputs(case)
        t = bench.graph_time(impl(mask, case.causal), q, k, v, do)
        if "graph_fwd_ms" not in t:
            print(label, case.name, t)
            continue
        f, b = t["graph_fwd_ms"], t["graph_bwd_ms"]
        print(f"{label} {case.name} {f:.4f} {b:.4f} {bench.tflops(case.fwd_flops, f):.1f} "
              f"{bench.tflops(2.5 * case.fwd_flops, b):.1f}", flush=True)


if __name__ == "__main__":
    main()
