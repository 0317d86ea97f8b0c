#pragma once
// Generation: a KV cache, batched prompts of different lengths, and sampling (greedy,
// temperature, top-k, top-p, min-p, repetition penalty), stop tokens and stop strings, a token
// budget and a seed. It lives in the model layer so that training, evaluation and RL can use it.
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/rng.h"
#include "model/llama.h"

namespace pollen::model {

// Keys and values of every layer for a batch of rows, each row with its own length. A model
// with LoRA adapters attached generates with them (without dropout).
class KvCache {
 public:
  KvCache(const LlamaConfig& config, int64_t rows, int64_t capacity, DType dtype = DType::f32);
  int64_t rows() const { return static_cast<int64_t>(lengths_.size()); }
  int64_t capacity() const { return capacity_; }
  int64_t length(int64_t row) const { return lengths_[static_cast<size_t>(row)]; }

  // Runs `tokens[r]` (any number, possibly none) through the model after row r's cached
  // tokens, appends their keys and values, and returns the logits (rows, V) of each row's last
  // new token (rows given no tokens get zeros).
  Tensor forward(const Llama& model, const std::vector<std::vector<uint32_t>>& tokens);
  // Forgets row r's tokens from `length` on (length <= the row's length).
  void truncate(int64_t row, int64_t length);
  // Grows to at least `rows` rows of at least `capacity` tokens each, keeping every row's tokens
  // (new rows hold none). Never shrinks.
  void reserve(int64_t rows, int64_t capacity);

 private:
  int64_t capacity_, kv_dim_;
  std::vector<int64_t> lengths_;
  std::vector<Tensor> k_, v_;  // per layer (rows, capacity, KVH*D)
};

struct SamplingOptions {
  int64_t max_tokens = 64;
  double temperature = 1.0;         // 0: greedy
  int64_t top_k = 0;                // 0: off; tokens tied with the k-th are kept too (as HF)
  double top_p = 1.0;               // 1: off
  double min_p = 0.0;               // 0: off; drops tokens below min_p * the top probability
  double repetition_penalty = 1.0;  // HF's: logits of seen tokens divided (>0) or multiplied
  uint64_t seed = 0;
  std::vector<uint32_t> stop_tokens;  // e.g. the tokenizer's EOS; not included in the output
  // Sample only ids below this: the tokenizer's size, when the model's vocabulary is padded
  // beyond it (ids the tokenizer does not know have no text). 0: every id of the model.
  int64_t vocab_size = 0;
  std::vector<std::string> stop_strings;  // need `decode`; the text is cut before the match
  bool use_cache = true;  // false: recompute the whole sequence every token (a reference)
};

struct Generation {
  std::vector<uint32_t> tokens;        // generated (no prompt)
  std::string text;                    // decoded when a decoder was given, cut at a stop string
  std::string finish_reason;           // "stop" (token or string) or "length"
  std::optional<uint32_t> stop_token;  // the stop token that ended it, when one did
};

using Decoder = std::function<std::string(std::span<const uint32_t>)>;

// Throws naming the first option out of its range (temperature >= 0, top_k >= 0, top_p in
// (0, 1], min_p in [0, 1], repetition_penalty > 0).
void check_sampling_options(const SamplingOptions& options);
// One sampling step on one row's logits (V); `seen` are the row's tokens so far (for the
// repetition penalty). Only the first options.vocab_size logits are candidates (all with 0).
// Deterministic given rng's state.
uint32_t sample_token(std::span<const float> logits, std::span<const uint32_t> seen,
                      const SamplingOptions& options, Rng& rng);
// The logits sampling draws from: the first options.vocab_size of `logits` (all with 0).
std::span<const float> candidate_logits(std::span<const float> logits,
                                        const SamplingOptions& options);

// Where `text` is cut: the earliest position of any of `stops` in it (empty ones never match),
// or npos when none occurs.
size_t first_stop(std::string_view text, const std::vector<std::string>& stops);

// Generates for every prompt (non-empty). Row r draws from Rng(seed).fork(r), so a row's output
// does not depend on the others in the batch.
std::vector<Generation> generate(const Llama& model,
                                 const std::vector<std::vector<uint32_t>>& prompts,
                                 const SamplingOptions& options, const Decoder& decode = {});

// One row of a batch whose rows each have their own options and random stream (a server batching
// unrelated requests). All rows must agree on use_cache.
struct GenerationRow {
  std::vector<uint32_t> prompt;  // non-empty
  SamplingOptions options;
  Rng rng;
  // Once set (by another thread: a client that went away), the row ends before its next step,
  // finish_reason "cancelled".
  std::shared_ptr<const std::atomic<bool>> cancelled;
};

// Called for every token a row keeps, with the row's logits over all of the model's V (sampling
// drew from the first options.vocab_size of them), so that its log-probability is the one
// scoring the same token in a prompt gives.
using OnToken = std::function<void(size_t row, uint32_t token, std::span<const float> logits)>;

// Throws naming what a row gets wrong (an empty prompt, a negative budget, stop strings without
// a decoder).
void check_generation_row(const GenerationRow& row, bool have_decoder);

// generate() with per-row options; a row's result equals generate() of it alone with its rng.
std::vector<Generation> generate_rows(const Llama& model, std::vector<GenerationRow> rows,
                                      const Decoder& decode = {}, const OnToken& on_token = {});

}  // namespace pollen::model
