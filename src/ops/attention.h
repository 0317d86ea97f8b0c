#pragma once
// Causal grouped-query attention over packed sequences, forward and backward.
//
// Tokens attend causally within their own document: token t of row b sees keys j with
// seg_start[b,t] <= j <= t. Both passes work in flash-style blocks with an online softmax, so no
// (T,T) score matrix is ever held; the backward recomputes the scores from the saved logsumexp.
// Results are bitwise reproducible and independent of the thread count.
#include "tensor/tensor.h"

namespace pollen::ops {

// doc_ids (B,T) int32 -> seg_start (B,T) int32: the position of the first token of each token's
// document run; a new run starts wherever doc_ids changes along T.
Tensor segment_starts(const Tensor& doc_ids);

// q (B,T,H,D); k, v (B,T,KVH,D) with H % KVH == 0 (head h reads kv head h / (H/KVH));
// seg_start (B,T) int32 from segment_starts (non-decreasing, seg_start[b,t] <= t).
// out (B,T,H,D) = softmax(q k^T * scale) v; lse (B,H,T) = logsumexp of each query's scaled scores.
// out and lse are allocated by the caller; f32 or f64, all tensors contiguous on the CPU. On CUDA
// (q on the GPU; docs/cuda.md): every tensor on the GPU, f32 or bf16 with lse f32, D 32/64/128.
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg_start,
                       double scale, Tensor& out, Tensor& lse);

// Gradients of a loss through attention_forward, given dout (B,T,H,D) and the forward's out and
// lse. dq (B,T,H,D), dk and dv (B,T,KVH,D) are overwritten, not accumulated.
void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg_start,
                        const Tensor& out, const Tensor& lse, const Tensor& dout, double scale,
                        Tensor& dq, Tensor& dk, Tensor& dv);

}  // namespace pollen::ops
