// The server-side cost of each protection, per round: aggregating N clients' pseudo-gradients of
// a llama-tiny-sized model (its parameter shapes, ~5.2M float32 values) with plain token-weighted
// averaging, norm bounding, the coordinate-wise median, the trimmed mean, Krum, Multi-Krum, and
// central DP (clipping, Gaussian noise on the sum, the accountant), fixed and adaptive.
// Arguments: N clients. One iteration is one round.
#include <benchmark/benchmark.h>

#include <map>

#include "base/rng.h"
#include "fed/privacy.h"
#include "fed/robust.h"
#include "fed/strategy.h"
#include "fed/wire.h"
#include "model/llama.h"

namespace pollen::fed {
namespace {

struct Round {
  Weights like;
  std::vector<ClientUpdate> updates;
};

const Round& round_of(int64_t clients) {
  static std::map<int64_t, Round> rounds;
  auto it = rounds.find(clients);
  if (it != rounds.end()) return it->second;
  Round r;
  model::Llama m(model::preset("llama-tiny"), 1);
  for (const auto& spec : param_specs(m)) r.like.push_back(Tensor::zeros(spec.shape, DType::f32));
  Rng rng(3);
  for (int64_t c = 0; c < clients; ++c) {
    ClientUpdate u;
    u.client_id = "silo-" + std::to_string(c);
    u.tokens = 4096 + 128 * c;
    for (const Tensor& t : r.like) {
      Tensor d = Tensor::empty(t.shape(), DType::f32);
      for (int64_t j = 0; j < d.numel(); ++j)
        d.data<float>()[j] = 1e-3f * static_cast<float>(rng.normal());
      u.delta.push_back(std::move(d));
    }
    r.updates.push_back(std::move(u));
  }
  return rounds.emplace(clients, std::move(r)).first->second;
}

void report_size(benchmark::State& state, const Round& r) {
  int64_t n = 0;
  for (const Tensor& t : r.like) n += t.numel();
  state.counters["params"] = static_cast<double>(n);
}

void robust(benchmark::State& state, const std::string& rule, double norm_bound) {
  const Round& r = round_of(state.range(0));
  RobustOptions o;
  o.aggregation = rule;
  o.norm_bound = norm_bound;
  o.trim_fraction = 0.25;
  o.byzantine = (state.range(0) - 3) / 2;  // the most Krum tolerates: n > 2f + 2
  for (auto _ : state) {
    AggregationReport report;
    benchmark::DoNotOptimize(robust_aggregate(o, r.like, r.updates, &report));
  }
  report_size(state, r);
}

void central_dp(benchmark::State& state, bool adaptive) {
  const Round& r = round_of(state.range(0));
  PrivacyOptions o;
  o.enabled = true;
  o.noise_multiplier = 1.0;
  o.clip = 0.5;
  o.adaptive_clip = adaptive;
  o.clipped_count_stddev = 1.0;
  CentralDp dp(o);
  int64_t round = 0;
  for (auto _ : state) {
    AggregationReport report;
    benchmark::DoNotOptimize(
        dp.aggregate(++round, r.like, r.updates, state.range(0), 4 * state.range(0), &report));
  }
  report_size(state, r);
}

BENCHMARK_CAPTURE(robust, mean, "mean", 0.0)->Arg(8)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(robust, norm_bound, "mean", 0.5)->Arg(8)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(robust, median, "median", 0.0)->Arg(8)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(robust, trimmed_mean, "trimmed_mean", 0.0)->Arg(8)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(robust, krum, "krum", 0.0)->Arg(8)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(robust, multi_krum, "multi_krum", 0.0)->Arg(8)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(central_dp, fixed_clip, false)->Arg(8)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(central_dp, adaptive_clip, true)->Arg(8)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace pollen::fed
