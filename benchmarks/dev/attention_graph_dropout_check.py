"""The C++ attention with dropout under CUDA graph capture, against the float64 reference with the kernels' mask:
tests/test_cudagraphs.py::test_dropout_under_cuda_graph_capture's step (2 x 4 x 128 x 64 bf16, p 0.3), eager twice and
replayed from seeds 7, 8, 7, each output and gradient's max abs error printed (run300: the diagnosis of run299's one
failure of that test, which did not recur). Usage (GPU): ``python benchmarks/dev/attention_graph_dropout_check.py TAG``
(set PYKERNELS_CUDA_ATTN_FUSED_DQ / _TMA for the other kernels)."""
import sys

import torch

import pykernels
from pykernels.attention import attention_dropout_mask, attention_reference
from pykernels._rng import new_seed
sdpa = pykernels.scaled_dot_product_attention
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = [torch.randn(2, 4, 128, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
           for _ in range(3)]
dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
def step():
    out = sdpa(q, k, v, dropout_p=0.3, backend="cuda")
    return [out.detach()] + list(torch.autograd.grad(out, (q, k, v), dout))
def ref(sv):
    torch.cuda.manual_seed(sv); s = new_seed("cuda")
    m = attention_dropout_mask(s, 2, 4, 128, 128, 0.3, "cuda")
    qq, kk, vv = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    o = attention_reference(qq, kk, vv, dropout_p=0.3, dropout_mask=m)
    return [o.detach()] + list(torch.autograd.grad(o, (qq, kk, vv), dout.double()))
def err(a, b): return " ".join(f"{(x.double() - y).abs().max().item():.3g}" for x, y in zip(a, b))
tag = sys.argv[1]
r7 = ref(7)
torch.cuda.manual_seed(7); e1 = step()
torch.cuda.manual_seed(7); e2 = step()
print(tag, "eager vs ref7:", err(e1, r7), "| eager twice equal:", all(torch.equal(a, b) for a, b in zip(e1, e2)))
side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side): step()
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph): cap = step()
for sv in (7, 8, 7):
    torch.cuda.manual_seed(sv); graph.replay(); torch.cuda.synchronize()
    print(tag, f"replay seed {sv} vs ref{sv}:", err(cap, ref(sv)))
torch.cuda.manual_seed(7); e3 = step()
print(tag, "eager after graph vs ref7:", err(e3, r7))
