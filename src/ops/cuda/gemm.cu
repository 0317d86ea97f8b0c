// Row-major GEMM through cuBLASLt, which is column-major: a row-major (R,C) matrix is the
// column-major (C,R) matrix, its transpose, so c = op(a) op(b) is computed as
// c^T (N,M) = op(b)^T (N,K) op(a)^T (K,M), with b's buffer as cuBLASLt's A and a's as its B.
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/log.h"
#include "ops/cuda/common.cuh"
#include "ops/cuda/cublaslt.h"
#include "ops/cuda/kernels.h"
#include "tensor/cuda_memory.h"

namespace pollen::ops::cuda {
namespace {

[[noreturn]] void fail_cublas(cublasStatus_t status, const char* call, const std::string& args,
                              const char* file, int line) {
  fail(call, " [", args, "] failed: ", cublaslt().get_status_name(status), " (",
       cublaslt().get_status_string(status), ") at ", file, ":", line);
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

// Both made, or neither: the workspace first, given back if the handle cannot be made.
std::unique_ptr<DeviceGemm> make_device_gemm(int device) {
  // The library first: where it cannot be loaded, cublaslt() throws, and a workspace allocated
  // before would leak on every later GEMM's retry.
  const CublasLt& library = cublaslt();
  auto g = std::make_unique<DeviceGemm>();
  g->workspace = CudaAllocator::instance().allocate(kWorkspaceBytes);
  const cublasStatus_t status = library.create(&g->handle);
  if (status != CUBLAS_STATUS_SUCCESS) {
    CudaAllocator::instance().release(g->workspace);
    fail_cublas(status, "cublasLtCreate(&handle)", cat("device=", device), __FILE__, __LINE__);
  }
  return g;
}

// Each GPU's entry is made once, behind its own pointer: callers use the reference after the
// lock is released, while another thread may add a GPU's entry and grow the vector (which would
// move entries stored in it by value).
DeviceGemm& device_gemm() {
  static std::mutex mutex;
  static auto* per_device = new std::vector<std::unique_ptr<DeviceGemm>>();  // never freed
  const int device = ::pollen::cuda::current_device();
  std::lock_guard lock(mutex);
  if (per_device->size() <= static_cast<size_t>(device))
    per_device->resize(static_cast<size_t>(device) + 1);
  std::unique_ptr<DeviceGemm>& g = (*per_device)[static_cast<size_t>(device)];
  if (!g) g = make_device_gemm(device);
  return *g;
}

// The library function that destroys each kind of descriptor, for warnings.
const char* destroy_name(cublasLtMatmulDesc_t) {
  return "cublasLtMatmulDescDestroy";
}
const char* destroy_name(cublasLtMatrixLayout_t) {
  return "cublasLtMatrixLayoutDestroy";
}
const char* destroy_name(cublasLtMatmulPreference_t) {
  return "cublasLtMatmulPreferenceDestroy";
}

// Destroys a cuBLASLt descriptor with the library's destroy function when it goes out of scope;
// a failure is a warning, as destructors must not throw.
template <typename D, auto CublasLt::*destroy>
struct Owned {
  D d = nullptr;
  Owned() = default;
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;
  ~Owned() {
    if (!d) return;
    const cublasStatus_t status = (cublaslt().*destroy)(d);
    if (status != CUBLAS_STATUS_SUCCESS)
      log::warn(destroy_name(d), " failed: ", cublaslt().get_status_name(status), " (",
                cublaslt().get_status_string(status), ")");
  }
};
using MatmulDesc = Owned<cublasLtMatmulDesc_t, &CublasLt::matmul_desc_destroy>;
using Layout = Owned<cublasLtMatrixLayout_t, &CublasLt::matrix_layout_destroy>;
using Preference = Owned<cublasLtMatmulPreference_t, &CublasLt::matmul_preference_destroy>;

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

// Everything that decides a call's descriptors and algorithm: all of it but the pointers' values
// and alpha and beta (passed to each cublasLtMatmul).
struct PlanKey {
  int device;
  DType ab, c_type;
  bool trans_a, trans_b;
  int64_t m, n, k;
  uint32_t align_a, align_b, align_c;
  bool operator==(const PlanKey& o) const {
    return device == o.device && ab == o.ab && c_type == o.c_type && trans_a == o.trans_a &&
           trans_b == o.trans_b && m == o.m && n == o.n && k == o.k && align_a == o.align_a &&
           align_b == o.align_b && align_c == o.align_c;
  }

  std::string describe() const {
    return cat("m=", m, " n=", n, " k=", k, " trans_a=", trans_a, " trans_b=", trans_b,
               " ab=", dtype_name(ab), " c=", dtype_name(c_type), " alignments a=", align_a,
               " b=", align_b, " c=", align_c);
  }
};

struct PlanKeyHash {
  size_t operator()(const PlanKey& key) const {
    size_t h = 0;
    for (const uint64_t v :
         {uint64_t(key.device), uint64_t(key.ab), uint64_t(key.c_type),
          uint64_t(key.trans_a) | uint64_t(key.trans_b) << 1, uint64_t(key.m), uint64_t(key.n),
          uint64_t(key.k),
          uint64_t(key.align_a) | uint64_t(key.align_b) << 9 | uint64_t(key.align_c) << 18})
      h = (h ^ std::hash<uint64_t>{}(v)) * 0x100000001b3ull;
    return h;
  }
};

// A call's descriptors and the algorithm cuBLASLt's heuristic chose for them.
struct Plan {
  MatmulDesc desc;
  Layout lay_b, lay_a, lay_c;  // cuBLASLt's A (b's buffer), B (a's) and C = D
  cublasLtMatmulAlgo_t algo{};
};

// Builds the plan of a key: fp32 accumulation and scaling (CUBLAS_COMPUTE_32F never uses TF32;
// the _FAST_TF32 variant would), the stored shapes, and the heuristic's first algorithm for them
// within the workspace and the pointers' alignments.
std::shared_ptr<const Plan> make_plan(const PlanKey& key, cublasLtHandle_t handle) {
  auto plan = std::make_shared<Plan>();
  POLLEN_CUBLAS_CHECK(cublaslt().matmul_desc_create(&plan->desc.d, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                      key.describe());
  const cublasOperation_t op_b = key.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's A
  const cublasOperation_t op_a = key.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's B
  POLLEN_CUBLAS_CHECK(cublaslt().matmul_desc_set_attribute(
                          plan->desc.d, CUBLASLT_MATMUL_DESC_TRANSA, &op_b, sizeof(op_b)),
                      key.describe());
  POLLEN_CUBLAS_CHECK(cublaslt().matmul_desc_set_attribute(
                          plan->desc.d, CUBLASLT_MATMUL_DESC_TRANSB, &op_a, sizeof(op_a)),
                      key.describe());

  // Stored (column-major) shapes: b's buffer is (N,K) ld N, or (K,N) ld K when transposed;
  // a's is (K,M) ld K, or (M,K) ld M when transposed; c's is (N,M) ld N.
  const uint64_t mu = static_cast<uint64_t>(key.m), nu = static_cast<uint64_t>(key.n),
                 ku = static_cast<uint64_t>(key.k);
  const bool ta = key.trans_a, tb = key.trans_b;
  POLLEN_CUBLAS_CHECK(cublaslt().matrix_layout_create(&plan->lay_b.d, cuda_type(key.ab),
                                                      tb ? ku : nu, tb ? nu : ku, tb ? ku : nu),
                      key.describe());
  POLLEN_CUBLAS_CHECK(cublaslt().matrix_layout_create(&plan->lay_a.d, cuda_type(key.ab),
                                                      ta ? mu : ku, ta ? ku : mu, ta ? mu : ku),
                      key.describe());
  POLLEN_CUBLAS_CHECK(
      cublaslt().matrix_layout_create(&plan->lay_c.d, cuda_type(key.c_type), nu, mu, nu),
      key.describe());

  Preference pref;
  POLLEN_CUBLAS_CHECK(cublaslt().matmul_preference_create(&pref.d), key.describe());
  const auto set_preference = [&](cublasLtMatmulPreferenceAttributes_t attribute, const void* value,
                                  size_t bytes) {
    POLLEN_CUBLAS_CHECK(cublaslt().matmul_preference_set_attribute(pref.d, attribute, value, bytes),
                        key.describe());
  };
  set_preference(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &kWorkspaceBytes,
                 sizeof(kWorkspaceBytes));
  set_preference(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &key.align_b, sizeof(key.align_b));
  set_preference(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &key.align_a, sizeof(key.align_a));
  set_preference(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &key.align_c, sizeof(key.align_c));
  set_preference(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &key.align_c, sizeof(key.align_c));

  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  POLLEN_CUBLAS_CHECK(cublaslt().matmul_algo_get_heuristic(
                          handle, plan->desc.d, plan->lay_b.d, plan->lay_a.d, plan->lay_c.d,
                          plan->lay_c.d, pref.d, 1, &heuristic, &found),
                      key.describe());
  POLLEN_CHECK(found > 0, "gemm: cuBLASLt has no algorithm for ", key.describe());
  plan->algo = heuristic.algo;
  return plan;
}

// The plans made so far, so that a training step's repeated shapes skip the descriptors and the
// heuristic (tens of microseconds of host time each). Bounded: when full it starts over (plans
// in use stay alive with their callers).
std::shared_ptr<const Plan> cached_plan(const PlanKey& key, cublasLtHandle_t handle) {
  constexpr size_t kMaxPlans = 4096;
  static std::mutex mutex;
  static auto* plans =  // never freed: plans must not be destroyed after the CUDA context
      new std::unordered_map<PlanKey, std::shared_ptr<const Plan>, PlanKeyHash>();
  {
    std::lock_guard lock(mutex);
    if (const auto it = plans->find(key); it != plans->end()) return it->second;
  }
  std::shared_ptr<const Plan> plan = make_plan(key, handle);
  std::lock_guard lock(mutex);
  if (plans->size() >= kMaxPlans) plans->clear();
  return plans->try_emplace(key, std::move(plan)).first->second;
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
  DeviceGemm& g = device_gemm();
  const PlanKey key{.device = ::pollen::cuda::current_device(),
                    .ab = ab,
                    .c_type = c_type,
                    .trans_a = trans_a,
                    .trans_b = trans_b,
                    .m = m,
                    .n = n,
                    .k = k,
                    .align_a = alignment_of(a),
                    .align_b = alignment_of(b),
                    .align_c = alignment_of(c)};
  const std::shared_ptr<const Plan> plan = cached_plan(key, g.handle);
  const float alpha_f = static_cast<float>(alpha), beta_f = static_cast<float>(beta);
  POLLEN_CUBLAS_CHECK(
      cublaslt().matmul(g.handle, plan->desc.d, &alpha_f, b, plan->lay_b.d, a, plan->lay_a.d,
                        &beta_f, c, plan->lay_c.d, c, plan->lay_c.d, &plan->algo, g.workspace,
                        kWorkspaceBytes, default_stream()),
      key.describe());
}

}  // namespace pollen::ops::cuda
