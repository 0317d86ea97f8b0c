// CUDA attention: the kernels are thin wrappers that run the block functions of
// ops/cuda/attention_tiles.h (f32, on CUDA cores) or ops/cuda/attention_mma.h (bf16, on the
// tensor cores) with one GPU thread block each; see those headers for the schedule.
//
// forward:  grid (query tiles, B*H); out and lse.
// backward: delta = rowsum(dout * out) (one thread per row); then dk, dv with grid (key tiles,
//           B*KVH), each block visiting every query head of its kv head; then dq with grid
//           (query tiles, B*H). Every output element is written by one thread: no atomics.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "base/error.h"
#include "ops/cuda/attention.h"
#include "ops/cuda/attention_mma.h"

namespace pollen::ops::cuda {

template <>
struct Element<__nv_bfloat16> {
  POLLEN_HD static float load(__nv_bfloat16 x) { return __bfloat162float(x); }
  POLLEN_HD static __nv_bfloat16 store(float x) { return __float2bfloat16_rn(x); }
};

namespace {

// Throws naming the failing call, the op and its shape. A failed runtime call (such as
// cudaFuncSetAttribute) also records its error as the thread's last error: clear it first, or
// the next launch check (cudaGetLastError) anywhere would report it again as its own failure.
void check_cuda(cudaError_t err, const char* call, const char* op, const AttentionShape& s) {
  if (err == cudaSuccess) return;
  cudaGetLastError();  // clears the error unless it is sticky (then the context is lost anyway)
  fail("CUDA error in ", op, " (B=", s.batch, " T=", s.seq, " H=", s.heads, " KVH=", s.kv_heads,
       " D=", s.head_dim, "): ", call, " returned ", cudaGetErrorName(err), ": ",
       cudaGetErrorString(err));
}
#define ATTENTION_CUDA_CHECK(call, op, shape) check_cuda((call), #call, op, shape)

// The GPU side of a block function's `block`: each thread runs every phase once, then waits for
// the others.
template <typename State>
struct GpuBlock {
  State state;
  template <typename Phase>
  POLLEN_HD void run(Phase&& phase) {
#if defined(__CUDA_ARCH__)
    phase(static_cast<int>(threadIdx.x), state);
    __syncthreads();
#endif
  }
};

template <int D, typename T>
__global__ void __launch_bounds__(kAttentionThreads) forward_kernel(ForwardArgs<T> a) {
  extern __shared__ float4 smem[];
  GpuBlock<Accumulator<D>> block;
  forward_block<D>(block, a, blockIdx.x, blockIdx.y, reinterpret_cast<float*>(smem));
}

template <typename T>
__global__ void delta_kernel(BackwardArgs<T> a, int64_t rows, float* delta) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row < rows) delta_for_row(a, row, delta);
}

template <int D, typename T>
__global__ void __launch_bounds__(kAttentionThreads) backward_dkdv_kernel(BackwardArgs<T> a) {
  extern __shared__ float4 smem[];
  GpuBlock<DkDv<D>> block;
  backward_dkdv_block<D>(block, a, blockIdx.x, blockIdx.y, reinterpret_cast<float*>(smem));
}

template <int D, typename T>
__global__ void __launch_bounds__(kAttentionThreads) backward_dq_kernel(BackwardArgs<T> a) {
  extern __shared__ float4 smem[];
  GpuBlock<Accumulator<D>> block;
  backward_dq_block<D>(block, a, blockIdx.x, blockIdx.y, reinterpret_cast<float*>(smem));
}

// The tensor-core kernels of bf16 (attention_mma.h); their shared memory starts 128-byte aligned.
template <int D>
__global__ void __launch_bounds__(kAttentionThreads)
    mma_forward_kernel(ForwardArgs<__nv_bfloat16> a) {
  extern __shared__ __align__(128) unsigned char mma_smem[];
  GpuBlock<MmaNoState> block;
  mma_forward_block<D>(block, a, blockIdx.x, blockIdx.y, mma_smem);
}

