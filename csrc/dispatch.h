// Host-side helpers shared by the ops: the dtype dispatch, the test suite's output poisoning, and the dropout seed
// the compiled graphs' forward ops draw.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/extension.h>

#include <cstdlib>
#include <cstring>
#include <limits>

namespace pykernels {

// Calls f with a value of the C++ element type (float, __half, __nv_bfloat16) matching ``st``, or raises naming
// ``what`` (the op and the argument).

template <typename F>
void dispatch_float_dtype(at::ScalarType st, const char* what, F&& f) {
  switch (st) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(__half{}); break;
    case at::kBFloat16: f(__nv_bfloat16{}); break;
    default: TORCH_CHECK(false, what, " must be float16, bfloat16 or float32, got ", st);
  }
}

// PYKERNELS_POISON=1 (the test suite sets it, as for the Python allocations in pykernels/_alloc.py): outputs the
// kernels must write in full are filled with NaN first, so a row a kernel leaves unwritten shows as NaN in tests.
// Read once.
inline bool poisoning() {
  static const bool on = [] {
    const char* e = std::getenv("PYKERNELS_POISON");
    return e != nullptr && e[0] != '\0' && std::strcmp(e, "0") != 0;
  }();
  return on;
}

inline at::Tensor poisoned(at::Tensor t) {
  if (poisoning() && t.defined() && t.numel() > 0 && at::isFloatingType(t.scalar_type()))
    t.fill_(std::numeric_limits<double>::quiet_NaN());
  return t;
}

// The dropout seed a forward op of a compiled graph draws (pykernels_cuda::layer_norm_fwd, ::attention_fwd): with
// dropout a CPU int64 tensor of one value in [0, 2^31 - 1), drawn from torch's default CPU generator as
// pykernels._rng.new_seed draws it (torch.randint(0, 2**31 - 1, (1,))), so one torch.manual_seed gives the same mask
// eagerly and compiled; without dropout an empty (0,) int64 tensor on ``like``'s device (a CPU tensor among a
// graph's outputs would make torch.compile skip CUDA graphs). Under CUDA-graph capture a seed drawn on the host
// would replay one mask forever: refused, as pykernels._rng.check_not_capturing refuses it.
inline at::Tensor draw_seed(double dropout_p, const at::Tensor& like, const char* op) {
  if (!(dropout_p > 0.0)) return at::empty({0}, like.options().dtype(at::kLong));
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(like.get_device()).stream(), &capture));
  TORCH_CHECK(capture == cudaStreamCaptureStatusNone, op,
              ": dropout_p > 0 inside CUDA-graph capture would replay one dropout mask on every replay (the seed is "
              "drawn on the host); capture the dropout-free part only, or run this op eagerly");
  return at::randint(0, (int64_t{1} << 31) - 1, {1}, at::TensorOptions().dtype(at::kLong));
}

// The value of a seed tensor draw_seed made (0 without dropout: the kernels then never read it)
inline int64_t seed_value(double dropout_p, const at::Tensor& seed, const char* op) {
  if (!(dropout_p > 0.0)) return 0;
  TORCH_CHECK(seed.numel() == 1 && seed.scalar_type() == at::kLong && seed.device().is_cpu(), op,
              ": seed must be the forward's (1,) int64 CPU tensor");
  return seed.item<int64_t>();
}

}  // namespace pykernels
