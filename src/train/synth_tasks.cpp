#include "train/synth_tasks.h"

#include <algorithm>
#include <cctype>
#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/rng.h"

namespace pollen::train {
namespace {

std::string random_word(Rng& rng) {
  std::string w(3 + rng.below(5), 'a');
  for (char& c : w) c = static_cast<char>('a' + rng.below(26));
  return w;
}

// Operands below `limit`.
SynthExample arithmetic(Rng& rng, uint64_t limit) {
  const int64_t a = static_cast<int64_t>(rng.below(limit)),
                b = static_cast<int64_t>(rng.below(limit));
  const bool add = rng.below(2) == 0;
  const std::string op = add ? " + " : " - ";
  const std::string answer = std::to_string(add ? a + b : a - b);
  const std::string expr = std::to_string(a) + op + std::to_string(b);
  return {"What is " + expr + "?", expr + " = " + answer + "\n#### " + answer, answer};
}

SynthExample reverse(Rng& rng, uint64_t) {
  const std::string w = random_word(rng);
  std::string r(w.rbegin(), w.rend());
  return {"Reverse the letters of '" + w + "'.", "'" + w + "' reversed is '" + r + "'.\n#### " + r,
          r};
}

SynthExample upper(Rng& rng, uint64_t) {
  const std::string w = random_word(rng);
  std::string u = w;
  std::transform(u.begin(), u.end(), u.begin(), [](unsigned char c) { return std::toupper(c); });
  return {"Write '" + w + "' in upper case.",
          "'" + w + "' in upper case is '" + u + "'.\n#### " + u, u};
}

}  // namespace

std::vector<std::string> synth_task_names() {
  return {"arithmetic", "reverse", "upper"};
}

std::vector<SynthExample> synth_examples(const std::string& task, int64_t count, uint64_t seed,
                                         int digits) {
  SynthExample (*make)(Rng&, uint64_t) = task == "arithmetic" ? arithmetic
                                         : task == "reverse"  ? reverse
                                         : task == "upper"    ? upper
                                                              : nullptr;
  POLLEN_CHECK(make != nullptr, "unknown synthetic task '", task,
               "': expected arithmetic, reverse or upper");
  POLLEN_CHECK(count > 0, "synthetic data: expected a positive count, got ", count);
  POLLEN_CHECK(digits >= 1 && digits <= 9, "synthetic data: expected 1 to 9 digits, got ", digits);
  uint64_t limit = 1;
  for (int d = 0; d < digits; ++d) limit *= 10;
  Rng rng(seed);
  std::vector<SynthExample> out;
  out.reserve(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) out.push_back(make(rng, limit));
  return out;
}

std::string sft_jsonl_line(const SynthExample& e) {
  const nlohmann::ordered_json line{{"messages",
                                     {{{"role", "user"}, {"content", e.prompt}},
                                      {{"role", "assistant"}, {"content", e.completion}}}}};
  return line.dump();
}

}  // namespace pollen::train
