#pragma once
// Rotary position embedding with the HF LlamaForCausalLM convention: dimension i is paired with
// i + D/2 (rotate_half), inv_freq[i] = theta^(-2i/D), angle = position * inv_freq[i] in double,
// out = x * cos + rotate_half(x) * sin.
#include "tensor/tensor.h"

namespace pollen::ops {

// HF's rope_scaling, as transformers 4.44 computes it (modeling_rope_utils.py):
// - `linear` divides every inverse frequency by `factor` (positions stretched);
// - `llama3` (Llama 3.1) divides the low frequencies (wavelength above
//   original_max_position_embeddings / low_freq_factor) by `factor`, keeps the high ones
//   (wavelength below original_max_position_embeddings / high_freq_factor) and blends linearly in
//   between;
// - `dynamic` (dynamic NTK) raises theta to theta * (factor * L / M - (factor - 1))^(D / (D - 2))
//   when the sequence length L (the largest position of the call + 1) exceeds
//   M = original_max_position_embeddings (the model's max_position_embeddings), so the rotation
//   depends on the longest position rotated together;
// - `yarn` divides the frequencies by `factor` below a ramp over the pairs whose rotations in M
//   positions lie between beta_slow and beta_fast, keeps them above it, and multiplies cos and sin
//   by attention_factor (HF's default 0.1 ln(factor) + 1 is resolved when the config is read).
struct RopeScaling {
  enum class Kind { none, linear, llama3, dynamic, yarn };
  Kind kind = Kind::none;
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
  double attention_factor = 1.0;  // yarn
  double beta_fast = 32.0;        // yarn
  double beta_slow = 1.0;         // yarn
  bool operator==(const RopeScaling&) const = default;
};

// The rotation's parameters; converts from a bare theta (no scaling).
struct RopeParams {
  RopeParams(double theta_in) : theta(theta_in) {}  // NOLINT: implicit on purpose
  RopeParams(double theta_in, const RopeScaling& s) : theta(theta_in), scaling(s) {}
  double theta;
  RopeScaling scaling;
  bool operator==(const RopeParams&) const = default;
};

// inv_freq[i] for pair i of a head of `head_dim`, in double, scaling applied (dynamic: for
// sequences no longer than original_max_position_embeddings; see rope_params_for_length).
double rope_inv_freq(const RopeParams& params, int64_t head_dim, int64_t i);

// What cos and sin are multiplied by: yarn's attention_factor, 1 otherwise.
double rope_attention_factor(const RopeParams& params);

// The parameters that rotate a call whose largest position is `seq_len` - 1: dynamic scaling
// becomes a plain rotation with its grown theta; the others are returned as they are.
RopeParams rope_params_for_length(const RopeParams& params, int64_t head_dim, int64_t seq_len);

// On the CPU x is f32 or f64, and the positions are checked. On the GPU x is f32 or bf16 (angles,
// cos and sin in f64, rotation in fp32), and the positions are used there unread, so that no call
// waits for the GPU: check them first with check_rope_positions (Llama does, once per batch).
// Only dynamic scaling reads them back, for the longest position.
// Checks that every position (B,T) int32 lies in [0, 2^22] (the CPU's cos and sin tables' reach),
// naming the first that does not; positions on the GPU are copied to the host for it.
void check_rope_positions(const Tensor& positions);

// x (B,T,H,D) with D even (H may count query heads or kv heads); positions (B,T) int32 >= 0
// (they restart per document in packed sequences). out (B,T,H,D) may be x itself (in place).
void rope_forward(const Tensor& x, const Tensor& positions, const RopeParams& params, Tensor& out);

// The transpose of rope_forward, a rotation by -angle: dx (B,T,H,D) from dout; dx may be dout.
void rope_backward(const Tensor& dout, const Tensor& positions, const RopeParams& params,
                   Tensor& dx);

}  // namespace pollen::ops
