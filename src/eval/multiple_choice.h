#pragma once
// Multiple-choice tasks scored by log-likelihood, as lm-evaluation-harness's `multiple_choice`
// output type scores them.
//
// An item is a context, its choices and the index of the right one. Each choice is a
// continuation " " + choice (the target delimiter) of the context; its score is the summed
// log-probability of the continuation's tokens given the context's. acc takes the choice with
// the highest score, acc_norm the highest score divided by the choice's length in characters
// (Unicode code points, as Python's len). Their standard errors are the sample standard
// deviation over items divided by sqrt(items), as lm-evaluation-harness reports them.
//
// Tokenisation is lm-evaluation-harness's: whitespace at the end of the context moves to the
// front of the continuation; the context and context + continuation are encoded without the
// post-processor's BOS/EOS, and the continuation's tokens are those of the whole past the
// context's length. An empty context becomes the prefix token (BOS, else EOS).
//
// Few-shot examples go before the context as lm-evaluation-harness writes them: each example's
// context, the delimiter, its right choice, then a blank line ("\n\n").
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "model/llama.h"
#include "tokenizer/tokenizer.h"

namespace pollen::eval {

struct ChoiceItem {
  std::string context;
  std::vector<std::string> choices;
  int64_t gold = 0;
  std::string where;  // "'FILE' line N", for errors (empty for items made in code)
};

// A JSONL task: one object per line with "context" (string), "choices" (strings) and "gold"
// (an index into choices); other fields are ignored. Errors name the file, line and field.
std::vector<ChoiceItem> read_choice_items(const std::filesystem::path& jsonl);

// The few-shot prefix: context + " " + right choice + "\n\n" per example.
std::string fewshot_prefix(std::span<const ChoiceItem* const> examples);

// Picks `count` examples for `item`, item `index` of a task, from `pool`, never one equal to the
// item (same context, choices and gold), as lm-evaluation-harness leaves the evaluated document
// out of its examples: the item itself when the pool is the task or a file holding it. Drawn
// from Rng(seed).fork(index): the same for a given seed, whatever else is evaluated.
std::vector<const ChoiceItem*> pick_fewshot(std::span<const ChoiceItem> pool,
                                            const ChoiceItem& item, int64_t index, int64_t count,
                                            uint64_t seed);

// lm-evaluation-harness's split of (context, continuation) into tokens; an empty context (or one
// of whitespace alone, moved to the continuation) becomes the prefix token.
struct TokenPair {
  std::vector<uint32_t> context, continuation;
};
TokenPair encode_pair(const tokenizer::Tokenizer& tok, std::string_view context,
                      std::string_view continuation, std::optional<uint32_t> prefix);

// Summed log p(continuation | context) of each pair (natural log, f64 sums of the f32
// log-softmax). The input is the last max_len tokens of context + continuation without its
// final token; pairs go through the model `batch` at a time, longest first, one per row.
// `on_batch(pairs done, pairs)` is called after each batch (progress).
std::vector<double> continuation_logprobs(const model::Llama& model,
                                          std::span<const TokenPair> pairs, int64_t max_len,
                                          int64_t batch,
                                          const std::function<void(size_t, size_t)>& on_batch = {});

// Unicode code points in UTF-8 text (invalid bytes count one each).
int64_t char_length(std::string_view text);

struct ItemResult {
  std::vector<double> logprobs;  // per choice
  std::vector<int64_t> lengths;  // per choice, in characters
  int64_t pred = 0;              // argmax of logprobs (the first of equal maxima)
  int64_t pred_norm = 0;         // argmax of logprobs / lengths
  bool correct = false, correct_norm = false;
};
ItemResult judge(const ChoiceItem& item, std::vector<double> logprobs);

struct ChoiceMetrics {
  int64_t items = 0;
  double acc = 0, acc_norm = 0;
  std::optional<double> acc_stderr, acc_norm_stderr;  // none for fewer than two items
};
ChoiceMetrics summarize(std::span<const ItemResult> items);

struct ChoiceEvalOptions {
  int64_t fewshot = 0;
  uint64_t seed = 1234;
  std::span<const ChoiceItem> fewshot_pool;  // empty: examples come from the task itself
  std::optional<uint32_t> prefix;            // the token an empty context becomes (none: refused)
  int64_t max_len = 2048;
  int64_t batch = 8;                             // (context, choice) pairs per forward pass
  std::function<void(size_t, size_t)> on_batch;  // (pairs done, pairs), after each pass
};

struct ChoiceEvalResult {
  ChoiceMetrics metrics;
  std::vector<std::string> contexts;  // with their few-shot prefix
  std::vector<ItemResult> items;
  double seconds = 0;
};

ChoiceEvalResult evaluate_choices(const model::Llama& model, const tokenizer::Tokenizer& tok,
                                  std::span<const ChoiceItem> items,
                                  const ChoiceEvalOptions& options);

}  // namespace pollen::eval
