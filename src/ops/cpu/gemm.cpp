// CPU GEMM: OpenBLAS, row-major.
#include <cblas.h>

#include "ops/cpu/kernels.h"

namespace pollen::ops::cpu {

template <>
void gemm<float>(const float* a, bool ta, const float* b, bool tb, float* c, int64_t m, int64_t n,
                 int64_t k, float alpha, float beta) {
  if (m == 0 || n == 0) return;
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), alpha, a,
              static_cast<blasint>(ta ? m : k), b, static_cast<blasint>(tb ? k : n), beta, c,
              static_cast<blasint>(n));
}

template <>
void gemm<double>(const double* a, bool ta, const double* b, bool tb, double* c, int64_t m,
                  int64_t n, int64_t k, double alpha, double beta) {
  if (m == 0 || n == 0) return;
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), alpha, a,
              static_cast<blasint>(ta ? m : k), b, static_cast<blasint>(tb ? k : n), beta, c,
              static_cast<blasint>(n));
}

}  // namespace pollen::ops::cpu
