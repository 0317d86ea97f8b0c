#pragma once
// Cross-entropy fused with the output projection (the LM head), computed over blocks of rows so
// that at most (block_rows, V) logits exist at a time and none are kept for backward.
#include <cstdint>
#include <vector>

#include "tensor/tensor.h"

namespace pollen::ops {

inline constexpr int32_t kIgnoreIndex = -100;  // targets below 0 are not scored (HF uses -100)

struct CrossEntropyGrads {
  Tensor dh;  // (N,C): overwritten with grad_scale * d(loss_sum)/dh
  Tensor dw;  // (V,C): accumulated with grad_scale * d(loss_sum)/dw; undefined: not computed (a
              // frozen head), which saves a GEMM per block
  double grad_scale = 1.0;
  // Per-sample clipping (CPU, autograd/per_sample.h): samples of sample_rows consecutive rows.
  // With sample_norms_sq, each sample's ||dw||^2 (its part of dw, grad_scale included) is added
  // to (*sample_norms_sq)[sample]; with sample_scale, each sample's rows of the gradient are
  // multiplied by its scale before dh and dw (a scale of 0 leaves the sample out). dh undefined:
  // not computed.
  int64_t sample_rows = 0;
  std::vector<double>* sample_norms_sq = nullptr;
  const std::vector<double>* sample_scale = nullptr;
  // Tied embeddings (with sample_norms_sq): the input ids (N), and out (N,C): row t of a sample
  // gets sum over the sample's rows r of g[r, id_t] h_r, the head's gradient of the table row of
  // input t's id (before its other inputs' share), for the cross term of the table's two uses.
  const int32_t* sample_input_ids = nullptr;
  Tensor sample_tied_rows;  // undefined: not wanted
};

// On the GPU h, w, dh and dw are f32 or bf16: each block's logits are fp32 (block_rows, V), as
// the CPU's block, and for bf16 the gradient is rounded to bf16 for its two GEMMs; a bf16 dw sums
// the blocks in fp32 and is rounded once; the targets are checked on the host from a copy and
// the row losses are summed there.
// h (N,C), w (V,C), targets (N) int32. Returns the sum over scored rows of
// -log softmax(h w^T)[target] and sets *scored to the number of scored rows. When `grads` is
// given, the gradients are computed in the same pass (the logits of a block are used for the
// loss and then turned into its gradient): three GEMMs per block and no second pass.
double cross_entropy_forward(const Tensor& h, const Tensor& w, const Tensor& targets,
                             int64_t* scored, CrossEntropyGrads* grads = nullptr,
                             int64_t block_rows = 0);

// The rows per block used when block_rows is 0 (also by token_logprobs), before the cap at N:
// about 4 M logits per block on the CPU; on the GPU, max(256, 2^28 / V) (fewer, wider dw GEMMs).
int64_t cross_entropy_default_block_rows(int64_t vocab, Device device);

}  // namespace pollen::ops
