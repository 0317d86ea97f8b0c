// CUDA attention (ops/cuda/attention.h) against the CPU op in double precision on the same
// inputs, on a GPU: fresh random inputs each run (the seed is printed on failure), several
// documents per row, T not a multiple of the tile, outputs poisoned with NaN before every launch
// and guarded on both sides against writes past their ends; the norm-relative error and the
// worst element's under gpu_compare.h's bounds. Without a GPU (or without the CUDA backend) the
// tests skip and say why.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "base/rng.h"
#include "cuda/gpu_compare.h"
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

// Device memory holding a copy of host values (or `bytes` to be poisoned), between two guards of
// kGuardBytes set to kGuardByte: a kernel that writes past either end of its output changes them.
struct DeviceBuffer {
  static constexpr size_t kGuardBytes = 64 << 10;  // a tile of rows, e.g. 64 x 128 x 4 bytes
  static constexpr unsigned char kGuardByte = 0xA5;

  DeviceBuffer(const void* host, size_t bytes) : bytes(bytes) {
    CUDA_OK(cudaMalloc(&base, kGuardBytes + bytes + kGuardBytes));
    CUDA_OK(cudaMemset(base, kGuardByte, kGuardBytes + bytes + kGuardBytes));
    ptr = static_cast<char*>(base) + kGuardBytes;  // 256-byte aligned as cudaMalloc's own
    if (host) CUDA_OK(cudaMemcpy(ptr, host, bytes, cudaMemcpyHostToDevice));
  }
  ~DeviceBuffer() {
    if (cudaFree(base) != cudaSuccess) ADD_FAILURE() << "cudaFree of a test buffer failed";
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void poison() { CUDA_OK(cudaMemset(ptr, 0xFF, bytes)); }  // all-ones: NaN in f32 and bf16
  // Whether both guards still hold kGuardByte in every byte.
  bool guards_intact() const {
    std::vector<unsigned char> guard(kGuardBytes);
    const void* before = base;
    const void* after = static_cast<const char*>(ptr) + bytes;
    for (const void* g : {before, after}) {
      CUDA_OK(cudaMemcpy(guard.data(), g, kGuardBytes, cudaMemcpyDeviceToHost));
      for (unsigned char b : guard)
        if (b != kGuardByte) return false;
    }
    return true;
  }
  void* base = nullptr;  // the allocation, guards included
  void* ptr = nullptr;   // the bytes between the guards
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

// N(0, 1) draws times `factor`, a power of two: exact in bf16 as in f32.
Values random_values(int64_t n, DType dtype, Rng& rng, float factor = 1) {
  Values v;
  for (int64_t i = 0; i < n; ++i) {
    float x = factor * static_cast<float>(rng.normal());
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

// A GPU result against the reference, under gpu_compare.h's bounds for the tested dtype: the
// norm-relative error, and the worst element's within worst_factor times that (NaN, an element
// never written, fails both).
void expect_close(const std::vector<double>& got, const Tensor& want, DType dtype, const char* what,
                  double worst_factor = testing::kWorstElementFactor) {
  const testing::Errors e = testing::errors(got, want.to_doubles());
  EXPECT_LT(e.norm_relative, testing::tolerance(dtype)) << what;
  EXPECT_LE(e.worst_relative, worst_factor * testing::tolerance(dtype))
      << what << ", the worst element in rms of the reference: at flat index " << e.worst_index
      << ", " << e.worst_got << " for " << e.worst_ref;
}

// The worst-element factor of dq and dk in bf16: 30 (0.3 rms) where gpu_compare.h's 10 would be
// too tight for a correct kernel. The backward's delta = rowsum(dout * out) reads out as stored,
// rounded to bf16 (as FlashAttention's does), which shifts each row's dS by about 2^-9 |dout|
// |out|, an error that does not shrink with the row's own dq. Where dS is small (a peaked softmax,
// documents of one or two tokens) it is large against dq's rms: a host emulation of the kernels'
// bf16 roundings (inputs, P, dS, out) found up to 0.11 rms, and 0.007 norm-relative, in results
// with no other error. A wrong row or element is off by about its own size, above 0.3 rms unless
// it is among the smallest.
double score_gradient_worst_factor(DType dtype) {
  return dtype == DType::bf16 ? 30 : testing::kWorstElementFactor;
}

// q_scale (a power of two) multiplies q: at 8 the scores spread over ~N(0, 64), and each row's
// softmax puts nearly all its weight on one key.
void expect_matches_cpu_op(DType dtype, int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads,
                           int64_t dim, int64_t max_run, float q_scale = 1) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message()
               << dtype_name(dtype) << " B=" << batch << " T=" << seq << " H=" << heads
               << " KVH=" << kv_heads << " D=" << dim << " max_run=" << max_run
               << " q_scale=" << q_scale << " seed=" << seed);
  Rng rng(seed);
  const Shape qs{batch, seq, heads, dim}, kvs{batch, seq, kv_heads, dim}, ls{batch, heads, seq};
  const int64_t q_size = shape_numel(qs), kv_size = shape_numel(kvs), l_size = shape_numel(ls);
  const Values q = random_values(q_size, dtype, rng, q_scale),
               k = random_values(kv_size, dtype, rng), v = random_values(kv_size, dtype, rng),
               dout = random_values(q_size, dtype, rng);
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
  expect_close(fetch(out, dtype, q_size), out_t, dtype, "out");
  expect_close(fetch(lse, DType::f32, l_size), lse_t, dtype, "lse");
  EXPECT_TRUE(out.guards_intact()) << "out: written past its ends";
  EXPECT_TRUE(lse.guards_intact()) << "lse: written past its ends";

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
      expect_close(grads[0], dq_t, dtype, "dq", score_gradient_worst_factor(dtype));
      expect_close(grads[1], dk_t, dtype, "dk", score_gradient_worst_factor(dtype));
      expect_close(grads[2], dv_t, dtype, "dv");
      EXPECT_TRUE(dq.guards_intact()) << "dq: written past its ends";
      EXPECT_TRUE(dk.guards_intact()) << "dk: written past its ends";
      EXPECT_TRUE(dv.guards_intact()) << "dv: written past its ends";
      EXPECT_TRUE(workspace.guards_intact()) << "the workspace: written past its ends";
      first = std::move(grads);
    } else {
      EXPECT_TRUE(grads == first) << "the backward is not deterministic";
    }
  }
}

