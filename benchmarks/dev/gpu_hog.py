"""Other GPU load for reproducing load-dependent failures: ``python gpu_hog.py SECONDS [GiB] [--no-compute]``
holds GiB of device memory and (unless --no-compute) runs bf16 matmuls in a loop, from its own process; it
prints "ready" once its first matmul ran (``tests/test_attention.py`` waits for that line)."""
import sys
import time

import torch

seconds, gib = float(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 20.0
held = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device="cuda")
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
a = (a @ a).clamp_(-1, 1)
torch.cuda.synchronize()
print("ready", flush=True)
end = time.time() + seconds
while time.time() < end:
    if "--no-compute" in sys.argv:
        time.sleep(0.1)
        continue
    for _ in range(50):
        a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()
