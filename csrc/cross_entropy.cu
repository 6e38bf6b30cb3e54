// Softmax cross-entropy on materialised logits, forward and backward, in CUDA C++, with its autograd in C++:
// torch.ops.pykernels_cuda.cross_entropy, the CUDA backend of pykernels.cross_entropy.
//
// Why a C++ op. The Triton path (kernels/cross_entropy.py, same algorithm) reaches 93-95% of copy bandwidth,
// but its forward and backward run through Python (the custom op's wrapper, the autograd node, launch
// wrappers): on the GPU machines' hosts that is several hundred microseconds a call, so an eager call on a
// few thousand rows is host-bound. Here the op, its reduction and its autograd are one dispatcher call with a
// CUDA kernel (no grad) and an Autograd kernel (a torch::autograd::Function whose backward runs in C++).
//
// Kernels (one pass over the logits each way, fp32 math whatever the dtype):
//   forward : one block a row. A row of a contiguous (N, V) tensor with odd V starts anywhere modulo 16
//             bytes, so it is read as a head of < 16 bytes, a body of 16-byte packs (kUnroll packs in flight a
//             thread) and a tail, each element folded into a per-thread online logsumexp in the log2 domain
//             (max m, sum s of exp2(x log2 e - m); one rescale a pack when its max exceeds m) and, with label
//             smoothing, a sum of the logits; the block combines the (m, s) pairs. Per row:
//               loss = (1 - eps) (lse - x[t]) + eps (lse - sum(x) / V) + z lse^2,  lse saved (fp32).
//             A row whose target is ignore_index writes loss = lse = 0 without reading the row. A target
//             outside [0, V) is never read: its loss and lse are NaN (so is its gradient), which shows the
//             error without a host sync (the reference raises).
//   reduce  : "sum" / "mean": one block sums the (N,) fp32 row losses in fp64 in a fixed order (deterministic),
//             counts the valid targets, divides by the count, a host int or a device tensor (clamped to at
//             least 1: an all-ignored batch gives 0, never NaN), and saves scale = d(loss) / d(row loss).
//   backward: one block per (row, chunk of kBwdThreads * kUnroll packs), so a few long rows still fill the
//             GPU: dlogits = g (softmax (1 + 2 z lse) - (1 - eps) onehot(t) - eps / V) with softmax =
//             exp2(x log2 e - lse log2 e) and g = grad[row] * scale; ignored rows get zeros without a read.
//             In place (inplace_backward) the gradient overwrites the logits: each element is read before the
//             same thread writes it. Vector loads and stores need dlogits' rows congruent to the logits'
//             modulo 16 bytes (in place, or both contiguous); otherwise the kernel runs element by element.
// Cover: fp16 / bf16 / fp32 logits (N, V) with unit column stride and any row stride; int32 / int64 targets;
// N < 2^31, V < 2^31; int64 row offsets (N * V past 2^31 elements). Python checks the cover first
// (pykernels/cross_entropy.py, _cuda_cover); the TORCH_CHECKs here name what they reject.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "dispatch.h"
#include "loss.cuh"
#include "pack.cuh"