template <int D>
__global__ void __launch_bounds__(kAttentionThreads)
    mma_backward_dkdv_kernel(BackwardArgs<__nv_bfloat16> a) {
  extern __shared__ __align__(128) unsigned char mma_smem[];
  GpuBlock<MmaDkDv<D>> block;
  mma_backward_dkdv_block<D>(block, a, blockIdx.x, blockIdx.y, mma_smem);
}

template <int D>
__global__ void __launch_bounds__(kAttentionThreads)
    mma_backward_dq_kernel(BackwardArgs<__nv_bfloat16> a) {
  extern __shared__ __align__(128) unsigned char mma_smem[];
  GpuBlock<MmaDq<D>> block;
  mma_backward_dq_block<D>(block, a, blockIdx.x, blockIdx.y, mma_smem);
}

// bf16 runs on the tensor cores unless POLLEN_CUDA_ATTENTION=tiles asks for the CUDA-core
// kernels (the f32 path's), read at each call.
bool bf16_on_tensor_cores() {
  const char* choice = std::getenv("POLLEN_CUDA_ATTENTION");
  return choice == nullptr || std::strcmp(choice, "tiles") != 0;
}

// Launches kernel on grid (tiles, heads) with `bytes` of dynamic shared memory (over 48 KB needs
// the kernel's limit raised first).
template <typename Kernel, typename Args>
void launch_tiles(Kernel kernel, const Args& args, int64_t tiles, int64_t heads, size_t bytes,
                  const char* op, const AttentionShape& s, cudaStream_t stream) {
  if (heads > 65535) fail(op, ": B * heads = ", heads, " exceeds the grid's 65535");
  ATTENTION_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(bytes)),
                       op, s);
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(heads));
  kernel<<<grid, kAttentionThreads, bytes, stream>>>(args);
  ATTENTION_CUDA_CHECK(cudaGetLastError(), op, s);
}

// Calls f(std::integral_constant<int, D>{}) for the supported head dims.
template <typename F>
void with_head_dim(int64_t head_dim, const char* op, F&& f) {
  switch (head_dim) {
    case 32:
      return f(std::integral_constant<int, 32>{});
    case 64:
      return f(std::integral_constant<int, 64>{});
    case 128:
      return f(std::integral_constant<int, 128>{});
    default:
      fail(op, ": head dimension ", head_dim, " is not supported on CUDA (32, 64 or 128)");
  }
}

template <typename T>
void forward_typed(const AttentionShape& s, const void* q, const void* k, const void* v,
                   const int32_t* seg_start, float scale, void* out, float* lse,
                   cudaStream_t stream) {
  const ForwardArgs<T> a{Geometry{s},
                         static_cast<const T*>(q),
                         static_cast<const T*>(k),
                         static_cast<const T*>(v),
                         seg_start,
                         scale,
                         static_cast<T*>(out),
                         lse};
  with_head_dim(s.head_dim, "attention_forward", [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      if (bf16_on_tensor_cores())
        return launch_tiles(mma_forward_kernel<D>, a, tile_count(s.seq), s.batch * s.heads,
                            MmaForwardSmem<D>::kBytes, "attention_forward", s, stream);
    }
    launch_tiles(forward_kernel<D, T>, a, tile_count(s.seq), s.batch * s.heads,
                 ForwardSmem<D>::kBytes, "attention_forward", s, stream);
  });
}

