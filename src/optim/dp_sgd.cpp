#include "optim/dp_sgd.h"

#include <openssl/rand.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

#include "base/error.h"
#include "base/log.h"
#include "base/thread_pool.h"
#include "ops/adamw.h"
#include "ops/elementwise.h"

namespace pollen::optim {

Rng noise_rng(int64_t seed, uint64_t stream) {
  if (seed >= 0) return Rng(static_cast<uint64_t>(seed)).fork(stream);
  uint64_t key = 0;
  POLLEN_CHECK(RAND_bytes(reinterpret_cast<unsigned char*>(&key), sizeof key) == 1,
               "privacy: the OS's random generator (OpenSSL RAND_bytes) failed");
  return Rng(key);
}

void add_gaussian_noise(std::vector<Tensor>& tensors, double std, int64_t seed, uint64_t stream,
                        bool secure) {
  if (std == 0) return;
  const Rng rng = noise_rng(seed, stream);
  // Philox block i (two 53-bit uniforms) makes a pair of normals by Box-Muller. Plain: elements
  // 2i and 2i + 1 of the tensors in order take block i's pair. Secure: element i takes the sum
  // of the first normal of blocks 4i to 4i + 3 over 2: four draws from eight uniforms (the two
  // normals of one pair sum to one draw of its two uniforms). Any split over threads draws the
  // same noise.
  std::vector<float*> data;
  std::vector<int64_t> starts{0};  // each tensor's first element, then the total
  for (Tensor& t : tensors) {
    data.push_back(t.data<float>());
    starts.push_back(starts.back() + t.numel());
  }
  const auto uniform = [](uint32_t hi, uint32_t lo) {
    const uint64_t bits = (static_cast<uint64_t>(hi) << 32) | lo;
    return std::max(static_cast<double>(bits >> 11) * 0x1.0p-53, 1e-300);
  };
  const auto pair_of = [&](int64_t block, double pair[2]) {
    const std::array<uint32_t, 4> bits = philox4x32(rng.seed(), 0, rng.offset() + block);
    const double r = std::sqrt(-2.0 * std::log(uniform(bits[0], bits[1])));
    const double theta = 2.0 * M_PI * uniform(bits[2], bits[3]);
    pair[0] = r * std::cos(theta);
    pair[1] = r * std::sin(theta);
  };
  const int64_t n = starts.back();
  parallel_for(secure ? n : (n + 1) / 2, 4096, [&](int64_t lo, int64_t hi) {
    size_t t = 0;
    const auto add = [&](int64_t e, double normal) {
      while (e >= starts[t + 1]) ++t;
      float& x = data[t][e - starts[t]];
      x = static_cast<float>(x + std * normal);
    };
    double a[2];
    for (int64_t i = lo; i < hi; ++i) {
      if (secure) {
        double sum = 0;
        for (int64_t k = 0; k < 4; ++k) {
          pair_of(4 * i + k, a);
          sum += a[0];
        }
        add(i, sum / 2);
      } else {
        pair_of(i, a);
        add(2 * i, a[0]);
        if (2 * i + 1 < n) add(2 * i + 1, a[1]);
      }
    }
  });
}

double smallest_noise_multiplier(const std::function<double(double)>& epsilon_at,
                                 double target_epsilon,
                                 const std::function<std::string()>& why_not) {
  double low = 0, high = 1;
  while (epsilon_at(high) > target_epsilon) {
    if (high >= 1024) throw Error(why_not());
    low = high;
    high *= 2;
  }
  while (high - low > 1e-3 * high) {
    const double mid = (low + high) / 2;
    (epsilon_at(mid) > target_epsilon ? low : high) = mid;
  }
  return high;
}

double calibrate_noise_multiplier(const PrivacyAccountant& spent, double target_epsilon,
                                  double delta, double q, int64_t steps) {
  return smallest_noise_multiplier(
      [&](double z) { return spent.after(q, z, steps).epsilon(delta).epsilon; }, target_epsilon,
      [&] {
        return cat("privacy.target_epsilon: ", target_epsilon, " at delta ", delta,
                   " cannot be reached in ", steps, " more steps at sampling rate ", q,
                   " with any noise multiplier up to 1024 (epsilon already spent: ",
                   spent.epsilon(delta).epsilon, "); ask for a larger epsilon or fewer steps");
      });
}

void warn_of_repeatable_noise(std::string_view key, int64_t seed) {
  if (seed < 0) return;
  log::warn_job(key, " = ", seed,
                ": the noise is repeatable; anyone who knows the seed can subtract ",
                "it, and the epsilon reported holds only against those who do not (for tests and ",
                "reproductions, not for data that needs the guarantee)");
}

DpSgd::DpSgd(DpSgdOptions options, int64_t records, int64_t expected_rows, int64_t steps)
    : options_(std::move(options)),
      records_(records),
      expected_rows_(expected_rows),
      steps_(steps) {
  warn_of_repeatable_noise("DP-SGD's noise_seed", options_.noise_seed);
  POLLEN_CHECK(records_ >= expected_rows_ && expected_rows_ > 0, "privacy: a step's ",
               expected_rows_, " expected sequences are more than the ", records_,
               " sequences of the training data; DP-SGD samples each with probability "
               "batch / sequences, which must be at most 1");
  q_ = static_cast<double>(expected_rows_) / static_cast<double>(records_);
  if (options_.delta == 0) options_.delta = std::min(1e-5, 0.1 / static_cast<double>(records_));
  z_ = options_.target_epsilon > 0
           ? calibrate_noise_multiplier(accountant_, options_.target_epsilon, options_.delta, q_,
                                        steps_)
           : options_.noise_multiplier;
}

uint64_t DpSgd::sample_key(int64_t step) const {
  return noise_rng(options_.noise_seed, 2 * static_cast<uint64_t>(step)).seed();
}

std::vector<int64_t> DpSgd::sample_from(uint64_t key) const {
  Rng rng(key);
  std::vector<int64_t> drawn;
  // One draw per sequence whatever the others drew: each one's presence is independent of every
  // other's, as the accountant's analysis assumes.
  for (int64_t i = 0; i < records_; ++i)
    if (rng.uniform() < q_) drawn.push_back(i);
  return drawn;
}

void DpSgd::begin(const std::vector<ag::Var>& params) {
  params_ = params;
  sum_.clear();
  for (const auto& p : params_) {
    POLLEN_CHECK(p.value().device() == Device::cpu && p.value().dtype() == DType::f32,
                 "privacy: DP-SGD runs on float32 parameters on the CPU so far");
    sum_.push_back(Tensor::zeros(p.value().shape(), DType::f32));
  }
  clipped_ = 0;
}

double DpSgd::add_clipped() {
  std::vector<Tensor> grads;
  for (const auto& p : params_)
    if (p.grad().defined()) grads.push_back(p.grad());
  const double norm = std::sqrt(ops::sum_of_squares(grads));
  const double factor = clip_factor(norm);
  if (factor == 0) return norm;
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].grad().defined()) ops::axpy(factor, params_[i].grad(), sum_[i]);
  return norm;
}

