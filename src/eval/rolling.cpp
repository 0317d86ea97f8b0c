#include "eval/rolling.h"

#include <algorithm>
#include <cmath>

#include "autograd/tape.h"
#include "base/error.h"
#include "ops/gemm.h"

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

namespace {

constexpr int64_t kScoredRows = 512;  // logits rows computed at once

// Runs the windows and calls visit(target, logits row (V), log-sum-exp of the row) for every
// scored token in order.
template <typename Visit>
void score_windows(const model::Llama& model, std::span<const uint32_t> tokens, uint32_t prefix,
                   int64_t max_len, Visit&& visit) {
  const int64_t V = model.config().vocab_size;
  for (const Window& w : rolling_windows(tokens, prefix, max_len)) {
    const int64_t t = static_cast<int64_t>(w.input.size());
    Tensor ids = Tensor::empty({1, t}, DType::i32);
    for (int64_t i = 0; i < t; ++i) {
      POLLEN_CHECK(w.input[static_cast<size_t>(i)] < static_cast<uint64_t>(V), "token id ",
                   w.input[static_cast<size_t>(i)], " is outside the model's vocabulary of ", V);
      ids.data<int32_t>()[i] = static_cast<int32_t>(w.input[static_cast<size_t>(i)]);
    }
    // The scored rows' logits kScoredRows at a time: a window of the model's whole context never
    // holds its T x V logits at once (131072 x 128256 floats would be 67 GB).
    ag::NoGrad no_grad;
    const ag::Var h = model.hidden_states(model::Batch::contiguous_rows(ids, ids));  // (t, C)
    const ag::Var head = model.head_weight();                                        // (V, C)
    const int64_t scored = static_cast<int64_t>(w.targets.size());
    for (int64_t j0 = 0; j0 < scored; j0 += kScoredRows) {
      const int64_t n = std::min(kScoredRows, scored - j0), first = t - scored + j0;
      Tensor chunk = Tensor::empty({n, V}, h.value().dtype(), h.value().device());
      ops::gemm(h.value().slice(0, first, first + n), false, head.value(), true, chunk);
      const Tensor logits = chunk.dtype() == DType::f32 ? chunk : chunk.to(DType::f32);
      for (int64_t j = 0; j < n; ++j) {
        const float* z = logits.data<float>() + j * V;
        const uint32_t target = w.targets[static_cast<size_t>(j0 + j)];
        POLLEN_CHECK(target < static_cast<uint64_t>(V), "token id ", target,
                     " is outside the model's vocabulary of ", V);
        const std::span<const float> row(z, static_cast<size_t>(V));
        visit(target, row, log_sum_exp(row));
      }
    }
  }
}

}  // namespace

std::vector<double> token_logprobs(const model::Llama& model, std::span<const uint32_t> tokens,
                                   uint32_t prefix, int64_t max_len) {
  std::vector<double> out;
  out.reserve(tokens.size());
  score_windows(model, tokens, prefix, max_len,
                [&](uint32_t target, std::span<const float> z, double lse) {
                  out.push_back(static_cast<double>(z[target]) - lse);
                });
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

std::vector<std::optional<TokenScore>> sequence_scores(const model::Llama& model,
                                                       std::span<const uint32_t> tokens,
                                                       int64_t max_len, int64_t top,
                                                       int64_t top_vocab) {
  std::vector<std::optional<TokenScore>> out;
  if (tokens.empty()) return out;
  out.push_back(std::nullopt);
  score_windows(model, tokens.subspan(1), tokens[0], max_len,
                [&](uint32_t target, std::span<const float> z, double lse) {
                  out.push_back(score_row(z, lse, target, top, top_vocab));
                });
  return out;
}

double log_sum_exp(std::span<const float> z) {
  double best = z[0];
  for (float v : z) best = std::max(best, static_cast<double>(v));
  double sum = 0;
  for (float v : z) sum += std::exp(static_cast<double>(v) - best);
  POLLEN_CHECK(!std::isnan(sum), "scoring: the model's logits hold NaN");
  return best + std::log(sum);
}

TokenScore score_row(std::span<const float> z, double lse, uint32_t token, int64_t top,
                     int64_t top_vocab) {
  TokenScore s;
  s.logprob = static_cast<double>(z[token]) - lse;
  const size_t n = top_vocab > 0 ? std::min(z.size(), static_cast<size_t>(top_vocab)) : z.size();
  const size_t k = std::min(n, static_cast<size_t>(std::max<int64_t>(top, 0)));
  if (k == 0) return s;
  thread_local std::vector<uint32_t> order;  // reused: a row per scored token
  order.resize(n);
  for (uint32_t v = 0; v < order.size(); ++v) order[v] = v;
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(),
                    [&](uint32_t a, uint32_t b) { return z[a] > z[b] || (z[a] == z[b] && a < b); });
  for (size_t i = 0; i < k; ++i)
    s.top.emplace_back(order[i], static_cast<double>(z[order[i]]) - lse);
  return s;
}

double LossTotals::perplexity() const {
  return std::exp(loss());
}

double LossTotals::bits_per_byte() const {
  return bytes ? nll / (std::log(2.0) * static_cast<double>(bytes)) : 0;
}

}  // namespace pollen::eval
