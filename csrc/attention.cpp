// Scaled dot-product attention in CUDA C++, the host half: torch.ops.pykernels_cuda.attention (CUDA and Autograd
// kernels), its input checks, outputs and autograd (AttentionFunction), and its compiled pair for torch.compile
// (attention_fwd / attention_bwd, at the end). The kernels, their design note and measured
// speed are in attention.cuh; attention.h is what the two halves share (the kernels' parameters, the launchers).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attention.h"
#include "dispatch.h"
#include "philox.cuh"

namespace pykernels {
namespace {

using at::Tensor;
using attn::kLog2e;
using attn::Params;
using c10::optional;

constexpr const char* kOp = "pykernels_cuda.attention";

// rows that cp.async can read 16 bytes at a time: a 16-byte aligned start and row / head / batch strides that
// keep it (stride 0 included); otherwise a contiguous copy
Tensor aligned(const Tensor& t) {
  const int64_t esz = t.element_size();
  bool ok = t.stride(-1) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int i = 0; i + 1 < t.dim() && ok; ++i) ok = (t.stride(i) * esz) % 16 == 0;
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

struct Shape {
  bool varlen;
  int64_t B, Hq, Hkv, Sq, Sk, D;
};

Shape check_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const optional<Tensor>& mask,
                   const optional<Tensor>& cu_q, const optional<Tensor>& cu_k, int64_t max_q, int64_t max_k) {
  TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), kOp, ": query, key and value must be CUDA tensors");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), kOp,
              ": query, key and value must have one dtype");
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16, kOp,
              ": query must be float16 or bfloat16, got ", q.scalar_type());
  const bool varlen = cu_q.has_value();
  TORCH_CHECK(varlen == cu_k.has_value(), kOp, ": cu_seqlens_q and cu_seqlens_k go together");
  const int nd = varlen ? 3 : 4;
  TORCH_CHECK(q.dim() == nd && k.dim() == nd && v.dim() == nd, kOp, ": query, key and value must be ",
              varlen ? "(tokens, heads, D)" : "(B, H, S, D)");
  Shape s;
  s.varlen = varlen;
  s.D = q.size(-1);
  TORCH_CHECK(k.size(-1) == s.D && v.size(-1) == s.D, kOp, ": query, key and value must have one head dim");
  TORCH_CHECK(s.D > 0 && s.D <= 256 && s.D % 8 == 0, kOp, ": head dim must be a multiple of 8 up to 256, got ", s.D);
  s.Hq = q.size(1);  // (B, H, S, D) and (tokens, H, D) alike
  s.Hkv = k.size(1);
  TORCH_CHECK(v.size(1) == s.Hkv && s.Hkv > 0 && s.Hq % s.Hkv == 0, kOp,
              ": query heads must be a multiple of key/value heads");
  TORCH_CHECK(s.Hq <= 65535, kOp, ": at most 65535 heads");
  if (varlen) {
    TORCH_CHECK(mask == c10::nullopt || !mask->defined(), kOp, ": varlen takes no mask");
    TORCH_CHECK(cu_q->scalar_type() == at::kInt && cu_k->scalar_type() == at::kInt && cu_q->dim() == 1 &&
                    cu_q->numel() == cu_k->numel() && cu_q->numel() >= 1 && cu_q->is_cuda() && cu_k->is_cuda() &&
                    cu_q->is_contiguous() && cu_k->is_contiguous(),
                kOp, ": cu_seqlens_q / cu_seqlens_k must be contiguous int32 CUDA tensors of B + 1 entries");
    TORCH_CHECK(k.size(0) == v.size(0), kOp, ": key and value must have the same tokens");
    s.B = cu_q->numel() - 1;
    s.Sq = max_q;
    s.Sk = max_k;
  } else {
    s.B = q.size(0);
    s.Sq = q.size(2);
    s.Sk = k.size(2);
    TORCH_CHECK(k.size(0) == s.B && v.size(0) == s.B && v.size(2) == s.Sk, kOp,
                ": key and value must be (B, Hkv, Sk, D) with query's B");
    if (mask.has_value() && mask->defined()) {
      TORCH_CHECK(mask->dim() == 4 && mask->size(0) == s.B && mask->size(1) == s.Hq && mask->size(2) == s.Sq &&
                      mask->size(3) == s.Sk && mask->is_cuda(),
                  kOp, ": attn_mask must be a (B, Hq, Sq, Sk) CUDA view");
      const auto mt = mask->scalar_type();
      TORCH_CHECK(mt == at::kBool || mt == at::kFloat || mt == at::kHalf || mt == at::kBFloat16 || mt == at::kDouble,
                  kOp, ": attn_mask must be bool or float, got ", mt);
    }
  }
  TORCH_CHECK(s.B <= 65535, kOp, ": at most 65535 sequences");
  TORCH_CHECK(s.Sq < (int64_t{1} << 31) - 64 && s.Sk < (int64_t{1} << 31) - 64, kOp, ": sequences below 2^31");
  return s;
}

