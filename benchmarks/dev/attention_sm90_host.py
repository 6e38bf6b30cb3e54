"""Host time of the sm_90 forward per call, and whether its launches take the fast path
(``kernels/_launch.py``): ``python benchmarks/dev/attention_sm90_host.py`` on an sm_90 GPU."""
from __future__ import annotations

import time

import torch

from pykernels._kernels import _launch
from pykernels._kernels import attention_sm90 as ks


def main() -> None:
    q, k, v = (torch.randn(8, 12, 1024, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for causal in (False, True):
        for host in (True, False):
            fn = lambda: ks.attention_fwd_sm90(q, k, v, causal=causal, scale=0.125, host_descriptors=host)  # noqa: E731
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            fk = _launch.fast(ks._attention_fwd_sm90_kernel)
            before = list(fk.launches)
            n = 200
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            fast, normal = (a - b for a, b in zip(fk.launches, before))
            print(f"causal={causal} host_descriptors={host}: {(t1 - t0) / n * 1e6:.0f} us host per call; "
                  f"fast launches {fast}, normal {normal}", flush=True)
    import cProfile
    import pstats
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(100):
        ks.attention_fwd_sm90(q, k, v, causal=True, scale=0.125)
    pr.disable()
    pstats.Stats(pr).sort_stats("cumulative").print_stats(18)


if __name__ == "__main__":
    main()