namespace pykernels {
namespace {

using at::Tensor;
using c10::optional;

constexpr int kFwdThreads = 256;    // a forward block: one row
constexpr int kBwdThreads = 256;    // a backward block: one chunk of a row
constexpr int kUnroll = 4;          // 16-byte packs in flight per thread

template <typename T, bool SMOOTH>
__device__ __forceinline__ void fold_pack(const uint4& raw, float& m, float& s, float& sx) {
  constexpr int n = Pack<T>::n;
  float f[n];
  unpack<T>(raw, f);
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < n; ++i) {
    if (SMOOTH) sx += f[i];
    f[i] *= kLog2e;
    mx = fmaxf(mx, f[i]);
  }
  if (mx > m) {
    s *= exp2f(m - mx);
    m = mx;
  }
  if (m != -INFINITY) {
#pragma unroll
    for (int i = 0; i < n; ++i) s += exp2f(f[i] - m);
  }
}

// The row's frame: ``head`` elements before the first 16-byte boundary (< one pack), then ``body`` packs.
template <typename T>
__device__ __forceinline__ int head_of(const T* p, int V) {
  const int lead = static_cast<int>((16u - static_cast<unsigned>(reinterpret_cast<uintptr_t>(p) & 15u)) & 15u);
  return min(V, lead / static_cast<int>(sizeof(T)));
}

template <typename T, typename TT, bool SMOOTH>
__global__ void __launch_bounds__(kFwdThreads) ce_fwd_kernel(
    const T* __restrict__ x, int64_t stride, const TT* __restrict__ target, int V, int64_t ignore_index, float eps,
    float z, float* __restrict__ loss_f32, T* __restrict__ loss_t, float* __restrict__ lse_out) {
  const int64_t row = blockIdx.x;
  const int64_t t = target_at(target, row);
  if (t == ignore_index) {
    if (threadIdx.x == 0) {
      if (loss_t != nullptr) loss_t[row] = from_f<T>(0.f);
      else loss_f32[row] = 0.f;
      lse_out[row] = 0.f;
    }
    return;
  }
  constexpr int n = Pack<T>::n;
  const T* p = x + row * stride;
  const int head = head_of(p, V);
  const int body = (V - head) / n;
  float m = -INFINITY, s = 0.f, sx = 0.f;
  for (int i = threadIdx.x; i < head; i += kFwdThreads) {
    const float v = to_f(p[i]);
    if (SMOOTH) sx += v;
    fold(v * kLog2e, m, s);
  }
  const uint4* pb = reinterpret_cast<const uint4*>(p + head);
  int j = threadIdx.x;
  for (; j + (kUnroll - 1) * kFwdThreads < body; j += kUnroll * kFwdThreads) {
    uint4 raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) raw[u] = __ldcs(pb + j + u * kFwdThreads);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) fold_pack<T, SMOOTH>(raw[u], m, s, sx);
  }
  for (; j < body; j += kFwdThreads) fold_pack<T, SMOOTH>(__ldcs(pb + j), m, s, sx);
  for (int i = head + body * n + threadIdx.x; i < V; i += kFwdThreads) {
    const float v = to_f(p[i]);
    if (SMOOTH) sx += v;
    fold(v * kLog2e, m, s);
  }
  block_lse<kFwdThreads, SMOOTH>(m, s, sx);
  if (threadIdx.x != 0) return;
  float lse = (m + log2f(s)) * kLn2;  // every logit -inf: -inf, and the loss NaN (as torch)
  float loss;
  if (t >= 0 && t < V) {
    loss = lse - to_f(p[t]);
    if (SMOOTH) loss = (1.f - eps) * loss + eps * (lse - sx / static_cast<float>(V));
    if (z != 0.f) loss += z * lse * lse;
  } else {  // out of range, not ignore_index: never read; NaN loss and gradient
    loss = lse = NAN;
  }
  if (loss_t != nullptr) loss_t[row] = from_f<T>(loss);
  else loss_f32[row] = loss;
  lse_out[row] = lse;
}

