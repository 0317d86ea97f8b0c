#pragma once
// The sampling options `pollen generate` and `pollen chat` share.
#include <CLI/CLI.hpp>

#include "model/generate.h"
#include "tokenizer/tokenizer.h"

namespace pollen::cli {

struct SamplingArgs {
  model::SamplingOptions options;
  bool greedy = false;

  // The options as given, --greedy applied, sampling only ids that `tok` can decode (a model's
  // vocabulary may be padded beyond its tokenizer's).
  model::SamplingOptions resolved(const tokenizer::Tokenizer& tok) const {
    model::SamplingOptions o = options;
    if (greedy) o.temperature = 0;
    o.vocab_size = static_cast<int64_t>(tok.vocab_size());
    return o;
  }
};

inline void add_sampling_options(CLI::App* cmd, SamplingArgs& a) {
  model::SamplingOptions& o = a.options;
  cmd->add_option("--max-tokens", o.max_tokens, "Most tokens to generate per prompt")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--temperature", o.temperature, "0 for greedy decoding")
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--greedy", a.greedy, "Greedy decoding (same as --temperature 0)");
  cmd->add_option("--top-k", o.top_k,
                  "Keep the k most likely tokens, ties with the k-th too (0: off)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--top-p", o.top_p, "Nucleus sampling mass in (0, 1] (1: off)")
      ->check(CLI::PositiveNumber & CLI::Range(0.0, 1.0));
  cmd->add_option("--min-p", o.min_p, "Drop tokens below min-p x the top probability (0: off)")
      ->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--repetition-penalty", o.repetition_penalty,
                  "HF's repetition penalty, above 0 (1: off)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--stop", o.stop_strings, "Stop string (repeatable)");
  cmd->add_option("--seed", o.seed, "Sampling seed");
}

}  // namespace pollen::cli
