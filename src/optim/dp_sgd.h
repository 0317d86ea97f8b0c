#pragma once
// DP-SGD (Abadi et al. 2016) as Opacus runs it, for `[privacy]` of `pollen train`: record-level
// differential privacy, the unit protected one training sequence.
//
// Each step draws every one of the N sequences independently with probability q = B / N (B: the
// expected rows of a step, train.batch_tokens / train.seq), clips each drawn sequence's gradient
// (of its mean token loss) to L2 norm C, sums them, adds N(0, (z C)^2 I) and divides by B, a
// denominator that no sequence's presence moves. The optimizer then steps on that gradient; what
// it does with it (AdamW, global-norm clipping) is post-processing. The accountant
// (optim/privacy_accountant.h) composes one Poisson-sampled Gaussian of multiplier z per step.
//
// The sample and the noise come from Philox keyed by 64 bits of the operating system's CSPRNG
// (OpenSSL RAND_bytes) at every step, so that nobody can draw them again (amplification by
// sampling needs the sample secret), unless noise_seed is set: then they are repeatable, for
// tests, and offer no privacy to anyone who knows the seed.
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "autograd/var.h"
#include "base/rng.h"
#include "optim/privacy_accountant.h"
#include "tensor/tensor.h"

namespace pollen::optim {

struct DpSgdOptions {
  bool enabled = false;         // a [privacy] table was given
  double clip = 0;              // C, per sequence
  double noise_multiplier = 0;  // z; with target_epsilon, calibrated instead
  double target_epsilon = 0;    // > 0: z such that the run's last step reaches it
  double delta = 0;             // 0: min(1e-5, 0.1 / N), set when N is known
  int64_t noise_seed = -1;      // -1: the OS's CSPRNG
  bool secure_noise = false;    // add_gaussian_noise's `secure`
};

// The noise's generator: `seed` < 0 draws the key from the OS's CSPRNG, else Philox(seed, stream).
Rng noise_rng(int64_t seed, uint64_t stream);

// Adds N(0, std^2) to every element of `tensors` (float32, on the CPU), drawn from
// noise_rng(seed, stream). `secure`: each value the sum of four independent normal draws over 2,
// as Opacus's secure_mode, which defeats the attacks that recover a floating-point normal draw's
// input from its low bits (Holohan and Braghin 2021, section 5.1), for eight times the random
// bits and the work.
void add_gaussian_noise(std::vector<Tensor>& tensors, double std, int64_t seed, uint64_t stream,
                        bool secure = false);

// The smallest noise multiplier z (to 0.1%) at which `epsilon_at(z)`, which falls as z grows, is
// at most `target_epsilon`, by doubling from 1 and then bisection; throws `why_not()` when no z
// up to 1024 reaches it.
double smallest_noise_multiplier(const std::function<double(double)>& epsilon_at,
                                 double target_epsilon,
                                 const std::function<std::string()>& why_not);

// The smallest noise multiplier z (to 0.1%; Opacus's get_noise_multiplier stops at a tolerance in
// epsilon instead) at which `steps` more Poisson-sampled Gaussian
// releases at rate q take `spent` to at most `target_epsilon` at `delta`; throws, saying so, when
// no z up to 1024 does.
double calibrate_noise_multiplier(const PrivacyAccountant& spent, double target_epsilon,
                                  double delta, double q, int64_t steps);

// Warns that a noise seed (`key` = N) makes the noise repeatable: anyone who knows the seed can
// subtract it, so the epsilon reported holds only against those who do not.
void warn_of_repeatable_noise(std::string_view key, int64_t seed);

class DpSgd {
 public:
  // `records`: N, the sequences sampled from; `expected_rows`: B; `steps`: the run's, which
  // target_epsilon is reached at.
  DpSgd(DpSgdOptions options, int64_t records, int64_t expected_rows, int64_t steps);

  // The sequences drawn for step `step` (1-based), ascending ids in [0, N): sample_from the
  // step's key, which several ranks take from one of them, so that all draw the same sample.
  std::vector<int64_t> sample(int64_t step) const { return sample_from(sample_key(step)); }
  uint64_t sample_key(int64_t step) const;
  std::vector<int64_t> sample_from(uint64_t key) const;

  // One step's gradient: begin, then for each drawn sequence its gradient in the parameters'
  // grads (which the caller then zeroes) added clipped, then release. Several ranks each add
  // their share of the sample, one of them add_noise, each finishes, and their gradients are
  // summed.
  void begin(const std::vector<ag::Var>& params);
  // Adds the parameters' gradients clipped to C (nothing when their norm is not finite, which
  // counts as clipped); returns their norm before clipping.
  double add_clipped();
  // Clipping a batch at once (autograd/per_sample.h): the factor of a sequence whose gradient has
  // this norm, min(1, C / (norm + 1e-6)) as Opacus's, or 0 when the norm is not finite; counts
  // the sequence as clipped when below 1. Then add_gradients adds the parameters' gradients (the
  // sum of the gradients so scaled) to the clipped sum.
  double clip_factor(double norm);
  void add_gradients();
  // Adds N(0, (z C)^2 I) to the clipped sum.
  void add_noise(int64_t step);
  // Sets each parameter's gradient to the sum over B and accounts for the release.
  void finish();
  // add_noise, then finish: one process's step.
  void release(int64_t step) {
    add_noise(step);
    finish();
  }

  double sampling_rate() const { return q_; }
  double noise_multiplier() const { return z_; }
  double delta() const { return options_.delta; }
  const DpSgdOptions& options() const { return options_; }
  // Epsilon spent so far: 0 before the first step.
  Epsilon epsilon() const;
  // Epsilon once `steps` more steps have run.
  Epsilon epsilon_after(int64_t steps) const;
  int64_t steps_accounted() const { return accountant_.steps(); }
  // Sequences clipped since begin().
  int64_t clipped() const { return clipped_; }

  // For checkpoints: clip, delta, z and the accountant. A resumed run, `done` of its `steps`
  // behind it, takes the accountant (refusing another clip or delta) and with target_epsilon the
  // saved z, unless the steps it was calibrated for differ from `steps` or steps were released
  // after the checkpoint (`released_since`: they run again, and their releases stay accounted):
  // z is then calibrated again for the steps left. With noise_multiplier, z is the configured
  // one.
  nlohmann::json state() const;
  void load_state(const nlohmann::json& state, int64_t steps, int64_t done,
                  bool released_since = false);
  // The accountant alone from state(), z staying as configured (a federated silo's noise
  // multiplier may change between restarts: each step is accounted at its own); refuses a state
  // accounted at another clip or delta.
  void restore_accountant(const nlohmann::json& state);

 private:
  DpSgdOptions options_;
  int64_t records_, expected_rows_, steps_;
  double q_, z_;
  PrivacyAccountant accountant_;
  std::vector<ag::Var> params_;
  std::vector<Tensor> sum_;  // f32, each parameter's clipped sum
  int64_t clipped_ = 0;
};

}  // namespace pollen::optim
