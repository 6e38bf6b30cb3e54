// Masked-position LM-head loss (the cross-entropy of hidden @ weight^T + bias at the rows whose target is not
// ignore_index), forward and backward, in CUDA C++ with cuBLAS GEMMs (through ATen) and its autograd in C++:
// torch.ops.pykernels_cuda.masked_lm_loss, the CUDA backend of pykernels.masked_lm_loss.
//
// Design. The valid rows are compacted (at::nonzero: one host sync for their count M, which sizes every GEMM)
// and gathered once, (M, H); the vocabulary is walked in chunks of VC columns so that an (M, VC) fp32 logits
// chunk and its (M, VC) dz chunk stay within kChunkBytes:
//   forward : logits_c = h_c W_c^T (cuBLAS, fp32 output); mlm_stats_kernel folds each row of the chunk (+ bias)
//             into the row's running online logsumexp (m, s in the log2 domain), the logits' sum (label
//             smoothing) and, in the chunk that holds it, the target logit; mlm_finish_kernel writes
//             loss = (1 - eps) (lse - z_t) + eps (lse - sum / V) and lse at each valid row (0 elsewhere), and
//             loss.cuh's reduction gives the sum or mean (divided by the count or num_valid, in fp64).
//   backward: per chunk the logits again (fp32), mlm_dz_kernel: dz = g (softmax - (1 - eps) onehot - eps / V)
//             in the weight dtype; dW_c = dz^T h_c (cuBLAS, each chunk owns its rows of dW), dbias_c = the
//             column sums of dz in fp32, dh += dz W_c (cuBLAS with an fp32 output accumulated across chunks);
//             dhidden is 0 at ignored rows and the accumulator, cast once, at the valid ones.
// 4 GEMMs of 2 M V H FLOPs, as the Triton path, plus an fp32 logits chunk written and read each way: slower than
// the Triton path's fused logit tiles on the GPU (which is why auto takes Triton), with no Python in its
// forward or backward. Targets outside [0, V) that are not ignore_index are never read: their loss is NaN and
// their gradient the plain softmax's (as the Triton path; the reference raises).
// Cover: hidden (N, H) and weight (V, H) of one dtype (fp16, bf16, fp32), bias (V,) of that dtype or none, any
// strides (copies where cuBLAS or the kernels need them); int64 targets; N, V < 2^31.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <algorithm>
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

constexpr int kRowThreads = 256;
constexpr int64_t kChunkBytes = int64_t{64} << 20;  // an (M, VC) fp32 logits chunk and its dz chunk together

template <typename T>
__device__ __forceinline__ float bias_at(const T* bias, int64_t col) {
  return bias == nullptr ? 0.f : to_f(bias[col]);
}

// one block a valid row: fold the row of the (M, vc) fp32 chunk (columns v0.. of the vocabulary) into the row's
// running state (m, s: online logsumexp in the log2 domain; sx: the logits' sum; zt: the target logit)
template <typename T, bool SMOOTH>
__global__ void __launch_bounds__(kRowThreads) mlm_stats_kernel(
    const float* __restrict__ logits, int vc, int64_t v0, const T* __restrict__ bias, const int64_t* __restrict__ tgt,
    float* __restrict__ m_state, float* __restrict__ s_state, float* __restrict__ sx_state,
    float* __restrict__ zt_state) {
  const int64_t row = blockIdx.x;
  const float* p = logits + row * vc;
  float m = -INFINITY, s = 0.f, sx = 0.f;
  for (int j = threadIdx.x; j < vc; j += kRowThreads) {
    const float x = p[j] + bias_at(bias, v0 + j);
    if (SMOOTH) sx += x;
    fold(x * kLog2e, m, s);
  }
  block_lse<kRowThreads, SMOOTH>(m, s, sx);
  if (threadIdx.x != 0) return;
  float mm = m_state[row], ss = s_state[row];
  combine(mm, ss, m, s);
  m_state[row] = mm;
  s_state[row] = ss;
  if (SMOOTH) sx_state[row] += sx;
  const int64_t t = tgt[row];
  if (t >= v0 && t < v0 + vc) zt_state[row] = p[t - v0] + bias_at(bias, t);
}

