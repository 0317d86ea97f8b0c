// Device dispatch for attention: checks every input, then runs the CPU or the CUDA kernel.
#include "ops/attention.h"

#include <cmath>

#include "ops/check.h"
#include "ops/cpu/attention.h"
#include "ops/profile.h"
#if POLLEN_HAVE_CUDA
#include "ops/cuda/attention.h"
#include "tensor/cuda_context.h"  // the default stream every other GPU op runs on
#endif

namespace pollen::ops {
namespace {

// Reads B, T, H, KVH, D from q and k and checks the shapes every attention call shares.
cpu::AttentionShape check_attention_inputs(const char* op, const Tensor& q, const Tensor& k,
                                           const Tensor& v, const Tensor& seg_start, double scale) {
  POLLEN_CHECK(q.defined() && q.dim() == 4, op, ": q must be (B,T,H,D), got ",
               q.defined() ? shape_str(q.shape()) : "undefined");
  POLLEN_CHECK(k.defined() && k.dim() == 4, op, ": k must be (B,T,KVH,D), got ",
               k.defined() ? shape_str(k.shape()) : "undefined");
  POLLEN_CHECK(q.dtype() == DType::f32 || q.dtype() == DType::f64, op,
               ": q must be f32 or f64, got ", dtype_name(q.dtype()));
  const cpu::AttentionShape s{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3)};
  POLLEN_CHECK(s.heads > 0 && s.kv_heads > 0 && s.heads % s.kv_heads == 0, op, ": H = ", s.heads,
               " (q) must be a positive multiple of KVH = ", s.kv_heads, " (k)");
  POLLEN_CHECK(s.head_dim > 0, op, ": head dimension D must be positive");
  POLLEN_CHECK(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  const Shape qs{s.batch, s.seq, s.heads, s.head_dim};
  const Shape kvs{s.batch, s.seq, s.kv_heads, s.head_dim};
  check_tensor(op, "q", q, q.dtype(), qs, "(B,T,H,D)");
  check_tensor(op, "k", k, q.dtype(), kvs, "(B,T,KVH,D)");
  check_tensor(op, "v", v, q.dtype(), kvs, "(B,T,KVH,D)");
  check_tensor(op, "seg_start", seg_start, DType::i32, {s.batch, s.seq}, "(B,T)");
  const int32_t* seg = seg_start.data<int32_t>();
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t t = 0; t < s.seq; ++t) {
      const int32_t start = seg[b * s.seq + t];
      const int32_t previous = t > 0 ? seg[b * s.seq + t - 1] : 0;
      POLLEN_CHECK(start >= previous && start <= t, op, ": seg_start[", b, ",", t, "] = ", start,
                   " must lie in [seg_start[", b, ",", t - 1, "], ", t,
                   "] (non-decreasing, at most the position); build it with segment_starts");
    }
  }
  return s;
}

template <typename T>
void forward_typed(const cpu::AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v,
                   const Tensor& seg_start, double scale, Tensor& out, Tensor& lse) {
  cpu::attention_forward<T>(s, q.data<T>(), k.data<T>(), v.data<T>(), seg_start.data<int32_t>(),
                            static_cast<T>(scale), out.data<T>(), lse.data<T>());
}

template <typename T>
void backward_typed(const cpu::AttentionShape& s, const Tensor& q, const Tensor& k, const Tensor& v,
                    const Tensor& seg_start, const Tensor& out, const Tensor& lse,
                    const Tensor& dout, double scale, Tensor& dq, Tensor& dk, Tensor& dv) {
  cpu::attention_backward<T>(s, q.data<T>(), k.data<T>(), v.data<T>(), seg_start.data<int32_t>(),
                             out.data<T>(), lse.data<T>(), dout.data<T>(), static_cast<T>(scale),
                             dq.data<T>(), dk.data<T>(), dv.data<T>());
}

// ---- CUDA (ops/cuda/attention.h): every tensor on the GPU, f32 or bf16 with lse f32 -----------