void set_strides(const Tensor& t, bool varlen, int64_t& sb, int64_t& sh, int64_t& ss) {
  if (varlen) {
    sb = 0;
    ss = t.stride(0);
    sh = t.stride(1);
  } else {
    sb = t.stride(0);
    sh = t.stride(1);
    ss = t.stride(2);
  }
}

Params base_params(const Shape& s, const Tensor& q, const Tensor& k, const Tensor& v, const optional<Tensor>& mask,
                   const optional<Tensor>& cu_q, const optional<Tensor>& cu_k, double p_drop, bool causal,
                   double scale, const optional<Tensor>& seed) {
  Params p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  set_strides(q, s.varlen, p.q_sb, p.q_sh, p.q_ss);
  set_strides(k, s.varlen, p.k_sb, p.k_sh, p.k_ss);
  set_strides(v, s.varlen, p.v_sb, p.v_sh, p.v_ss);
  if (s.varlen) {
    p.cu_q = cu_q->data_ptr<int>();
    p.cu_k = cu_k->data_ptr<int>();
    p.tq = q.size(0);
    p.tk = k.size(0);
    p.lse_sb = 0;
    p.lse_sh = q.size(0);
  } else {
    p.lse_sb = s.Hq * s.Sq;
    p.lse_sh = s.Sq;
  }
  p.batch = static_cast<int>(s.B);
  p.sq = static_cast<int>(s.Sq);
  p.sk = static_cast<int>(s.Sk);
  p.hq = static_cast<int>(s.Hq);
  p.group = static_cast<int>(s.Hq / s.Hkv);
  p.d = static_cast<int>(s.D);
  p.scale = static_cast<float>(scale);
  p.scale_log2 = static_cast<float>(scale) * kLog2e;
  p.mask_kind = attn::kNoMask;
  if (mask.has_value() && mask->defined()) {
    const Tensor& m = *mask;
    p.mask = m.data_ptr();
    switch (m.scalar_type()) {
      case at::kBool: p.mask_kind = attn::kBoolMask; break;
      case at::kFloat: p.mask_kind = attn::kF32Mask; break;
      case at::kHalf: p.mask_kind = attn::kF16Mask; break;
      case at::kBFloat16: p.mask_kind = attn::kBF16Mask; break;
      default: p.mask_kind = attn::kF64Mask; break;
    }
    p.m_sb = m.stride(0);
    p.m_sh = m.stride(1);
    p.m_sq = m.stride(2);
    p.m_sk = m.stride(3);
    p.mask_keys = (m.size(1) == 1 || m.stride(1) == 0) && (m.size(2) == 1 || m.stride(2) == 0);
  }
  p.causal = causal;
  // the rate the kernels realise: p rounded to a multiple of 2^-16 (pykernels.attention.dropout_rate)
  const double rate = dropout_rate(p_drop);
  p.p_drop = static_cast<float>(rate);
  p.inv_keep = rate > 0.0 ? static_cast<float>(1.0 / (1.0 - rate)) : 1.f;
  p.seed = seed_ptr(p_drop, seed, q, kOp);
  TORCH_CHECK(p.sk <= INT32_MAX - 7, kOp, ": at most 2^31 - 8 keys");
  p.drop_sk = (p.sk + 7) / 8 * 8;
  return p;
}

// Packed sequences: o's and lse's rows outside [cu_seqlens_q[0], cu_seqlens_q[-1]), which no kernel writes: o's
// zeroed, lse's -inf, by launch_forward (the order kernel's spare blocks, or a launch of its own; no host sync: the
// bounds are read on the device). The backward's gradients are zeroed there by its pre kernel. (A fill of every row
// cost the packed BERT batch 6-7 us a tensor, run308.)
attn::ZeroRows forward_outside(const Shape& s, const Tensor& o, const Tensor& lse, const Tensor& cu_q) {
  TORCH_CHECK(o.is_contiguous() && lse.is_contiguous() && o.element_size() == 2, kOp,
              ": the packed o must be contiguous 2-byte, lse contiguous");
  attn::ZeroRows z{};
  z.batch = static_cast<int>(s.B);
  const int64_t rows = o.size(0);
  if (rows == 0 || o.numel() == 0) return z;
  const int* cu = cu_q.data_ptr<int>();
  z.t[z.n++] = {o.data_ptr(), cu, rows, o.numel() / rows * 2, 1, 0, 0u};
  z.t[z.n++] = {lse.data_ptr(), cu, rows, 4, s.Hq, rows * 4, 0xff800000u};  // (-inf)
  return z;
}