// per valid row: loss and lse at the row's position (the (N,) outputs were zeroed) and lse compacted for the
// backward; a target never seen (out of range) leaves zt NaN, so the loss is NaN
__global__ void __launch_bounds__(kRowThreads) mlm_finish_kernel(
    const float* __restrict__ m_state, const float* __restrict__ s_state, const float* __restrict__ sx_state,
    const float* __restrict__ zt_state, const int64_t* __restrict__ rows, int64_t M, int64_t V, float eps,
    float* __restrict__ loss_rows, float* __restrict__ lse_c) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kRowThreads + threadIdx.x;
  if (i >= M) return;
  const float lse = (m_state[i] + log2f(s_state[i])) * kLn2;
  float loss = lse - zt_state[i];
  if (eps > 0.f) loss = (1.f - eps) * loss + eps * (lse - sx_state[i] / static_cast<float>(V));
  loss_rows[rows[i]] = loss;
  lse_c[i] = lse;
}

// dz of the (M, vc) chunk in T, from its fp32 logits: a block per (row, part of kRowThreads * 4 columns)
template <typename T>
__global__ void __launch_bounds__(kRowThreads) mlm_dz_kernel(
    const float* __restrict__ logits, T* __restrict__ dz, int vc, int parts, int64_t v0, const T* __restrict__ bias,
    const int64_t* __restrict__ tgt, const int64_t* __restrict__ rows, const float* __restrict__ lse_c,
    const float* __restrict__ grad, int64_t stride_g, const float* __restrict__ scale, int64_t V, float eps) {
  const int64_t row = blockIdx.x / parts;
  const int part = static_cast<int>(blockIdx.x % parts);
  const float g = grad[rows[row] * stride_g] * *scale;
  const float l2 = lse_c[row] * kLog2e;
  const float off = g * eps / static_cast<float>(V), gt = g * (1.f - eps);
  const int64_t t = tgt[row] - v0;  // the target's column in this chunk (outside [0, vc): not here)
  const float* p = logits + row * vc;
  T* q = dz + row * vc;
  const int end = min(vc, (part + 1) * kRowThreads * 4);
  for (int j = part * kRowThreads * 4 + threadIdx.x; j < end; j += kRowThreads) {
    const float x = p[j] + bias_at(bias, v0 + j);
    float d = g * exp2f(x * kLog2e - l2) - off;
    if (j == t) d -= gt;
    q[j] = from_f<T>(d);
  }
}

// T*, or nullptr for an undefined tensor
template <typename T>
const T* ptr_or_null(const Tensor& t) {
  return t.defined() ? static_cast<const T*>(t.data_ptr()) : nullptr;
}

// the chunk's logits in fp32: h_c W_c^T (cuBLAS accumulates in fp32 and writes fp32)
Tensor logits_chunk(const Tensor& hc, const Tensor& wc) {
  return hc.scalar_type() == at::kFloat ? at::mm(hc, wc.t()) : at::mm(hc, wc.t(), at::kFloat);
}

int64_t chunk_columns(int64_t M, int64_t V) {
  const int64_t vc = kChunkBytes / std::max<int64_t>(M * 6, 1) / 8 * 8;  // 4 (fp32 logits) + 2 (dz) bytes
  return std::max<int64_t>(8, std::min<int64_t>(V, vc));
}