void check_cuda_tensor(const char* op, const char* name, const Tensor& t, DType dtype,
                       const Shape& shape, const char* layout) {
  POLLEN_CHECK(t.defined(), op, ": ", name, " is undefined; expected ", layout, " ",
               shape_str(shape));
  POLLEN_CHECK(t.device() == Device::cuda, op, ": ", name, " is on ", device_name(t.device()),
               ", expected cuda like q");
  POLLEN_CHECK(t.dtype() == dtype, op, ": ", name, " has dtype ", dtype_name(t.dtype()),
               ", expected ", dtype_name(dtype));
  POLLEN_CHECK(t.shape() == shape, op, ": ", name, " has shape ", shape_str(t.shape()),
               ", expected ", layout, " ", shape_str(shape));
  POLLEN_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

// The shapes of a CUDA call; seg_start's values stay on the GPU and are the caller's promise.
cpu::AttentionShape check_cuda_inputs(const char* op, const Tensor& q, const Tensor& k,
                                      const Tensor& v, const Tensor& seg_start, double scale) {
  POLLEN_CHECK(q.dim() == 4 && k.defined() && k.dim() == 4, op,
               ": q must be (B,T,H,D) and k (B,T,KVH,D), got ", shape_str(q.shape()), " and ",
               k.defined() ? shape_str(k.shape()) : "undefined");
  POLLEN_CHECK(q.dtype() == DType::f32 || q.dtype() == DType::bf16, op,
               ": q on cuda must be f32 or bf16, got ", dtype_name(q.dtype()));
  const cpu::AttentionShape s{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3)};
  POLLEN_CHECK(s.heads > 0 && s.kv_heads > 0 && s.heads % s.kv_heads == 0, op, ": H = ", s.heads,
               " (q) must be a positive multiple of KVH = ", s.kv_heads, " (k)");
  POLLEN_CHECK(std::isfinite(scale), op, ": scale must be finite, got ", scale);
  const Shape kvs{s.batch, s.seq, s.kv_heads, s.head_dim};
  check_cuda_tensor(op, "q", q, q.dtype(), q.shape(), "(B,T,H,D)");
  check_cuda_tensor(op, "k", k, q.dtype(), kvs, "(B,T,KVH,D)");
  check_cuda_tensor(op, "v", v, q.dtype(), kvs, "(B,T,KVH,D)");
  check_cuda_tensor(op, "seg_start", seg_start, DType::i32, {s.batch, s.seq}, "(B,T)");
  return s;
}

void forward_cuda(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg_start,
                  double scale, Tensor& out, Tensor& lse) {
  const char* op = "attention_forward";
  const auto s = check_cuda_inputs(op, q, k, v, seg_start, scale);
  check_cuda_tensor(op, "out", out, q.dtype(), q.shape(), "(B,T,H,D)");
  check_cuda_tensor(op, "lse", lse, DType::f32, {s.batch, s.heads, s.seq}, "(B,H,T)");
#if POLLEN_HAVE_CUDA
  cuda::attention_forward({s.batch, s.seq, s.heads, s.kv_heads, s.head_dim}, q.dtype(), q.raw(),
                          k.raw(), v.raw(), seg_start.data<int32_t>(), static_cast<float>(scale),
                          out.raw(), lse.data<float>(), pollen::cuda::default_stream());
#else
  fail(op, ": tensors on cuda, but this pollen was built without CUDA");
#endif
}