// (o, lse)
std::vector<Tensor> forward_impl(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                 const optional<Tensor>& mask, const optional<Tensor>& cu_q,
                                 const optional<Tensor>& cu_k, int64_t max_q, int64_t max_k, double p_drop,
                                 bool causal, double scale, const optional<Tensor>& seed,
                                 const optional<Tensor>& kv_range = c10::nullopt) {
  const Shape s = check_inputs(q_in, k_in, v_in, mask, cu_q, cu_k, max_q, max_k);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const Tensor q = aligned(q_in), k = aligned(k_in), v = aligned(v_in);
  // o in q's layout where q is dense (transformers' transposed views reshape back for free); varlen: contiguous, o's
  // and lse's rows outside the sequences filled by launch_forward (forward_outside)
  Tensor o = s.varlen ? poisoned(at::empty_like(q, at::MemoryFormat::Contiguous)) : poisoned(aligned(at::empty_like(q)));
  Tensor lse = poisoned(s.varlen ? at::empty({s.Hq, q.size(0)}, q.options().dtype(at::kFloat))
                                 : at::empty({s.B, s.Hq, s.Sq}, q.options().dtype(at::kFloat)));
  Params p = base_params(s, q, k, v, mask, cu_q, cu_k, p_drop, causal, scale, seed);
  p.out = o.data_ptr();
  set_strides(o, s.varlen, p.o_sb, p.o_sh, p.o_ss);
  p.lse = lse.data_ptr<float>();
  // packed sequences: room for the warp-specialised forward's ordered walk (launch_forward uses it where it runs
  // that kernel)
  Tensor order;
  if (s.varlen && (p.fwd_order_n = attn::fwd_order_tiles(s.B, s.Hq, s.Sq)) > 0) {
    order = at::empty({p.fwd_order_n + 1}, q.options().dtype(at::kInt));
    p.fwd_order = order.data_ptr<int>();
  }
  const attn::ZeroRows outside = s.varlen ? forward_outside(s, o, lse, *cu_q) : attn::ZeroRows{};
  // a boolean key-padding mask: each batch's valid key range for the forward's split (attention.cuh's fwd_key_ranges),
  // the caller's (pykernels.attention's, which the Triton backward takes too; without dropout: with it the split needs
  // runs from key 0, which the kernel here flags) or computed here; no host sync
  Tensor ranges;
  if (!s.varlen && attn::fwd_key_ranges_planned(p)) {  // (check_inputs: fp16 / bf16 only)
    if (kv_range.has_value() && kv_range->defined() && p.p_drop == 0.f) {
      const Tensor& r = *kv_range;
      TORCH_CHECK(r.scalar_type() == at::kInt && r.dim() == 2 && r.size(0) == s.B && r.size(1) == 3 &&
                      r.is_contiguous() && r.device() == q.device(),
                  kOp, ": kv_range must be a contiguous (B, 3) int32 tensor on query's device");
      ranges = r;
    } else {
      ranges = at::empty({s.B, 3}, q.options().dtype(at::kInt));
      attn::launch_kv_range(p, ranges.data_ptr<int>(), c10::cuda::getCurrentCUDAStream());
    }
    p.kv_range = ranges.data_ptr<int>();
  }
  dispatch_float_dtype(q.scalar_type(), "pykernels_cuda.attention: query", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, float>) attn::launch_forward<T>(p, c10::cuda::getCurrentCUDAStream(), &outside);
  });
  return {o, lse};
}

