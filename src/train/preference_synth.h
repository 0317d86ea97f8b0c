#pragma once
// Preference pairs made by a rule, for tests and examples (no downloads): the chosen reply
// follows the rule and the rejected one breaks it.
//   arithmetic: "What is 17 + 25?" -> chosen "17 + 25 = 42.", rejected with a wrong sum (operands
//               of at most `digits` digits).
//   case:       "Reply in upper case: ..." or "... lower case: ..." -> chosen in the asked case,
//               rejected in the other.
#include <cstdint>
#include <filesystem>
#include <string>

namespace pollen::train {

struct PreferenceSynthOptions {
  std::string task = "arithmetic";  // "arithmetic" or "case"
  int64_t count = 100;
  uint64_t seed = 0;
  int digits = 2;          // arithmetic: operands of at most this many digits (1 to 9)
  bool messages = true;    // prompts as chat messages (else plain text)
  bool responses = false;  // prompt/response records (both replies, with "preferred") to score
};

// Writes `count` records as JSONL (atomically); the same options give the same file.
void write_preference_synth(const PreferenceSynthOptions& options,
                            const std::filesystem::path& out);

}  // namespace pollen::train
