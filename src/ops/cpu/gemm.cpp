// CPU GEMM: OpenBLAS, row-major, run single-threaded inside pollen's own pool. The output is
// cut into one contiguous block of rows (or columns) per thread, so there is one set of threads
// in the process (no BLAS threads spinning against the pool's) and each block is computed the
// same way for a given thread count.
#include <cblas.h>

#include <algorithm>
#include <mutex>

#include "base/thread_pool.h"
#include "ops/cpu/kernels.h"

namespace pollen::ops::cpu {
namespace {

void blas(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int64_t m, int64_t n, int64_t k, float alpha,
          const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
          int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta, tb, static_cast<blasint>(m), static_cast<blasint>(n),
              static_cast<blasint>(k), alpha, a, static_cast<blasint>(lda), b,
              static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}

void blas(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int64_t m, int64_t n, int64_t k, double alpha,
          const double* a, int64_t lda, const double* b, int64_t ldb, double beta, double* c,
          int64_t ldc) {
  cblas_dgemm(CblasRowMajor, ta, tb, static_cast<blasint>(m), static_cast<blasint>(n),
              static_cast<blasint>(k), alpha, a, static_cast<blasint>(lda), b,
              static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}

constexpr int64_t kMinBlock = 32;  // rows or columns per thread below which splitting stops

void make_blas_single_threaded() {
  static std::once_flag once;
  std::call_once(once, [] { openblas_set_num_threads(1); });
}

}  // namespace

template <typename T>
void gemm(const T* a, bool ta, const T* b, bool tb, T* c, int64_t m, int64_t n, int64_t k, T alpha,
          T beta) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    // An empty sum: c = beta c, and zero when beta is 0 (c is not read). BLAS would refuse the
    // leading dimension of 0 and leave c as it was.
    for (int64_t i = 0; i < m * n; ++i) c[i] = beta == T(0) ? T(0) : beta * c[i];
    return;
  }
  make_blas_single_threaded();
  const CBLAS_TRANSPOSE opa = ta ? CblasTrans : CblasNoTrans;
  const CBLAS_TRANSPOSE opb = tb ? CblasTrans : CblasNoTrans;
  const int64_t lda = ta ? m : k, ldb = tb ? k : n;
  const int64_t threads = num_threads();
  if (m >= n && m >= 2 * kMinBlock && threads > 1) {
    // Rows of c: rows of op(a). Row i of op(a) starts at a + i*lda, or column i when transposed.
    const int64_t chunks = std::min(threads, m / kMinBlock);
    pool().run_chunks(m, static_cast<int>(chunks), [&](int64_t lo, int64_t hi, int) {
      const T* a_blk = ta ? a + lo : a + lo * lda;
      blas(opa, opb, hi - lo, n, k, alpha, a_blk, lda, b, ldb, beta, c + lo * n, n);
    });
  } else if (n >= 2 * kMinBlock && threads > 1) {
    // Columns of c: columns of op(b).
    const int64_t chunks = std::min(threads, n / kMinBlock);
    pool().run_chunks(n, static_cast<int>(chunks), [&](int64_t lo, int64_t hi, int) {
      const T* b_blk = tb ? b + lo * ldb : b + lo;
      blas(opa, opb, m, hi - lo, k, alpha, a, lda, b_blk, ldb, beta, c + lo, n);
    });
  } else {
    blas(opa, opb, m, n, k, alpha, a, lda, b, ldb, beta, c, n);
  }
}

template void gemm<float>(const float*, bool, const float*, bool, float*, int64_t, int64_t, int64_t,
                          float, float);
template void gemm<double>(const double*, bool, const double*, bool, double*, int64_t, int64_t,
                           int64_t, double, double);

}  // namespace pollen::ops::cpu