// (dq, dk, dv)
std::vector<Tensor> backward_impl(const Tensor& dout_in, const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                  const Tensor& o_in, const Tensor& lse, const optional<Tensor>& mask,
                                  const optional<Tensor>& cu_q, const optional<Tensor>& cu_k, int64_t max_q,
                                  int64_t max_k, double p_drop, bool causal, double scale,
                                  const optional<Tensor>& seed, bool deterministic) {
  const Shape s = check_inputs(q_in, k_in, v_in, mask, cu_q, cu_k, max_q, max_k);
  TORCH_CHECK(dout_in.sizes() == o_in.sizes(), kOp, ": the output gradient must have the output's shape");
  const c10::cuda::CUDAGuard guard(q_in.device());
  const Tensor q = aligned(q_in), k = aligned(k_in), v = aligned(v_in), o = aligned(o_in);
  const Tensor dout = aligned(dout_in.scalar_type() == q.scalar_type() ? dout_in : dout_in.to(q.scalar_type()));
  // every row of a sequence is written (dense: every row); varlen: contiguous, the rows outside the sequences zeroed
  // by the pre kernel (attention.cuh's grads_outside)
  const auto alloc = [&](const Tensor& t) {
    return poisoned(s.varlen ? at::empty_like(t, at::MemoryFormat::Contiguous) : aligned(at::empty_like(t)));
  };
  Tensor dq = alloc(q), dk = alloc(k), dv = alloc(v);
  Tensor delta = at::empty_like(lse);
  Params p = base_params(s, q, k, v, mask, cu_q, cu_k, p_drop, causal, scale, seed);
  p.o = o.data_ptr();
  p.dout = dout.data_ptr();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.lse = const_cast<float*>(lse.data_ptr<float>());
  p.delta = delta.data_ptr<float>();
  set_strides(o, s.varlen, p.o_sb, p.o_sh, p.o_ss);
  set_strides(dout, s.varlen, p.do_sb, p.do_sh, p.do_ss);
  set_strides(dq, s.varlen, p.dq_sb, p.dq_sh, p.dq_ss);
  set_strides(dk, s.varlen, p.dk_sb, p.dk_sh, p.dk_ss);
  set_strides(dv, s.varlen, p.dv_sb, p.dv_sh, p.dv_ss);
  // the fused backward (dQ by bulk reductions, in no fixed order) unless the backward must be reproducible bit for bit
  Tensor dq_acc;
  if (!deterministic && !at::globalContext().deterministicAlgorithms() && attn::fused_dq_planned(p)) {
    // (uninitialised: the pre kernel zeroes it in its pass over the rows, attn_bwd_pre_kernel; varlen: the packed
    // rows as one sequence, those past cu_seqlens_q[-1] neither zeroed nor read)
    dq_acc = at::empty({s.varlen ? 1 : s.B, s.Hq, attn::dq_acc_cols(p.d) / 64, s.varlen ? q.size(0) : s.Sq, 64},
                       q.options().dtype(at::kFloat));
    p.dq_acc = dq_acc.data_ptr<float>();
  }
  dispatch_float_dtype(q.scalar_type(), "pykernels_cuda.attention: query", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, float>) attn::launch_backward<T>(p, c10::cuda::getCurrentCUDAStream());
  });
  return {dq, dk, dv};
}

class AttentionFunction : public torch::autograd::Function<AttentionFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& q,
                                                const Tensor& k, const Tensor& v, const optional<Tensor>& mask,
                                                const optional<Tensor>& cu_q, const optional<Tensor>& cu_k,
                                                int64_t max_q, int64_t max_k, double p_drop, bool causal,
                                                double scale, const optional<Tensor>& seed, bool deterministic) {
    auto out = forward_impl(q, k, v, mask, cu_q, cu_k, max_q, max_k, p_drop, causal, scale, seed);
    const Tensor none;
    ctx->save_for_backward({q, k, v, out[0], out[1], mask.value_or(none), cu_q.value_or(none), cu_k.value_or(none),
                            seed.value_or(none)});
    ctx->saved_data["max_q"] = max_q;
    ctx->saved_data["max_k"] = max_k;
    ctx->saved_data["p_drop"] = p_drop;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["deterministic"] = deterministic;
    return {out[0]};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(), "pykernels_cuda::attention: double backward (create_graph=True) is "
                "not supported; use backend='reference'");
    auto saved = ctx->get_saved_variables();
    const auto opt = [](const Tensor& t) { return t.defined() ? optional<Tensor>(t) : optional<Tensor>(); };
    const Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(saved[3]);
    auto g = backward_impl(dout, saved[0], saved[1], saved[2], saved[3], saved[4], opt(saved[5]), opt(saved[6]),
                           opt(saved[7]), ctx->saved_data["max_q"].toInt(), ctx->saved_data["max_k"].toInt(),
                           ctx->saved_data["p_drop"].toDouble(), ctx->saved_data["causal"].toBool(),
                           ctx->saved_data["scale"].toDouble(), opt(saved[8]),
                           ctx->saved_data["deterministic"].toBool());
    return {g[0], g[1], g[2], Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(),
            Tensor(), Tensor()};
  }
};

