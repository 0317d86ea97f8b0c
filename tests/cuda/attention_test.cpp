// CUDA attention (ops/cuda/attention.h) against the CPU op in double precision on the same
// inputs, on a GPU: fresh random inputs each run (the seed is printed on failure), several
// documents per row, T not a multiple of the tile, outputs poisoned with NaN before every launch.
// Without a GPU (or without the CUDA backend) the tests skip and say why.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <random>
#include <vector>

#include "base/rng.h"
#include "ops/attention.h"
#include "support/attention_inputs.h"
#include "tensor/device.h"

#if POLLEN_HAVE_CUDA
#include <cuda_runtime.h>

#include "ops/cuda/attention.h"
#endif

namespace pollen::ops {
namespace {

using testing::random_seg_start;
using testing::relative_error;

#define SKIP_WITHOUT_GPU()                                                      \
  do {                                                                          \
    if (!cuda_built() || cuda_devices().empty()) GTEST_SKIP() << cuda_status(); \
  } while (0)

#if POLLEN_HAVE_CUDA

void cuda_ok(cudaError_t err, const char* call) {
  if (err != cudaSuccess)
    fail(call, " returned ", cudaGetErrorName(err), ": ", cudaGetErrorString(err));
}
#define CUDA_OK(call) cuda_ok((call), #call)

// Device memory holding a copy of host values (or `count` poisoned elements).
struct DeviceBuffer {
  DeviceBuffer(const void* host, size_t bytes) : bytes(bytes) {
    CUDA_OK(cudaMalloc(&ptr, bytes));
    if (host) CUDA_OK(cudaMemcpy(ptr, host, bytes, cudaMemcpyHostToDevice));
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void poison() { CUDA_OK(cudaMemset(ptr, 0xFF, bytes)); }  // all-ones: NaN in f32 and bf16
  void* ptr = nullptr;
  size_t bytes;
};

// Values as the GPU reads them (f32, or bf16 bits) and as the reference reads them (the same
// values in f64).
struct Values {
  std::vector<float> f32;
  std::vector<bf16> b16;
  std::vector<double> f64;
  const void* device_bytes(DType dtype) const {
    return dtype == DType::f32 ? static_cast<const void*>(f32.data()) : b16.data();
  }
  size_t bytes(DType dtype) const { return f64.size() * dtype_size(dtype); }
};

Values random_values(int64_t n, DType dtype, Rng& rng) {
  Values v;
  for (int64_t i = 0; i < n; ++i) {
    float x = static_cast<float>(rng.normal());
    if (dtype == DType::bf16) {
      v.b16.push_back(bf16::from_float(x));
      x = v.b16.back().to_float();
    }
    v.f32.push_back(x);
    v.f64.push_back(x);
  }
  return v;
}

// Device result as doubles.
std::vector<double> fetch(const DeviceBuffer& buffer, DType dtype, int64_t n) {
  std::vector<double> out(static_cast<size_t>(n));
  if (dtype == DType::f32) {
    std::vector<float> host(static_cast<size_t>(n));
    CUDA_OK(cudaMemcpy(host.data(), buffer.ptr, host.size() * 4, cudaMemcpyDeviceToHost));
    std::copy(host.begin(), host.end(), out.begin());
  } else {
    std::vector<bf16> host(static_cast<size_t>(n));
    CUDA_OK(cudaMemcpy(host.data(), buffer.ptr, host.size() * 2, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < host.size(); ++i) out[i] = host[i].to_float();
  }
  return out;
}

void expect_matches_cpu_op(DType dtype, int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
                           int64_t dim, int64_t max_run) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " B=" << batch << " T=" << seq
                                    << " H=" << heads << " KVH=" << kv_heads << " D=" << dim
                                    << " max_run=" << max_run << " seed=" << seed);
  const double tolerance = dtype == DType::f32 ? 1e-4 : 1e-2;
  Rng rng(seed);
  const Shape qs{batch, seq, heads, dim}, kvs{batch, seq, kv_heads, dim}, ls{batch, heads, seq};
  const int64_t q_size = shape_numel(qs), kv_size = shape_numel(kvs), l_size = shape_numel(ls);
  const Values q = random_values(q_size, dtype, rng), k = random_values(kv_size, dtype, rng),
               v = random_values(kv_size, dtype, rng), dout = random_values(q_size, dtype, rng);
  const std::vector<int32_t> seg = random_seg_start(batch, seq, max_run, rng);
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));

  // reference: the CPU op in f64 on the same values
  const Tensor seg_t = Tensor::from({batch, seq}, seg);
  const Tensor q_t = Tensor::from(qs, q.f64), k_t = Tensor::from(kvs, k.f64),
               v_t = Tensor::from(kvs, v.f64), dout_t = Tensor::from(qs, dout.f64);
  Tensor out_t = Tensor::empty(qs, DType::f64), lse_t = Tensor::empty(ls, DType::f64);
  attention_forward(q_t, k_t, v_t, seg_t, scale, out_t, lse_t);
  Tensor dq_t = Tensor::empty(qs, DType::f64), dk_t = Tensor::empty(kvs, DType::f64),
         dv_t = Tensor::empty(kvs, DType::f64);
  attention_backward(q_t, k_t, v_t, seg_t, out_t, lse_t, dout_t, scale, dq_t, dk_t, dv_t);

