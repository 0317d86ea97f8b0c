#pragma once
// Verifiable rewards: a completion checked against a prompt's reference answer, scored in [0, 1].
// Built in: exact answer match, numeric match with tolerance, and a regular expression. A reward
// model plugs in beside them (train/grpo.h: a rollout's reward from its prompt and completion).
#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include "base/config.h"

namespace pollen::train {

// Maps (prompt, completion, reference answer) to a reward: a verifier's is in [0, 1], a reward
// model's score any number (it ignores the answer).
using RewardFunction = std::function<double(std::string_view prompt, std::string_view completion,
                                            std::string_view answer)>;

// Where a completion's answer is: after the last `marker` (to the end of that line), on the last
// non-empty line, or the whole completion. Surrounding whitespace is dropped.
struct AnswerExtraction {
  enum class Mode { marker, last_line, whole };
  Mode mode = Mode::marker;
  std::string marker = "####";
};

// The answer text, or nothing when the completion has no answer (no marker, nothing but spaces).
std::optional<std::string> extract_answer(std::string_view completion,
                                          const AnswerExtraction& extraction);

// A number as people write it: an optional sign ('-', '+' or U+2212 minus), digits with optional
// thousands separators in groups of three ("1,234,567"), an optional fraction (".5", "3.25").
// Nothing else may surround it but spaces; returns nothing when `text` is not such a number.
std::optional<double> parse_number(std::string_view text);
// The last number written anywhere in `text` ("x = 1,250.5 dollars" -> 1250.5), or nothing.
std::optional<double> last_number(std::string_view text);

// 1 when the extracted answer equals `answer` (both with runs of whitespace made one space).
double exact_match_reward(std::string_view completion, std::string_view answer,
                          const AnswerExtraction& extraction);
// 1 when the last number of the extracted answer is within max(abs_tol, rel_tol * |answer|) of
// the answer; `answer` must be a number (parse_number).
double numeric_match_reward(std::string_view completion, double answer,
                            const AnswerExtraction& extraction, double abs_tol, double rel_tol);

// A verifier from its config table ([grpo.verifier]): kind = "exact" | "numeric" | "regex",
// extract = "marker" | "last_line" | "whole", marker, abs_tol, rel_tol, pattern (regex: searched
// in the whole completion; "{answer}" in it stands for the answer, escaped). Every key is checked
// (unknown keys refused, an invalid pattern named).
RewardFunction make_verifier(ConfigTable& table);

}  // namespace pollen::train