Tensor attention_autograd(const Tensor& q, const Tensor& k, const Tensor& v, const optional<Tensor>& mask,
                          const optional<Tensor>& cu_q, const optional<Tensor>& cu_k, int64_t max_q, int64_t max_k,
                          double p_drop, bool causal, double scale, const optional<Tensor>& seed,
                          bool deterministic) {
  return AttentionFunction::apply(q, k, v, mask, cu_q, cu_k, max_q, max_k, p_drop, causal, scale, seed,
                                  deterministic)[0];
}

Tensor attention_nograd(const Tensor& q, const Tensor& k, const Tensor& v, const optional<Tensor>& mask,
                        const optional<Tensor>& cu_q, const optional<Tensor>& cu_k, int64_t max_q, int64_t max_k,
                        double p_drop, bool causal, double scale, const optional<Tensor>& seed,
                        bool /*deterministic: the backward's*/) {
  return forward_impl(q, k, v, mask, cu_q, cu_k, max_q, max_k, p_drop, causal, scale, seed)[0];
}

// The compiled graphs' pair (torch.compile): forward and backward as two ops with no autograd of their own, which
// pykernels.attention's _CudaAttention (an autograd.Function that dynamo traces) calls, so a compiled graph calls
// the kernels with no Python at run time; their fake impls are in pykernels/_cuda_ops.py. The forward draws the
// dropout seed (draw_seed) and returns it with o and lse.
std::tuple<Tensor, Tensor, Tensor> attention_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                                 const optional<Tensor>& mask, const optional<Tensor>& cu_q,
                                                 const optional<Tensor>& cu_k, int64_t max_q, int64_t max_k,
                                                 double p_drop, bool causal, double scale,
                                                 const optional<Tensor>& kv_range) {
  Tensor seed = draw_seed(p_drop, q);
  auto out = forward_impl(q, k, v, mask, cu_q, cu_k, max_q, max_k, p_drop, causal, scale, seed, kv_range);
  return {out[0], out[1], seed};
}

std::tuple<Tensor, Tensor, Tensor> attention_bwd(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                 const Tensor& v, const Tensor& o, const Tensor& lse,
                                                 const optional<Tensor>& mask, const optional<Tensor>& cu_q,
                                                 const optional<Tensor>& cu_k, int64_t max_q, int64_t max_k,
                                                 double p_drop, bool causal, double scale, const Tensor& seed,
                                                 bool deterministic) {
  auto g = backward_impl(dout, q, k, v, o, lse, mask, cu_q, cu_k, max_q, max_k, p_drop, causal, scale, seed,
                         deterministic);
  return {g[0], g[1], g[2]};
}

#ifdef PYKERNELS_FWD_TRACE
// the bf16 warp-specialised forward's timeline since the last reset (attention.cuh, FwdTrace), as int64
Tensor attention_fwd_trace(bool reset) {
  const int64_t n = attn::fwd_trace_read(nullptr, false);
  Tensor out = torch::empty({n}, torch::dtype(torch::kInt64));
  attn::fwd_trace_read(reinterpret_cast<unsigned long long*>(out.data_ptr<int64_t>()), reset);
  return out;
}
#endif

}  // namespace
}  // namespace pykernels

TORCH_LIBRARY_FRAGMENT(pykernels_cuda, m) {
#ifdef PYKERNELS_FWD_TRACE
  m.def("attention_fwd_trace(bool reset) -> Tensor", &pykernels::attention_fwd_trace);
#endif
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
        "int max_seqlen_q, int max_seqlen_k, float dropout_p, bool causal, float scale, Tensor? seed, "
        "bool deterministic=False) -> Tensor");
  m.def("attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
        "int max_seqlen_q, int max_seqlen_k, float dropout_p, bool causal, float scale, Tensor? kv_range=None) -> "
        "(Tensor, Tensor, Tensor)");
  m.def("attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor? attn_mask, "
        "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float dropout_p, bool causal, "
        "float scale, Tensor seed, bool deterministic=False) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pykernels_cuda, CUDA, m) {
  m.impl("attention", &pykernels::attention_nograd);
  m.impl("attention_fwd", &pykernels::attention_fwd);
  m.impl("attention_bwd", &pykernels::attention_bwd);
}

TORCH_LIBRARY_IMPL(pykernels_cuda, Autograd, m) { m.impl("attention", &pykernels::attention_autograd); }
