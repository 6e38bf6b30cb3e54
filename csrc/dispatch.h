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
// dropout a (1,) int64 tensor in [0, 2^31 - 1) on ``like``'s device, drawn from that device's generator as
// pykernels._rng.op_seed draws it (torch.randint(0, 2**31 - 1, (1,), device=...)), so one torch.manual_seed gives the
// same mask eagerly and compiled; without dropout an empty (0,) int64 placeholder there. Drawn on the device, it is
// CUDA-graph safe: torch's CUDA generator advances its Philox offset on every replay of a captured graph, and the
// kernels read the seed from memory (seed_ptr; philox.cuh's drop_seed_init), so each replay has a fresh mask.
inline at::Tensor draw_seed(double dropout_p, const at::Tensor& like) {
  if (!(dropout_p > 0.0)) return at::empty({0}, like.options().dtype(at::kLong));
  return at::randint(0, (int64_t{1} << 31) - 1, {1}, like.options().dtype(at::kLong));
}

// The device address of the seed the kernels read (nullptr without dropout: the kernels then never read it). The C++
// kernels read its low 32 bits (seeds are drawn below 2^31; the Triton kernels and the reference read all 64, equal
// for every seed drawn)
inline const int64_t* seed_ptr(double dropout_p, const c10::optional<at::Tensor>& seed, const at::Tensor& like,
                               const char* op) {
  if (!(dropout_p > 0.0)) return nullptr;
  TORCH_CHECK(seed.has_value() && seed->defined() && seed->numel() >= 1 && seed->scalar_type() == at::kLong &&
                  seed->device() == like.device(),
              op, ": with dropout_p > 0, seed must be a (1,) int64 tensor on the inputs' device ",
              "(pykernels._rng.new_seed(device)), got ",
              seed.has_value() && seed->defined() ? seed->toString() + " on " + seed->device().str() : "none");
  return seed->data_ptr<int64_t>();
}

}  // namespace pykernels
