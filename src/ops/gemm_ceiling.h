#pragma once
// The machine's GEMM ceiling as pollen runs it: square f32 products through ops::gemm on the
// pool's threads, the best of several repetitions. Benchmarks report their fraction of it.
#include <cstdint>

namespace pollen::ops {

struct GemmCeiling {
  int64_t size = 0;
  int threads = 0;
  double gflops = 0;  // best repetition
};

GemmCeiling measure_gemm_ceiling(int64_t size, int repetitions);

}  // namespace pollen::ops