  const cuda::AttentionShape shape{batch, seq, heads, kv_heads, dim};
  // device copies of the inputs, and outputs
  DeviceBuffer in_q(q.device_bytes(dtype), q.bytes(dtype));
  DeviceBuffer in_k(k.device_bytes(dtype), k.bytes(dtype));
  DeviceBuffer in_v(v.device_bytes(dtype), v.bytes(dtype));
  DeviceBuffer in_dout(dout.device_bytes(dtype), dout.bytes(dtype));
  DeviceBuffer in_seg(seg.data(), seg.size() * sizeof(int32_t));
  DeviceBuffer out(nullptr, q.bytes(dtype)), lse(nullptr, static_cast<size_t>(l_size) * 4);
  DeviceBuffer dq(nullptr, q.bytes(dtype)), dk(nullptr, k.bytes(dtype)),
      dv(nullptr, v.bytes(dtype));
  DeviceBuffer workspace(nullptr, cuda::attention_backward_workspace_bytes(shape));
  const auto* seg_ptr = static_cast<const int32_t*>(in_seg.ptr);

  out.poison();
  lse.poison();
  cuda::attention_forward(shape, dtype, in_q.ptr, in_k.ptr, in_v.ptr, seg_ptr,
                          static_cast<float>(scale), out.ptr, static_cast<float*>(lse.ptr),
                          nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_LT(relative_error(fetch(out, dtype, q_size), out_t), tolerance) << "out";
  EXPECT_LT(relative_error(fetch(lse, DType::f32, l_size), lse_t), tolerance) << "lse";

  // backward from the GPU's own out and lse, as training runs it; twice, bitwise equal
  std::vector<std::vector<double>> first;
  for (int run = 0; run < 2; ++run) {
    dq.poison();
    dk.poison();
    dv.poison();
    workspace.poison();
    cuda::attention_backward(shape, dtype, in_q.ptr, in_k.ptr, in_v.ptr, seg_ptr, out.ptr,
                             static_cast<const float*>(lse.ptr), in_dout.ptr,
                             static_cast<float>(scale), dq.ptr, dk.ptr, dv.ptr, workspace.ptr,
                             nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<std::vector<double>> grads{fetch(dq, dtype, q_size), fetch(dk, dtype, kv_size),
                                           fetch(dv, dtype, kv_size)};
    if (run == 0) {
      EXPECT_LT(relative_error(grads[0], dq_t), tolerance) << "dq";
      EXPECT_LT(relative_error(grads[1], dk_t), tolerance) << "dk";
      EXPECT_LT(relative_error(grads[2], dv_t), tolerance) << "dv";
      first = std::move(grads);
    } else {
      EXPECT_TRUE(grads == first) << "the backward is not deterministic";
    }
  }
}

#endif  // POLLEN_HAVE_CUDA

TEST(CudaAttention, Float32GroupedQueryFourToOneD64) {
  SKIP_WITHOUT_GPU();
#if POLLEN_HAVE_CUDA
  expect_matches_cpu_op(DType::f32, 2, 200, 8, 2, 64, 90);
#endif
}

TEST(CudaAttention, Float32OneToOneD128) {
  SKIP_WITHOUT_GPU();
#if POLLEN_HAVE_CUDA
  expect_matches_cpu_op(DType::f32, 2, 200, 4, 4, 128, 90);
#endif
}

TEST(CudaAttention, Bfloat16GroupedQueryFourToOneD128) {
  SKIP_WITHOUT_GPU();
#if POLLEN_HAVE_CUDA
  expect_matches_cpu_op(DType::bf16, 2, 200, 8, 2, 128, 90);
#endif
}

TEST(CudaAttention, Bfloat16OneToOneD64) {
  SKIP_WITHOUT_GPU();
#if POLLEN_HAVE_CUDA
  expect_matches_cpu_op(DType::bf16, 2, 200, 4, 4, 64, 90);
#endif
}

TEST(CudaAttention, HeadDim32ShortDocumentsAndALongRow) {
  SKIP_WITHOUT_GPU();
#if POLLEN_HAVE_CUDA
  expect_matches_cpu_op(DType::f32, 1, 333, 4, 1, 32, 10);
  expect_matches_cpu_op(DType::bf16, 2, 130, 4, 2, 32, 12);
  expect_matches_cpu_op(DType::bf16, 1, 1000, 4, 2, 64, 400);
#endif
}

// bf16 runs on the tensor cores (attention_mma.h); POLLEN_CUDA_ATTENTION=tiles puts it back on
// the CUDA-core kernels, which must stay right too.
TEST(CudaAttention, Bfloat16OnCudaCoresWhenAsked) {
  SKIP_WITHOUT_GPU();
#if POLLEN_HAVE_CUDA
  ASSERT_EQ(setenv("POLLEN_CUDA_ATTENTION", "tiles", 1), 0);
  expect_matches_cpu_op(DType::bf16, 2, 200, 8, 2, 64, 90);
  expect_matches_cpu_op(DType::bf16, 1, 150, 2, 2, 128, 40);
  unsetenv("POLLEN_CUDA_ATTENTION");
#endif
}

// Checked before any CUDA call: runs wherever the backend is built, GPU or not.
TEST(CudaAttention, RejectsUnsupportedHeadDimNamingIt) {
#if !POLLEN_HAVE_CUDA
  GTEST_SKIP() << cuda_status();
#else
  try {
    cuda::attention_forward({1, 8, 2, 2, 48}, DType::f32, nullptr, nullptr, nullptr, nullptr, 1.0f,
                            nullptr, nullptr, nullptr);
    FAIL() << "head dim 48 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("head dimension 48"), std::string::npos) << e.what();
  }
#endif
}

}  // namespace
}  // namespace pollen::ops
