#include "fed/first_moments.h"

#include <cmath>

#include "base/error.h"

namespace pollen::fed {

namespace {
constexpr const char* kSuffix = ".exp_avg";
}

const std::vector<std::string>& first_moments_names() {
  static const std::vector<std::string> names{"none", "output", "token_rows"};
  return names;
}

ParamSpecs first_moment_specs(const ParamSpecs& specs, const std::string& which) {
  if (which == "none") return {};
  POLLEN_CHECK(which == "output" || which == "token_rows", "first moments of '", which,
               "': expected none, output or token_rows");
  const TokenRowTensors rows = token_row_tensors(specs);
  // An untied model's output layer, else the tied embedding, which is it.
  const int64_t output = rows.output >= 0 ? rows.output : rows.embedding;
  ParamSpecs out;
  for (int64_t i = 0; i < static_cast<int64_t>(specs.size()); ++i) {
    const bool shared = i == output || (which == "token_rows" && i == rows.embedding);
    if (shared)
      out.push_back(
          {specs[static_cast<size_t>(i)].name + kSuffix, specs[static_cast<size_t>(i)].shape});
  }
  POLLEN_CHECK(!out.empty(), "first moments of '", which, "': the model has no token rows");
  return out;
}

std::string moment_tensor_name(const ParamSpec& moment) {
  const std::string suffix = kSuffix;
  POLLEN_ASSERT(moment.name.size() > suffix.size() &&
                moment.name.compare(moment.name.size() - suffix.size(), suffix.size(), suffix) ==
                    0);
  return moment.name.substr(0, moment.name.size() - suffix.size());
}

void check_first_moments(const ParamSpecs& moments, const Weights& m, const std::string& what) {
  POLLEN_CHECK(m.size() == moments.size(), what, ": ", m.size(), " first moments, expected ",
               moments.size());
  for (size_t t = 0; t < m.size(); ++t) {
    const float* x = m[t].data<float>();
    for (int64_t j = 0; j < m[t].numel(); ++j) {
      POLLEN_CHECK(std::isfinite(x[j]) && std::abs(x[j]) <= kMaxFirstMoment, what, ": '",
                   moments[t].name, "'[", j, "] is ", x[j], ", beyond +-", kMaxFirstMoment,
                   " (a first moment is a running mean of gradients)");
    }
  }
}

Weights average_first_moments(const std::vector<const Weights*>& each,
                              const std::vector<double>& weights) {
  POLLEN_ASSERT(!each.empty() && each.size() == weights.size());
  double total = 0;
  for (double w : weights) total += w;
  POLLEN_CHECK(total > 0, "first moments: the clients' weights sum to ", total);
  Weights mean;
  for (size_t t = 0; t < each[0]->size(); ++t) {
    const Tensor& first = (*each[0])[t];
    Tensor m = Tensor::empty(first.shape(), DType::f32);
    float* o = m.data<float>();
    for (int64_t j = 0; j < m.numel(); ++j) {
      double s = 0;
      for (size_t c = 0; c < each.size(); ++c) {
        POLLEN_ASSERT((*each[c])[t].numel() == m.numel());
        s += weights[c] * static_cast<double>((*each[c])[t].data<float>()[j]);
      }
      o[j] = static_cast<float>(s / total);
    }
    mean.push_back(std::move(m));
  }
  return mean;
}

}  // namespace pollen::fed
