"""Host time per call of the torch GEMM variants the masked-LM loss's sized backward issues per chunk
(bf16 inputs, shapes of one BERT-base chunk), with the GPU kept ahead so that only the host is timed.

Usage (GPU): ``python benchmarks/dev/gemm_host.py``"""
from __future__ import annotations

import torch

from host_overhead import per_call_us  # benchmarks/dev/ (the script's directory is on sys.path)


def main() -> None:
    dev, bf = "cuda", torch.bfloat16
    m, vc, h = 256, 512, 256  # small: the GPU finishes each call before the host issues the next
    d = torch.randn(m, vc, device=dev, dtype=bf)
    hc = torch.randn(m, h, device=dev, dtype=bf)
    w = torch.randn(vc, h, device=dev, dtype=bf)
    dw = torch.empty(vc, h, device=dev, dtype=bf)
    acc = torch.zeros(m, h, device=dev)
    dt = d.t()
    cases = {
        "torch.mm(d.t(), hc, out=dw)": lambda: torch.mm(dt, hc, out=dw),
        "torch.mm(d, w)": lambda: torch.mm(d, w),
        "torch.mm(d, w, out_dtype=fp32)": lambda: torch.mm(d, w, out_dtype=torch.float32),
        "torch.addmm(acc, d, w, out_dtype=fp32, out=acc)": lambda: torch.addmm(acc, d, w, out_dtype=torch.float32,
                                                                             out=acc),
        "acc.addmm_(d.float(), w.float())": lambda: acc.addmm_(d.float(), w.float()),
        "dw[0:512] (slice)": lambda: dw[0:512],
        "d.sum(0, dtype=fp32)": lambda: d.sum(0, dtype=torch.float32),
    }
    print(torch.cuda.get_device_name(), torch.__version__)
    for name, fn in cases.items():
        print(f"{name:<50} {per_call_us(fn):7.1f} us")


if __name__ == "__main__":
    main()