double DpSgd::clip_factor(double norm) {
  // A non-finite gradient is left out, as if clipped to zero: one sequence must not decide
  // whether the step's update happens.
  // Opacus's factor: C / (norm + 1e-6), at most 1.
  const double factor = std::isfinite(norm) ? std::min(1.0, options_.clip / (norm + 1e-6)) : 0.0;
  clipped_ += factor < 1.0;
  return factor;
}

void DpSgd::add_gradients() {
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].grad().defined()) ops::axpy(1.0, params_[i].grad(), sum_[i]);
}

void DpSgd::add_noise(int64_t step) {
  add_gaussian_noise(sum_, z_ * options_.clip, options_.noise_seed,
                     2 * static_cast<uint64_t>(step) + 1, options_.secure_noise);
}

void DpSgd::finish() {
  for (size_t i = 0; i < params_.size(); ++i) {
    ops::scale_into(1.0 / static_cast<double>(expected_rows_), sum_[i], sum_[i]);
    params_[i].grad() = sum_[i];
  }
  sum_.clear();
  params_.clear();
  accountant_.add(q_, z_);
}

Epsilon DpSgd::epsilon() const {
  return accountant_.steps() == 0 ? Epsilon{} : accountant_.epsilon(options_.delta);
}

Epsilon DpSgd::epsilon_after(int64_t steps) const {
  return accountant_.after(q_, z_, steps).epsilon(options_.delta);
}

nlohmann::json DpSgd::state() const {
  return {{"clip", options_.clip},   {"delta", options_.delta},  {"noise_multiplier", z_},
          {"steps_planned", steps_}, {"rdp", accountant_.rdp()}, {"steps", accountant_.steps()}};
}

void DpSgd::restore_accountant(const nlohmann::json& state) {
  try {
    // Written before clip and delta were kept: nothing to compare.
    const double clip = state.value("clip", options_.clip);
    const double delta = state.value("delta", options_.delta);
    POLLEN_CHECK(clip == options_.clip && delta == options_.delta,
                 "privacy state: accounted at clip ", clip, " and delta ", delta, ", not at the ",
                 "configured clip ", options_.clip, " and delta ", options_.delta,
                 "; an account goes on with the settings it began with");
    accountant_.restore(state.at("rdp"), state.at("steps").get<int64_t>());
  } catch (const nlohmann::json::exception& e) {
    fail("privacy state: expected {rdp, steps}: ", e.what());
  }
}

void DpSgd::load_state(const nlohmann::json& state, int64_t steps, int64_t done,
                       bool released_since) {
  restore_accountant(state);
  try {
    const int64_t planned = state.at("steps_planned").get<int64_t>();
    if (options_.target_epsilon > 0 && (planned != steps || released_since)) {
      z_ = calibrate_noise_multiplier(accountant_, options_.target_epsilon, options_.delta, q_,
                                      std::max<int64_t>(1, steps - done));
    } else if (options_.target_epsilon > 0) {
      z_ = state.at("noise_multiplier").get<double>();
    }  // else z_ is the configured noise_multiplier
  } catch (const nlohmann::json::exception& e) {
    fail("checkpoint state.json: 'privacy': expected {noise_multiplier, steps_planned, rdp, ",
         "steps}: ", e.what());
  }
  steps_ = steps;
}

}  // namespace pollen::optim
