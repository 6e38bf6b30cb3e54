// IF nodes in a CUDA graph being captured by torch (torch.cuda.graph, torch.compile's CUDA graphs), for work that
// runs at replay only where a device count says it has something to do: the captured MLM loss's overflow pass
// (kernels/masked_lm_loss.py, masked_lm_loss_bwd_bounded), whose row blocks are usually empty.
//
// graph_if_begin(count, start, length, out): while the current stream captures, a one-thread kernel computes
// out[0] = clamp(count[0] - start, 0, length) at replay and sets the handle of an IF node added after it; the
// current stream becomes one capturing that node's body until graph_if_end. Torch 2.11 has no such API
// (CUDAGraph.begin_capture_to_if_node came later); this is the same construction for one predicate: a handle
// of the capturing graph, the setter kernel, the conditional node made the stream's only dependency, and the
// body captured on a pool stream not capturing already. Nothing may be allocated inside a body: the caching
// allocator serves the graph's pool only to streams capturing the graph itself, so the body's launches use buffers
// made before it.
#include <torch/extension.h>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <vector>

namespace pykernels {
namespace {

#if CUDART_VERSION >= 12040
__global__ void graph_if_set_kernel(cudaGraphConditionalHandle handle, const int* count, long long start,
                                    long long length, int* out) {
  const long long here = min(max(static_cast<long long>(*count) - start, 0LL), length);
  *out = static_cast<int>(here);
  cudaGraphSetConditional(handle, here > 0 ? 1u : 0u);
}
#endif

struct Body {
  c10::cuda::CUDAStream parent;
  c10::cuda::CUDAStream child;
};
thread_local std::vector<Body> bodies;  // the open bodies, innermost last

// Whether an IF node was added (the current stream capturing); false otherwise, having done nothing.
bool graph_if_begin(const at::Tensor& count, int64_t start, int64_t length, const at::Tensor& out) {
  TORCH_CHECK(count.is_cuda() && count.scalar_type() == at::kInt && count.numel() >= 1,
              "graph_if: count must be an int32 CUDA tensor, got ", count.scalar_type(), " on ", count.device());
  TORCH_CHECK(out.is_cuda() && out.scalar_type() == at::kInt && out.numel() >= 1 && out.device() == count.device(),
              "graph_if: out must be an int32 CUDA tensor on count's device");
  TORCH_CHECK(length >= 0, "graph_if: length must be >= 0, got ", length);
  c10::cuda::CUDAGuard guard(count.device());
  const c10::cuda::CUDAStream parent = c10::cuda::getCurrentCUDAStream();
  cudaStreamCaptureStatus status{};
  C10_CUDA_CHECK(cudaStreamIsCapturing(parent.stream(), &status));
  if (status != cudaStreamCaptureStatusActive) return false;
#if CUDART_VERSION >= 12040
  cudaGraph_t graph{};
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo(parent.stream(), &status, nullptr, &graph));
  cudaGraphConditionalHandle handle{};
  C10_CUDA_CHECK(cudaGraphConditionalHandleCreate(&handle, graph, 0, 0));
  graph_if_set_kernel<<<1, 1, 0, parent.stream()>>>(handle, count.data_ptr<int>(), start, length,
                                                     out.data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const cudaGraphNode_t* deps = nullptr;  // (the setter kernel, the stream's dependency now)
  const cudaGraphEdgeData* edges = nullptr;
  size_t n_deps = 0;
#if CUDART_VERSION >= 13000
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo(parent.stream(), &status, nullptr, &graph, &deps, &edges, &n_deps));
#else
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo_v3(parent.stream(), &status, nullptr, &graph, &deps, &edges, &n_deps));
#endif
  cudaGraphNodeParams params{};
  params.type = cudaGraphNodeTypeConditional;
  params.conditional.handle = handle;
  params.conditional.type = cudaGraphCondTypeIf;
  params.conditional.size = 1;
  cudaGraphNode_t node{};
#if CUDART_VERSION >= 13000
  C10_CUDA_CHECK(cudaGraphAddNode(&node, graph, deps, edges, n_deps, &params));
  C10_CUDA_CHECK(
      cudaStreamUpdateCaptureDependencies(parent.stream(), &node, nullptr, 1, cudaStreamSetCaptureDependencies));
#else
  C10_CUDA_CHECK(cudaGraphAddNode_v2(&node, graph, deps, edges, n_deps, &params));
  C10_CUDA_CHECK(
      cudaStreamUpdateCaptureDependencies_v2(parent.stream(), &node, nullptr, 1, cudaStreamSetCaptureDependencies));
#endif
  // a pool stream not capturing already (the pool is round-robin, and torch.cuda.Stream() and torch.cuda.graph's
  // capture stream come from it too: run399's probe drew the capturing stream itself)
  c10::cuda::CUDAStream child = c10::cuda::getStreamFromPool(false, count.device().index());
  for (int tries = 0;; ++tries) {
    cudaStreamCaptureStatus child_status{};
    C10_CUDA_CHECK(cudaStreamIsCapturing(child.stream(), &child_status));
    if (child_status == cudaStreamCaptureStatusNone) break;
    TORCH_CHECK(tries < 64, "graph_if: no stream of torch's pool is free to capture an IF node's body");
    child = c10::cuda::getStreamFromPool(false, count.device().index());
  }
  // thread-local mode: an unsafe call from this thread (a cudaMalloc) inside the body fails instead of slipping in
  C10_CUDA_CHECK(cudaStreamBeginCaptureToGraph(child.stream(), params.conditional.phGraph_out[0], nullptr, nullptr,
                                              0, cudaStreamCaptureModeThreadLocal));
  bodies.push_back({parent, child});
  c10::cuda::setCurrentCUDAStream(child);
  return true;
#else
  TORCH_CHECK(false, "graph_if: CUDA graph conditional nodes need CUDA 12.4 (built with ", CUDART_VERSION, ")");
#endif
}

void graph_if_end() {
  TORCH_CHECK(!bodies.empty(), "graph_if_end without an open graph_if_begin");
  const Body body = bodies.back();
  bodies.pop_back();
  cudaGraph_t graph{};
  const cudaError_t err = cudaStreamEndCapture(body.child.stream(), &graph);
  c10::cuda::setCurrentCUDAStream(body.parent);
  C10_CUDA_CHECK(err);
}

}  // namespace

void bind_graph_if(pybind11::module_& m) {
  m.def("graph_if_begin", &graph_if_begin, pybind11::arg("count"), pybind11::arg("start"), pybind11::arg("length"),
        pybind11::arg("out"),
        "While the current stream captures a CUDA graph: an IF node taken where clamp(count[0] - start, 0, length) "
        "> 0 (written to out[0] at replay), its body captured from the current stream until graph_if_end; True. "
        "Otherwise False, doing nothing.");
  m.def("graph_if_end", &graph_if_end, "Ends the innermost body graph_if_begin opened; the stream before it is "
        "current again.");
}

}  // namespace pykernels
