"""The two cuBLAS GEMMs of one sized-backward chunk of the masked-LM loss, alone, at the chunk widths
the backward uses: dW[chunk] = dz^T h (output VC x H, reduction over the M rows) and dh += dz W[chunk]
(fp32 accumulator, reduction over VC). A narrow chunk's dW GEMM has few output tiles (VC = 1024, H = 768:
48 tiles of 128 x 128 for 132 SMs), so it is also timed split over the rows (bmm of S row groups into
fp32, then one sum), to see whether the machine is idle there.

Usage (GPU): ``python benchmarks/dev/mlm_gemm_probe.py``. Prints ms and TFLOP/s per variant."""
from __future__ import annotations

import torch
from triton.testing import do_bench


def tflops(flop: float, ms: float) -> str:
    return f"{ms * 1e3:8.1f} us {flop / ms / 1e9:6.0f} TFLOP/s"


def main() -> None:
    torch.manual_seed(0)
    dt = torch.bfloat16
    print(torch.cuda.get_device_name(), torch.__version__)
    for m, h, vcs in ((8192, 768, (1024, 2048, 4096, 8192)), (2446, 768, (5120,))):
        hc = torch.randn(m, h, device="cuda", dtype=dt)
        for vc in vcs:
            d = torch.randn(m, vc, device="cuda", dtype=dt) * 1e-3
            wc = torch.randn(vc, h, device="cuda", dtype=dt)
            dw = torch.empty(vc, h, device="cuda", dtype=dt)
            acc = torch.zeros(m, h, device="cuda", dtype=torch.float32)
            flop = 2.0 * m * vc * h
            ref = (d.float().t() @ hc.float())
            ms = do_bench(lambda: torch.mm(d.t(), hc, out=dw))
            print(f"M {m} VC {vc}: dW mm            {tflops(flop, ms)}")
            for split in (2, 4, 8):
                if m % split:
                    continue
                a = d.view(split, m // split, vc).transpose(1, 2)
                b = hc.view(split, m // split, h)
                try:
                    out = torch.bmm(a, b, out_dtype=torch.float32).sum(0)
                    err = ((out - ref).abs().max() / ref.abs().max()).item()
                    ms = do_bench(lambda: torch.bmm(a, b, out_dtype=torch.float32).sum(0).to(dt))
                    print(f"M {m} VC {vc}: dW bmm split {split}     {tflops(flop, ms)}  rel err {err:.1e}")
                except (TypeError, RuntimeError) as e:  # noqa: PERF203
                    print(f"M {m} VC {vc}: dW bmm split {split}: {type(e).__name__} {str(e)[:120]}")
            ms = do_bench(lambda: torch.addmm(acc, d, wc, out_dtype=torch.float32, out=acc))
            print(f"M {m} VC {vc}: dh addmm fp32 acc {tflops(flop, ms)}")
            ms = do_bench(lambda: torch.mm(d, wc, out_dtype=torch.float32))
            print(f"M {m} VC {vc}: dh mm fp32 out   {tflops(flop, ms)}")
            s1 = torch.cuda.Stream()
            s2 = torch.cuda.Stream()

            def both():
                cur = torch.cuda.current_stream()
                s1.wait_stream(cur)
                s2.wait_stream(cur)
                with torch.cuda.stream(s1):
                    torch.mm(d.t(), hc, out=dw)
                with torch.cuda.stream(s2):
                    torch.addmm(acc, d, wc, out_dtype=torch.float32, out=acc)
                cur.wait_stream(s1)
                cur.wait_stream(s2)

            ms_seq = do_bench(lambda: (torch.mm(d.t(), hc, out=dw),
                                       torch.addmm(acc, d, wc, out_dtype=torch.float32, out=acc)))
            ms_par = do_bench(both)
            print(f"M {m} VC {vc}: both GEMMs one stream {tflops(2 * flop, ms_seq)}; two streams {tflops(2 * flop, ms_par)}")


if __name__ == "__main__":
    main()
