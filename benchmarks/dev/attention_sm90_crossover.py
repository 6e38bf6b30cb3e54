"""Where the sm_90 Gluon forward (kernels/attention_sm90.py) beats the Triton forward: pykernels'
forward at D = 64 and 128 over key lengths, ``PYKERNELS_ATTN_SM90`` off and on (the dispatch reads it
per call), 16K query tokens, 16 heads, bf16. Usage (sm_90 GPU): ``python benchmarks/dev/attention_sm90_crossover.py``.
The ``preferred`` rule in ``kernels/attention_sm90.py`` comes from this table."""
from __future__ import annotations

import importlib.util
import os

import torch
from triton.testing import do_bench

from pykernels._kernels import attention as katt
from pykernels._kernels import attention_sm90


def _graph_ms():
    spec = importlib.util.spec_from_file_location(
        "attention_sm90_gluon_ws", os.path.join(os.path.dirname(os.path.abspath(__file__)), "attention_sm90_gluon_ws.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.graph_ms


def main() -> None:
    graph_ms = _graph_ms()
    print(torch.cuda.get_device_name(), torch.__version__)
    print(f"{'D':>4} {'S':>6} {'causal':>6} {'triton':>8} {'gluon':>8} {'ratio':>6}  (TFLOP/s, do_bench; then graph replay)")
    for d in (64, 128):
        for s in (256, 512, 1024, 2048, 4096, 8192):
            b, h = max(1, 16384 // s), 16
            q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            for causal in (False, True):
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                res = []
                for flag in ("0", "1"):
                    os.environ["PYKERNELS_ATTN_SM90"] = flag
                    if d == 64:  # the D = 64 rule is what this measures: call the kernel itself
                        fn = (lambda: attention_sm90.attention_fwd_sm90(q, k, v, causal=causal, scale=d ** -0.5)) \
                            if flag == "1" else (lambda: katt.attention_fwd(q, k, v, None, causal=causal,
                                                                            scale=d ** -0.5, dropout_p=0.0, seed=0))
                    else:
                        took = katt.sm90_forward(q, k, v, None, dropout_p=0.0, scale=d ** -0.5, causal=causal)
                        assert took == (flag == "1"), (d, s, flag)
                        fn = lambda: katt.attention_fwd(q, k, v, None, causal=causal, scale=d ** -0.5,  # noqa: E731
                                                        dropout_p=0.0, seed=0)
                    res.append(flops / do_bench(fn, warmup=25, rep=100) / 1e9)
                    res.append(flops / graph_ms(fn) / 1e9)
                print(f"{d:>4} {s:>6} {str(causal):>6} {res[0]:8.1f} {res[2]:8.1f} {res[2] / res[0]:6.2f}   "
                      f"{res[1]:8.1f} {res[3]:8.1f} {res[3] / res[1]:6.2f}", flush=True)
    os.environ.pop("PYKERNELS_ATTN_SM90")


if __name__ == "__main__":
    main()