// The shapes at the tiles' edges (64 queries and keys), on the path the dtype and
// POLLEN_CUDA_ATTENTION choose: T = 17, one partial tile; T = 128, whole tiles only; documents of
// one token each, where every key but the query's own is masked (dq and dk are then zero up to
// rounding, about 1e-7 on the tensor cores, whose dP is not summed as D is: compared absolutely);
// and a peaked softmax. The CPU reference takes well under a second.
void expect_edge_shapes_match(DType dtype) {
  expect_matches_cpu_op(dtype, 2, 17, 4, 2, 64, 90);
  expect_matches_cpu_op(dtype, 1, 128, 4, 2, 128, 200);
  expect_matches_cpu_op(dtype, 2, 100, 4, 2, 64, 1);
  expect_matches_cpu_op(dtype, 1, 200, 4, 2, 64, 90, 8);
}

// Sets an environment variable (or unsets it, for nullptr) for a scope, and puts back what was
// there before on the way out, also when an assertion or a CUDA error leaves early.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) previous_ = old;
    set(value);
  }
  ~ScopedEnv() { set(previous_ ? previous_->c_str() : nullptr); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  void set(const char* value) {
    const int r = value ? setenv(name_.c_str(), value, 1) : unsetenv(name_.c_str());
    if (r != 0) ADD_FAILURE() << "could not set " << name_;
  }
  std::string name_;
  std::optional<std::string> previous_;
};

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
  const ScopedEnv tiles("POLLEN_CUDA_ATTENTION", "tiles");
  expect_matches_cpu_op(DType::bf16, 2, 200, 8, 2, 64, 90);
  expect_matches_cpu_op(DType::bf16, 1, 150, 2, 2, 128, 40);
  expect_edge_shapes_match(DType::bf16);
#endif
}

// The edge shapes on the other two paths: f32 (CUDA cores) and bf16 on the tensor cores (with
// POLLEN_CUDA_ATTENTION unset, whatever the caller's environment holds).
TEST(CudaAttention, EdgeShapesInFloat32AndOnTensorCores) {
  SKIP_WITHOUT_GPU();
#if POLLEN_HAVE_CUDA
  const ScopedEnv tensor_cores("POLLEN_CUDA_ATTENTION", nullptr);
  expect_edge_shapes_match(DType::f32);
  expect_edge_shapes_match(DType::bf16);
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
