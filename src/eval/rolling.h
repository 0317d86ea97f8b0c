#pragma once
// Log-likelihood of long token sequences in rolling windows, as lm-evaluation-harness's
// loglikelihood_rolling does (get_rolling_token_windows with context_len 1): the first window is
// the prefix token then the first max_len - 1 tokens and scores the first max_len tokens; each
// later window scores the next up to max_len tokens, with the preceding tokens (up to max_len in
// all) as its input. Every token is scored exactly once.
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "model/llama.h"

namespace pollen::eval {

struct Window {
  std::vector<uint32_t> input;    // fed to the model
  std::vector<uint32_t> targets;  // the last targets.size() next-token predictions are scored
};

// lm-evaluation-harness's windows (context_len 1). max_len >= 1; no windows for no tokens.
std::vector<Window> rolling_windows(std::span<const uint32_t> tokens, uint32_t prefix,
                                    int64_t max_len);

// log p(tokens[i] | prefix, tokens[<i]) for every i, in natural log, f64 sums of the model's f32
// log-softmax. Windows of up to max_len tokens.
std::vector<double> token_logprobs(const model::Llama& model, std::span<const uint32_t> tokens,
                                   uint32_t prefix, int64_t max_len);

// Scores of a sequence with no prefix: [nullopt, log p(t1 | t0), log p(t2 | t0 t1), ...].
std::vector<std::optional<double>> sequence_logprobs(const model::Llama& model,
                                                     std::span<const uint32_t> tokens,
                                                     int64_t max_len);

// A scored token with the `top` most likely tokens at its position (most likely first).
struct TokenScore {
  double logprob = 0;
  std::vector<std::pair<uint32_t, double>> top;
};

// log(sum exp z) of one row of logits, in double; throws when they hold NaN (as sampling refuses
// them: a NaN log-probability would read as JSON's null, "nothing predicts this token").
double log_sum_exp(std::span<const float> z);
// One position's score from its row of logits `z` (all of the model's vocabulary) and their
// log-sum-exp: log p(token) and the `top` most likely among the first `top_vocab` ids (0: all).
TokenScore score_row(std::span<const float> z, double lse, uint32_t token, int64_t top,
                     int64_t top_vocab = 0);

// sequence_logprobs with the top alternatives at each position: the same logprobs, bit for bit.
// The alternatives are drawn from the ids below `top_vocab` (0: all of the model's), so that a
// model whose vocabulary is padded beyond its tokenizer never names an id nothing can decode.
std::vector<std::optional<TokenScore>> sequence_scores(const model::Llama& model,
                                                       std::span<const uint32_t> tokens,
                                                       int64_t max_len, int64_t top,
                                                       int64_t top_vocab = 0);

// Sums over a corpus; loss and perplexity per scored token, bits per byte over the bytes of text
// the scored tokens stand for.
struct LossTotals {
  double nll = 0;      // nats
  int64_t tokens = 0;  // scored
  int64_t bytes = 0;   // UTF-8 bytes the scored tokens cover
  int64_t documents = 0;
  double loss() const { return tokens ? nll / static_cast<double>(tokens) : 0; }
  double perplexity() const;
  double bits_per_byte() const;
};

}  // namespace pollen::eval