template <typename T>
void backward_typed(const AttentionShape& s, const void* q, const void* k, const void* v,
                    const int32_t* seg_start, const void* out, const float* lse, const void* dout,
                    float scale, void* dq, void* dk, void* dv, void* workspace,
                    cudaStream_t stream) {
  const char* op = "attention_backward";
  float* delta = static_cast<float*>(workspace);
  const BackwardArgs<T> a{Geometry{s},
                          static_cast<const T*>(q),
                          static_cast<const T*>(k),
                          static_cast<const T*>(v),
                          static_cast<const T*>(out),
                          static_cast<const T*>(dout),
                          seg_start,
                          lse,
                          delta,
                          scale,
                          static_cast<T*>(dq),
                          static_cast<T*>(dk),
                          static_cast<T*>(dv)};
  const int64_t rows = s.batch * s.seq * s.heads;
  constexpr int kDeltaThreads = 256;
  delta_kernel<T><<<static_cast<unsigned>((rows + kDeltaThreads - 1) / kDeltaThreads),
                    kDeltaThreads, 0, stream>>>(a, rows, delta);
  ATTENTION_CUDA_CHECK(cudaGetLastError(), op, s);
  with_head_dim(s.head_dim, op, [&](auto dim) {
    constexpr int D = decltype(dim)::value;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      if (bf16_on_tensor_cores()) {
        launch_tiles(mma_backward_dkdv_kernel<D>, a, tile_count(s.seq), s.batch * s.kv_heads,
                     MmaBackwardSmem<D>::kBytes, op, s, stream);
        return launch_tiles(mma_backward_dq_kernel<D>, a, tile_count(s.seq), s.batch * s.heads,
                            MmaBackwardSmem<D>::kBytes, op, s, stream);
      }
    }
    launch_tiles(backward_dkdv_kernel<D, T>, a, tile_count(s.seq), s.batch * s.kv_heads,
                 BackwardSmem<D>::kBytes, op, s, stream);
    launch_tiles(backward_dq_kernel<D, T>, a, tile_count(s.seq), s.batch * s.heads,
                 BackwardSmem<D>::kBytes, op, s, stream);
  });
}

void check_shape(const char* op, const AttentionShape& s, DType dtype) {
  // POLLEN_CHECK's [[unlikely]] is C++20; CUDA sources are C++17.
  if (s.batch <= 0 || s.seq <= 0 || s.heads <= 0 || s.kv_heads <= 0)
    fail(op, ": B, T, H and KVH must be positive, got B=", s.batch, " T=", s.seq, " H=", s.heads,
         " KVH=", s.kv_heads);
  if (s.heads % s.kv_heads != 0)
    fail(op, ": H = ", s.heads, " must be a multiple of KVH = ", s.kv_heads);
  if (s.seq > INT32_MAX) fail(op, ": T = ", s.seq, " does not fit seg_start's int32");
  if (!attention_head_dim_supported(s.head_dim))
    fail(op, ": head dimension ", s.head_dim, " is not supported on CUDA (32, 64 or 128)");
  if (dtype != DType::f32 && dtype != DType::bf16)
    fail(op, ": CUDA attention takes f32 or bf16, got ", dtype_name(dtype));
}

}  // namespace

bool attention_head_dim_supported(int64_t head_dim) {
  return head_dim == 32 || head_dim == 64 || head_dim == 128;
}

void attention_forward(const AttentionShape& shape, DType dtype, const void* q, const void* k,
                       const void* v, const int32_t* seg_start, float scale, void* out, float* lse,
                       cudaStream_t stream) {
  check_shape("attention_forward", shape, dtype);
  if (dtype == DType::f32) {
    forward_typed<float>(shape, q, k, v, seg_start, scale, out, lse, stream);
  } else {
    forward_typed<__nv_bfloat16>(shape, q, k, v, seg_start, scale, out, lse, stream);
  }
}

size_t attention_backward_workspace_bytes(const AttentionShape& shape) {
  return static_cast<size_t>(shape.batch * shape.heads * shape.seq) * sizeof(float);
}

void attention_backward(const AttentionShape& shape, DType dtype, const void* q, const void* k,
                        const void* v, const int32_t* seg_start, const void* out, const float* lse,
                        const void* dout, float scale, void* dq, void* dk, void* dv,
                        void* workspace, cudaStream_t stream) {
  check_shape("attention_backward", shape, dtype);
  if (dtype == DType::f32) {
    backward_typed<float>(shape, q, k, v, seg_start, out, lse, dout, scale, dq, dk, dv, workspace,
                          stream);
  } else {
    backward_typed<__nv_bfloat16>(shape, q, k, v, seg_start, out, lse, dout, scale, dq, dk, dv,
                                  workspace, stream);
  }
}

}  // namespace pollen::ops::cuda