// dlogits of one chunk of one row. VEC: 16-byte packs (dlogits' rows congruent to the logits' modulo 16
// bytes); else element by element over the chunk's kBwdThreads * kUnroll * n columns.
template <typename T, typename TT, bool VEC>
__global__ void __launch_bounds__(kBwdThreads) ce_bwd_kernel(
    const T* __restrict__ x, int64_t stride_x, T* d, int64_t stride_d, const TT* __restrict__ target,
    const float* __restrict__ lse, const T* __restrict__ grad, int64_t stride_g, const float* __restrict__ scale,
    int V, int chunks, int64_t ignore_index, float eps, float z) {
  constexpr int n = Pack<T>::n;
  constexpr int kPer = kBwdThreads * kUnroll;  // packs (VEC) or pack-sized groups of columns a chunk
  const int64_t row = blockIdx.x / chunks;
  const int c = static_cast<int>(blockIdx.x % chunks);
  const int64_t t = target_at(target, row);
  const bool active = t != ignore_index;
  const T* p = x + row * stride_x;
  T* q = d + row * stride_d;
  float gs = 0.f, off = 0.f, gt = 0.f, l2 = 0.f;
  if (active) {
    const float l = lse[row];
    const float g = to_f(grad[row * stride_g]) * *scale;
    gs = g * (z != 0.f ? 1.f + 2.f * z * l : 1.f);
    off = g * eps / static_cast<float>(V);
    gt = g * (1.f - eps);
    l2 = l * kLog2e;
  }
  const auto grad_at = [&](float v, int64_t col) {
    if (!active) return 0.f;
    float r = gs * exp2f(v * kLog2e - l2) - off;
    return col == t ? r - gt : r;
  };
  if constexpr (VEC) {
    const int head = head_of(p, V);
    const int body = (V - head) / n;
    if (c == 0) {
      for (int i = threadIdx.x; i < head; i += kBwdThreads) q[i] = from_f<T>(grad_at(active ? to_f(p[i]) : 0.f, i));
      for (int i = head + body * n + threadIdx.x; i < V; i += kBwdThreads) {
        q[i] = from_f<T>(grad_at(active ? to_f(p[i]) : 0.f, i));
      }
    }
    const uint4* pb = reinterpret_cast<const uint4*>(p + head);
    uint4* qb = reinterpret_cast<uint4*>(q + head);
    const int j0 = c * kPer + threadIdx.x;
    uint4 raw[kUnroll];
    if (active) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = j0 + u * kBwdThreads;
        if (j < body) raw[u] = __ldcs(pb + j);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j = j0 + u * kBwdThreads;
      if (j >= body) break;
      float f[n];
      if (active) {
        unpack<T>(raw[u], f);
      }
      const int64_t col0 = head + static_cast<int64_t>(j) * n;
#pragma unroll
      for (int i = 0; i < n; ++i) f[i] = grad_at(active ? f[i] : 0.f, col0 + i);
      __stcs(qb + j, pack_of_floats<T>(f));
    }
  } else {
    const int64_t begin = static_cast<int64_t>(c) * kPer * n;
    const int64_t end = min(static_cast<int64_t>(V), begin + static_cast<int64_t>(kPer) * n);
    for (int64_t i = begin + threadIdx.x; i < end; i += kBwdThreads) q[i] = from_f<T>(grad_at(active ? to_f(p[i]) : 0.f, i));
  }
}

template <typename F>
void dispatch_target(at::ScalarType st, F&& f) {
  switch (st) {
    case at::kLong: f(int64_t{}); break;
    case at::kInt: f(int32_t{}); break;
    default: TORCH_CHECK(false, "pykernels_cuda.cross_entropy: target must be int32 or int64, got ", st);
  }
}

void check_inputs(const Tensor& logits, const Tensor& target, const optional<Tensor>& num_valid,
                  int64_t reduction) {
  TORCH_CHECK(logits.is_cuda(), "pykernels_cuda.cross_entropy: logits must be a CUDA tensor");
  TORCH_CHECK(logits.dim() == 2, "pykernels_cuda.cross_entropy: logits must be 2-D (N, V), got ", logits.dim(),
              " dims");
  const int64_t N = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V >= 1 && V < (int64_t{1} << 31), "pykernels_cuda.cross_entropy: V must be in [1, 2^31), got ", V);
  TORCH_CHECK(N < (int64_t{1} << 31), "pykernels_cuda.cross_entropy: N must be below 2^31, got ", N);
  TORCH_CHECK(V == 1 || logits.stride(1) == 1, "pykernels_cuda.cross_entropy: logits must have unit column stride");
  TORCH_CHECK(logits.stride(0) >= 0, "pykernels_cuda.cross_entropy: logits must have a non-negative row stride");
  TORCH_CHECK(target.device() == logits.device(), "pykernels_cuda.cross_entropy: target must be on logits' device ",
              logits.device());
  TORCH_CHECK(target.dim() == 1 && target.size(0) == N, "pykernels_cuda.cross_entropy: target must have shape (",
              N, ",)");
  TORCH_CHECK(reduction == kNone || reduction == kSum || reduction == kMean,
              "pykernels_cuda.cross_entropy: reduction must be 0 (none), 1 (sum) or 2 (mean), got ", reduction);
  if (num_valid.has_value()) {
    TORCH_CHECK(reduction == kMean, "pykernels_cuda.cross_entropy: num_valid applies only to the mean");
    TORCH_CHECK(num_valid->device() == logits.device() && num_valid->numel() == 1 &&
                    num_valid->scalar_type() == at::kFloat,
                "pykernels_cuda.cross_entropy: num_valid must be a one-element float32 tensor on logits' device");
  }
}

