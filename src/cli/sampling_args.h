#pragma once
// The sampling options `pollen generate` and `pollen chat` share.
#include <CLI/CLI.hpp>
#include <limits>
#include <string>

#include "cli/commands.h"
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

// A check that a number is in [low, high] (or above low when `above`), saying so in words.
inline CLI::Validator number_in(double low, double high, bool above, const std::string& words) {
  return CLI::Validator(
      [=](const std::string& text) -> std::string {
        double v = 0;
        try {
          size_t used = 0;
          v = std::stod(text, &used);
          if (used != text.size()) return "expected a number " + words + ", got '" + text + "'";
        } catch (const std::exception&) {
          return "expected a number " + words + ", got '" + text + "'";
        }
        const bool ok = (above ? v > low : v >= low) && v <= high;
        return ok ? std::string() : "expected a number " + words + ", got " + text;
      },
      "");  // the help text says the range in words
}

inline void add_sampling_options(CLI::App* cmd, SamplingArgs& a) {
  constexpr double kAny = std::numeric_limits<double>::max();
  model::SamplingOptions& o = a.options;
  cmd->add_option("--max-tokens", o.max_tokens, "Most tokens to generate per prompt")
      ->check(number_in(0, kAny, false, ">= 0"))
      ->capture_default_str();
  cmd->add_option("--temperature", o.temperature, "0 for greedy decoding")
      ->check(number_in(0, kAny, false, ">= 0"))
      ->capture_default_str();
  cmd->add_flag("--greedy", a.greedy, "Greedy decoding (same as --temperature 0)");
  cmd->add_option("--top-k", o.top_k,
                  "Keep the k most likely tokens, ties with the k-th too (0: off)")
      ->check(number_in(0, kAny, false, ">= 0"))
      ->capture_default_str();
  cmd->add_option("--top-p", o.top_p, "Nucleus sampling mass in (0, 1] (1: off)")
      ->check(number_in(0, 1, true, "in (0, 1]"))
      ->capture_default_str();
  cmd->add_option("--min-p", o.min_p, "Drop tokens below min-p x the top probability (0: off)")
      ->check(number_in(0, 1, false, "in [0, 1]"))
      ->capture_default_str();
  cmd->add_option("--repetition-penalty", o.repetition_penalty,
                  "HF's repetition penalty, above 0 (1: off)")
      ->check(number_in(0, kAny, true, "above 0"))
      ->capture_default_str();
  cmd->add_option("--stop", o.stop_strings, "Stop string (repeatable)");
  cmd->add_option("--seed", o.seed, "Sampling seed")->check(seed_number())->capture_default_str();
}

}  // namespace pollen::cli
