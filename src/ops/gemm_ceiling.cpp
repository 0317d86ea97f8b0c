#include "ops/gemm_ceiling.h"

#include <algorithm>
#include <chrono>

#include "base/thread_pool.h"
#include "ops/gemm.h"

namespace pollen::ops {

GemmCeiling measure_gemm_ceiling(int64_t size, int repetitions) {
  Tensor a = Tensor::full({size, size}, 0.5, DType::f32);
  Tensor b = Tensor::full({size, size}, 0.25, DType::f32);
  Tensor c = Tensor::zeros({size, size}, DType::f32);
  gemm(a, false, b, false, c);  // warm-up: pages touched, BLAS buffers allocated
  double best = 1e300;
  for (int r = 0; r < std::max(repetitions, 1); ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    gemm(a, false, b, false, c);
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const double flops =
      2.0 * static_cast<double>(size) * static_cast<double>(size) * static_cast<double>(size);
  return {size, num_threads(), flops / best / 1e9};
}

}  // namespace pollen::ops