// -> loss (logits' dtype: (N,) or 0-dim), lse (N,) fp32, scale 0-dim fp32
std::vector<Tensor> forward_impl(const Tensor& logits, const Tensor& target_in, const optional<Tensor>& num_valid,
                                 int64_t ignore_index, double eps, double z, int64_t reduction,
                                 int64_t num_valid_int) {
  check_inputs(logits, target_in, num_valid, reduction);
  const c10::cuda::CUDAGuard guard(logits.device());
  const Tensor target = target_in.contiguous();
  const int64_t N = logits.size(0);
  const int V = static_cast<int>(logits.size(1));
  auto f32 = logits.options().dtype(at::kFloat);
  Tensor lse = poisoned(at::empty({N}, f32));
  Tensor scale = at::empty({}, f32);
  Tensor loss = poisoned(reduction == kNone ? at::empty({N}, logits.options()) : at::empty({}, logits.options()));
  Tensor rows = reduction == kNone ? Tensor() : at::empty({N}, f32);
  auto stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float_dtype(logits.scalar_type(), "pykernels_cuda.cross_entropy: logits", [&](auto tag) {
    using T = decltype(tag);
    dispatch_target(target.scalar_type(), [&](auto ttag) {
      using TT = decltype(ttag);
      const T* xp = static_cast<const T*>(logits.data_ptr());
      const TT* tp = target.data_ptr<TT>();
      if (N > 0) {
        const auto launch = [&](auto smooth) {
          ce_fwd_kernel<T, TT, decltype(smooth)::value><<<static_cast<unsigned>(N), kFwdThreads, 0, stream>>>(
              xp, logits.stride(0), tp, V, ignore_index, static_cast<float>(eps), static_cast<float>(z),
              reduction == kNone ? nullptr : rows.data_ptr<float>(),
              reduction == kNone ? static_cast<T*>(loss.data_ptr()) : nullptr, lse.data_ptr<float>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        };
        if (eps > 0.0) launch(std::true_type{});
        else launch(std::false_type{});
      }
      if (reduction == kNone) {
        scale.fill_(1.f);
      } else {
        loss_reduce_kernel<T, TT><<<1, kReduceThreads, 0, stream>>>(
            N > 0 ? rows.data_ptr<float>() : nullptr, tp, N, ignore_index, reduction,
            static_cast<double>(num_valid_int), num_valid.has_value() ? num_valid->data_ptr<float>() : nullptr,
            /*clamp_given=*/true, static_cast<T*>(loss.data_ptr()), scale.data_ptr<float>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    });
  });
  return {loss, lse, scale};
}

// dlogits into ``out`` (a new tensor, or the logits themselves in place)
void backward_impl(const Tensor& grad_in, const Tensor& logits, const Tensor& target, const Tensor& lse,
                   const Tensor& scale, const Tensor& out, int64_t ignore_index, double eps, double z) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t N = logits.size(0);
  const int V = static_cast<int>(logits.size(1));
  if (N == 0) return;
  const Tensor grad = grad_in.scalar_type() == logits.scalar_type() ? grad_in : grad_in.to(logits.scalar_type());
  TORCH_CHECK(grad.numel() == 1 || (grad.dim() == 1 && grad.size(0) == N),
              "pykernels_cuda.cross_entropy: the loss gradient must be a scalar or (N,)");
  const int64_t stride_g = grad.numel() == 1 && grad.dim() == 0 ? 0 : grad.stride(0);
  auto stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float_dtype(logits.scalar_type(), "pykernels_cuda.cross_entropy: logits", [&](auto tag) {
    using T = decltype(tag);
    constexpr int n = Pack<T>::n;
    const int64_t chunk_cols = static_cast<int64_t>(kBwdThreads) * kUnroll * n;
    const int chunks = static_cast<int>((V + chunk_cols - 1) / chunk_cols);
    TORCH_CHECK(N * chunks < (int64_t{1} << 31), "pykernels_cuda.cross_entropy: too many rows for the backward grid");
    const auto xa = reinterpret_cast<uintptr_t>(logits.data_ptr()), da = reinterpret_cast<uintptr_t>(out.data_ptr());
    const bool vec = (xa - da) % 16 == 0 &&
                     ((logits.stride(0) - out.stride(0)) * static_cast<int64_t>(sizeof(T))) % 16 == 0;
    dispatch_target(target.scalar_type(), [&](auto ttag) {
      using TT = decltype(ttag);
      const auto launch = [&](auto v) {
        ce_bwd_kernel<T, TT, decltype(v)::value><<<static_cast<unsigned>(N * chunks), kBwdThreads, 0, stream>>>(
            static_cast<const T*>(logits.data_ptr()), logits.stride(0), static_cast<T*>(out.data_ptr()),
            out.stride(0), target.data_ptr<TT>(), lse.data_ptr<float>(), static_cast<const T*>(grad.data_ptr()),
            stride_g, scale.data_ptr<float>(), V, chunks, ignore_index, static_cast<float>(eps),
            static_cast<float>(z));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      if (vec) launch(std::true_type{});
      else launch(std::false_type{});
    });
  });
}

class CrossEntropyFunction : public torch::autograd::Function<CrossEntropyFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& logits,
                                                const Tensor& target, const optional<Tensor>& num_valid,
                                                int64_t ignore_index, double eps, double z, int64_t reduction,
                                                int64_t num_valid_int, bool inplace_backward) {
    auto out = forward_impl(logits, target, num_valid, ignore_index, eps, z, reduction, num_valid_int);
    ctx->save_for_backward({logits, target.contiguous(), out[1], out[2]});
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["z"] = z;
    ctx->saved_data["inplace"] = inplace_backward;
    return {out[0]};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(), "pykernels_cuda::cross_entropy: double backward (create_graph=True) is "
                "not supported; use backend='reference' for this loss");
    auto saved = ctx->get_saved_variables();  // (checks that nothing modified the logits since the forward)
    const Tensor& logits = saved[0];
    const bool inplace = ctx->saved_data["inplace"].toBool();
    // in place: the gradient is an alias of the logits' memory (detached: no autograd history of its own)
    Tensor dlogits = inplace ? logits.detach() : poisoned(at::empty({logits.size(0), logits.size(1)}, logits.options()));
    const Tensor grad = grads[0].defined() ? grads[0] : at::zeros({}, logits.options());
    backward_impl(grad, logits, saved[1], saved[2], saved[3], dlogits, ctx->saved_data["ignore_index"].toInt(),
                  ctx->saved_data["eps"].toDouble(), ctx->saved_data["z"].toDouble());
    // in place: the logits now hold their gradient; a later backward that saved them must see it
    if (inplace) logits.unsafeGetTensorImpl()->bump_version();
    return {dlogits, Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

Tensor cross_entropy_autograd(const Tensor& logits, const Tensor& target, const optional<Tensor>& num_valid,
                              int64_t ignore_index, double eps, double z, int64_t reduction, int64_t num_valid_int,
                              bool inplace_backward) {
  return CrossEntropyFunction::apply(logits, target, num_valid, ignore_index, eps, z, reduction, num_valid_int,
                                     inplace_backward)[0];
}

Tensor cross_entropy_nograd(const Tensor& logits, const Tensor& target, const optional<Tensor>& num_valid,
                            int64_t ignore_index, double eps, double z, int64_t reduction, int64_t num_valid_int,
                            bool inplace_backward) {
  return forward_impl(logits, target, num_valid, ignore_index, eps, z, reduction, num_valid_int)[0];
}

}  // namespace
}  // namespace pykernels

TORCH_LIBRARY_FRAGMENT(pykernels_cuda, m) {
  m.def("cross_entropy(Tensor logits, Tensor target, Tensor? num_valid, int ignore_index, float label_smoothing, "
        "float z_loss, int reduction, int num_valid_int, bool inplace_backward) -> Tensor");
}

TORCH_LIBRARY_IMPL(pykernels_cuda, CUDA, m) { m.impl("cross_entropy", &pykernels::cross_entropy_nograd); }

TORCH_LIBRARY_IMPL(pykernels_cuda, Autograd, m) { m.impl("cross_entropy", &pykernels::cross_entropy_autograd); }
