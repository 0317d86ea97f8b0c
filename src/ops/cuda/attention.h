#pragma once
// CUDA attention launchers behind ops/attention.h: causal grouped-query attention over packed
// sequences, forward and backward, on raw device pointers, enqueued on a stream.
//
// Same semantics and layouts as the CPU op (ops/cpu/attention.h): q (B,T,H,D), k and v
// (B,T,KVH,D) with H % KVH == 0, seg_start (B,T) int32 from segment_starts (non-decreasing,
// seg_start[b,t] <= t; not checked here, the caller builds it), out (B,T,H,D), lse (B,H,T).
// Elements are f32 or bf16 (q, k, v, out, dout, dq, dk, dv share one dtype); lse is f32 for both;
// all arithmetic is in f32. Head dims 32, 64 and 128. No (T,T) matrix is ever held: both passes
// work in (64,64) tiles with an online softmax, and the backward recomputes P from lse. The
// backward is deterministic (no atomics): dk and dv are accumulated per key tile, dq in a
// separate pass. Each CUDA call is checked; a failure throws pollen::Error naming the call.
#include <cuda_runtime_api.h>

#include <cstddef>

#include "ops/cuda/attention_tiles.h"
#include "tensor/dtype.h"

namespace pollen::ops::cuda {

bool attention_head_dim_supported(int64_t head_dim);  // 32, 64 or 128

// out (B,T,H,D) and lse (B,H,T) from q, k, v, seg_start.
void attention_forward(const AttentionShape& shape, DType dtype, const void* q, const void* k,
                       const void* v, const int32_t* seg_start, float scale, void* out, float* lse,
                       cudaStream_t stream);

// Device scratch the backward needs (delta (B,H,T) f32), in bytes.
size_t attention_backward_workspace_bytes(const AttentionShape& shape);

// dq (B,T,H,D), dk, dv (B,T,KVH,D), overwritten, from the forward's inputs, out, lse and dout.
// workspace holds attention_backward_workspace_bytes(shape) bytes of device memory.
void attention_backward(const AttentionShape& shape, DType dtype, const void* q, const void* k,
                        const void* v, const int32_t* seg_start, const void* out, const float* lse,
                        const void* dout, float scale, void* dq, void* dk, void* dv,
                        void* workspace, cudaStream_t stream);

}  // namespace pollen::ops::cuda