void check_inputs(const Tensor& hidden, const Tensor& weight, const Tensor& target, const optional<Tensor>& bias,
                  const optional<Tensor>& num_valid, int64_t reduction) {
  TORCH_CHECK(hidden.is_cuda(), "pykernels_cuda.masked_lm_loss: hidden must be a CUDA tensor");
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2, "pykernels_cuda.masked_lm_loss: hidden must be (N, H) and "
              "weight (V, H)");
  TORCH_CHECK(weight.size(1) == hidden.size(1), "pykernels_cuda.masked_lm_loss: weight must be (V, ", hidden.size(1),
              "), got ", weight.sizes());
  TORCH_CHECK(weight.size(0) >= 1 && weight.size(0) < (int64_t{1} << 31) && hidden.size(0) < (int64_t{1} << 31),
              "pykernels_cuda.masked_lm_loss: V must be in [1, 2^31) and N below 2^31");
  TORCH_CHECK(weight.scalar_type() == hidden.scalar_type() && weight.device() == hidden.device(),
              "pykernels_cuda.masked_lm_loss: weight must have hidden's dtype and device");
  TORCH_CHECK(target.scalar_type() == at::kLong && target.dim() == 1 && target.size(0) == hidden.size(0) &&
                  target.device() == hidden.device(),
              "pykernels_cuda.masked_lm_loss: target must be int64 (N,) on hidden's device");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == hidden.scalar_type() && bias->dim() == 1 && bias->size(0) == weight.size(0) &&
                    bias->device() == hidden.device(),
                "pykernels_cuda.masked_lm_loss: bias must be (V,) with hidden's dtype and device");
  }
  TORCH_CHECK(reduction == kNone || reduction == kSum || reduction == kMean,
              "pykernels_cuda.masked_lm_loss: reduction must be 0 (none), 1 (sum) or 2 (mean), got ", reduction);
  if (num_valid.has_value()) {
    TORCH_CHECK(reduction == kMean && num_valid->numel() == 1 && num_valid->scalar_type() == at::kFloat &&
                    num_valid->device() == hidden.device(),
                "pykernels_cuda.masked_lm_loss: num_valid must be a one-element float32 tensor on hidden's device "
                "(reduction mean only)");
  }
}

struct Forward {
  Tensor loss, rows, tgt_c, hc, lse_c, scale;
};