void backward_cuda(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg_start,
                   const Tensor& out, const Tensor& lse, const Tensor& dout, double scale,
                   Tensor& dq, Tensor& dk, Tensor& dv) {
  const char* op = "attention_backward";
  const auto s = check_cuda_inputs(op, q, k, v, seg_start, scale);
  check_cuda_tensor(op, "out", out, q.dtype(), q.shape(), "(B,T,H,D)");
  check_cuda_tensor(op, "lse", lse, DType::f32, {s.batch, s.heads, s.seq}, "(B,H,T)");
  check_cuda_tensor(op, "dout", dout, q.dtype(), q.shape(), "(B,T,H,D)");
  check_cuda_tensor(op, "dq", dq, q.dtype(), q.shape(), "(B,T,H,D)");
  check_cuda_tensor(op, "dk", dk, q.dtype(), k.shape(), "(B,T,KVH,D)");
  check_cuda_tensor(op, "dv", dv, q.dtype(), k.shape(), "(B,T,KVH,D)");
#if POLLEN_HAVE_CUDA
  const cuda::AttentionShape shape{s.batch, s.seq, s.heads, s.kv_heads, s.head_dim};
  Tensor workspace = Tensor::empty({s.batch, s.heads, s.seq}, DType::f32, Device::cuda);
  POLLEN_ASSERT(workspace.nbytes() >= cuda::attention_backward_workspace_bytes(shape));
  cuda::attention_backward(shape, q.dtype(), q.raw(), k.raw(), v.raw(), seg_start.data<int32_t>(),
                           out.raw(), lse.data<float>(), dout.raw(), static_cast<float>(scale),
                           dq.raw(), dk.raw(), dv.raw(), workspace.raw(),
                           pollen::cuda::default_stream());
#else
  fail(op, ": tensors on cuda, but this pollen was built without CUDA");
#endif
}

}  // namespace

Tensor segment_starts(const Tensor& doc_ids) {
  POLLEN_CHECK(doc_ids.defined() && doc_ids.dim() == 2,
               "segment_starts: doc_ids must be (B,T), got ",
               doc_ids.defined() ? shape_str(doc_ids.shape()) : "undefined");
  check_tensor("segment_starts", "doc_ids", doc_ids, DType::i32, doc_ids.shape(), "(B,T)");
  Tensor seg_start = Tensor::empty(doc_ids.shape(), DType::i32);
  cpu::segment_starts(doc_ids.data<int32_t>(), doc_ids.size(0), doc_ids.size(1),
                      seg_start.data<int32_t>());
  return seg_start;
}

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg_start,
                       double scale, Tensor& out, Tensor& lse) {
  const OpTimer timer("attention_forward", q);
  if (q.defined() && q.device() == Device::cuda) {
    forward_cuda(q, k, v, seg_start, scale, out, lse);
    return;
  }
  const char* op = "attention_forward";
  const auto s = check_attention_inputs(op, q, k, v, seg_start, scale);
  check_tensor(op, "out", out, q.dtype(), q.shape(), "(B,T,H,D)");
  check_tensor(op, "lse", lse, q.dtype(), {s.batch, s.heads, s.seq}, "(B,H,T)");
  if (q.dtype() == DType::f32) {
    forward_typed<float>(s, q, k, v, seg_start, scale, out, lse);
  } else {
    forward_typed<double>(s, q, k, v, seg_start, scale, out, lse);
  }
}

void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg_start,
                        const Tensor& out, const Tensor& lse, const Tensor& dout, double scale,
                        Tensor& dq, Tensor& dk, Tensor& dv) {
  const OpTimer timer("attention_backward", q);
  if (q.defined() && q.device() == Device::cuda) {
    backward_cuda(q, k, v, seg_start, out, lse, dout, scale, dq, dk, dv);
    return;
  }
  const char* op = "attention_backward";
  const auto s = check_attention_inputs(op, q, k, v, seg_start, scale);
  check_tensor(op, "out", out, q.dtype(), q.shape(), "(B,T,H,D)");
  check_tensor(op, "lse", lse, q.dtype(), {s.batch, s.heads, s.seq}, "(B,H,T)");
  check_tensor(op, "dout", dout, q.dtype(), q.shape(), "(B,T,H,D)");
  check_tensor(op, "dq", dq, q.dtype(), q.shape(), "(B,T,H,D)");
  check_tensor(op, "dk", dk, q.dtype(), k.shape(), "(B,T,KVH,D)");
  check_tensor(op, "dv", dv, q.dtype(), k.shape(), "(B,T,KVH,D)");
  if (q.dtype() == DType::f32) {
    backward_typed<float>(s, q, k, v, seg_start, out, lse, dout, scale, dq, dk, dv);
  } else {
    backward_typed<double>(s, q, k, v, seg_start, out, lse, dout, scale, dq, dk, dv);
  }
}

}  // namespace pollen::ops
