#pragma once
// CPU kernels behind ops/attention.h. Inputs are checked by the caller; pointers are contiguous
// row-major arrays with the shapes written beside them.
#include <cstdint>

namespace pollen::ops::cpu {

struct AttentionShape {
  int64_t batch, seq, heads, kv_heads, head_dim;  // B, T, H, KVH, D
};

// doc_ids (B,T) -> seg_start (B,T).
void segment_starts(const int32_t* doc_ids, int64_t batch, int64_t seq, int32_t* seg_start);

// q (B,T,H,D), k v (B,T,KVH,D), seg_start (B,T) -> out (B,T,H,D), lse (B,H,T).
template <typename T>
void attention_forward(const AttentionShape& shape, const T* q, const T* k, const T* v,
                       const int32_t* seg_start, T scale, T* out, T* lse);

// ... plus out, lse and dout (B,T,H,D) -> dq (B,T,H,D), dk dv (B,T,KVH,D).
template <typename T>
void attention_backward(const AttentionShape& shape, const T* q, const T* k, const T* v,
                        const int32_t* seg_start, const T* out, const T* lse, const T* dout,
                        T scale, T* dq, T* dk, T* dv);

}  // namespace pollen::ops::cpu
