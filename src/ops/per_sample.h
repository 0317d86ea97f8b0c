#pragma once
// CPU helpers of per-sample gradient clipping (autograd/per_sample.h): the norm of one sample's
// gradient of a weight, and the weight's gradient summed over samples each scaled by its clip
// factor. A sample is `rows` consecutive rows (tokens) of an op's (N, ...) operands. float32.
#include <cstdint>
#include <vector>

#include "tensor/tensor.h"

namespace pollen::ops {

// ||a^T b||_F^2 for a (t,m) and b (t,k) (one sample's dw = dy^T x), computed the cheaper way:
// from the two (t,t) Gram matrices, sum((a a^T) * (b b^T)) ("ghost" norm, 2 t^2 (m + k) flops),
// or from a^T b itself (2 t m k flops).
double outer_product_norm_sq(const float* a, int64_t m, const float* b, int64_t k, int64_t t);

// Each sample's ||dy_s^T x_s||_F^2 of dy (N,M) and x (N,K), N = samples * rows.
std::vector<double> sample_outer_norms_sq(const Tensor& dy, const Tensor& x, int64_t rows);

// Tied embeddings: each sample's <its gradient of the table through the embedding, through the
// head>, the sum over its positions t of dx_t . tied_t, from the embedding's output gradient dx
// (N,C) and the head's gradient of the table row of each input's id, tied (N,C)
// (CrossEntropyGrads::sample_tied_rows).
std::vector<double> tied_cross_terms(const Tensor& tied, const Tensor& dx, int64_t rows);

// g (N,M) with each sample's rows multiplied by its scale; a sample of scale 0 becomes zeros
// (whatever g held: a non-finite gradient is left out, not multiplied).
Tensor scale_samples(const Tensor& g, int64_t rows, const std::vector<double>& scale);

// x (N,K) with the rows of every sample of scale 0 zeroed (x itself when there is none): a sample
// left out for a non-finite gradient may hold non-finite activations, which a zero gradient
// row would still carry into a GEMM's sums (0 * inf).
Tensor without_left_out(const Tensor& x, int64_t rows, const std::vector<double>& scale);

// One sample's embedding gradient, its distinct ids and their rows summed: (ids, ids.size() x C).
struct SparseRows {
  std::vector<int32_t> ids;
  std::vector<float> sums;
  double norm_sq() const;
};
// Each sample's gradient of the table from dout (N,C) at ids (N) int32.
std::vector<SparseRows> embedding_sample_grads(const Tensor& dout, const Tensor& ids, int64_t rows);
// dtable (V,C) += sum over samples of scale * its gradient (samples of scale 0 skipped).
void add_scaled_sparse_rows(const std::vector<SparseRows>& grads, const std::vector<double>& scale,
                            Tensor& dtable);

}  // namespace pollen::ops
