// Device dispatch for rotary position embedding: checks the inputs, then runs the CPU or the
// CUDA kernel.
#include "ops/rope.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/check.h"
#include "ops/cpu/rope.h"
#include "ops/cuda/kernels.h"
#include "ops/profile.h"
#include "tensor/cuda_context.h"

namespace pollen::ops {
namespace {

// Largest position id accepted; the cached cos/sin tables cover [0, max position].
constexpr int32_t kMaxPosition = 1 << 22;

// The largest position, after checking each lies in [0, kMaxPosition]; positions (B,T) on the host.
int32_t checked_max_position(const char* op, const Tensor& positions) {
  const int64_t seq = positions.size(1);
  const int32_t* pos = positions.data<int32_t>();
  int32_t max_position = 0;
  for (int64_t i = 0; i < positions.numel(); ++i) {
    POLLEN_CHECK(pos[i] >= 0 && pos[i] <= kMaxPosition, op, ": positions[", i / seq, ",", i % seq,
                 "] = ", pos[i], " must lie in [0, ", kMaxPosition, "]");
    max_position = std::max(max_position, pos[i]);
  }
  return max_position;
}

#if POLLEN_HAVE_CUDA
// The inverse frequencies of (params, D), computed in double on the host and kept on this
// thread's current GPU, so that a step's rope calls upload nothing. The most
// recent few are kept: dynamic scaling makes new parameters as sequences grow.
Tensor device_inv_freq(const RopeParams& params, int64_t dim) {
  struct Entry {
    RopeParams params;
    int64_t dim;
    int device;       // the GPU it lies on: a thread may move to another
    Tensor inv_freq;  // (D/2) f64 on that GPU
  };
  thread_local std::vector<Entry> cache;
  const int device = ::pollen::cuda::current_device();
  for (const Entry& e : cache)
    if (e.params == params && e.dim == dim && e.device == device) return e.inv_freq;
  std::vector<double> inv_freq(static_cast<size_t>(dim / 2));
  for (int64_t i = 0; i < dim / 2; ++i)
    inv_freq[static_cast<size_t>(i)] = rope_inv_freq(params, dim, i);
  constexpr size_t kMaxEntries = 16;
  if (cache.size() == kMaxEntries) cache.erase(cache.begin());
  cache.push_back(
      {params, dim, device, Tensor::from<double>({dim / 2}, inv_freq).to(Device::cuda)});
  return cache.back().inv_freq;
}

// On the GPU: f32 or bf16 (fp32 math), the angles and their cos and sin in double. The positions
// stay on the GPU, unread (reading them back would wait for every op before): the caller checks
// them (check_rope_positions). Dynamic scaling alone reads them, for the longest position.
void rope_cuda(const char* op, const char* in_name, const char* out_name, const Tensor& x,
               const Tensor& positions, const RopeParams& params, bool inverse, Tensor& out) {
  const int64_t batch = x.size(0), seq = x.size(1), heads = x.size(2), dim = x.size(3);
  expect(op, in_name, x, x.shape(), x.dtype(), Device::cuda);
  expect(op, "positions", positions, {batch, seq}, DType::i32, Device::cuda);
  expect(op, out_name, out, x.shape(), x.dtype(), Device::cuda);
  RopeParams resolved = params;
  if (params.scaling.kind == RopeScaling::Kind::dynamic) {
    const int32_t max_position = checked_max_position(op, positions.to(Device::cpu));
    resolved = rope_params_for_length(params, dim, int64_t{max_position} + 1);
  }
  const Tensor inv_freq = device_inv_freq(resolved, dim);
  cuda::rope_rotate(x.dtype(), x.raw(), positions.data<int32_t>(), batch * seq, heads, dim,
                    inv_freq.data<double>(), rope_attention_factor(resolved), inverse, out.raw());
}
#endif

// x (B,T,H,D) rotated into out by +angle, or by -angle when inverse.
void rope(const char* op, const char* in_name, const char* out_name, const Tensor& x,
          const Tensor& positions, const RopeParams& params, bool inverse, Tensor& out) {
  POLLEN_CHECK(x.defined() && x.dim() == 4, op, ": ", in_name, " must be (B,T,H,D), got ",
               x.defined() ? shape_str(x.shape()) : "undefined");
  POLLEN_CHECK(x.size(3) % 2 == 0, op, ": head dimension D = ", x.size(3), " of ", in_name,
               " must be even");
  POLLEN_CHECK(std::isfinite(params.theta) && params.theta > 0, op,
               ": theta must be positive, got ", params.theta);
#if POLLEN_HAVE_CUDA
  if (x.device() == Device::cuda)
    return rope_cuda(op, in_name, out_name, x, positions, params, inverse, out);
#endif
  POLLEN_CHECK(x.dtype() == DType::f32 || x.dtype() == DType::f64, op, ": ", in_name,
               " must be f32 or f64, got ", dtype_name(x.dtype()));
  const int64_t batch = x.size(0), seq = x.size(1), heads = x.size(2), dim = x.size(3);
  check_tensor(op, in_name, x, x.dtype(), x.shape(), "(B,T,H,D)");
  check_tensor(op, "positions", positions, DType::i32, {batch, seq}, "(B,T)");
  check_tensor(op, out_name, out, x.dtype(), x.shape(), "(B,T,H,D)");
  const int32_t* pos = positions.data<int32_t>();
  const int32_t max_position = checked_max_position(op, positions);
  const RopeParams resolved = rope_params_for_length(params, dim, int64_t{max_position} + 1);
  if (x.dtype() == DType::f32) {
    cpu::rope_rotate(x.data<float>(), pos, batch * seq, heads, dim, resolved, inverse,
                     out.data<float>());
  } else {
    cpu::rope_rotate(x.data<double>(), pos, batch * seq, heads, dim, resolved, inverse,
                     out.data<double>());
  }
}

}  // namespace

double rope_inv_freq(const RopeParams& params, int64_t head_dim, int64_t i) {
  const double inv_freq =
      1.0 / std::pow(params.theta, static_cast<double>(2 * i) / static_cast<double>(head_dim));
  const RopeScaling& s = params.scaling;
  switch (s.kind) {
    case RopeScaling::Kind::none:
      return inv_freq;
    case RopeScaling::Kind::linear:
      return inv_freq / s.factor;
    case RopeScaling::Kind::llama3: {
      // transformers' _compute_llama3_parameters.
      const double old_len = static_cast<double>(s.original_max_position_embeddings);
      const double low_freq_wavelen = old_len / s.low_freq_factor;
      const double high_freq_wavelen = old_len / s.high_freq_factor;
      const double wavelen = 2.0 * M_PI / inv_freq;
      if (wavelen < high_freq_wavelen) return inv_freq;
      if (wavelen > low_freq_wavelen) return inv_freq / s.factor;
      const double smooth =
          (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
      return (1.0 - smooth) * inv_freq / s.factor + smooth * inv_freq;
    }
    case RopeScaling::Kind::dynamic:
      return inv_freq;  // at lengths up to original_max_position_embeddings
    case RopeScaling::Kind::yarn: {
      // transformers' _compute_yarn_parameters: the pair index where a frequency turns
      // `rotations` times over the original context, and a ramp between the two betas' indices.
      const double dim = static_cast<double>(head_dim);
      const double old_len = static_cast<double>(s.original_max_position_embeddings);
      auto correction_dim = [&](double rotations) {
        return dim * std::log(old_len / (rotations * 2.0 * M_PI)) / (2.0 * std::log(params.theta));
      };
      const double low = std::max(std::floor(correction_dim(s.beta_fast)), 0.0);
      double high = std::min(std::ceil(correction_dim(s.beta_slow)), dim - 1);
      if (low == high) high += 0.001;  // as HF, against a zero-width ramp
      const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
      return inv_freq / s.factor * ramp + inv_freq * (1.0 - ramp);
    }
  }
  return inv_freq;
}

double rope_attention_factor(const RopeParams& params) {
  return params.scaling.kind == RopeScaling::Kind::yarn ? params.scaling.attention_factor : 1.0;
}

RopeParams rope_params_for_length(const RopeParams& params, int64_t head_dim, int64_t seq_len) {
  const RopeScaling& s = params.scaling;
  if (s.kind != RopeScaling::Kind::dynamic) return params;
  // transformers' _compute_dynamic_ntk_parameters, with its lengths up to the original one
  // taken as the original one.
  const double old_len = static_cast<double>(s.original_max_position_embeddings);
  const double len = std::max(static_cast<double>(seq_len), old_len);
  const double dim = static_cast<double>(head_dim);
  const double theta =
      params.theta * std::pow(s.factor * len / old_len - (s.factor - 1.0), dim / (dim - 2.0));
  return RopeParams(theta);
}

void check_rope_positions(const Tensor& positions) {
  POLLEN_CHECK(positions.defined() && positions.dim() == 2 && positions.dtype() == DType::i32,
               "rope: positions must be (B,T) int32, got ",
               positions.defined()
                   ? cat(shape_str(positions.shape()), " ", dtype_name(positions.dtype()))
                   : std::string("undefined"));
  checked_max_position("rope", positions.device() == Device::cpu ? positions.contiguous()
                                                                 : positions.to(Device::cpu));
}

void rope_forward(const Tensor& x, const Tensor& positions, const RopeParams& params, Tensor& out) {
  const OpTimer timer("rope_forward", x);
  rope("rope_forward", "x", "out", x, positions, params, false, out);
}

void rope_backward(const Tensor& dout, const Tensor& positions, const RopeParams& params,
                   Tensor& dx) {
  const OpTimer timer("rope_backward", dout);
  rope("rope_backward", "dout", "dx", dout, positions, params, true, dx);
}

}  // namespace pollen::ops
