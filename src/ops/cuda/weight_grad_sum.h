#pragma once
// The output projection's weight gradient in the GPU block loops of cross_entropy_forward and
// token_logprobs_backward: dw (V,C) += the sum over blocks of rows of g^T (V,nb) @ hb (nb,C).
// For the C++20 side only (it holds tensors); .cu files never include it.
#include <cstdint>

#include "ops/cuda/kernels.h"
#include "tensor/tensor.h"

namespace pollen::ops::cuda {

// A bf16 dw that each block's GEMM updated in place would be read, added to and rounded to bf16
// once per block: over the hundreds of blocks of a real batch the roundings add up to percents of
// error, against ~0.2% for one rounding. So when a bf16 dw takes more than one block, the blocks
// are summed in an f32 copy of dw (V,C) (the conversion is exact) and that sum is rounded into dw
// once, by finish(): dw gets its old value plus every block, rounded once, as the CPU's dw (in its
// own dtype) gets. An f32 dw, or a single block, is accumulated in place.
class WeightGradSum {
 public:
  // dw (V,C) f32 or bf16 on the GPU, contiguous; `blocks` is the number of add() calls to come.
  WeightGradSum(const Tensor& dw, int64_t blocks) : dw_(dw) {
    if (dw.dtype() == DType::bf16 && blocks > 1) sum_ = dw.to(DType::f32);
  }

  // dw (V,C) += g^T (V,nb) @ hb (nb,C), g and hb of dtype ab (dw's dtype); the GEMM accumulates
  // in fp32 and adds to the f32 sum when there is one.
  void add(DType ab, const void* g, const void* hb, int64_t nb) {
    const Tensor& into = sum_.defined() ? sum_ : dw_;
    gemm(ab, g, true, hb, false, into.dtype(), into.raw(), dw_.size(0), dw_.size(1), nb, 1.0, 1.0);
  }

  // Rounds the f32 sum into dw, if there is one. Call after the last add().
  void finish() {
    if (sum_.defined()) dw_.copy_(sum_);
  }

 private:
  Tensor dw_;   // (V,C): a handle on the caller's storage
  Tensor sum_;  // (V,C) f32: dw plus the blocks so far, when dw is bf16 and blocks > 1
};

}  // namespace pollen::ops::cuda