Forward forward_impl(const Tensor& hidden, const Tensor& weight_in, const Tensor& target_in,
                     const optional<Tensor>& bias_in, int64_t ignore_index, double eps, int64_t reduction,
                     const optional<Tensor>& num_valid, double num_valid_host) {
  check_inputs(hidden, weight_in, target_in, bias_in, num_valid, reduction);
  const c10::cuda::CUDAGuard guard(hidden.device());
  const Tensor target = target_in.contiguous();
  const Tensor weight = weight_in.stride(1) == 1 ? weight_in : weight_in.contiguous();
  const Tensor bias = bias_in.has_value() ? bias_in->contiguous() : Tensor();
  const int64_t N = hidden.size(0), V = weight.size(0);
  auto f32 = hidden.options().dtype(at::kFloat);
  Forward out;
  out.rows = at::nonzero(target != ignore_index).view({-1});  // the one host sync: M sizes every GEMM
  const int64_t M = out.rows.size(0);
  out.tgt_c = target.index_select(0, out.rows);
  out.hc = hidden.index_select(0, out.rows);  // (M, H), contiguous
  out.lse_c = at::empty({M}, f32);
  Tensor loss_rows = at::zeros({N}, f32);
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (M > 0) {
    Tensor m_state = at::full({M}, -INFINITY, f32), s_state = at::zeros({M}, f32), sx_state = at::zeros({M}, f32);
    Tensor zt_state = at::full({M}, NAN, f32);
    const int64_t vc_max = chunk_columns(M, V);
    dispatch_float_dtype(hidden.scalar_type(), "pykernels_cuda.masked_lm_loss: hidden", [&](auto tag) {
      using T = decltype(tag);
      for (int64_t v0 = 0; v0 < V; v0 += vc_max) {
        const int64_t vc = std::min(vc_max, V - v0);
        const Tensor logits = logits_chunk(out.hc, weight.narrow(0, v0, vc));
        const auto launch = [&](auto smooth) {
          mlm_stats_kernel<T, decltype(smooth)::value><<<static_cast<unsigned>(M), kRowThreads, 0, stream>>>(
              logits.data_ptr<float>(), static_cast<int>(vc), v0, ptr_or_null<T>(bias), out.tgt_c.data_ptr<int64_t>(),
              m_state.data_ptr<float>(), s_state.data_ptr<float>(), sx_state.data_ptr<float>(),
              zt_state.data_ptr<float>());
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        };
        if (eps > 0.0) launch(std::true_type{});
        else launch(std::false_type{});
      }
    });
    mlm_finish_kernel<<<static_cast<unsigned>((M + kRowThreads - 1) / kRowThreads), kRowThreads, 0, stream>>>(
        m_state.data_ptr<float>(), s_state.data_ptr<float>(), sx_state.data_ptr<float>(), zt_state.data_ptr<float>(),
        out.rows.data_ptr<int64_t>(), M, V, static_cast<float>(eps), loss_rows.data_ptr<float>(),
        out.lse_c.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  out.scale = at::empty({}, f32);
  if (reduction == kNone) {
    out.loss = loss_rows;
    out.scale.fill_(1.f);
  } else {
    out.loss = at::empty({}, f32);
    loss_reduce_kernel<float, int64_t><<<1, kReduceThreads, 0, stream>>>(
        N > 0 ? loss_rows.data_ptr<float>() : nullptr, target.data_ptr<int64_t>(), N, ignore_index, reduction,
        num_valid_host, num_valid.has_value() ? num_valid->data_ptr<float>() : nullptr,
        /*clamp_given=*/false, out.loss.data_ptr<float>(), out.scale.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out;
}

// -> dhidden (N, H), dweight (V, H), dbias (V,) or undefined
std::vector<Tensor> backward_impl(const Tensor& grad_in, const Tensor& hc, const Tensor& weight_in, const Tensor& bias,
                                  const Tensor& rows, const Tensor& tgt_c, const Tensor& lse_c, const Tensor& scale,
                                  int64_t N, double eps, bool need_dh, bool need_dw) {
  const c10::cuda::CUDAGuard guard(hc.device());
  const Tensor weight = weight_in.stride(1) == 1 ? weight_in : weight_in.contiguous();
  const int64_t M = hc.size(0), H = hc.size(1), V = weight.size(0);
  const Tensor grad = grad_in.scalar_type() == at::kFloat ? grad_in : grad_in.to(at::kFloat);
  const int64_t stride_g = grad.dim() == 0 ? 0 : grad.stride(0);
  auto f32 = hc.options().dtype(at::kFloat);
  Tensor dh = need_dh ? at::zeros({N, H}, hc.options()) : Tensor();
  Tensor dw = need_dw ? (M > 0 ? poisoned(at::empty({V, H}, weight.options())) : at::zeros({V, H}, weight.options()))
                      : Tensor();
  Tensor db32 = need_dw && bias.defined() ? at::zeros({V}, f32) : Tensor();
  if (M > 0 && (need_dh || need_dw)) {
    auto stream = c10::cuda::getCurrentCUDAStream();
    const int64_t vc_max = chunk_columns(M, V);
    Tensor acc;
    Tensor dz_buf = at::empty({M * vc_max}, hc.options());
    dispatch_float_dtype(hc.scalar_type(), "pykernels_cuda.masked_lm_loss: hidden", [&](auto tag) {
      using T = decltype(tag);
      for (int64_t v0 = 0; v0 < V; v0 += vc_max) {
        const int64_t vc = std::min(vc_max, V - v0);
        const Tensor wc = weight.narrow(0, v0, vc);
        const Tensor logits = logits_chunk(hc, wc);
        Tensor dz = dz_buf.narrow(0, 0, M * vc).view({M, vc});
        const int parts = static_cast<int>((vc + kRowThreads * 4 - 1) / (kRowThreads * 4));
        mlm_dz_kernel<T><<<static_cast<unsigned>(M * parts), kRowThreads, 0, stream>>>(
            logits.data_ptr<float>(), static_cast<T*>(dz.data_ptr()), static_cast<int>(vc), parts, v0,
            ptr_or_null<T>(bias), tgt_c.data_ptr<int64_t>(), rows.data_ptr<int64_t>(), lse_c.data_ptr<float>(),
            grad.data_ptr<float>(), stride_g, scale.data_ptr<float>(), V, static_cast<float>(eps));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        if (need_dw) {
          Tensor dw_c = dw.narrow(0, v0, vc);
          at::mm_out(dw_c, dz.t(), hc);  // fp32 accumulation in cuBLAS, one rounding
          if (db32.defined()) {
            Tensor db_c = db32.narrow(0, v0, vc);
            at::sum_out(db_c, dz, at::IntArrayRef{0}, false, at::kFloat);
          }
        }
        if (need_dh) {
          if (!acc.defined()) {
            acc = hc.scalar_type() == at::kFloat ? at::mm(dz, wc) : at::mm(dz, wc, at::kFloat);
          } else if (hc.scalar_type() == at::kFloat) {
            acc.addmm_(dz, wc);
          } else {
            at::addmm_out(acc, acc, dz, wc, at::kFloat);
          }
        }
      }
    });
    if (need_dh) dh.index_copy_(0, rows, acc.to(hc.scalar_type()));
  }
  Tensor db = db32.defined() ? db32.to(bias.scalar_type()) : Tensor();
  return {dh, dw, db};
}

class MaskedLMLossFunction : public torch::autograd::Function<MaskedLMLossFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& hidden,
                                                const Tensor& weight, const Tensor& target,
                                                const optional<Tensor>& bias, int64_t ignore_index, double eps,
                                                int64_t reduction, const optional<Tensor>& num_valid,
                                                double num_valid_host) {
    Forward f = forward_impl(hidden, weight, target, bias, ignore_index, eps, reduction, num_valid, num_valid_host);
    ctx->save_for_backward({f.hc, weight, bias.has_value() ? *bias : Tensor(), f.rows, f.tgt_c, f.lse_c, f.scale});
    ctx->saved_data["N"] = hidden.size(0);
    ctx->saved_data["eps"] = eps;
    return {f.loss};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(), "pykernels_cuda::masked_lm_loss: double backward (create_graph=True) "
                "is not supported; use backend='reference'");
    auto saved = ctx->get_saved_variables();
    // (an absent bias is no input edge: needs_input_grad(3) exists only with a bias)
    const bool has_b = saved[2].defined();
    const bool need_dh = ctx->needs_input_grad(0);
    const bool need_db = has_b && ctx->needs_input_grad(3);
    const bool need_dw = ctx->needs_input_grad(1) || need_db;
    const Tensor grad = grads[0].defined() ? grads[0] : at::zeros({}, saved[0].options().dtype(at::kFloat));
    auto g = backward_impl(grad, saved[0], saved[1], saved[2], saved[3], saved[4], saved[5], saved[6],
                           ctx->saved_data["N"].toInt(), ctx->saved_data["eps"].toDouble(), need_dh, need_dw);
    return {g[0], ctx->needs_input_grad(1) ? g[1] : Tensor(), Tensor(), need_db ? g[2] : Tensor(), Tensor(), Tensor(),
            Tensor(), Tensor(), Tensor()};
  }
};

Tensor masked_lm_loss_autograd(const Tensor& hidden, const Tensor& weight, const Tensor& target,
                               const optional<Tensor>& bias, int64_t ignore_index, double label_smoothing,
                               int64_t reduction, const optional<Tensor>& num_valid, double num_valid_host) {
  return MaskedLMLossFunction::apply(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, num_valid,
                                     num_valid_host)[0];
}

Tensor masked_lm_loss_nograd(const Tensor& hidden, const Tensor& weight, const Tensor& target,
                             const optional<Tensor>& bias, int64_t ignore_index, double label_smoothing,
                             int64_t reduction, const optional<Tensor>& num_valid, double num_valid_host) {
  return forward_impl(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, num_valid,
                      num_valid_host).loss;
}

}  // namespace
}  // namespace pykernels

TORCH_LIBRARY_FRAGMENT(pykernels_cuda, m) {
  m.def("masked_lm_loss(Tensor hidden, Tensor weight, Tensor target, Tensor? bias, int ignore_index, "
        "float label_smoothing, int reduction, Tensor? num_valid, float num_valid_host) -> Tensor");
}

TORCH_LIBRARY_IMPL(pykernels_cuda, CUDA, m) { m.impl("masked_lm_loss", &pykernels::masked_lm_loss_nograd); }

TORCH_LIBRARY_IMPL(pykernels_cuda, Autograd, m) { m.impl("masked_lm_loss", &pykernels::masked_lm_loss_autograd); }
