// Row-major GEMM through cuBLASLt, which is column-major: a row-major (R,C) matrix is the
// column-major (C,R) matrix, its transpose, so c = op(a) op(b) is computed as
// c^T (N,M) = op(b)^T (N,K) op(a)^T (K,M), with b's buffer as cuBLASLt's A and a's as its B.
#include <cublasLt.h>

#include <mutex>
#include <vector>

#include "ops/cuda/common.cuh"
#include "ops/cuda/kernels.h"
#include "tensor/cuda_memory.h"

namespace pollen::ops::cuda {
namespace {

[[noreturn]] void fail_cublas(cublasStatus_t status, const char* call, const std::string& args,
                              const char* file, int line) {
  fail(call, " [", args, "] failed: ", cublasLtGetStatusName(status), " (",
       cublasLtGetStatusString(status), ") at ", file, ":", line);
}

#define POLLEN_CUBLAS_CHECK(call, ...)                                                           \
  do {                                                                                           \
    const cublasStatus_t pollen_cublas_status_ = (call);                                         \
    if (pollen_cublas_status_ != CUBLAS_STATUS_SUCCESS)                                          \
      fail_cublas(pollen_cublas_status_, #call, ::pollen::cat(__VA_ARGS__), __FILE__, __LINE__); \
  } while (0)

constexpr size_t kWorkspaceBytes = size_t{32} << 20;

// The cuBLASLt handle and workspace of each GPU, made at first use and kept.
struct DeviceGemm {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
};

DeviceGemm& device_gemm() {
  static std::mutex mutex;
  static std::vector<DeviceGemm>* per_device = new std::vector<DeviceGemm>();  // never freed
  const int device = ::pollen::cuda::current_device();
  std::lock_guard lock(mutex);
  if (per_device->size() <= static_cast<size_t>(device))
    per_device->resize(static_cast<size_t>(device) + 1);
  DeviceGemm& g = (*per_device)[static_cast<size_t>(device)];
  if (!g.handle) {
    POLLEN_CUBLAS_CHECK(cublasLtCreate(&g.handle), "device=", device);
    g.workspace = CudaAllocator::instance().allocate(kWorkspaceBytes);
  }
  return g;
}

// Destroys a cuBLASLt descriptor when it goes out of scope.
template <typename D, cublasStatus_t (*destroy)(D)>
struct Owned {
  D d = nullptr;
  ~Owned() {
    if (d) destroy(d);
  }
};
using MatmulDesc = Owned<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>;
using Layout = Owned<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>;
using Preference = Owned<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>;

cudaDataType_t cuda_type(DType t) {
  return t == DType::bf16 ? CUDA_R_16BF : CUDA_R_32F;
}

// The largest power of two (up to 256) that divides the address: the alignment cuBLASLt may
// assume when it picks a kernel.
uint32_t alignment_of(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && address % a != 0) a /= 2;
  return a;
}

}  // namespace

void gemm(DType ab, const void* a, bool trans_a, const void* b, bool trans_b, DType c_type, void* c,
          int64_t m, int64_t n, int64_t k, double alpha, double beta) {
  POLLEN_CHECK(ab == DType::f32 || ab == DType::bf16,
               "gemm: a and b must be f32 or bf16 on cuda, got ", dtype_name(ab));
  POLLEN_CHECK(c_type == DType::f32 || (c_type == DType::bf16 && ab == DType::bf16),
               "gemm: c must be f32, or bf16 when a and b are, got c ", dtype_name(c_type),
               " with a and b ", dtype_name(ab));
  if (m == 0 || n == 0) return;
  if (k == 0) {  // c = beta * c
    if (beta == 0) {
      ::pollen::cuda::zero_bytes(c, static_cast<size_t>(m * n) * dtype_size(c_type));
    } else {
      scale_into(c_type, beta, c, c, m * n);
    }
    return;
  }
  const std::string shape =
      cat("m=", m, " n=", n, " k=", k, " trans_a=", trans_a, " trans_b=", trans_b,
          " ab=", dtype_name(ab), " c=", dtype_name(c_type));
  DeviceGemm& g = device_gemm();

  // fp32 accumulation and scaling; CUBLAS_COMPUTE_32F never uses TF32 (the _FAST_TF32 variant
  // would).
  MatmulDesc desc;
  POLLEN_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc.d, CUBLAS_COMPUTE_32F, CUDA_R_32F), shape);
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's A
  const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's B
  POLLEN_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_TRANSA, &op_b, sizeof(op_b)),
      shape);
  POLLEN_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_TRANSB, &op_a, sizeof(op_a)),
      shape);

  // Stored (column-major) shapes: b's buffer is (N,K) ld N, or (K,N) ld K when transposed;
  // a's is (K,M) ld K, or (M,K) ld M when transposed; c's is (N,M) ld N.
  const uint64_t mu = static_cast<uint64_t>(m), nu = static_cast<uint64_t>(n),
                 ku = static_cast<uint64_t>(k);
  Layout lay_b, lay_a, lay_c;
  POLLEN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lay_b.d, cuda_type(ab), trans_b ? ku : nu,
                                                 trans_b ? nu : ku, trans_b ? ku : nu),
                      shape);
  POLLEN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lay_a.d, cuda_type(ab), trans_a ? mu : ku,
                                                 trans_a ? ku : mu, trans_a ? mu : ku),
                      shape);
  POLLEN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lay_c.d, cuda_type(c_type), nu, mu, nu), shape);

  Preference pref;
  POLLEN_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref.d), shape);
  POLLEN_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref.d, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                           &kWorkspaceBytes, sizeof(kWorkspaceBytes)),
      shape);
  const uint32_t align_b = alignment_of(b), align_a = alignment_of(a), align_c = alignment_of(c);
  POLLEN_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref.d, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                           &align_b, sizeof(align_b)),
      shape);
  POLLEN_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref.d, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                           &align_a, sizeof(align_a)),
      shape);
  POLLEN_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref.d, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                           &align_c, sizeof(align_c)),
      shape);
  POLLEN_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref.d, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                           &align_c, sizeof(align_c)),
      shape);

  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  POLLEN_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(g.handle, desc.d, lay_b.d, lay_a.d, lay_c.d,
                                                     lay_c.d, pref.d, 1, &heuristic, &found),
                      shape);
  POLLEN_CHECK(found > 0, "gemm: cuBLASLt has no algorithm for ", shape);

  const float alpha_f = static_cast<float>(alpha), beta_f = static_cast<float>(beta);
  POLLEN_CUBLAS_CHECK(
      cublasLtMatmul(g.handle, desc.d, &alpha_f, b, lay_b.d, a, lay_a.d, &beta_f, c, lay_c.d, c,
                     lay_c.d, &heuristic.algo, g.workspace, kWorkspaceBytes, default_stream()),
      shape);
}

}  // namespace pollen::ops::cuda
