#pragma once
// CUDA kernels behind the ops' dispatch points (src/ops/*.cpp), for code that does not include
// CUDA's headers: raw device pointers, sizes and dtypes checked by the caller. Elements are f32 or
// bf16 (T below: the op's dtype) with the arithmetic in fp32. Every launch goes to the current
// GPU's default stream in order and is checked: a failure throws pollen::Error naming the kernel
// and its sizes. Nothing here waits for the GPU unless it says so.
#include <cstdint>

#include "tensor/dtype.h"

namespace pollen::ops::cuda {

// c (M,N) = alpha * op(a) @ op(b) + beta * c through cuBLASLt, row-major as ops::gemm;
// a, b of dtype ab (f32, or bf16), c of dtype c_type (f32, or bf16 when ab is bf16). The products
// accumulate in fp32; f32 inputs never use TF32. beta = 0 never reads c.
void gemm(DType ab, const void* a, bool trans_a, const void* b, bool trans_b, DType c_type, void* c,
          int64_t m, int64_t n, int64_t k, double alpha, double beta);

// Elementwise, n elements of dtype t.
void add(DType t, const void* a, const void* b, void* out, int64_t n);
void mul(DType t, const void* a, const void* b, void* out, int64_t n);
void axpy(DType t, double alpha, const void* x, void* y, int64_t n);        // y += alpha * x
void scale_into(DType t, double alpha, const void* x, void* y, int64_t n);  // y = alpha * x
void swiglu_forward(DType t, const void* gate, const void* up, void* out, int64_t n);
void swiglu_backward(DType t, const void* dout, const void* gate, const void* up, void* dgate,
                     void* dup, int64_t n);

// out (N,C) = table (V,C) rows at ids (N).
void embedding_forward(DType t, const void* table, const int32_t* ids, void* out, int64_t n,
                       int64_t c);
// dtable (V,C) += the rows of dout (N,C) summed per id, in fp32 and in token order (no atomics):
// rows (R) are the distinct ids, and the tokens of rows[r] are order[starts[r] .. starts[r+1]).
void embedding_backward(DType t, const void* dout, const int32_t* rows, const int32_t* starts,
                        const int32_t* order, int64_t row_count, void* dtable, int64_t c);

// y (N,C) = x * rstd * w; rstd (N) fp32 = 1 / sqrt(mean(x^2) + eps).
void rmsnorm_forward(DType t, const void* x, const void* w, void* y, float* rstd, int64_t n,
                     int64_t c, double eps);
// dx (N,C) = (or +=) the input gradient; dw (C) += sum over rows of dy * x * rstd, summed in fp32
// over rmsnorm_dw_chunks(N) chunks of rows into dw_partials (chunks,C) f32 (scratch), then over
// the chunks in order, and rounded into dw once.
void rmsnorm_backward(DType t, const void* dy, const void* x, const void* w, const float* rstd,
                      void* dx, void* dw, float* dw_partials, int64_t n, int64_t c,
                      bool accumulate_dx);
// Chunks of at least 64 rows, at most 128 of them: 32768 rows (llama-124m's batch) make 128
// chunks of 256 rows, 384 blocks for C = 768.
inline int64_t rmsnorm_dw_chunks(int64_t n) {
  const int64_t chunks = (n + 63) / 64;
  return chunks < 1 ? 1 : (chunks > 128 ? 128 : chunks);
}

// x (rows, H, D) rotated by +angle (or -angle when inverse), angle = positions[row] *
// inv_freq[i] in double, cos and sin times attention_factor; inv_freq (D/2) f64 on the GPU.
// out may equal x.
void rope_rotate(DType t, const void* x, const int32_t* positions, int64_t rows, int64_t heads,
                 int64_t head_dim, const double* inv_freq, double attention_factor, bool inverse,
                 void* out);

// One block of cross-entropy rows: logits (nb,V) fp32 -> row_loss (nb) f64 (0 for targets < 0);
// when want_grad the gradient grad_scale * (softmax - onehot(target)) (zero in rows with targets
// < 0) replaces the logits, or, when grad_bf16 is not null, goes there as bf16 (nb,V) instead.
void softmax_cross_entropy_rows(float* logits, const int32_t* targets, int64_t nb, int64_t v,
                                double* row_loss, bool want_grad, float grad_scale,
                                void* grad_bf16 = nullptr);

// One block of token log-probability rows: logits (nb,V) fp32 -> lse (nb) and logp (nb) f32, the
// log-softmax at each row's target (0 for targets < 0).
void token_logprob_rows(const float* logits, const int32_t* targets, int64_t nb, int64_t v,
                        float* logp, float* lse);
// Their backward: logits (nb,V) replaced by dlogp * scale * (onehot(target) - exp(logits - lse))
// (rows with targets < 0 become zero), or that written to grad_bf16 (nb,V) as bf16 when not null.
// scale: 1 / the temperature the logits were divided by.
void token_logprob_grad_rows(float* logits, const int32_t* targets, const float* dlogp,
                             const float* lse, int64_t nb, int64_t v, float scale,
                             void* grad_bf16 = nullptr);

// AdamW (torch.optim.AdamW) on many tensors in few launches (kMultiTensors a launch): param,
// exp_avg and exp_avg_sq f32; grad f32 or bf16 (grad_bf16); model_copy (bf16) written with the
// updated param when not null. Gradients are multiplied by grad_scale, and by *device_scale when
// not null (a factor computed on the GPU); when that factor is not finite the step leaves
// everything unchanged.
struct AdamWTensor {
  float* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* model_copy;
  int64_t n;
  float decay;  // 1 - lr * weight_decay
  bool grad_bf16;
};
struct AdamWArgs {
  float beta1, beta2, step_size, inv_sqrt_bias_correction2, eps, grad_scale;
};
inline constexpr int kMultiTensors = 48;  // per launch: the list stays within 4 KB of parameters
void adamw(const AdamWTensor* tensors, int64_t count, const AdamWArgs& args,
           const float* device_scale);

// total[0] += the sum of squares of the elements of every tensor (f32, or bf16 when bf16), in
// f64, reduced in a fixed order (deterministic), kMultiTensors tensors a launch. partials holds
// kSumOfSquaresBlocks doubles of scratch.
struct SquaresTensor {
  const void* x;
  int64_t n;
  bool bf16;
};
inline constexpr int kSumOfSquaresBlocks = 256;
void sum_of_squares_accumulate(const SquaresTensor* tensors, int64_t count, double* partials,
                               double* total);

// norm_and_scale (2) f32 = [sqrt(*total), the clipping factor]: max_norm / (norm + 1e-6) when
// max_norm > 0 and norm > max_norm, else 1; NaN when the norm is not finite.
void clip_factor(const double* total, double max_norm, float* norm_and_scale);

}  // namespace pollen::ops::cuda
