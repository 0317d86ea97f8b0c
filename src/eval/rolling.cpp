#include "eval/rolling.h"

#include <algorithm>
#include <cmath>

#include "base/error.h"

namespace pollen::eval {

std::vector<Window> rolling_windows(std::span<const uint32_t> tokens, uint32_t prefix,
                                    int64_t max_len) {
  POLLEN_CHECK(max_len >= 1, "rolling windows: max_len must be >= 1, got ", max_len);
  std::vector<Window> out;
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (n == 0) return out;
  const int64_t first = std::min(max_len, n);
  Window w;
  w.input.push_back(prefix);
  w.input.insert(w.input.end(), tokens.begin(), tokens.begin() + (first - 1));
  w.targets.assign(tokens.begin(), tokens.begin() + first);
  out.push_back(std::move(w));
  int64_t predicted = first;
  while (predicted < n) {
    const int64_t len = std::min(n - predicted, max_len);
    const int64_t end = predicted + len;
    Window next;
    next.input.assign(tokens.begin() + std::max<int64_t>(0, end - max_len - 1),
                      tokens.begin() + (end - 1));
    next.targets.assign(tokens.begin() + (end - len), tokens.begin() + end);
    out.push_back(std::move(next));
    predicted += len;
  }
  return out;
}

std::vector<double> token_logprobs(const model::Llama& model, std::span<const uint32_t> tokens,
                                   uint32_t prefix, int64_t max_len) {
  std::vector<double> out;
  out.reserve(tokens.size());
  const int64_t V = model.config().vocab_size;
  for (const Window& w : rolling_windows(tokens, prefix, max_len)) {
    const int64_t t = static_cast<int64_t>(w.input.size());
    Tensor ids = Tensor::empty({1, t}, DType::i32);
    for (int64_t i = 0; i < t; ++i) {
      POLLEN_CHECK(w.input[static_cast<size_t>(i)] < static_cast<uint64_t>(V), "token id ",
                   w.input[static_cast<size_t>(i)], " is outside the model's vocabulary of ", V);
      ids.data<int32_t>()[i] = static_cast<int32_t>(w.input[static_cast<size_t>(i)]);
    }
    const Tensor logits = model.logits(model::Batch::contiguous_rows(ids, ids)).to(DType::f32);
    const int64_t scored = static_cast<int64_t>(w.targets.size());
    for (int64_t j = 0; j < scored; ++j) {
      const int64_t row = t - scored + j;
      const float* z = logits.data<float>() + row * V;
      const uint32_t target = w.targets[static_cast<size_t>(j)];
      POLLEN_CHECK(target < static_cast<uint64_t>(V), "token id ", target,
                   " is outside the model's vocabulary of ", V);
      double best = z[0];
      for (int64_t v = 1; v < V; ++v) best = std::max(best, static_cast<double>(z[v]));
      double sum = 0;
      for (int64_t v = 0; v < V; ++v) sum += std::exp(static_cast<double>(z[v]) - best);
      out.push_back(static_cast<double>(z[target]) - best - std::log(sum));
    }
  }
  return out;
}

std::vector<std::optional<double>> sequence_logprobs(const model::Llama& model,
                                                     std::span<const uint32_t> tokens,
                                                     int64_t max_len) {
  std::vector<std::optional<double>> out;
  if (tokens.empty()) return out;
  out.push_back(std::nullopt);
  for (double lp : token_logprobs(model, tokens.subspan(1), tokens[0], max_len)) out.push_back(lp);
  return out;
}

double LossTotals::perplexity() const {
  return std::exp(loss());
}

double LossTotals::bits_per_byte() const {
  return bytes ? nll / (std::log(2.0) * static_cast<double>(bytes)) : 0;
}

}  // namespace pollen::eval
